"""Offline API: ``from k3serve import LLM, SamplingParams``.

::

    llm = LLM(model="k3-tiny", enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=32)
    outs = llm.generate(["def fib(n):", [256, 100, 101]], params)
    outs[0].text, outs[0].token_ids, outs[0].num_cached_tokens, outs[0].finish_reason

Model resolution (``model=``) is :func:`k3serve.model.checkpoint.load_model`'s (re-exported
here as ``load_model``):

* a :class:`~k3serve.config.ModelConfig`: that shape, random init (seeded) — tests;
* a folder with ``k3serve_config.json`` / ``config.json`` and safetensors (K3 or Kimi-Linear
  names), checked strictly;
* a preset name: its embedded checkpoint ``k3serve/assets/<name>/`` (``k3-tiny`` ships one);
  a preset without one is refused unless ``load_weights=False`` asks for random weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from k3serve.config import PRESETS, ModelConfig
from k3serve.engine.config import EngineConfig
from k3serve.engine.engine import LLMEngine
from k3serve.model.checkpoint import load_model
from k3serve.model.checkpoint_files import checkpoint_identity, random_init_identity
from k3serve.protocol import RequestOutput
from k3serve.sampling import SamplingParams


class LLM:
    """Offline generation over an :class:`LLMEngine`.

    Args:
        model: preset name, checkpoint folder, or a ``ModelConfig`` (random init).
        enable_prefix_caching: reuse cached prefixes.
        tokenizer: a ``k3serve.tokenizer`` tokenizer (default: the model's).
        seed: random-init seed (not the sampling seed).
        dtype: compute / pool dtype (CPU: float32).
        device: ``"cpu"`` or a CUDA device.
        load_weights: False: random weights of the model's shape (nothing is read).
        **engine_kwargs: :class:`EngineConfig` fields (``block_size``, ``num_pages``,
            ``num_slots``, ``num_snapshots``, ``max_num_batched_tokens``, ``max_num_seqs``,
            ``gpu_memory_utilization`` (CUDA: size the pools from free memory after the weights
            load), ``cuda_graphs`` (CUDA: replay captured decode graphs; default on),
            ``speculative`` (a :class:`~k3serve.engine.spec.config.SpecConfig`), …).

    Raises:
        ValueError: unknown model or engine field; ``CheckpointError`` (a ValueError) for
            weights that do not match the model.
        FileNotFoundError: a preset without an embedded checkpoint (and ``load_weights``),
            a folder without safetensors.
    """

    def __init__(
        self,
        model: str | ModelConfig = "k3-tiny",
        *,
        enable_prefix_caching: bool = True,
        tokenizer: Any = None,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        load_weights: bool = True,
        **engine_kwargs: Any,
    ):
        names = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_kwargs) - names)
        if unknown:
            raise ValueError(f"LLM: unknown engine option(s) {unknown}; known: {sorted(names)}")
        net, cfg, folder = load_model(model, device, dtype, seed=seed, random_init=not load_weights)
        if tokenizer is None:
            from k3serve.tokenizer import get_tokenizer

            tokenizer = get_tokenizer(
                folder if folder else (cfg.name if cfg.name in PRESETS else "byte")
            )
        self.tokenizer = tokenizer
        weights_id = checkpoint_identity(folder) if folder else random_init_identity(seed)
        config = EngineConfig(enable_prefix_caching=enable_prefix_caching, **engine_kwargs)
        self.engine = LLMEngine(
            net, cfg, tokenizer, config, device=device, dtype=dtype, weights_id=weights_id
        )
        self._counter = 0

    def _encode(self, prompt: str | Sequence[int], i: int) -> list[int]:
        if isinstance(prompt, str):
            bos = getattr(self.tokenizer, "bos_token_id", None)
            try:
                return self.tokenizer.encode(prompt, add_bos=bos is not None)
            except UnicodeError as e:  # e.g. a lone surrogate: no UTF-8 for it
                raise ValueError(f"prompts[{i}]: cannot encode the text: {e}") from None
        if hasattr(prompt, "tolist") and not isinstance(prompt, list):  # numpy / torch
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence) or isinstance(prompt, bytes):
            raise ValueError(
                f"prompts[{i}]: must be a str or a list of token ids, got {type(prompt).__name__}"
            )
        return list(prompt)  # ids are checked by the engine (``prompt_token_ids``)

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        snapshot_at: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (run to completion, batched by the engine).

        Args:
            prompts: a string, a token-id list, or a list of either.
            sampling_params: one for all or one per prompt (default ``SamplingParams()``).
            cache_salt: tenant salt for all prompts.
            snapshot_at: positions for all prompts, or one list per prompt.

        Returns:
            One :class:`RequestOutput` per prompt, in order (``.text``, ``.token_ids``,
            ``.num_cached_tokens``, ``.finish_reason``; ``.outputs`` for ``n > 1``).

        Raises:
            ValueError: bad prompts or params (nothing is queued then).
        """
        plist = _prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"sampling_params: {len(params)} given for {len(plist)} prompts")
        else:
            params = [sampling_params or SamplingParams()] * len(plist)
        if snapshot_at is None:
            snaps: list[Sequence[int]] = [()] * len(plist)
        elif snapshot_at and not isinstance(snapshot_at[0], int):
            snaps = list(snapshot_at)  # type: ignore[arg-type]
            if len(snaps) != len(plist):
                raise ValueError(f"snapshot_at: {len(snaps)} lists for {len(plist)} prompts")
        else:
            snaps = [snapshot_at] * len(plist)  # type: ignore[list-item]
        ids = [self._encode(p, i) for i, p in enumerate(plist)]
        rids = []
        try:
            for i, p in enumerate(ids):
                rid = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(
                    rid, p, params[i], cache_salt=cache_salt, snapshot_at=snaps[i]
                )
                rids.append(rid)
        except ValueError:
            for rid in rids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        idle = 0
        try:
            while len(final) < len(rids):
                before = self.engine.stats.num_forwards
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                idle = 0 if self.engine.stats.num_forwards > before else idle + 1
                if idle > 10_000:  # nothing scheduled for long: a capacity bug, not a slow model
                    raise RuntimeError(
                        f"LLM.generate: engine stalled with {len(rids) - len(final)} requests left"
                    )
        except BaseException:  # an error or an interrupt: leave no orphans running
            for rid in rids:
                if rid not in final:
                    self.engine.abort_request(rid)
            raise
        return [final[r] for r in rids]


def _is_id(x: Any) -> bool:
    """An int-like token id (int, numpy / torch integer scalar), not a prompt."""
    return not isinstance(x, (str, bytes)) and hasattr(type(x), "__index__")


def _prompt_list(prompts: Any) -> list[Any]:
    """``generate``'s ``prompts`` as a list of prompts (each a str or a sequence of ids).

    Raises:
        ValueError: ``prompts`` is neither a str, a sequence of ids, nor a sequence of those.
    """
    if isinstance(prompts, str):
        return [prompts]
    if hasattr(prompts, "tolist") and not isinstance(prompts, list):  # numpy / torch arrays
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ValueError(
            "prompts: must be a str, a list of token ids, or a list of those, "
            f"got {type(prompts).__name__}"
        )
    if len(prompts) and _is_id(prompts[0]):
        return [prompts]  # one prompt of ids (the engine checks every id)
    return list(prompts)


__all__ = ["LLM", "load_model"]
