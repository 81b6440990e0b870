"""Weights of several layers stacked into one tensor for the fused decode step, without a copy.

A decode step is launch-bound (``docs/results/gpu_e2e.md``): projections that read the
same input run as one GEMM over the concatenated weight. :class:`StackedWeights` concatenates
the parameters once along dim 0 and re-points each parameter's ``.data`` to its row slice of
the stack (as ``MoE.stacked_experts`` does for the experts), so memory is not doubled, an
in-place load (``copy_``, ``load_state_dict``) updates both, and the stack is rebuilt when a
parameter is no longer its view (``model.to``, reassignment). Build it before capturing CUDA
graphs (building allocates); the first fused decode step builds it otherwise.
"""

from __future__ import annotations

import torch
from torch import nn


class StackedWeights:
    """A lazily built ``torch.cat(params, 0)`` whose parts the parameters then view.

    Args:
        names: dotted parameter names under the owning module, in stacking order (looked up
            at each call, so a replaced parameter — or a deep copy's own — is seen).
    """

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        self._stack: torch.Tensor | None = None
        self._key: tuple[int, ...] = ()

    def _params(self, owner: nn.Module) -> list[nn.Parameter]:
        return [owner.get_parameter(n) for n in self.names]

    def _current_key(self, ps: list[nn.Parameter]) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in ps)

    def valid(self, owner: nn.Module) -> bool:
        """Whether the stack exists and every parameter of ``owner`` still views it."""
        return self._stack is not None and self._current_key(self._params(owner)) == self._key

    def get(self, owner: nn.Module) -> torch.Tensor:
        """The stack ``[Σ rows, …]`` (built, or rebuilt when stale).

        Raises:
            ValueError: the parameters' trailing shapes or dtypes differ.
        """
        ps = self._params(owner)
        if self._stack is not None and self._current_key(ps) == self._key:
            return self._stack
        if len({(tuple(p.shape[1:]), p.dtype, p.device) for p in ps}) != 1:
            raise ValueError("params: trailing shapes / dtypes / devices differ, cannot stack")
        with torch.inference_mode(False), torch.no_grad():
            stack = torch.cat([p.data for p in ps], 0)
            r = 0
            for p in ps:
                p.data = stack[r : r + p.shape[0]]
                r += p.shape[0]
        self._stack, self._key = stack, self._current_key(ps)
        return stack


__all__ = ["StackedWeights"]
