"""The engine thread of a worker process: :class:`EngineLoop` and :func:`build_engine`.

::

    uvicorn (asyncio)                          engine thread (EngineLoop)
    ─────────────────                          ──────────────────────────
    FastAPI handlers ── loop.call(fn) ───────▶ fn(...) runs between two engine steps
        await the answer ◀── call_soon_threadsafe ── results / token events
                                               loop: commands → role.tick() (kvstore polls)
                                                     → engine.step() → role.on_outputs(...)

The engine (:class:`~k3serve.engine.engine.LLMEngine`) and the kvstore senders / receivers are
touched from the engine thread only; handlers reach them through :meth:`EngineLoop.call`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from worker.config import WorkerConfig

log = logging.getLogger("k3serve.worker")


def build_engine(config: WorkerConfig) -> Any:
    """The worker's :class:`LLMEngine`, built exactly as the offline ``k3serve.LLM`` builds its
    own (one switch for model loading: ``k3serve.engine.llm.load_model`` — the embedded k3-tiny
    checkpoint when present, else random init seeded by ``config.seed``), then warmed up
    (:func:`warm`): no request compiles a kernel.

    Raises:
        ValueError: unknown model or inconsistent capacities.
    """
    import torch

    from k3serve.engine.llm import LLM

    if config.device == "cpu":
        torch.set_num_threads(config.threads)
    if config.tp > 1 or config.ep > 1:
        return build_parallel_engine(config)
    llm = LLM(config.model, seed=config.seed, device=config.device,
              dtype=getattr(torch, config.torch_dtype_name), **config.engine_options())
    warm(llm.engine)
    return llm.engine


def warm(engine: Any) -> None:
    """Run every forward shape class once before the worker registers
    (:func:`k3serve.engine.warmup.warm_up`; skipped on the CPU, with the reason logged)."""
    from k3serve.engine.warmup import warm_up

    rep = warm_up(engine)
    if rep.skipped:
        log.info("warm-up skipped: %s", rep.skipped)
    else:
        log.warning("warm-up: %d forwards in %.1f s", rep.num_forwards, rep.seconds)


def instance_spec(config: WorkerConfig) -> Any:
    """The :class:`~k3serve.parallel.runner.InstanceSpec` of a ``--tp`` / ``--ep`` worker
    (pools sized by the worker's capacities; ``--expert-plan`` read as the placement;
    ``--collective-timeout`` as ``collective_timeout_s``).

    Raises:
        ValueError: an unreadable or malformed plan file (naming ``expert_plan``), a
            ``--device`` other than ``cpu`` / ``cuda…``.
    """
    import json

    from k3serve.parallel.runner import InstanceSpec

    plan = None
    if config.expert_plan is not None:
        try:
            with open(config.expert_plan) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"expert_plan: cannot read {config.expert_plan}: {e}") from None
        plan = doc.get("placement", doc) if isinstance(doc, dict) else None
        if not isinstance(plan, dict):
            raise ValueError(f"expert_plan: {config.expert_plan} holds no placement object")
        from k3serve.parallel.expert_plan import Plan

        try:
            ranks = Plan.from_dict(plan).layers[0].num_ranks
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"expert_plan: {config.expert_plan}: {e}") from None
        if ranks != config.ep:
            raise ValueError(f"expert_plan: {config.expert_plan} places experts on {ranks} "
                             f"ranks, --ep is {config.ep}")
    dev = config.device
    if dev != "cpu" and not dev.startswith("cuda"):
        raise ValueError(f"device: a --tp/--ep instance runs on cpu or cuda, got {dev!r}")
    timeout = ({} if config.collective_timeout_s is None
               else {"collective_timeout_s": config.collective_timeout_s})
    return InstanceSpec(
        model=config.model, tp=config.tp, ep=config.ep, num_slots=config.num_slots,
        num_pages=config.num_pages, block_size=config.block_size,
        num_snapshots=config.num_snapshots, plan=plan, dtype=config.torch_dtype_name,
        seed=config.seed, device="cpu" if dev == "cpu" else "cuda", threads=config.threads,
        **timeout)


def build_parallel_engine(config: WorkerConfig) -> Any:
    """The engine of a multi-rank instance: this process becomes rank 0 and starts ranks
    1 … W−1 (:func:`k3serve.parallel.ranks.start_instance`), or, with ``remote_ranks``, waits
    for the ranks another launcher starts (``start_remote_instance``); the engine drives rank 0's
    :class:`~k3serve.parallel.runner.ParallelModelRunner`, which broadcasts every op.

    Raises:
        ValueError: as :func:`instance_spec`; RuntimeError: the ranks did not start.
    """
    import torch

    from k3serve.config import PRESETS
    from k3serve.engine.config import EngineConfig
    from k3serve.engine.engine import LLMEngine
    from k3serve.model.checkpoint_files import checkpoint_identity, random_init_identity
    from k3serve.parallel.ranks import start_instance, start_remote_instance
    from k3serve.tokenizer import get_tokenizer

    spec = instance_spec(config)
    runner = (start_remote_instance(spec, config.url_host) if config.remote_ranks
              else start_instance(spec))
    try:
        cfg = runner.cfg
        tok = get_tokenizer(runner.folder if runner.folder else
                            (cfg.name if cfg.name in PRESETS else "byte"))
        weights_id = (checkpoint_identity(runner.folder) if runner.folder
                      else random_init_identity(spec.seed))
        ec = EngineConfig(
            block_size=config.block_size, num_pages=config.num_pages,
            num_slots=config.num_slots, num_snapshots=config.num_snapshots,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching)
        return LLMEngine(runner.model, cfg, tok, ec, device=runner.device,
                         dtype=getattr(torch, spec.dtype), weights_id=weights_id, runner=runner)
    except BaseException:
        runner.close()
        raise


def parallel_info(engine: Any) -> dict[str, int]:
    """``{"tp", "ep"}`` of the engine's instance (1, 1 for one process)."""
    spec = getattr(engine.runner, "spec", None)
    return {"tp": getattr(spec, "tp", 1), "ep": getattr(spec, "ep", 1)}


