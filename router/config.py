"""Router configuration and command line: :class:`RouterConfig` (frozen), its flags and
the process settings :mod:`router.__main__` serves with.

Run: ``python -m router --host 127.0.0.1 --port 8000 --model k3-tiny [--api-key KEY]``; the
cluster token comes from ``$K3SERVE_CLUSTER_TOKEN`` (``k3serve serve`` sets it), the API key
from ``--api-key`` or ``$K3SERVE_API_KEY``.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from k3serve.process import LOG_LEVELS, FlagParser, log_level
from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV, api_keys_from_env
from k3serve.tracing import ENDPOINT_ENV, check_endpoint
from router.placement import PlacementParams
from router.policies.home import HomeParams
from router.policies.table import DEFAULT_POLICY, POLICIES
from router.replicas import METRICS_ENV, REGISTRY_ENV

#: The store master's address when ``--store-url`` is not given (the workers' store clients
#: read the same variable: kvstore.store.client.StoreConfig).
STORE_URL_ENV = "K3SERVE_STORE_URL"


@dataclass(frozen=True)
class RouterConfig:
    """Everything the router is configured with (read once, in ``main``).

    Attributes:
        model: Served model name (preset or checkpoint folder); requests must name it.
        policy: Prefill placement policy, a key of ``router.policies.table.POLICIES``.
        api_key: Bearer token required on ``/v1/*`` (and on ``/metrics``,
            ``/health?detail=1``, ``/openapi.json``, ``/docs``, ``/redoc``); ``None`` leaves
            the API open.
        api_keys: Further accepted bearer tokens (``--api-key K1 K2``, ``--api-key-file``):
            each key is a client of its own for admission's fair shares
            (:mod:`router.admission`).
        cluster_token: Token exchanged with workers on every internal call.
        tokenizer: Tokenizer name or folder; ``None`` = the model's.
        add_bos: Prepend BOS to text prompts of ``/v1/completions`` (token-id prompts and
            chat templates are used as given).
        poll_interval_s: Seconds between cache-event pulls of each worker.
        poll_timeout_s: Timeout of one cache-event pull, seconds: ``unhealthy_after`` slow
            pulls in a row take a stuck (alive but unresponsive) worker out of placement. The
            polls have their own connection pool: request traffic never starves them.
        unhealthy_after: Failed pulls in a row that take a worker out of placement.
        timeout_s: Timeout of one internal call, seconds (a stream: between two events).
        max_model_len: Longest prompt + output in tokens; ``None`` = the workers' (or the
            model config's) value.
        prefill_rate: Prefill tokens/s assumed for a worker until it reports a measured rate
            (``WorkerLoad.prefill_rate``).
        busy_wait_s: How long a request waits for room while every decode worker answers
            ``busy`` (no free slot or pages) before it fails with 503, seconds.
        deadline_s: Seconds a request-path call (reserve, prefill, the wait between two
            stream events) waits on a worker that is no longer available (its polls fail, or
            its breaker is open) before it fails as hung; a healthy (busy) worker is waited
            for up to ``timeout_s``.
        pool_timeout_s: Seconds a request waits for a free connection of the request pool;
            past it the request is shed (503 + ``Retry-After``), no worker is blamed.
        max_connections: Size of the request path's connection pool.
        breaker_fail_max: Request-path failures in a row that open a worker's circuit
            breaker (placement skips it until a trial request succeeds).
        breaker_reset_s: Seconds an open breaker waits before one trial request, seconds.
        max_prompts: Most prompts in one ``/v1/completions`` batch (more: 400).
        max_body_bytes: Largest request body, bytes (more: 413).
        max_queued: Choices admitted beyond the decode workers' slots (Σ ``num_slots`` of the
            available decode workers); they wait for a slot in arrival order. A request that
            would pass ``slots + max_queued`` is refused at once with 429 and ``Retry-After``.
        max_admitted_tokens: The token part of admission's limit: prompt tokens +
            ``max_tokens`` per choice, summed over the admitted requests
            (:mod:`router.admission`); ``None``: the decode workers' cache tokens
            (Σ ``num_pages × block_size``) × ``(slots + max_queued) / slots``.
        retry_after_s: The ``Retry-After`` of a shed request (429, 503), seconds.
        placement: Placement knobs (``HomeParams``: the cache-aware ones and ``prefix_home``'s).
        replica: This process's index among the router replicas (``--replicas N``,
            :mod:`router.replicas`); ``None``: the only router process.
        registry_dir: The replicas' shared registry folder (``None``: no replicas).
        metrics_dir: The replicas' prometheus-client multiprocess folder (``None``: metrics
            of this process only).
        decode_channels: Read a decode worker's token streams on one decode channel per
            worker (when the worker serves them: ``WorkerInfo.channels``); False: one stream
            per request (``--no-decode-channels``).
        otlp_traces_endpoint: OTLP/HTTP URL the request spans are exported to
            (:mod:`k3serve.tracing`); ``None``: tracing off.
        store_url: The shared store's master, ``host:port`` (``--store-url``, else
            ``$K3SERVE_STORE_URL``): ``/health`` reports whether it is reachable
            (:mod:`router.store_health`); ``None``: no store known.

    Raises:
        ValueError: an unknown policy or a non-positive poll interval / timeout (named).
    """

    model: str = "k3-tiny"
    policy: str = DEFAULT_POLICY
    api_key: str | None = field(default=None, repr=False)  # secrets never in a log line
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cluster_token: str | None = field(default=None, repr=False)
    tokenizer: str | None = None
    add_bos: bool = True
    poll_interval_s: float = 0.1
    poll_timeout_s: float = 10.0
    unhealthy_after: int = 3
    timeout_s: float = 600.0
    max_model_len: int | None = None
    prefill_rate: float = 10_000.0
    busy_wait_s: float = 60.0
    deadline_s: float = 30.0
    pool_timeout_s: float = 5.0
    max_connections: int = 1024
    breaker_fail_max: int = 3
    breaker_reset_s: float = 5.0
    max_prompts: int = 256
    max_body_bytes: int = 4 << 20
    max_queued: int = 64
    max_admitted_tokens: int | None = None
    retry_after_s: int = 1
    placement: PlacementParams = field(default_factory=HomeParams)
    replica: int | None = None
    registry_dir: str | None = None
    metrics_dir: str | None = None
    decode_channels: bool = True
    otlp_traces_endpoint: str | None = None
    store_url: str | None = None

    def __post_init__(self) -> None:
        check_endpoint(self.otlp_traces_endpoint)
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {sorted(POLICIES)}")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s: must be > 0")
        for name in ("poll_timeout_s", "deadline_s", "pool_timeout_s", "breaker_reset_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0")
        for name in ("max_connections", "breaker_fail_max", "max_prompts", "max_body_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.api_keys and not self.api_key:
            raise ValueError("api_keys: set api_key too (the first key)")
        if any(not k for k in self.api_keys):
            raise ValueError("api_keys: an empty key")
        if self.max_queued < 0 or self.retry_after_s < 0:
            raise ValueError("max_queued, retry_after_s: must be >= 0")
        if self.max_admitted_tokens is not None and self.max_admitted_tokens < 1:
            raise ValueError("max_admitted_tokens: must be >= 1")
        if not self.prefill_rate > 0:  # prices a queue in seconds: tokens / rate
            raise ValueError(f"prefill_rate: must be > 0 (got {self.prefill_rate})")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len: must be >= 1 (got {self.max_model_len})")
        if self.store_url is not None:
            host, _, port = self.store_url.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"store_url: {self.store_url!r} is not host:port")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m router`` (the launcher passes ``--host --port --model
    --policy`` and optionally ``--api-key --poll-timeout``)."""
    ap = FlagParser(prog="python -m router",
                                 description="k3serve router: OpenAI-compatible front of the "
                                             "prefill/decode cluster")
    ap.add_argument("--host", default="127.0.0.1", help="bind address")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port")
    ap.add_argument("--model", default="k3-tiny",
                    help="served model: preset name or checkpoint folder (its tokenizer and "
                         "context length)")
    ap.add_argument("--policy", default=DEFAULT_POLICY, choices=sorted(POLICIES),
                    help="prefill placement policy")
    ap.add_argument("--api-key", default=None, nargs="+", action="extend",
                    help=f"bearer token(s) for /v1/*, /metrics, /health?detail=1 and the API "
                         f"docs; repeat or list several (default: ${API_KEY_ENV}, keys separated by "
                         f"spaces, else open)")
    ap.add_argument("--api-key-file", default=None,
                    help="a file of further API keys, one a line (# comments, blank lines)")
    ap.add_argument("--tokenizer", default=None,
                    help="tokenizer name or folder (default: the model's)")
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS to text prompts")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds")
    ap.add_argument("--poll-timeout", type=float, default=10.0,
                    help="seconds one cache-event pull may take before it counts as failed")
    ap.add_argument("--deadline", type=float, default=30.0,
                    help="seconds a request waits on an unavailable (hung) worker")
    ap.add_argument("--max-prompts", type=int, default=256,
                    help="most prompts in one /v1/completions batch")
    ap.add_argument("--max-body-bytes", type=int, default=4 << 20,
                    help="largest request body in bytes (more: 413)")
    ap.add_argument("--max-queued", type=int, default=64,
                    help="choices admitted beyond the decode slots (then 429)")
    ap.add_argument("--max-admitted-tokens", type=int, default=None, metavar="TOKENS",
                    help="tokens admitted at once (prompt + max_tokens per choice, summed; "
                         "then 429); default: the decode workers' cache tokens scaled by "
                         "(slots + max-queued) / slots")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="longest prompt + output in tokens (default: the workers' context "
                         "length)")
    ap.add_argument("--prefill-rate", type=float, default=10_000.0,
                    help="prefill tokens/s assumed for a worker until it reports its measured "
                         "rate with its cache events (then the measured rate prices its queue)")
    ap.add_argument("--log-level", default="warning", type=log_level, metavar="LEVEL",
                    help="logging level: " + ", ".join(LOG_LEVELS))
    ap.add_argument("--no-decode-channels", action="store_true",
                    help="one decode stream per request, not one channel per decode worker")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help=f"export request spans over OTLP/HTTP to URL (default: "
                         f"${ENDPOINT_ENV}, else tracing off)")
    ap.add_argument("--store-url", default=None, metavar="HOST:PORT",
                    help=f"the shared store's master (mooncake_master RPC address), shown on "
                         f"/health (default: ${STORE_URL_ENV}, else none)")
    ap.add_argument("--replicas", type=int, default=1,
                    help="router processes behind the one address (router/replicas.py)")
    ap.add_argument("--replica-index", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)
    return ap


@functools.lru_cache(maxsize=8)
def model_context_len(model: str) -> int | None:
    """``max_position_embeddings`` of ``model``'s config (a preset or a checkpoint folder),
    tokens; ``None`` when it cannot be read."""
    from k3serve.config import load_config

    try:
        return load_config(model).max_position_embeddings
    except (ValueError, KeyError, TypeError, OSError):
        return None


def check_model_len(model: str, max_model_len: int | None) -> None:
    """Refuse a ``--max-model-len`` above ``model``'s context length (vLLM refuses it too:
    positions past the model's are never computed right).

    Raises:
        ValueError: one line naming the flag, the value and the model's limit.
    """
    limit = model_context_len(model)
    if max_model_len is not None and limit is not None and max_model_len > limit:
        raise ValueError(f"--max-model-len: {max_model_len} is above the context length of "
                         f"{model} ({limit} tokens, max_position_embeddings)")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The :class:`RouterConfig` of parsed flags and the two environment variables.

    Raises:
        ValueError: a bad value (the field or the flag and the value, one line).
    """
    check_model_len(args.model, args.max_model_len)
    keys = (api_keys_of(args.api_key or [], args.api_key_file)
            or api_keys_from_env(os.environ.get(API_KEY_ENV)))
    return RouterConfig(
        model=args.model, policy=args.policy,
        api_key=keys[0] if keys else None, api_keys=tuple(keys[1:]),
        cluster_token=os.environ.get(CLUSTER_TOKEN_ENV) or None, tokenizer=args.tokenizer,
        add_bos=not args.no_bos, poll_interval_s=args.poll_interval,
        poll_timeout_s=args.poll_timeout, deadline_s=args.deadline,
        max_prompts=args.max_prompts, max_body_bytes=args.max_body_bytes,
        max_queued=args.max_queued, max_admitted_tokens=args.max_admitted_tokens,
        max_model_len=args.max_model_len, prefill_rate=args.prefill_rate,
        replica=args.replica_index, decode_channels=not args.no_decode_channels,
        otlp_traces_endpoint=args.otlp_traces_endpoint or os.environ.get(ENDPOINT_ENV) or None,
        store_url=args.store_url or os.environ.get(STORE_URL_ENV) or None,
        registry_dir=os.environ.get(REGISTRY_ENV) if args.replica_index is not None else None,
        metrics_dir=os.environ.get(METRICS_ENV) if args.replica_index is not None else None)


def api_keys_of(keys: list[str], path: str | None) -> list[str]:
    """The API keys of ``--api-key`` and of the ``--api-key-file`` at ``path`` (one a line;
    blank lines and ``#`` comments skipped), in that order, duplicates dropped.

    Raises:
        ValueError: the file cannot be read (named).
    """
    out = [k.strip() for k in keys if k.strip()]
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror}") from None
        out += [ln.strip() for ln in text.splitlines()
                if ln.strip() and not ln.strip().startswith("#")]
    return list(dict.fromkeys(out))


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket for the router (uvicorn serves on it).

    Raises:
        OSError: the address cannot be bound (taken port, unknown host, no permission).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


#: uvicorn's HTTP implementation of the router (deploy/fake_stack.Stack serves it the same).
ROUTER_HTTP = "httptools"

#: uvicorn's event loop for the router: ``"auto"`` is uvloop (a declared dependency, C event
#: loop on libuv) where it is installed, else asyncio's. uvloop cuts the router's CPU per
#: relayed token by ~15 % (benchmarks/router_relay.py): every chunk is a
#: socket read, a task wake-up and a socket write. The workers stay on asyncio's loop.
ROUTER_LOOP = "auto"

#: The router process's first collector threshold (CPython's default is 700): a request
#: allocates and frees thousands of container objects (messages, deltas, tasks, futures),
#: and a young-generation collection every 700 of them cost ~4 % of the router's CPU in the
#: streaming benchmark (benchmarks/router_relay.py); 50 000 young objects are a few MB.
GC_THRESHOLD0 = 50_000


def tune_gc() -> None:
    """Collector settings of a router process (not of the code that imports the router):
    the objects made at startup (the app, its schemas and models: ~80 000) are frozen out of
    every later collection (``gc.freeze``), and the young generation is collected every
    :data:`GC_THRESHOLD0` allocations. Cycles are still collected; only less often."""
    import gc

    gc.collect()
    gc.freeze()
    _, t1, t2 = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD0, t1, t2)
