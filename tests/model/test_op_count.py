"""CPU guard for the GPU decode fast path: a fixed number of torch ops, and no host sync.

One decode step of the MoE layer (router → latent down-projection → routed experts → norm →
up-projection + shared expert), the same code the GPU runs except that the two Triton launches
are the torch grouped GEMMs here, is run on CPU tensors under a ``TorchDispatchMode`` that
records every aten op. The count must not depend on the batch size (1, 4, 16) nor on the number
of experts (8 and 32), and no op may read a tensor back to the host
(``aten::_local_scalar_dense`` is what ``.item()``, ``.tolist()``, ``bool(t)`` and
``torch.bincount`` on CUDA dispatch). The per-expert loop (the reference) fails both checks;
``test_the_guard_catches_the_loop`` keeps the guard honest.

``test_whole_model_decode_step…`` runs one decode step of a 4-layer k3-tiny (KDA recurrent
step, absorbed paged MLA decode, grouped MoE, fused norms) with the Triton kernels in the
interpreter on CPU — the GPU's code path; the interpreter's own per-launch argument copies are
counted too, a constant per launch — and asserts the same two properties over batch sizes 2 / 8 and 8 / 16 experts. (Batch 1 is
left out: size-1 dims make some ``.contiguous()`` calls no-ops, 6 fewer ops.)
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the @triton.jit definitions

from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.model.batch import make_batch
from k3serve.model.model import K3ForCausalLM
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


def decode_ops(num_experts: int, batch: int) -> Counter[str]:
    """Ops of one decode step (5 cached tokens per sequence) of a 4-layer k3-tiny."""
    cfg = dataclasses.replace(
        TINY, num_layers=4, mla_layers=(3,), attn_res_block_layers=2, n_routed_experts=num_experts
    )
    tables = [[2 * i, 2 * i + 1] for i in range(batch)]
    step = make_batch([1] * batch, [5] * batch, list(range(batch)), tables, 4)
    return forward_ops(cfg, batch, batch * 2 + 2, step)


def forward_ops(cfg, num_slots: int, num_pages: int, step) -> Counter[str]:
    """Ops of one forward of a fresh ``cfg`` model (seed 0) over ``step``'s tokens (random
    ids), with pools of ``num_slots`` slots and ``num_pages`` pages of 4 tokens; the MoE's
    load-time work is done before counting."""
    torch.manual_seed(0)
    model = K3ForCausalLM(cfg).eval()
    pools = KVPools(cfg, num_slots=num_slots, num_pages=num_pages, block_size=4)
    ids = torch.randint(0, cfg.vocab_size, (step.num_tokens,))
    with torch.inference_mode():
        for mod in model.modules():
            if isinstance(mod, MoE):
                mod.stacked_experts()  # load-time work
        with OpCounter() as c:
            model(ids, step, pools)
    return c.ops


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="CPU check: the Triton kernels run in the interpreter")
def test_whole_model_decode_step_has_fixed_op_count_and_no_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    runs = {(e, b): decode_ops(e, b) for e, b in ((8, 2), (8, 8), (16, 8))}
    for key, ops in runs.items():
        assert not syncs(ops), f"experts, batch = {key}: host sync ops {syncs(ops)}"
    base = runs[(8, 2)]
    for key, ops in runs.items():
        assert ops == base, f"{key}: {dict(ops - base)} more, {dict(base - ops)} fewer than (8, 2)"


def prefill_ops(num_layers: int, mla_layers: tuple[int, ...], host: bool = True) -> Counter[str]:
    """Ops of one prefill forward (two uncached prompts of 7 and 5 tokens) of a k3-tiny with
    ``num_layers`` layers; ``host=False`` drops the batch's host copy (``ForwardBatch.host``)."""
    cfg = dataclasses.replace(
        TINY, num_layers=num_layers, mla_layers=mla_layers, attn_res_block_layers=2,
        n_routed_experts=8,
    )  # fmt: skip
    step = make_batch([7, 5], [0, 0], [0, 1], [[0, 1], [2, 3]], 4)
    if not host:
        step = dataclasses.replace(step, host=None)
    return forward_ops(cfg, 2, 6, step)


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="CPU check: the Triton kernels run in the interpreter")
def test_prefill_forward_reads_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill forward (chunked KDA, SDPA MLA prefill, grouped MoE) of a batch from
    ``make_batch`` reads no device tensor back (each read is a stream sync on CUDA: it drains the
    launch queue mid-forward), and its host → device table uploads (``lift_fresh``: the KDA
    chunk tables, built once per forward) do not grow with the number of layers."""
    pytest.importorskip("triton")
    monkeypatch.setenv("K3SERVE_KERNELS", "triton")
    monkeypatch.setenv("K3SERVE_MLA_PREFILL", "sdpa")
    small, big = prefill_ops(2, (1,)), prefill_ops(4, (1, 3))
    for name, ops in (("2 layers", small), ("4 layers", big)):
        assert not syncs(ops), f"{name}: host reads {syncs(ops)}"
    assert small["lift_fresh"] == big["lift_fresh"] <= 2, (small["lift_fresh"], big["lift_fresh"])
    assert sum(big.values()) > sum(small.values())  # the count covers the layers' work
    # without the host copy the same forward reads cu_seqlens etc. back: the guard sees it
    dev_reads = syncs(prefill_ops(2, (1,), host=False))
    assert dev_reads.get("Tensor.tolist", 0) >= 2, dev_reads
