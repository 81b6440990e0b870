"""LLMEngine: builds the serving core of one worker and gives it its public API.

The step itself (schedule → run → sample → outputs) is :class:`~k3serve.engine.core.EngineCore`;
:class:`LLMEngine` sizes and builds its parts (pools, cache manager, scheduler, runner, input
processor) and adds the API. Requests: :meth:`LLMEngine.add_request` (optionally after tokens
sampled elsewhere), ``abort_request``. A connector at the engine's edge
(:class:`~k3serve.engine.connector.KVConnector`) reaches the engine only through the members
:class:`~k3serve.engine.connector.EngineAPI` lists: :meth:`~LLMEngine.check_request`,
:meth:`~LLMEngine.add_request`, :meth:`~LLMEngine.reserve_cache` / :meth:`~LLMEngine.resume` /
:meth:`~LLMEngine.free_cache` (a cache that arrives from elsewhere), :meth:`~LLMEngine.hold` /
:meth:`~LLMEngine.release_held` (a sampled request whose cache a sender reads) and
:attr:`~LLMEngine.cache` (the cache manager's read side). ``cache_events`` / ``cache_state`` /
:meth:`~LLMEngine.info` feed the router. Lifecycle: :mod:`k3serve.protocol`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from k3serve.cache.allocator import CacheFullError
from k3serve.cache.events import EventLog
from k3serve.cache.manager import CacheManager
from k3serve.cache.pools import KVPools
from k3serve.cache.reader import CacheReader
from k3serve.cache.specs import CacheConfig, CacheDtypes, layout_fingerprint
from k3serve.cache.types import PrefixHit
from k3serve.config import ModelConfig
from k3serve.engine.config import EngineConfig
from k3serve.engine.connector import CacheReservation, KVConnector
from k3serve.engine.core import EngineCore
from k3serve.engine.memory import dense_snapshot_blocks, fit_to_memory
from k3serve.engine.processor import InputProcessor, request_output
from k3serve.engine.runner import ModelRunner
from k3serve.engine.scheduler import Scheduler
from k3serve.engine.sequence import Request, SeqStatus, as_token_ids
from k3serve.engine.sequence import Sequence as Seq
from k3serve.engine.spec.build import build_speculator
from k3serve.engine.spec.proposer import Proposer
from k3serve.protocol import CacheHandle, RequestOutput
from k3serve.sampling import SamplingParams

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class LLMEngine(EngineCore):
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
            ``None`` (the default; ``DisaggConnector.of(engine)`` attaches one later).
        runner: the runner to drive instead of a :class:`ModelRunner` over ``model`` (e.g.
            rank 0's ``k3serve.parallel.runner.ParallelModelRunner`` of a multi-rank
            instance): it brings its own ``pools`` (sized as ``config``; the cache allocator
            stays here, slot and page numbers mean the same on every rank), ``execute``, the
            cache copies, ``transfer_pools``, ``fingerprint_fields()`` (added to
            :attr:`fingerprint_fields`) and ``receive_cache(slot, pages)``.
        proposer: the speculative proposer to use instead of the one
            ``config.speculative`` names (any :class:`~k3serve.engine.spec.proposer.Proposer`).

    Attributes:
        connector: the attached connector or ``None`` (then the step calls none).
        cm: the :class:`~k3serve.cache.manager.CacheManager`; scheduler, runner, pools,
            stats, requests (live requests by id): the parts the step drives.
        inputs: the :class:`~k3serve.engine.processor.InputProcessor` (validation, sequences).
        fingerprint: the layout fingerprint (hash salt base, ``GET /internal/info``).
        fingerprint_fields: what the kvstore pairing compares besides the pool shapes (the
            ``PoolLayout`` extra): the model's ``fingerprint_fields()`` plus ``weights``.

    Raises:
        ValueError: inconsistent capacities; speculation with a multi-rank runner; a draft
            model whose vocabulary differs.
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
        proposer: Proposer | None = None,
    ):
        c = config or EngineConfig()
        given_runner = runner is not None
        dev = torch.device(device)
        use_graphs = c.cuda_graphs and dev.type == "cuda"
        extra = 1 if use_graphs else 0  # the graphs' scratch slot and page (never allocated)
        c = fit_to_memory(c, model, model_config, dtype, dev, extra)
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
        cm = CacheManager(
            CacheConfig(
                c.num_pages,
                c.num_slots,
                c.num_snapshots,
                c.block_size,
                c.enable_prefix_caching,
                c.snapshot_interval_tokens,
                c.rolling_snapshot_fraction,
                dense_snapshot_blocks(c, model_config, dn),
            ),
            self.fingerprint,
            EventLog(c.max_events),
        )
        scheduler = Scheduler(
            cm, c.max_num_batched_tokens, min(c.max_num_seqs or c.num_slots, c.num_slots)
        )
        self.max_model_len = min(
            model_config.max_position_embeddings,
            c.max_model_len or 1 << 62,
            c.num_pages * c.block_size,
        )
        if runner is None and use_graphs:
            from k3serve.engine.cuda_graphs import CUDAGraphRunner

            runner = CUDAGraphRunner(
                model, self.pools, device, self.max_model_len,
                max_num_seqs=min(c.max_num_seqs or c.num_slots, c.num_slots),
                scratch_slot=c.num_slots, scratch_page=c.num_pages,
                verify_k=c.speculative.num_speculative_tokens if c.speculative else 0,
                verify_max_batch=c.speculative.max_batch_size if c.speculative else 0,
                max_num_batched_tokens=c.max_num_batched_tokens,
            )  # fmt: skip
            runner.capture()
        elif runner is None:
            runner = ModelRunner(model, self.pools, device)
        inputs = InputProcessor(model_config, tokenizer, self.max_model_len)
        super().__init__(c, cm, scheduler, runner, inputs)
        if c.speculative is not None:
            if given_runner:
                raise ValueError("speculative: not supported with a multi-rank runner")
            self.spec = build_speculator(c, model_config, inputs.grammar, self.max_model_len,
                                         dev, dtype, proposer)  # fmt: skip
        if connector is not None:
            self.attach(connector)

    # ================================================================== requests
    def check_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> list[int]:
        """A new request's id and prompt, checked.

        Returns:
            The prompt as plain ints.

        Raises:
            ValueError: an empty id, one live here or in the connector, a bad prompt.
        """
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty str, got {request_id!r}")
        if request_id in self.requests or (
            self.connector is not None and self.connector.has_request(request_id)
        ):
            raise ValueError(f"request_id: {request_id!r} is already live")
        return self.inputs.check_prompt(prompt_token_ids)

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
        snapshot_on_finish: bool = True,
    ) -> RequestOutput | None:
        """Queue a request to run here from prompt to finish.

        With ``output_token_ids`` the request continues after tokens sampled elsewhere (the
        decode worker's fallback after a failed transfer continues from the prefill worker's
        token #1, which the client already has): the prefill covers ``prompt + outputs`` and
        sampling continues at position ``L + len(outputs)``, exactly as after
        :meth:`resume`. The given tokens are outputs #1…: they count for ``max_tokens``, stop
        tokens / strings and the penalties, and are not sampled again.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: ``[L]`` ids in ``[0, vocab)``, ``L < max_model_len``.
            params: sampling parameters (default ``SamplingParams()``); an unset seed is drawn.
            cache_salt: tenant salt for prefix caching.
            snapshot_at: extra snapshot positions (the router's branch points).
            output_token_ids: tokens already generated for this request (``params.n == 1``).
            output_logprobs: their logprobs (for the outputs; NaN where absent).
            snapshot_on_finish: keep an end-of-request snapshot (the next turn's hit); a
                connector turns it off for a prefill-only request.

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
        ids = self.check_request(request_id, prompt_token_ids)
        params = self.inputs.check_params(params)
        outs = as_token_ids(output_token_ids, self.model_config.vocab_size, "output_token_ids")
        if outs and params.n != 1:
            raise ValueError(f"SamplingParams.n: must be 1 with output_token_ids, got {params.n}")
        req = Request(request_id, ids, params, params.seed, cache_salt, tuple(snapshot_at))  # type: ignore[arg-type]
        seq = self.inputs.new_seq(req, 0, ids + outs)
        if outs:
            fed = self.inputs.feed_outputs(seq, outs, output_logprobs)
            if fed < len(outs):
                raise ValueError(
                    f"output_token_ids: the request finishes at token {fed}; "
                    f"{len(outs) - fed} more given"
                )
            if seq.detok.finished:  # nothing left to generate: done before any compute
                seq.status = SeqStatus.FINISHED
                return request_output(req, self.config.record_logits)
        self.cm.add(seq.seq_id, seq.token_ids, cache_salt, req.snapshot_at, snapshot_on_finish)
        self.requests[request_id] = req
        self.scheduler.add(seq)
        return None

    # ================================================================== connector API
    @property
    def cache(self) -> CacheReader:
        """The cache manager's read side (block tables, slots, free room, events)."""
        return self.cm

    def reserve_cache(
        self, request_id: str, token_ids: list[int], num_tokens: int | None, cache_salt: str | None
    ) -> CacheReservation:
        """Take a zeroed slot and pages for a cache that arrives from elsewhere; the request
        joins the engine at :meth:`resume`.

        Args:
            request_id: the request (named in errors). token_ids: its checked prompt
                (:meth:`check_request`), indexed here once resumed.
            num_tokens: tokens whose cache arrives (``None``: the prompt's ``L``).
            cache_salt: the request's tenant salt.

        Raises:
            ValueError: ``num_tokens`` outside ``[L, max_model_len)``.
            CacheFullError: no slot or pages now (nothing is taken).
        """
        n = len(token_ids) if num_tokens is None else num_tokens
        # resume() continues after ≥ 1 output token: the cache covers at least the prompt
        if not isinstance(n, int) or not len(token_ids) <= n < self.max_model_len:
            raise ValueError(
                f"num_tokens: must lie in [len(prompt_token_ids) = {len(token_ids)}, "
                f"{self.max_model_len}), got {n!r}"
            )
        sid = self.inputs.next_seq_id()
        self.cm.add(sid, token_ids, cache_salt, plan_snapshots=False, lookup=False)
        if not self.cm.can_admit(sid, PrefixHit(0), n):
            self.cm.remove(sid)
            raise CacheFullError(f"reserve {request_id!r}: no slot or pages for {n} tokens")
        adm = self.cm.admit(sid, PrefixHit(0), n)
        self.pools.zero_slot(adm.slot)
        pages = self.cm.block_table(sid)[: -(-n // self.config.block_size)]
        return CacheReservation(sid, tuple(token_ids), n, cache_salt, adm.slot, pages)

    def free_cache(self, reservation: CacheReservation) -> None:
        """Give back the slot and pages of a reservation that was not resumed."""
        self.cm.remove(reservation.seq_id)

    def resume(
        self,
        request_id: str,
        reservation: CacheReservation,
        output_token_ids: Sequence[int],
        params: SamplingParams,
        output_logprobs: Sequence[float] | None = None,
    ) -> RequestOutput | None:
        """Run ``request_id`` on a reservation whose cache has landed, after tokens sampled
        elsewhere: the prompt's full blocks are indexed and sampling continues at position
        ``num_tokens + 1`` (the runner first hands a multi-rank instance its part).

        Args:
            request_id: the request. reservation: from :meth:`reserve_cache`; it covers
                ``prompt + output_token_ids[:-1]``.
            output_token_ids: token #1, … sampled elsewhere.
            params: the request's params with its seed.
            output_logprobs: their logprobs (NaN when absent).

        Returns:
            The request's output if the given tokens already finish it, else ``None``.

        Raises:
            ValueError: bad ids, a count disagreeing with the reservation, bad params,
                ``params.n != 1`` (nothing changed; the reservation stays).
        """
        r = reservation
        self.runner.receive_cache(r.slot, list(r.pages))
        outs = as_token_ids(output_token_ids, self.model_config.vocab_size, "output_token_ids")
        if not outs:
            raise ValueError("output_token_ids: need ≥ 1 token")
        if len(r.prompt) + len(outs) - 1 != r.num_tokens:
            raise ValueError(
                f"output_token_ids: {len(outs)} tokens do not follow the {r.num_tokens} reserved"
            )
        params = self.inputs.check_params(params)
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n: must be 1 for a disaggregated request, got {params.n}"
            )
        req = Request(request_id, list(r.prompt), params, params.seed, cache_salt=r.cache_salt)  # type: ignore[arg-type]
        req.num_cached_tokens = 0
        seq = self.inputs.new_seq(req, 0, [*r.prompt, *outs], seq_id=r.seq_id)
        self.requests[request_id] = req
        seq.num_computed = seq.target = r.num_tokens
        self.runner.save_snapshots(self.cm.commit(r.seq_id, seq.token_ids, r.num_tokens))
        self.inputs.feed_outputs(seq, outs, output_logprobs)
        if seq.detok.finished:
            self._finish_seq(seq)
            del self.requests[request_id]
            return request_output(req, self.config.record_logits)
        self.scheduler.add_running(seq)
        return None

    def hold(self, seq: Seq, handle: CacheHandle) -> None:
        """Keep a sampled sequence's slot and pages: off the scheduler, ``HELD``; its request's
        outputs carry ``handle`` until :meth:`release_held` or :meth:`abort_request`."""
        self.scheduler.remove(seq)
        seq.status = SeqStatus.HELD
        seq.request.handle = handle

    def release_held(self, request_id: str) -> bool:
        """Free a held request's slot and pages and forget it (its full blocks stay cached).

        Returns:
            False (nothing done) when ``request_id`` is not a held request.
        """
        req = self.requests.get(request_id)
        if req is None or req.seqs[0].status is not SeqStatus.HELD:
            return False
        del self.requests[request_id]
        seq = req.seqs[0]
        self.cm.remove(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        return True

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


__all__ = ["LLMEngine"]
