"""The worker's configuration: one frozen :class:`WorkerConfig`, built once at startup.

``python -m prefill.worker`` / ``python -m decode.worker`` parse their flags here
(:func:`parse_config`) and read the environment here — the only place a worker does:

    K3SERVE_CLUSTER_TOKEN    internal calls must carry it (``X-K3serve-Cluster-Token``)
    K3SERVE_WORKER_THREADS   torch intra-op threads (default 1: processes share the CPU)
    K3SERVE_TEST_HOOKS       ``1``/``true`` accepts per-request test hooks
    K3SERVE_KV_*             kvstore's transfer settings (:meth:`kvstore.KVConfig.from_env`)
    K3SERVE_STORE_*          the shared Mooncake Store client (:class:`kvstore.store.client.StoreConfig`)

Components receive the config (or the narrowest part of it) and never mutate it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from k3serve.engine.spec.config import SpecConfig
from k3serve.process import LOG_LEVELS, FlagParser, device_name, log_level
from k3serve.protocol import CLUSTER_TOKEN_ENV
from k3serve.tracing import ENDPOINT_ENV, check_endpoint
from kvstore import KVConfig
from kvstore.store.client import StoreConfig
from worker.device import LARGE_CARD_BYTES, DeviceProbe, Sizes, probe, resolve_sizes

Role = Literal["prefill", "decode"]

TEST_HOOKS_ENV = "K3SERVE_TEST_HOOKS"
"""Set to ``1`` to accept per-request test hooks (``debug_fail_transfer_n``)."""
DEFAULT_NUM_PAGES = 1024
THREADS_ENV = "K3SERVE_WORKER_THREADS"
"""torch intra-op threads per worker process (default 1: several processes share the CPU)."""


class WorkerEnv(BaseSettings):
    """The worker's environment variables (``K3SERVE_*``; kvstore reads its own ``K3SERVE_KV_*``).

    Booleans parse as pydantic does (``1``/``true``/``yes``/``on`` and their opposites), so
    ``K3SERVE_TEST_HOOKS=0`` is off; a value that does not parse is a ``ValidationError`` naming
    the variable.
    """

    model_config = SettingsConfigDict(env_prefix="K3SERVE_", extra="ignore", frozen=True)

    cluster_token: str | None = Field(default=None, validation_alias=CLUSTER_TOKEN_ENV,
                                      repr=False)
    worker_threads: int = Field(default=1, ge=1, validation_alias=THREADS_ENV)
    test_hooks: bool = Field(default=False, validation_alias=TEST_HOOKS_ENV)
    otlp_traces_endpoint: str | None = Field(default=None, validation_alias=ENDPOINT_ENV)

    @field_validator("cluster_token")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None


@dataclass(frozen=True)
class WorkerConfig:
    """Everything a worker process is configured with (flags + environment), immutable.

    Attributes:
        role: ``prefill`` or ``decode``.
        host, port: bind address; ``port`` 0 = any free port (:meth:`bound_to` gives the
            config with the port the socket got).
        advertise_host: host the router should call (``None``: ``host``, or 127.0.0.1 for
            0.0.0.0).
        model: preset name or checkpoint folder.
        router_url: register with this router (``None``: do not register).
        worker_id: name in metrics and ``/internal/info`` (``None``: ``{role}@{host}:{port}``).
        block_size, num_pages, num_slots, num_snapshots, max_num_batched_tokens: engine
            capacities (tokens per block, pages, KDA state slots, KDA snapshots, tokens/step).
        enable_prefix_caching: reuse cached prefixes.
        device, dtype, seed: where and how the model runs (``dtype`` ``auto``: float32 on CPU,
            bfloat16 on CUDA); ``seed`` seeds a random init when there is no checkpoint.
        threads: torch intra-op threads.
        log_level: python logging / uvicorn level name.
        cluster_token: the token internal calls must carry (``None``: no check).
        test_hooks: accept per-request test hooks.
        kv: kvstore's transfer settings.
        store: the shared store client (``store.url`` unset: no store).
        dense_snapshot_blocks: log-spaced prompt snapshots (``-1``: chosen from the byte
            arithmetic, ``k3serve.cache.specs.auto_dense_snapshot_blocks``; 0: off).
        tp, ep: tensor- / expert-parallel ranks of the instance (``--tp`` / ``--ep``; 1: one
            process). This process is rank 0 and starts the others (``k3serve.parallel``).
        remote_ranks: ranks 1 … W−1 are started by another launcher (Ray rank actors on
            other nodes): this process hosts their rendezvous and prints its address
            (``k3serve.parallel.ranks``) instead of starting them.
        expert_plan: a planner placement file (``k3serve experts plan --json OUT``) for EP,
            or ``None`` (experts split contiguously).
        collective_timeout_s: seconds rank 0 waits on one collective of a ``--tp`` / ``--ep``
            instance before it exits and the instance fails as a whole (a hung rank);
            ``None``: ``k3serve.parallel.runner.COLLECTIVE_TIMEOUT_S``.
        gpu_memory_utilization: CUDA: this worker's share of the card's total memory, counted
            against what this process holds; the pools are sized from it after the weights
            load (``None``: the explicit sizes). :mod:`worker.device` fills it, the batch
            sizes and the device when the flags leave them out.
        max_num_seqs: most running sequences (``None``: ``num_slots``).
        cuda_graphs: CUDA: replay captured decode graphs.
        drain_timeout_s: SIGTERM: most seconds to wait for running requests before exiting.
        max_prefill_backlog: prefill workers: admit no new prompt while the running prefills
            have this many tokens left to compute (``None``: ``max_num_batched_tokens``; 0: no
            cap); see :mod:`k3serve.engine.scheduler`.
        max_queued: most admission calls (``reserve`` / ``prefill`` / ``generate`` /
            ``resume``) this worker holds unanswered at once — its queue; one more is answered
            503 ``busy`` with ``Retry-After`` (:mod:`worker.http`) and the router places it
            elsewhere. 0: no bound.
        speculative: decode workers: speculative decoding method (``ngram`` / ``draft``) or
            ``None`` (off); prefill workers ignore it (they sample token #1 only).
        num_speculative_tokens: ``k``, tokens proposed per sequence and step.
        speculative_draft_model: the draft model of ``draft`` (preset name or folder).
        otlp_traces_endpoint: OTLP/HTTP URL the request spans are exported to
            (:mod:`k3serve.tracing`); ``None``: tracing off.
    """

    role: Role
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    model: str = "k3-tiny"
    router_url: str | None = None
    worker_id: str | None = None
    block_size: int = 64
    num_pages: int = 1024
    num_slots: int = 32
    num_snapshots: int = 32
    max_num_batched_tokens: int = 512
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    seed: int = 0
    threads: int = 1
    log_level: str = "warning"
    cluster_token: str | None = field(default=None, repr=False)  # never in a log line
    test_hooks: bool = False
    kv: KVConfig = field(default_factory=KVConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    dense_snapshot_blocks: int = -1
    tp: int = 1
    ep: int = 1
    expert_plan: str | None = None
    remote_ranks: bool = False
    collective_timeout_s: float | None = None

    def __post_init__(self) -> None:
        check_endpoint(self.otlp_traces_endpoint)
        for f in ("tp", "ep"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}: must be an int ≥ 1, got {v!r}")
        if self.tp > 1 and self.ep > 1 and self.ep % self.tp:
            raise ValueError(f"ep: {self.ep} is not a multiple of tp {self.tp} (attention groups "
                             f"of tp ranks)")
        if not self.drain_timeout_s >= 0:
            raise ValueError(f"drain_timeout_s: must be >= 0 (got {self.drain_timeout_s})")
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    cuda_graphs: bool = True
    drain_timeout_s: float = 60.0
    max_prefill_backlog: int | None = None
    max_queued: int = 256
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_draft_model: str | None = None
    otlp_traces_endpoint: str | None = None

    def engine_options(self) -> dict[str, Any]:
        """The engine settings of this worker: keyword arguments of
        :class:`~k3serve.engine.config.EngineConfig` (``k3serve.LLM`` takes the same).

        Raises:
            ValueError: bad speculative flags (:meth:`spec_config`).
        """
        return {"block_size": self.block_size, "num_pages": self.num_pages,
                "num_slots": self.num_slots, "num_snapshots": self.num_snapshots,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "enable_prefix_caching": self.enable_prefix_caching,
                "dense_snapshot_blocks": self.dense_snapshot_blocks,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "max_num_seqs": self.max_num_seqs, "cuda_graphs": self.cuda_graphs,
                "speculative": self.spec_config()}

    def spec_config(self) -> SpecConfig | None:
        """The engine's speculative-decoding settings (``None``: off, or a prefill worker).

        Raises:
            ValueError: bad speculative flags (``SpecConfig`` names the field).
        """
        if self.speculative is None or self.role != "decode":
            return None
        return SpecConfig(self.speculative, self.num_speculative_tokens,
                          draft_model=self.speculative_draft_model)

    @property
    def url_host(self) -> str:
        """The host in the URL the router calls."""
        return self.advertise_host or ("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)

    @property
    def url(self) -> str:
        """``http://{url_host}:{port}`` (meaningful once the port is bound)."""
        return f"http://{self.url_host}:{self.port}"

    @property
    def name(self) -> str:
        """The worker's name (``--worker-id`` or ``{role}@{host}:{port}``)."""
        return self.worker_id or f"{self.role}@{self.host}:{self.port}"

    @property
    def torch_dtype_name(self) -> str:
        """``float32`` / ``bfloat16`` (``auto`` resolved by device)."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    def bound_to(self, port: int) -> WorkerConfig:
        """This config with the port the listening socket got (a new object)."""
        from dataclasses import replace

        return replace(self, port=port)


def build_parser(role: str, env: WorkerEnv) -> argparse.ArgumentParser:
    """The flags of ``python -m {role}.worker`` (defaults from ``env``)."""
    ap = FlagParser(prog=f"python -m {role}.worker",
                                 description=f"k3serve {role} worker")
    ap.add_argument("--host", default="127.0.0.1", help="bind address")
    ap.add_argument("--port", type=int, default=0, help="HTTP port (0: any free port)")
    ap.add_argument("--advertise-host", default=None,
                    help="host the router should call (default: --host, 127.0.0.1 for 0.0.0.0)")
    ap.add_argument("--model", default="k3-tiny", help="preset name or checkpoint folder")
    ap.add_argument("--router-url", default=None, help="register with this router")
    ap.add_argument("--worker-id", default=None, help="name in metrics and /internal/info")
    ap.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="MLA latent pages (default 1024; CUDA: sized from the memory share)")
    ap.add_argument("--num-slots", type=int, default=None,
                    help="KDA state slots (default: CPU 32, CUDA --max-num-seqs)")
    ap.add_argument("--num-snapshots", type=int, default=32, help="KDA snapshot budget")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens per engine step (default: CPU 512; CUDA 8192 on a card of "
                         "≥ 70 GiB, else 2048; worker/device.py)")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="do not reuse cached prompt prefixes")
    ap.add_argument("--device", default=None, type=device_name,
                    help="cpu or cuda[:N] (default: cuda when torch sees a GPU, else cpu)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="compute / cache dtype (auto: float32 on CPU, bfloat16 on CUDA); "
                         "prefill and decode workers must agree")
    ap.add_argument("--seed", type=int, default=0, help="random-init seed (no checkpoint)")
    ap.add_argument("--threads", type=int, default=env.worker_threads,
                    help=f"torch threads (default ${THREADS_ENV} or 1)")
    ap.add_argument("--log-level", default="warning", type=log_level, metavar="LEVEL",
                    help="logging level: " + ", ".join(LOG_LEVELS))
    _store_flags(ap)
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel ranks (KDA / MLA heads split; this process is rank 0)")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel ranks (1, or a multiple of --tp: ep / tp attention "
                         "groups)")
    ap.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                    help="--tp/--ep: seconds rank 0 waits on a collective before the instance "
                         "fails (default 30)")
    ap.add_argument("--remote-ranks", action="store_true",
                    help="ranks 1.. are started elsewhere (Ray): host their rendezvous")
    ap.add_argument("--expert-plan", default=None, metavar="PLAN.json",
                    help="expert placement from `k3serve experts plan --json` (with --ep)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="CUDA: this worker's share of the card's total memory (weights + "
                         "activations + pools, counted against what this process holds); sizes "
                         "the pools after the weights load (default: 0.9 / --workers-per-gpu, "
                         "or none with an explicit --num-pages)")
    ap.add_argument("--workers-per-gpu", type=int, default=1, metavar="N",
                    help="CUDA: workers sharing this GPU (the launcher sets it); splits the "
                         "default memory share")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="most running sequences (default: CPU --num-slots; CUDA 256)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA: replay captured decode graphs (--no-cuda-graphs: eager)")
    ap.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                    help="SIGTERM: seconds to let running requests finish before exiting")
    ap.add_argument("--max-prefill-backlog", type=int, default=None, metavar="TOKENS",
                    help="prefill: admit no new prompt while the running prefills have this "
                         "many tokens left (default: --max-num-batched-tokens; 0: no cap)")
    ap.add_argument("--speculative", default=None, choices=("ngram", "draft"),
                    help="decode: speculative decoding by n-gram prompt lookup or a draft "
                         "model (default: off; prefill workers ignore it)")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K",
                    help="decode: tokens proposed per sequence and step (with --speculative)")
    ap.add_argument("--speculative-draft-model", default=None, metavar="MODEL",
                    help="decode: the draft model of --speculative draft (preset or folder, "
                         "the target's vocabulary)")
    ap.add_argument("--max-queued", type=int, default=256, metavar="N",
                    help="most admission calls (reserve/prefill/generate/resume) held "
                         "unanswered at once; more: 503 busy + Retry-After (0: no bound)")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help=f"export request spans over OTLP/HTTP to URL (default: "
                         f"${ENDPOINT_ENV}, else tracing off)")
    return ap


def _store_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--store-url", default=None,
                    help="mooncake_master RPC address host:port of the shared store "
                         "(default $K3SERVE_STORE_URL; unset: no store)")
    ap.add_argument("--dense-snapshot-blocks", type=int, default=-1,
                    help="log-spaced prompt snapshots: every block up to this many blocks, "
                         "then doubling spacings (-1: from the byte arithmetic; 0: off)")


def _store_config(a: argparse.Namespace) -> StoreConfig:
    env = StoreConfig()
    return env.model_copy(update={"url": a.store_url}) if a.store_url else env


def _sizes(a: argparse.Namespace, seen: DeviceProbe | None) -> Sizes:
    """The device and engine sizes of the parsed flags (:func:`worker.device.resolve_sizes`).

    Raises:
        SystemExit: a bad ``--workers-per-gpu``, or ``--device cuda`` without CUDA.
    """
    if a.workers_per_gpu < 1:
        raise SystemExit(f"--workers-per-gpu: must be ≥ 1, got {a.workers_per_gpu}")
    if seen is None:
        seen = DeviceProbe(False) if a.device == "cpu" else probe(a.device)
    try:
        return resolve_sizes(
            a.device, seen, max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.max_num_seqs, num_slots=a.num_slots,
            num_pages_given=a.num_pages is not None,
            gpu_memory_utilization=a.gpu_memory_utilization, workers_per_gpu=a.workers_per_gpu)
    except ValueError as e:
        raise SystemExit(f"--{e}") from None


def parse_config(role: Role, argv: list[str] | None = None,
                 env: WorkerEnv | None = None, seen: DeviceProbe | None = None) -> WorkerConfig:
    """The :class:`WorkerConfig` of ``python -m {role}.worker [argv]``.

    Args:
        role: ``prefill`` or ``decode``.
        argv: the flags (default ``sys.argv[1:]``); the same flags ``deploy.launcher`` passes.
        env: the environment (default: read ``os.environ`` now).
        seen: the machine (default: :func:`worker.device.probe`, unless ``--device cpu``);
            flags not given are sized from it (:mod:`worker.device`).

    Raises:
        SystemExit: bad flags (argparse prints the usage).
        pydantic.ValidationError: a ``K3SERVE_*`` variable that does not parse.
        ValueError: a ``K3SERVE_KV_*`` variable that does not parse.
    """
    env = env if env is not None else WorkerEnv()
    return config_from_args(role, build_parser(role, env).parse_args(argv), env, seen)


def config_from_args(role: Role, a: argparse.Namespace, env: WorkerEnv,
                     seen: DeviceProbe | None = None) -> WorkerConfig:
    """The :class:`WorkerConfig` of flags parsed by :func:`build_parser` (``parse_config``'s
    arguments).

    Raises:
        SystemExit: a bad flag value (the message names the flag).
        ValueError: a ``K3SERVE_KV_*`` variable that does not parse.
    """
    sizes = _sizes(a, seen)
    return WorkerConfig(
        role=role, host=a.host, port=a.port, advertise_host=a.advertise_host, model=a.model,
        router_url=a.router_url.rstrip("/") if a.router_url else None, worker_id=a.worker_id,
        block_size=a.block_size,
        num_pages=DEFAULT_NUM_PAGES if a.num_pages is None else a.num_pages,
        num_slots=sizes.num_slots, num_snapshots=a.num_snapshots,
        max_num_batched_tokens=sizes.max_num_batched_tokens,
        enable_prefix_caching=not a.no_prefix_caching, device=sizes.device, dtype=a.dtype,
        seed=a.seed, threads=max(1, a.threads), log_level=a.log_level,
        cluster_token=env.cluster_token, test_hooks=env.test_hooks, kv=KVConfig.from_env(),
        store=_store_config(a), dense_snapshot_blocks=a.dense_snapshot_blocks,
        **_parallel_flags(a),
        gpu_memory_utilization=sizes.gpu_memory_utilization, max_num_seqs=sizes.max_num_seqs,
        cuda_graphs=a.cuda_graphs, drain_timeout_s=a.drain_timeout,
        max_prefill_backlog=_at_least(0, "--max-prefill-backlog", a.max_prefill_backlog),
        max_queued=_at_least(0, "--max-queued", a.max_queued),
        otlp_traces_endpoint=a.otlp_traces_endpoint or env.otlp_traces_endpoint or None,
        **_spec_flags(a, role))


#: the flag of a ``WorkerConfig`` / ``EngineConfig`` field whose own name is not the flag's
FIELD_FLAGS = {"drain_timeout_s": "--drain-timeout"}


def check_flags(argv: list[str], device: str | None = None,
                roles: tuple[Role, ...] = ("prefill", "decode")) -> None:
    """Parse ``argv`` as ``python -m {role}.worker`` does for each of ``roles`` and build the
    engine's config from it, in this process: a flag value a worker would refuse at its start
    is refused here (``k3serve serve`` checks the worker flags it passes on before anything
    starts). Nothing is loaded; CUDA is not touched (a CUDA ``device``, or none, is checked
    as a card with the default sizes).

    Args:
        argv: the workers' flags.
        device: the workers' ``--device`` (``None``: chosen by each worker).
        roles: the roles started with these flags.

    Raises:
        ValueError: one line naming the flag and the value.
    """
    from k3serve.engine.config import EngineConfig

    env = WorkerEnv()
    seen = DeviceProbe(False) if device == "cpu" else DeviceProbe(True, LARGE_CARD_BYTES)
    for role in roles:
        ap = build_parser(role, env)
        ap.exit_on_error = False  # a usage error raises ArgumentError: one line, no usage
        try:
            a, rest = ap.parse_known_args(argv)
        except argparse.ArgumentError as e:
            raise ValueError(str(e)) from None
        if rest:
            raise ValueError(f"unrecognized worker flags: {' '.join(rest)}")
        try:
            EngineConfig(**config_from_args(role, a, env, seen).engine_options())
        except SystemExit as e:
            raise ValueError(str(e.code)) from None
        except ValueError as e:
            head, sep, tail = str(e).partition(":")
            name = head.removeprefix("EngineConfig.")
            if not sep or " " in name:
                raise
            raise ValueError(FIELD_FLAGS.get(name, "--" + name.replace("_", "-")) + sep + tail
                             ) from None


def _spec_flags(a: argparse.Namespace, role: str) -> dict:
    """``speculative``, ``num_speculative_tokens``, ``speculative_draft_model``, checked
    (a decode worker refuses to start with settings ``SpecConfig`` rejects).

    Raises:
        SystemExit: a bad combination (the message names the field).
    """
    out = {"speculative": a.speculative, "num_speculative_tokens": a.num_speculative_tokens,
           "speculative_draft_model": a.speculative_draft_model}
    if a.speculative is not None and role == "decode":
        if a.tp > 1 or a.ep > 1:
            raise SystemExit("--speculative: not supported with --tp / --ep > 1")
        try:
            SpecConfig(a.speculative, a.num_speculative_tokens,
                       draft_model=a.speculative_draft_model)
        except ValueError as e:
            raise SystemExit(f"--speculative: {e}") from None
    return out


def _at_least(least: int, flag: str, n: int | None) -> int | None:
    """``n``, the value of ``flag`` (``None``: not given), checked against ``least``.

    Raises:
        SystemExit: ``n`` below ``least`` (names the flag).
    """
    if n is not None and n < least:
        raise SystemExit(f"{flag}: must be ≥ {least}, got {n}")
    return n


def _parallel_flags(a: argparse.Namespace) -> dict:
    """``tp``, ``ep``, ``expert_plan``, ``remote_ranks``, ``collective_timeout_s`` of the
    parsed flags.

    Raises:
        SystemExit: a bad value (argparse-style message naming the flag).
    """
    for flag in ("tp", "ep"):
        if getattr(a, flag) < 1:
            raise SystemExit(f"--{flag}: must be ≥ 1, got {getattr(a, flag)}")
    if a.tp > 1 and a.ep > 1 and a.ep % a.tp:
        raise SystemExit(f"--ep: {a.ep} is not a multiple of --tp {a.tp} (attention groups)")
    if a.expert_plan is not None and a.ep == 1:
        raise SystemExit("--expert-plan: needs --ep > 1")
    if a.remote_ranks and max(a.tp, a.ep) == 1:
        raise SystemExit("--remote-ranks: needs --tp or --ep > 1")
    if a.collective_timeout is not None and not a.collective_timeout > 0:
        raise SystemExit(f"--collective-timeout: must be > 0, got {a.collective_timeout}")
    return {"tp": a.tp, "ep": a.ep, "expert_plan": a.expert_plan, "remote_ranks": a.remote_ranks,
            "collective_timeout_s": a.collective_timeout}


__all__ = [
    "FIELD_FLAGS",
    "TEST_HOOKS_ENV",
    "THREADS_ENV",
    "WorkerConfig",
    "WorkerEnv",
    "build_parser",
    "check_flags",
    "config_from_args",
    "parse_config",
]
