"""LLMEngine: the step loop (schedule → run → sample → outputs) and the worker API.

One :meth:`LLMEngine.step`::

    plan = schedule()                 scheduler admits / allocates / preempts (ids only); the
                                      runner zeroes or loads admitted slots; connector.on_admit
    for group in (prefill chunks, decodes):          two forwards at most
        logits = runner.execute(RunBatch)            raises part-way → the group is recomputed
        commit: index full blocks, save snapshots    (cm.commit → runner.save_snapshots)
        sample rows that computed their last known token (n > 1: fork the choices);
        detokenize, stop checks; finished → cm.finish (end-of-request snapshot)
    outputs

Disaggregation is not in this path: it lives in a :class:`~k3serve.engine.connector.KVConnector`
at the engine's edge (``LLMEngine.connector``; ``None`` for an offline / colocated engine). The
worker API methods :meth:`add_prefill_request` / :meth:`release` (prefill worker) and
:meth:`reserve` / :meth:`admit` (decode worker) are a facade over the
:class:`~k3serve.engine.connector.DisaggConnector`, attached on the first such call.
:meth:`abort_request` works anywhere; :meth:`cache_events` / :meth:`cache_state` / :meth:`info`
feed the router. Lifecycle: :mod:`k3serve.protocol`.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from k3serve.cache.events import EventLog
from k3serve.cache.manager import CacheManager
from k3serve.cache.pools import KVPools
from k3serve.cache.specs import (
    CacheConfig,
    CacheDtypes,
    KDAStateSpec,
    MLALatentSpec,
    auto_dense_snapshot_blocks,
    layout_fingerprint,
)
from k3serve.config import ModelConfig
from k3serve.engine.connector import DisaggConnector, KVConnector
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.sampler import SampleResult, SamplingRow, sample
from k3serve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from k3serve.engine.sequence import Request, SeqStatus, as_token_ids
from k3serve.engine.sequence import Sequence as Seq
from k3serve.protocol import CacheHandle, CompletionOutput, RequestOutput
from k3serve.sampling import SamplingParams, draw_seed
from k3serve.tokenizer.detok import IncrementalDetokenizer

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class EngineConfig:
    """Engine capacities and policy.

    Attributes:
        block_size: tokens per latent page / hashed block ``B``.
        num_pages: latent pages ``P`` (capacity ``P·B`` tokens).
        num_slots: KDA state slots (running + held + reserved sequences).
        num_snapshots: KDA snapshot budget.
        max_num_batched_tokens: tokens per step (prefill chunks + decodes).
        max_num_seqs: most running sequences (``None``: ``num_slots``).
        enable_prefix_caching: reuse cached prefixes (blocks + snapshots).
        snapshot_interval_tokens: also snapshot every this many prompt tokens (0: off).
        rolling_snapshot_fraction: share of ``num_snapshots`` that decoding sequences may pin
            for their end-of-request snapshots (``CacheConfig.rolling_snapshot_fraction``).
        dense_snapshot_blocks: log-spaced prompt snapshots so the first divergence hits
            (``CacheConfig.dense_snapshot_blocks``; 0: off; -1: chosen from the byte
            arithmetic, ``k3serve.cache.specs.auto_dense_snapshot_blocks``).
        max_model_len: cap on prompt + output tokens (``None``: the model's, and at most
            ``P·B``).
        record_logits: keep each sampled token's logits in the outputs (tests).
        max_events: cache events kept for readers.
        gpu_memory_utilization: CUDA only: the share of the accelerator's memory this engine
            may hold (weights already loaded + activations + pools), as vLLM / SGLang's flag;
            the pools are then sized from what is free after the weights load
            (:func:`size_pools_from_memory`): ``num_slots = max(num_slots, max_num_seqs)``,
            ``num_snapshots`` as given, and ``num_pages`` from the rest (``num_pages`` is then
            ignored). ``None``: the explicit sizes (always on CPU).
        cuda_graphs: CUDA only: replay captured decode graphs
            (:class:`~k3serve.engine.cuda_graphs.CUDAGraphRunner`; buckets up to
            ``max_num_seqs`` or ``num_slots``); the pools get one scratch slot and page.
    """

    block_size: int = 64
    num_pages: int = 1024
    num_slots: int = 32
    num_snapshots: int = 32
    max_num_batched_tokens: int = 512
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = True
    snapshot_interval_tokens: int = 0
    rolling_snapshot_fraction: float = 0.5
    dense_snapshot_blocks: int = 0
    max_model_len: int | None = None
    record_logits: bool = False
    max_events: int = 100_000
    gpu_memory_utilization: float | None = None
    cuda_graphs: bool = True

    def __post_init__(self) -> None:
        def check(fld: str, lo: int, optional: bool = False) -> None:
            v = getattr(self, fld)
            if optional and v is None:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                none = " or None" if optional else ""
                raise ValueError(f"EngineConfig.{fld}: must be an int ≥ {lo}{none}, got {v!r}")

        for fld in ("block_size", "num_pages", "num_slots", "max_num_batched_tokens", "max_events"):
            check(fld, 1)
        check("num_snapshots", 0)
        check("snapshot_interval_tokens", 0)
        check("dense_snapshot_blocks", -1)
        check("max_num_seqs", 1, optional=True)
        check("max_model_len", 2, optional=True)  # a prompt token and a generated one
        util = self.gpu_memory_utilization
        if util is not None and (
            isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1
        ):
            raise ValueError(
                f"EngineConfig.gpu_memory_utilization: must be a number in (0, 1] or None, "
                f"got {util!r}"
            )
        if not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"EngineConfig.cuda_graphs: must be a bool, got {self.cuda_graphs!r}")
        frac = self.rolling_snapshot_fraction
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 <= frac <= 1:
            raise ValueError(
                f"EngineConfig.rolling_snapshot_fraction: must be a number in [0, 1], got {frac!r}"
            )


def pool_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Bytes of one state slot, one snapshot and one latent page (all layers).

    Returns:
        ``(slot_bytes, snapshot_bytes, page_bytes)``: a slot / snapshot holds every KDA layer's
        ``[H, K, V]`` float32 state and ``[W-1, 3·H·K]`` conv state (``dtype``); a page holds
        every MLA layer's ``[B, D]`` latents (``dtype``) — the :class:`KVPools` layout.
    """
    es = torch.empty((), dtype=dtype).element_size()
    lk, h, k = cfg.num_kda_layers, cfg.kda_num_heads, cfg.kda_head_dim
    state = lk * (h * k * k * 4 + (cfg.kda_conv_kernel - 1) * cfg.kda_conv_dim * es)
    page = cfg.num_mla_layers * block_size * cfg.mla_latent_dim * es
    return state, state, page