class PrefillMeter:
    """The worker's measured prefill rate: prompt tokens computed per second of the engine
    steps that computed them, over the last ``window`` such steps::

        rate = Σ prompt tokens / Σ step seconds   (steps with prompt tokens > 0 only)

    A step that prefilled and decoded together counts whole (its decode rows are part of the
    cost of that prefill); decode-only steps are left out, so the figure does not drift with
    the decode batch. Engine thread only (steps are timed there, reports are built there).

    Args:
        window: Steps kept (≥ 1).
    """

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window!r}")
        self._steps: deque[tuple[int, float]] = deque(maxlen=window)
        self._tokens, self._seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        """Count one step that computed ``tokens`` prompt tokens in ``seconds`` (steps with
        no prompt tokens, or no measurable time, are ignored)."""
        if tokens <= 0 or seconds <= 0:
            return
        if len(self._steps) == self._steps.maxlen:
            t0, s0 = self._steps[0]
            self._tokens, self._seconds = self._tokens - t0, self._seconds - s0
        self._steps.append((tokens, seconds))
        self._tokens += tokens
        self._seconds += seconds

    @property
    def rate(self) -> float | None:
        """Tokens per second over the kept steps; ``None`` before the first."""
        if not self._steps or self._seconds <= 0:
            return None
        return self._tokens / self._seconds


class EngineLoop:
    """Runs ``engine.step()`` in a thread; everything else reaches the engine through it.

    Args:
        engine: the worker's engine.
        tick: called every iteration (before and after each step); polls transfers. Returns
            True while transfers are in flight (the loop then polls every ``active_s``).
        on_outputs: called with each step's outputs.
        on_error: called with the exception when a step raises (the role fails its requests).
        idle_s, active_s: wait between iterations when the engine has nothing to run (s).
    """

    def __init__(self, engine: Any, tick: Callable[[], bool],
                 on_outputs: Callable[[list], None], on_error: Callable[[BaseException], None],
                 idle_s: float = 0.05, active_s: float = 0.002) -> None:
        self.engine = engine
        self._tick, self._on_outputs, self._on_error = tick, on_outputs, on_error
        self.idle_s, self.active_s = idle_s, active_s
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.error: BaseException | None = None
        self.num_step_errors = 0
        self.prefill_meter = PrefillMeter()

    def start(self) -> EngineLoop:
        """Start the thread; returns self."""
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future:
        """Run ``fn(*args)`` on the engine thread; its result / exception in the future."""
        fut: cf.Future = cf.Future()
        if self._stop.is_set():
            fut.set_exception(RuntimeError("worker is stopping"))
            return fut
        self._q.put((fut, fn, args))
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        """Await ``fn(*args)`` run on the engine thread.

        Raises:
            TimeoutError: not run within ``timeout`` seconds (the engine thread is stuck).
            Exception: whatever ``fn`` raised.
        """
        return await asyncio.wait_for(asyncio.wrap_future(self.submit(fn, *args)), timeout)

    def _drain(self, wait_s: float) -> None:
        try:
            item = self._q.get(timeout=wait_s) if wait_s > 0 else self._q.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fut, fn, args = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - delivered to the caller
                    fut.set_exception(e)
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return

    def _timed_step(self) -> list:
        """``engine.step()``, its prompt tokens (``EngineStats.prompt_tokens_computed``'s
        increase) and seconds into :attr:`prefill_meter`."""
        stats = getattr(self.engine, "stats", None)
        before = getattr(stats, "prompt_tokens_computed", 0)
        t0 = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - t0
        self.prefill_meter.add(getattr(stats, "prompt_tokens_computed", 0) - before, seconds)
        return outs

    def _run(self) -> None:
        active = False
        while not self._stop.is_set():
            busy = self.engine.has_unfinished_requests()
            self._drain(0 if busy else (self.active_s if active else self.idle_s))
            if self._stop.is_set():
                break
            try:
                active = self._tick()
                if self.engine.has_unfinished_requests():
                    outs = self._timed_step()
                    self._on_outputs(outs)
                    active = self._tick() or active
            except Exception as e:
                self.num_step_errors += 1
                log.exception("engine loop error")
                try:
                    self._on_error(e)
                except Exception:
                    log.exception("on_error failed")
                    self.error = e
                    return
        # answer whatever is still queued
        with contextlib.suppress(queue.Empty):
            while True:
                item = self._q.get_nowait()
                if item is not None and item[0].set_running_or_notify_cancel():
                    item[0].set_exception(RuntimeError("worker is stopping"))


__all__ = ["EngineLoop", "PrefillMeter", "build_engine", "build_parallel_engine", "instance_spec", "parallel_info"]
