"""CPU guard for the GPU decode fast path: a fixed number of torch ops, and no host sync.

One decode step of the MoE layer (router → latent down-projection → routed experts → norm →
up-projection + shared expert), the same code the GPU runs except that the two Triton launches
are the torch grouped GEMMs here, is run on CPU tensors under a ``TorchDispatchMode`` that
records every aten op. The count must not depend on the batch size (1, 4, 16) nor on the number
of experts (8 and 32), and no op may read a tensor back to the host
(``aten::_local_scalar_dense`` is what ``.item()``, ``.tolist()``, ``bool(t)`` and
``torch.bincount`` on CUDA dispatch). The per-expert loop (the reference) fails both checks;
``test_the_guard_catches_the_loop`` keeps the guard honest.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from k3serve.config import PRESETS
from k3serve.model.moe import MoE

torch.set_num_threads(1)
TINY = PRESETS["k3-tiny"]
SYNC_OPS = (
    "_local_scalar_dense",  # .item(), bool(t), int(t) on any device
    "bincount",  # reads the input's max back on CUDA
    "nonzero",  # data-dependent output shape
    "unique",
    "Tensor.tolist",  # CPU tolist reads memory in C++ without dispatching an op: patched below
    "Tensor.item",
    "Tensor.__bool__",
)
_HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__")


class OpCounter(TorchDispatchMode):
    """Records the aten op name of every dispatched op, and every ``Tensor.tolist`` / ``item`` /
    ``__bool__`` / ``__int__`` / ``__float__`` call (host reads that on CPU bypass dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in _HOST_READS:
            orig = getattr(torch.Tensor, name)
            self._saved[name] = orig

            def wrapped(t, *a, _orig=orig, _name=name, **kw):
                self.ops[f"Tensor.{_name}"] += 1
                return _orig(t, *a, **kw)

            setattr(torch.Tensor, name, wrapped)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, orig in self._saved.items():
            setattr(torch.Tensor, name, orig)
        return super().__exit__(*exc)


def moe(num_experts: int, impl: str) -> MoE:
    cfg = dataclasses.replace(TINY, n_routed_experts=num_experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    m = MoE(cfg, torch.float32).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.1)
    m.expert_impl = impl
    return m


def count(m: MoE, batch: int) -> Counter[str]:
    x = torch.randn(batch, m.cfg.hidden_size)
    with torch.inference_mode():
        m(x)  # builds the stacked experts once (load-time work, not per step)
        with OpCounter() as c:
            m(x)
    return c.ops


def syncs(ops: Counter[str]) -> dict[str, int]:
    return {k: v for k, v in ops.items() if k in SYNC_OPS}


@pytest.mark.parametrize("num_experts", [8, 32])
def test_grouped_decode_step_has_fixed_op_count_and_no_sync(num_experts: int) -> None:
    m = moe(num_experts, "grouped")
    counts = {b: count(m, b) for b in (1, 4, 16)}
    for b, ops in counts.items():
        assert not syncs(ops), f"batch {b}: host sync ops {syncs(ops)}"
    assert counts[1] == counts[4] == counts[16], counts
    total = sum(counts[1].values())
    assert 0 < total < 120, counts[1]


def test_op_count_does_not_grow_with_experts() -> None:
    assert count(moe(8, "grouped"), 4) == count(moe(32, "grouped"), 4)


def test_the_guard_catches_the_loop() -> None:
    """The per-expert loop syncs and its op count grows with batch and experts."""
    m8 = moe(8, "loop")
    ops1, ops16 = count(m8, 1), count(m8, 16)
    assert syncs(ops1)
    assert sum(ops16.values()) > sum(ops1.values())
    assert sum(count(moe(32, "loop"), 16).values()) > sum(ops16.values())