def size_pools_from_memory(
    cfg: ModelConfig,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    reserve_bytes: int,
    block_size: int,
    num_slots: int,
    num_snapshots: int,
    dtype: torch.dtype,
    extra: int = 0,
) -> int:
    """Latent pages that fit the engine's memory share (vLLM's ``gpu_memory_utilization``).

    ``budget = utilization·total − (total − free) − reserve`` bytes, where ``total − free`` is
    what is already held (the weights, other processes) and ``reserve`` the activations (a
    profiled forward) and graph memory; the slots (``num_slots + extra``) and snapshots come
    out of the budget first, the pages take the rest.

    Args:
        cfg: model config. total_bytes, free_bytes: the accelerator's memory (bytes), as
            ``torch.cuda.mem_get_info`` reports it after the weights load.
        utilization: share in (0, 1]. reserve_bytes: activations + graphs (bytes).
        block_size: tokens per page. num_slots, num_snapshots: the other pools' sizes.
        dtype: latent / conv dtype. extra: scratch slots / pages the engine adds (CUDA graphs).

    Returns:
        ``num_pages`` (≥ 1).

    Raises:
        ValueError: the budget cannot hold the slots, snapshots and one page (the message
            gives the figures: lower ``max_num_seqs`` / ``num_snapshots`` or raise the share).
    """
    slot_b, snap_b, page_b = pool_bytes(cfg, block_size, dtype)
    budget = int(utilization * total_bytes) - (total_bytes - free_bytes) - reserve_bytes
    left = budget - (num_slots + extra) * slot_b - num_snapshots * snap_b - extra * page_b
    pages = left // page_b if left > 0 else 0
    if pages < 1:
        gib = 1 << 30
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization: {utilization} of {total_bytes / gib:.1f} GiB "
            f"leaves {budget / gib:.2f} GiB after {(total_bytes - free_bytes) / gib:.2f} GiB held "
            f"and {reserve_bytes / gib:.2f} GiB of activations; {num_slots} slots and "
            f"{num_snapshots} snapshots need {(num_slots * slot_b + num_snapshots * snap_b) / gib:.2f}"
            " GiB before any page"
        )
    return int(pages)


@torch.inference_mode()
def profile_activation_bytes(
    model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, block_size: int,
    dtype: torch.dtype, device: torch.device,
) -> int:  # fmt: skip
    """Peak bytes a forward of ``num_tokens`` prompt tokens allocates beyond what is held
    (one throw-away sequence in tiny pools; CUDA only, as vLLM's profile run)."""
    from k3serve.model.batch import make_batch

    pages = -(-num_tokens // block_size)
    tmp = KVPools(cfg, 1, pages, block_size, 0, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    b = make_batch([num_tokens], [0], [0], [list(range(pages))], block_size, device=device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    model(ids, b, tmp)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del tmp, b, ids
    torch.cuda.empty_cache()
    return int(peak)


@dataclass
class EngineStats:
    """Counters since start (tokens)."""

    num_steps: int = 0
    num_forwards: int = 0
    num_mixed_steps: int = 0  # steps with prefill chunks and decodes together
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0


class _RenderAll:
    """``decode`` that renders special ids too (the detokenizer skips them itself)."""

    def __init__(self, tok: Any):
        self.tok = tok

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class LLMEngine:
    """The serving core of one worker: cache, scheduler, model runner, sampler.

    Args:
        model: ``K3ForCausalLM`` in eval mode.
        model_config: its config.
        tokenizer: ``k3serve.tokenizer.Tokenizer`` (detokenization; may be ``None``: no text).
        config: :class:`EngineConfig`.
        device: pools and inputs live here.
        dtype: latent / conv pool dtype (CPU: float32).
        weights_id: identity of the model's weights
            (``k3serve.model.checkpoint_files.checkpoint_identity`` / ``random_init_identity``;
            :class:`~k3serve.engine.llm.LLM` sets it), part of the layout fingerprint: engines
            serving different weights never share block hashes. ``None``: unknown.
        connector: a :class:`~k3serve.engine.connector.KVConnector` at the engine's edge, or
            ``None`` (the default; the disaggregation methods attach a
            :class:`~k3serve.engine.connector.DisaggConnector` on first use).
        runner: the runner to drive instead of a :class:`ModelRunner` over ``model`` (e.g.
            rank 0's ``k3serve.parallel.runner.ParallelModelRunner`` of a multi-rank
            instance): it brings its own ``pools`` (sized as ``config``; the cache allocator
            stays here, slot and page numbers mean the same on every rank), ``execute``, the
            cache copies, ``transfer_pools``, ``fingerprint_fields()`` (added to
            :attr:`fingerprint_fields`) and ``receive_cache(slot, pages)``.

    Attributes:
        connector: the attached connector or ``None`` (then the step calls none).
        fingerprint: the layout fingerprint (hash salt base, ``GET /internal/info``).
        fingerprint_fields: what the kvstore pairing compares besides the pool shapes (the
            ``PoolLayout`` extra): the model's ``fingerprint_fields()`` plus ``weights``.

    Raises:
        ValueError: inconsistent capacities.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        weights_id: str | None = None,
        connector: KVConnector | None = None,
        runner: Any = None,
    ):
        c = config or EngineConfig()
        dev = torch.device(device)
        use_graphs = c.cuda_graphs and dev.type == "cuda"
        extra = 1 if use_graphs else 0  # the graphs' scratch slot and page (never allocated)
        if c.gpu_memory_utilization is not None and dev.type == "cuda":
            slots = max(c.num_slots, c.max_num_seqs or 0)
            reserve = profile_activation_bytes(
                model, model_config, c.max_num_batched_tokens, c.block_size, dtype, dev
            )
            reserve = reserve * (2 if use_graphs else 1)  # the graphs' pool beside the eager one
            free, total = torch.cuda.mem_get_info(dev)
            pages = size_pools_from_memory(
                model_config, total, free, float(c.gpu_memory_utilization), reserve,
                c.block_size, slots, c.num_snapshots, dtype, extra,
            )  # fmt: skip
            c = dataclasses.replace(c, num_slots=slots, num_pages=pages)
        self.config = c
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.pools = (
            runner.pools
            if runner is not None
            else KVPools(
                model_config, c.num_slots + extra, c.num_pages + extra, c.block_size,
                c.num_snapshots, dtype, device,
            )
        )  # fmt: skip
        dn = _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))
        self.weights_id = weights_id
        self.fingerprint = layout_fingerprint(
            model_config, c.block_size, CacheDtypes(dn, dn, "float32"), weights_id
        )
        self.fingerprint_fields: dict[str, Any] = {
            **model_config.fingerprint_fields(),
            "weights": weights_id,
            **(runner.fingerprint_fields() if runner is not None else {"tp": 1}),
        }
        self.cm = CacheManager(
            CacheConfig(
                c.num_pages,
                c.num_slots,
                c.num_snapshots,
                c.block_size,
                c.enable_prefix_caching,
                c.snapshot_interval_tokens,
                c.rolling_snapshot_fraction,
                self._dense_snapshot_blocks(model_config, dn),
            ),
            self.fingerprint,
            EventLog(c.max_events),
        )
        self.scheduler = Scheduler(
            self.cm, c.max_num_batched_tokens, min(c.max_num_seqs or c.num_slots, c.num_slots)
        )
        self.max_model_len = min(
            model_config.max_position_embeddings,
            c.max_model_len or 1 << 62,
            c.num_pages * c.block_size,
        )
        self.runner: ModelRunner
        if runner is not None:  # a multi-rank instance (k3serve.parallel) brings its own
            self.runner = runner
        elif use_graphs:
            from k3serve.engine.cuda_graphs import CUDAGraphRunner

            self.runner = CUDAGraphRunner(
                model, self.pools, device, self.max_model_len,
                max_num_seqs=min(c.max_num_seqs or c.num_slots, c.num_slots),
                scratch_slot=c.num_slots, scratch_page=c.num_pages,
            )  # fmt: skip
            self.runner.capture()
        else:
            self.runner = ModelRunner(model, self.pools, device)
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = model_config.eos_token_id if eos is None else eos
        specials = getattr(tokenizer, "special_tokens", None) if tokenizer is not None else None
        self._special_ids = (
            frozenset(specials.values()) if isinstance(specials, dict) else frozenset()
        )
        self._decoder = _RenderAll(tokenizer) if tokenizer is not None else None
        self.connector: KVConnector | None = None
        if connector is not None:
            self.attach(connector)
        # structured outputs: the grammar vocabulary (built on first use) and each live
        # request's matchers by choice; rebuilt from grammar + outputs whenever they disagree
        self._grammar_vocab: Any = None
        self._matchers: weakref.WeakKeyDictionary[Request, dict[int, Any]] = (
            weakref.WeakKeyDictionary())

    def _dense_snapshot_blocks(self, cfg: ModelConfig, dtype_name: str) -> int:
        c = self.config
        if c.dense_snapshot_blocks >= 0:
            return c.dense_snapshot_blocks
        return auto_dense_snapshot_blocks(
            MLALatentSpec.from_config(cfg, c.block_size, dtype_name),
            KDAStateSpec.from_config(cfg, CacheDtypes(dtype_name, dtype_name, "float32")),
        )

    def attach(self, connector: KVConnector) -> None:
        """Put ``connector`` at the engine's edge (and in the scheduler's hook).

        Raises:
            ValueError: another connector is attached already.
        """
        if self.connector is not None and self.connector is not connector:
            raise ValueError("connector: the engine has a connector already")
        self.connector = connector
        self.scheduler.hook = connector

    def _disagg(self) -> DisaggConnector:
        """The disaggregation connector the worker API facade delegates to (attached now if
        the engine has none).

        Raises:
            TypeError: the engine's connector is not a :class:`DisaggConnector`.
        """
        if self.connector is None:
            self.attach(DisaggConnector(self))
        if not isinstance(self.connector, DisaggConnector):
            raise TypeError(
                f"connector: {type(self.connector).__name__} does not serve the disaggregation "
                "API (reserve / admit / add_prefill_request / release)"
            )
        return self.connector

    # ================================================================== validation
    def _check_new(self, request_id: str, prompt_token_ids: Sequence[int]) -> list[int]:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
        if request_id in self.requests or (
            self.connector is not None and self.connector.has_request(request_id)
        ):
            raise ValueError(f"request_id: {request_id!r} is already live")
        ids = as_token_ids(prompt_token_ids, self.model_config.vocab_size, "prompt_token_ids")
        if not ids:
            raise ValueError("prompt_token_ids: empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(ids)} tokens leave no room to generate within the model "
                f"length {self.max_model_len}"
            )
        return ids

    def _check_params(self, params: SamplingParams | None) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams, got {type(params).__name__}")
        v = self.model_config.vocab_size
        if any(t >= v for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids: ids must be < vocab_size {v}")
        if params.grammar is not None:
            self._vocab_for_grammars().validate(params.grammar)  # GrammarError(ValueError)
        if params.seed is None:
            params = params.with_seed(draw_seed())
        return params

    def _vocab_for_grammars(self) -> Any:
        if self._grammar_vocab is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.grammar: the engine has no tokenizer")
            from k3serve.structured import GrammarVocab

            self._grammar_vocab = GrammarVocab(self.tokenizer, self.model_config.vocab_size)
        return self._grammar_vocab

    def _grammar_masks(self, meta: list[tuple[Seq, int, torch.Tensor]],
                       rows: list[SamplingRow]) -> tuple[torch.Tensor | None, list[Any]]:
        """Bool ``[N, V]`` allowed-token mask of the rows (``None``: no row has a grammar) and
        each row's matcher (``None`` for unconstrained rows). A matcher is rebuilt from the
        request's grammar and the choice's outputs when it has not consumed exactly those
        (admission after token #1 elsewhere, the decode-side fallback, a fork)."""
        if not any(r.params.grammar for r in rows):
            return None, [None] * len(rows)
        from k3serve.structured.mask import grammar_mask

        vocab = self._vocab_for_grammars()
        matchers: list[Any] = []
        for (seq, c, _), r in zip(meta, rows):
            if not r.params.grammar:
                matchers.append(None)
                continue
            by_choice = self._matchers.setdefault(seq.request, {})
            m = by_choice.get(c)
            if m is None or m.num_consumed != len(r.output_token_ids):
                m = by_choice[c] = vocab.matcher(r.params.grammar, r.output_token_ids)
            matchers.append(m)
        width = self.model_config.vocab_size
        allowed = torch.ones(len(rows), width, dtype=torch.bool)
        idx = [i for i, m in enumerate(matchers) if m is not None]
        allowed[idx] = grammar_mask([matchers[i] for i in idx], width)
        return allowed, matchers

    def _next_seq_id(self) -> int:
        return next(self._seq_ids)

    def _new_seq(
        self, req: Request, choice: int, tokens: list[int], seq_id: int | None = None
    ) -> Seq:
        left = self.max_model_len - len(req.prompt_token_ids)
        detok = IncrementalDetokenizer(
            self._decoder or _NoText(),
            req.params,
            eos_token_id=self._eos,
            special_token_ids=self._special_ids,
            max_tokens=left,
        )
        sid = self._next_seq_id() if seq_id is None else seq_id
        seq = Seq(sid, req, choice, tokens, len(req.prompt_token_ids), detok)
        req.seqs.append(seq)
        return seq

    # ================================================================== requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
        output_token_ids: Sequence[int] = (),
        output_logprobs: Sequence[float] | None = None,
    ) -> RequestOutput | None:
        """Queue a request to run here from prompt to finish.

        With ``output_token_ids`` the request continues after tokens sampled elsewhere (the
        decode worker's fallback after a failed transfer continues from the prefill worker's
        token #1, which the client already has): the prefill covers ``prompt + outputs`` and
        sampling continues at position ``L + len(outputs)``, exactly as after
        :meth:`admit`. The given tokens are outputs #1…: they count for ``max_tokens``, stop
        tokens / strings and the penalties, and are not sampled again.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: ``[L]`` ids in ``[0, vocab)``, ``L < max_model_len``.
            params: sampling parameters (default ``SamplingParams()``); an unset seed is drawn.
            cache_salt: tenant salt for prefix caching.
            snapshot_at: extra snapshot positions (the router's branch points).
            output_token_ids: tokens already generated for this request (``params.n == 1``).
            output_logprobs: their logprobs (for the outputs; NaN where absent).

        Returns:
            ``None`` (the request streams from :meth:`step`), or its final output when the
            given output tokens already finish it (a stop, ``max_tokens``); it is then not
            kept.

        Raises:
            ValueError: a duplicate id, an empty / out-of-vocabulary / too long prompt, bad
                params (``SamplingParams`` names the field), bad ``cache_salt`` or
                ``snapshot_at``; bad ``output_token_ids`` (out of vocabulary, with ``n > 1``,
                or going on after a token that finishes the request).
        """
        return self._add(
            request_id,
            prompt_token_ids,
            params,
            cache_salt,
            snapshot_at,
            outputs=(output_token_ids, output_logprobs),
        )

    def _add(
        self,
        rid: str,
        prompt: Sequence[int],
        params: SamplingParams | None,
        cache_salt: str | None,
        snapshot_at: Iterable[int],
        outputs: tuple[Sequence[int], Sequence[float] | None] = ((), None),
        *,
        snapshot_on_finish: bool = True,
    ) -> RequestOutput | None:
        """Validate, register with the cache manager and queue (``add_request``; a connector's
        own requests with ``snapshot_on_finish=False``)."""
        ids = self._check_new(rid, prompt)
        params = self._check_params(params)
        outs = as_token_ids(outputs[0], self.model_config.vocab_size, "output_token_ids")
        if outs and params.n != 1:
            raise ValueError(f"SamplingParams.n: must be 1 with output_token_ids, got {params.n}")
        req = Request(rid, ids, params, params.seed, cache_salt, tuple(snapshot_at))  # type: ignore[arg-type]
        seq = self._new_seq(req, 0, ids + outs)
        if outs:
            fed = self._feed_outputs(seq, outs, outputs[1])
            if fed < len(outs):
                raise ValueError(
                    f"output_token_ids: the request finishes at token {fed}; "
                    f"{len(outs) - fed} more given"
                )
            if seq.detok.finished:  # nothing left to generate: done before any compute
                seq.status = SeqStatus.FINISHED
                return self._output(req)
        self.cm.add(seq.seq_id, seq.token_ids, cache_salt, req.snapshot_at, snapshot_on_finish)
        self.requests[rid] = req
        self.scheduler.add(seq)
        return None

    def _feed_outputs(self, seq: Seq, outs: Sequence[int], logprobs: Sequence[float] | None) -> int:
        """Record output tokens sampled elsewhere (their logprobs, detokenization, stop checks).

        Returns:
            How many were consumed: all, or up to and including the one that finishes.
        """
        lps = list(logprobs) if logprobs is not None else []
        lps += [float("nan")] * (len(outs) - len(lps))
        for k, (t, lp) in enumerate(zip(outs, lps)):
            seq.logprobs.append(lp)
            if seq.request.params.logprobs is not None:
                seq.top_logprobs.append(())
            if seq.detok.step(t).finished:
                return k + 1
        return len(outs)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request at any point (queued, prefilling, decoding, held, reserved).

        Frees its slot, pages and snapshots; computed full blocks stay cached. Callable from
        ``on_admit`` and ``layer_hook`` (the step skips the rest of the aborted request's work).

        Returns:
            True when the request was live.
        """
        if self.connector is not None and self.connector.on_abort(request_id):
            return True
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq)
                if self.cm.has(seq.seq_id):
                    self.cm.remove(seq.seq_id)
                seq.status = SeqStatus.FINISHED
        return True

    # ================================================================== worker API facade
    def add_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
        on_admit: Callable[[CacheHandle], None] | None = None,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        """Prefill side: queue a prefill-only request; it stops after token #1 and holds its
        cache (:class:`~k3serve.engine.connector.DisaggConnector`).

        Args:
            on_admit: called once with the :class:`CacheHandle` (slot, pages of the whole
                prompt) before its first forward.
            layer_hook: ``hook(layer_idx, upto_tokens)`` after each layer of each forward that
                computed its tokens: that layer's cache holds tokens ``[0, upto_tokens)``; the
                KDA state is final when ``upto_tokens == L`` (``KVSender.layer_ready``).
            Others as :meth:`add_request`.

        The step that samples token #1 returns a :class:`RequestOutput` with ``handle`` (with
        :class:`~k3serve.protocol.FirstToken`); the slot and pages stay until :meth:`release`.

        Raises:
            ValueError: as :meth:`add_request`; ``params.n != 1``.
            TypeError: the engine's connector is not a ``DisaggConnector``.
        """
        self._disagg().add_prefill_request(
            request_id, prompt_token_ids, params, cache_salt, snapshot_at, on_admit, layer_hook
        )

    def release(self, request_id: str) -> None:
        """Prefill side: the transfer is done; free the held slot and pages.

        Raises:
            ValueError: not a held prefill-only request.
        """
        self._disagg().release(request_id)

    @property
    def num_reserved(self) -> int:
        """Reservations waiting for their cache (:meth:`reserve` not yet admitted or aborted)."""
        return self.connector.num_reserved if isinstance(self.connector, DisaggConnector) else 0

    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a slot and pages for ``num_tokens`` tokens are free now."""
        return self._disagg().can_reserve(num_tokens)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        num_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> CacheHandle:
        """Decode side: take a slot and pages for a request whose cache will arrive.

        Args:
            request_id: the request.
            prompt_token_ids: its prompt (indexed in this worker's cache once admitted).
            num_tokens: tokens whose cache arrives (default ``L``).
            cache_salt: the request's tenant salt.

        Returns:
            :class:`CacheHandle` (slot, pages covering ``[0, num_tokens)``).

        Raises:
            ValueError: as :meth:`add_request`; ``num_tokens`` outside ``[L, max_model_len)``.
            CacheFullError: no slot or pages now (try later / elsewhere).
        """
        return self._disagg().reserve(request_id, prompt_token_ids, num_tokens, cache_salt)

    def admit(
        self,
        request_id: str,
        output_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        output_logprobs: Sequence[float] | None = None,
    ) -> RequestOutput | None:
        """Decode side: the cache arrived; continue the request after ``output_token_ids``.

        Args:
            request_id: a reserved request.
            output_token_ids: tokens sampled elsewhere (token #1, …); the reservation covers
                ``prompt + output_token_ids[:-1]`` (``num_tokens`` at :meth:`reserve`).
            params: the request's params with its seed (the sampler continues at position
                ``num_tokens + 1``).
            output_logprobs: their logprobs (for the outputs; NaN when absent).

        Returns:
            The request's output if it is already finished (a stop in the given tokens or
            ``max_tokens`` reached), else ``None`` (it streams from :meth:`step`).

        Raises:
            ValueError: not reserved, token count disagreeing with the reservation, bad ids or
                params, ``params.n != 1``.
        """
        self._receive_cache(request_id)
        return self._disagg().admit(request_id, output_token_ids, params, output_logprobs)

    def _receive_cache(self, request_id: str) -> None:
        """Tell the runner that ``request_id``'s transferred cache landed in its transfer pools
        (a multi-rank runner hands every rank its part); unknown ids are left to ``admit``."""
        res = getattr(self.connector, "_reserved", {}).get(request_id)
        slot = self.cm.slot(res.seq_id) if res is not None else None
        if slot is not None:
            n = -(-res.num_tokens // self.config.block_size)
            self.runner.receive_cache(slot, list(self.cm.block_table(res.seq_id)[:n]))

    # ================================================================== step
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Run one engine step: schedule → run → sample → outputs.

        Returns:
            Outputs of the requests that changed (new tokens, finished, held); finished ones
            are dropped from the engine afterwards (held requests stay until released).

        Raises:
            whatever a forward (or a connector hook inside it) raises; the forward's sequences
            are recomputed later (or handed to the connector), the engine stays consistent.
        """
        plan = self._schedule()
        for group in (plan.prefills, plan.decodes):
            group = [s for s in group if s.seq.status is SeqStatus.RUNNING]  # aborted by a hook
            if group:
                self._sample(self._run(group))
        return self._collect()

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan, with the admitted slots zeroed or loaded from a snapshot and
        the connector told (``on_admit`` may abort requests: the step skips them)."""
        plan = self.scheduler.schedule()
        self.stats.num_steps += 1
        self.stats.num_mixed_steps += bool(plan.prefills and plan.decodes)
        admitted = [s for s in plan.prefills if s.admission is not None]
        for s in admitted:
            req = s.seq.request
            if s.seq.choice == 0 and req.num_cached_tokens is None:
                req.num_cached_tokens = s.admission.num_cached  # type: ignore[union-attr]
        self.runner.prepare_slots(s.admission for s in admitted)  # type: ignore[misc]
        if self.connector is not None and admitted:
            self.connector.on_admit([s.seq for s in admitted])
        return plan

    def _run(self, group: list[ScheduledSeq]) -> list[tuple[Seq, torch.Tensor]]:
        """One forward over ``group`` through the runner's seam, then the commit (index full
        blocks, save snapshots).

        Returns:
            ``(seq, [V] logits)`` of the rows that computed their last known token (to sample).
        """
        hook = self.connector.layer_hook(group) if self.connector is not None else None
        try:
            logits = self.runner.execute(RunBatch(tuple(self._row(s) for s in group), hook))
        except BaseException:
            self._drop_failed_forward(group)
            raise
        self.stats.num_forwards += 1
        to_sample: list[tuple[Seq, torch.Tensor]] = []
        for k, s in enumerate(group):
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:  # aborted by a layer hook: skip
                continue
            if seq.is_prefill:
                self.stats.prompt_tokens_computed += s.num_new
            seq.num_computed += s.num_new
            self.runner.save_snapshots(self.cm.commit(seq.seq_id, seq.token_ids, s.num_new))
            if seq.num_computed == len(seq.token_ids):
                to_sample.append((seq, logits[k]))
        # the caller samples each group right after its forward: if the next forward raises,
        # these rows are done (left unsampled they would never be scheduled again)
        return to_sample

    def _drop_failed_forward(self, group: list[ScheduledSeq]) -> None:
        """A forward over ``group`` raised part-way (a hook, an interrupt): the KDA/conv states
        of its slots are advanced in some layers and not in others, and nothing was committed.
        Re-running the chunk from there would compute (and index) wrong latents and snapshots,
        so every such sequence is recomputed from the cache instead (preempted), unless the
        connector takes it (a prefill-only request, whose pages a sender holds, is aborted)."""
        for s in group:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            if self.connector is None or not self.connector.on_forward_failed(seq):
                self.scheduler.preempt(seq)

    def _row(self, s: ScheduledSeq) -> Row:
        """The new tokens ``[num_computed, num_computed + num_new)`` of one sequence."""
        seq, start = s.seq, s.seq.num_computed
        slot = self.cm.slot(seq.seq_id)
        assert slot is not None  # scheduled sequences are admitted
        table = self.cm.block_table(seq.seq_id)
        return Row(seq.token_ids[start : start + s.num_new], start, slot, table)

    def _sample(self, items: list[tuple[Seq, torch.Tensor]]) -> None:
        if not items:
            return
        rows: list[SamplingRow] = []
        meta: list[tuple[Seq, int, torch.Tensor]] = []
        for seq, lg in items:
            req = seq.request
            forking = req.needs_fork and seq.choice == 0
            prompt_ids = req.prompt_token_ids if req.params.repetition_penalty != 1.0 else ()
            for c in range(req.params.n) if forking else (seq.choice,):
                outs = seq.output_token_ids if c == seq.choice else []
                rows.append(
                    SamplingRow(req.params, req.seed, len(seq.token_ids), c, outs, prompt_ids)
                )
                meta.append((seq, c, lg))
        allowed, matchers = self._grammar_masks(meta, rows)
        results = sample(torch.stack([m[2] for m in meta]), rows, allowed)
        for m, res in zip(matchers, results):
            if m is not None:
                m.consume(res.token_id)
        # forks first: the children copy the parent's slot before anything can finish it
        pending: list[tuple[Seq, SampleResult, torch.Tensor]] = []
        for (seq, c, lg), res in zip(meta, results):
            if c == seq.choice:
                pending.append((seq, res, lg))
                continue
            child = self._new_seq(seq.request, c, seq.token_ids[: len(seq.token_ids)])
            if self.cm.can_fork(seq.seq_id):
                self.runner.fork(self.cm.fork(seq.seq_id, child.seq_id))
                child.num_computed = child.target = seq.num_computed
                self.scheduler.add_running(child)
            else:
                child.status = SeqStatus.WAITING  # registered and queued after its token
            pending.append((child, res, lg))
        for seq, res, lg in pending:
            self._append(seq, res, lg)

    def _append(self, seq: Seq, res: SampleResult, lg: torch.Tensor) -> None:
        req = seq.request
        req.dirty = True
        seq.token_ids.append(res.token_id)
        seq.logprobs.append(res.logprob)
        if req.params.logprobs is not None:
            seq.top_logprobs.append(res.top_logprobs or ())
        if self.config.record_logits:
            seq.logits.append(lg.detach().clone())
        self.stats.generation_tokens += 1
        finished = seq.detok.step(res.token_id).finished
        if self.connector is not None and self.connector.on_sampled(seq, res):
            return  # HELD: the connector owns what happens next
        if finished:
            self._finish_seq(seq)
        elif not self.cm.has(seq.seq_id):  # an unforked child: recompute from the cache
            self.cm.add(seq.seq_id, seq.token_ids, req.cache_salt)
            self.scheduler.add(seq)

    def _finish_seq(self, seq: Seq) -> None:
        self.scheduler.remove(seq)
        if self.cm.has(seq.seq_id):
            self.cm.finish(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.request.dirty = True

    # ================================================================== outputs
    def _output(self, req: Request) -> RequestOutput:
        outs = []
        for s in req.seqs:
            reason = s.detok.finish_reason
            if reason is None and s.status is SeqStatus.FINISHED:
                reason = "abort"
            outs.append(
                CompletionOutput(
                    s.choice,
                    s.detok.text,
                    s.output_token_ids,
                    list(s.logprobs),
                    [list(x) for x in s.top_logprobs] if req.params.logprobs is not None else None,
                    reason,
                    s.detok.stop_reason,
                )
            )
        held = req.seqs[0].status is SeqStatus.HELD
        return RequestOutput(
            req.request_id,
            list(req.prompt_token_ids),
            outs,
            req.num_cached_tokens or 0,
            finished=req.finished or held,
            handle=req.handle,
            logits=[list(s.logits) for s in req.seqs] if self.config.record_logits else None,
        )

    def _collect(self) -> list[RequestOutput]:
        out = []
        for rid, req in list(self.requests.items()):
            if not req.dirty:
                continue
            req.dirty = False
            out.append(self._output(req))
            if req.finished:
                del self.requests[rid]
        return out

    # ================================================================== router feeds
    def cache_events(self, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        """``GET /internal/cache_events?after=SEQ`` body."""
        return self.cm.events_since(after, limit)

    def cache_state(self) -> dict[str, Any]:
        """``GET /internal/cache_state`` body."""
        return self.cm.cache_state()

    def info(self) -> dict[str, Any]:
        """``GET /internal/info`` fields owned by the engine (the worker adds its role)."""
        return {
            "model": self.model_config.name,
            "layout_fingerprint": self.fingerprint,
            "weights_id": self.weights_id,
            "block_size": self.config.block_size,
            "num_pages": self.config.num_pages,
            "num_slots": self.config.num_slots,
            "num_snapshots": self.config.num_snapshots,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": self.config.enable_prefix_caching,
        }


class _NoText:
    def decode(self, ids: Sequence[int]) -> str:
        return ""


__all__ = ["EngineConfig", "EngineStats", "LLMEngine"]
