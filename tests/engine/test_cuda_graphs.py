"""The CUDA-graph decode runner (k3serve/engine/cuda_graphs.py) and pool sizing from memory.

CPU: bucket choice, which batches may replay (fallback rules), the static buffers' contents
equal to the eager ``make_batch`` (padding rows on the scratch slot / page), and the padded
forward through the static buffers giving the eager forward's logits, states and latents for
the real rows (the computation the graphs capture); ``size_pools_from_memory`` arithmetic and
the new ``EngineConfig`` / worker flags. GPU (``-m gpu``): graph replay equals eager.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.engine.config import EngineConfig
from k3serve.engine.cuda_graphs import (
    CUDAGraphRunner,
    StaticDecodeBuffers,
    choose_bucket,
    default_buckets,
    graph_eligible,
)
from k3serve.engine.memory import pool_bytes, size_pools_from_memory
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.model.batch import make_batch
from k3serve.model.model import K3ForCausalLM

TINY = PRESETS["k3-tiny"]
BS = 4  # tokens per page in these tests: rows span several pages


def test_buckets_and_choice() -> None:
    assert default_buckets(1) == (1,)
    assert default_buckets(5) == (1, 2, 4, 5)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert default_buckets(65)[-1] == 80
    bk = default_buckets(64)
    assert [choose_bucket(n, bk) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    assert choose_bucket(65, bk) is None
    with pytest.raises(ValueError, match="n"):
        choose_bucket(0, bk)
    with pytest.raises(ValueError, match="max_num_seqs"):
        default_buckets(0)


def _row(tokens: list[int], cached: int, slot: int, pages: list[int]) -> Row:
    return Row(tuple(tokens), cached, slot, tuple(pages))


def test_fallback_rules() -> None:
    bk = (1, 2, 4)
    dec = tuple(_row([5], 3, i, [i]) for i in range(3))
    assert graph_eligible(RunBatch(dec), bk) == 4
    assert graph_eligible(RunBatch(dec, layer_hook=lambda i: None), bk) is None  # a hook
    assert graph_eligible(RunBatch(dec + (_row([5, 6], 0, 9, [9]),)), bk) is None  # prefill
    big = tuple(_row([5], 3, i, [i]) for i in range(5))
    assert graph_eligible(RunBatch(big), bk) is None  # above the largest bucket


def test_static_buffers_equal_eager_batch() -> None:
    st = StaticDecodeBuffers(8, 40, BS, scratch_slot=9, scratch_page=30, device="cpu")
    rows = [_row([11], 5, 2, [7, 3]), _row([12], 0, 0, [4]), _row([13], 12, 5, [1, 2, 6, 8])]
    st.fill(rows, 4)
    fb = st.batch(4)
    ref = make_batch([1] * 3, [r.num_cached for r in rows], [r.slot for r in rows],
                     [r.block_table for r in rows], BS)  # fmt: skip
    assert fb.is_decode and fb.num_tokens == 4 and fb.max_seq_len == 40
    assert torch.equal(fb.cu_seqlens[:4], ref.cu_seqlens)
    assert torch.equal(fb.num_cached[:3], ref.num_cached)
    assert torch.equal(fb.state_slots[:3], ref.state_slots)
    assert torch.equal(fb.slot_mapping[:3], ref.slot_mapping)
    w = ref.block_table.shape[1]
    assert torch.equal(fb.block_table[:3, :w], ref.block_table)
    assert bool((fb.block_table[:3, w:] == -1).all())
    assert st.input_ids[:3].tolist() == [11, 12, 13]
    # padding row: token 0 at position 0 on the scratch slot and page
    assert fb.num_cached[3].item() == 0 and fb.state_slots[3].item() == 9
    assert fb.slot_mapping[3].item() == 30 * BS and fb.block_table[3, 0].item() == 30
    # a smaller step afterwards re-pads the rows the bigger one used
    st.fill(rows[:1], 4)
    assert st.state_slots[1:4].tolist() == [9, 9, 9] and st.block_table[1, 1].item() == -1


def test_static_buffers_reject_bad_rows() -> None:
    st = StaticDecodeBuffers(4, 16, BS, scratch_slot=9, scratch_page=30, device="cpu")
    with pytest.raises(ValueError, match="token_ids"):
        st.fill([_row([1, 2], 0, 0, [0])], 1)
    with pytest.raises(ValueError, match="block_table"):
        st.fill([_row([1], 8, 0, [0, 1])], 1)  # position 8 needs page index 2
    with pytest.raises(ValueError, match="max_model_len"):
        st.fill([_row([1], 16, 0, [0, 1, 2, 3, 4])], 1)
    with pytest.raises(ValueError, match="bucket"):
        st.fill([_row([1], 0, 0, [0])] * 2, 1)


def _tiny_model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(TINY, torch.float32).eval()


def test_padded_static_forward_equals_eager() -> None:
    """The graphs' computation (padded rows, static buffers) run eagerly on CPU: the real rows'
    logits, final KDA/conv states and written latents equal the plain eager forward's."""
    model = _tiny_model()
    slots, pages = 4, 12
    g = torch.Generator().manual_seed(1)

    def pools() -> KVPools:
        p = KVPools(TINY, slots + 1, pages + 1, BS, 0, torch.float32)
        torch.manual_seed(2)
        p.kda_state.normal_(0, 0.1)
        p.conv_state.normal_(0, 0.1)
        p.mla_latent.normal_(0, 0.1)
        return p

    rows = [_row([int(torch.randint(3, 200, (1,), generator=g))], c, s, pg)
            for c, s, pg in ((5, 0, [0, 1]), (0, 2, [2]), (9, 3, [3, 4, 5]))]  # fmt: skip
    pe, pg_ = pools(), pools()
    eager = ModelRunner(model, pe).forward(rows)
    graph_runner = CUDAGraphRunner(model, pg_, "cpu", max_model_len=pages * BS, buckets=(1, 8))
    padded = graph_runner.forward_padded(rows, 8)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    for s in (0, 2, 3):
        torch.testing.assert_close(pg_.kda_state[:, s], pe.kda_state[:, s])
        torch.testing.assert_close(pg_.conv_state[:, s], pe.conv_state[:, s])
    torch.testing.assert_close(pg_.mla_latent[:, :pages], pe.mla_latent[:, :pages])
    assert torch.equal(pg_.kda_state[:, 1], pe.kda_state[:, 1])  # an idle slot is untouched


def test_runner_falls_back_to_eager_without_graphs() -> None:
    model = _tiny_model()
    p = KVPools(TINY, 3, 5, BS, 0, torch.float32)
    r = CUDAGraphRunner(model, p, "cpu", max_model_len=16, buckets=(1, 2))
    r.capture()  # a no-op off CUDA
    out = r.execute(RunBatch((_row([7], 0, 0, [0]),)))
    assert out.shape == (1, TINY.vocab_size) and r.num_eager == 1 and r.num_replays == 0


def test_size_pools_from_memory() -> None:
    slot_b, snap_b, page_b = pool_bytes(TINY, 64, torch.bfloat16)
    assert page_b == TINY.num_mla_layers * 64 * TINY.mla_latent_dim * 2
    gib = 1 << 30
    total, free = 100 * gib, 90 * gib  # 10 GiB held (weights)
    pages = size_pools_from_memory(TINY, total, free, 0.5, gib, 64, 8, 4, torch.bfloat16, 1)
    budget = 50 * gib - 10 * gib - gib - 9 * slot_b - 4 * snap_b - page_b
    assert pages == budget // page_b
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        size_pools_from_memory(TINY, total, free, 0.1, 0, 64, 8, 4, torch.bfloat16)


def test_engine_config_new_fields() -> None:
    assert EngineConfig(gpu_memory_utilization=0.9).gpu_memory_utilization == 0.9
    for bad in (0, 1.5, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(gpu_memory_utilization=bad)
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(cuda_graphs=1)  # type: ignore[arg-type]


def test_cpu_engine_keeps_explicit_sizes() -> None:
    from k3serve.engine.engine import LLMEngine

    c = EngineConfig(num_pages=20, num_slots=3, gpu_memory_utilization=0.5, block_size=BS)
    eng = LLMEngine(_tiny_model(), TINY, None, c)
    assert eng.pools.num_pages == 20 and eng.pools.num_slots == 3  # no scratch on CPU
    assert type(eng.runner) is ModelRunner


def test_worker_flags() -> None:
    from worker.config import parse_config

    c = parse_config("decode", ["--device", "cpu"])  # CPU defaults, on any machine
    assert (c.gpu_memory_utilization, c.max_num_seqs, c.cuda_graphs) == (None, None, True)
    c = parse_config("decode", ["--gpu-memory-utilization", "0.8", "--max-num-seqs", "64",
                                "--no-cuda-graphs"])  # fmt: skip
    assert (c.gpu_memory_utilization, c.max_num_seqs, c.cuda_graphs) == (0.8, 64, False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_equals_eager_gpu() -> None:
    """Decode steps replayed from graphs equal eager steps (bf16 tolerance), 3 steps, ragged
    contexts, a batch padded from 3 to 4."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = K3ForCausalLM(TINY, torch.bfloat16).to(dev).eval()
    slots, pages = 4, 16

    def pools() -> KVPools:
        p = KVPools(TINY, slots + 1, pages + 1, BS, 0, torch.bfloat16, dev)
        torch.manual_seed(2)
        p.kda_state.normal_(0, 0.1)
        p.conv_state.normal_(0, 0.1)
        p.mla_latent.normal_(0, 0.1)
        return p

    pe, pgr = pools(), pools()
    eager = ModelRunner(model, pe, dev)
    gr = CUDAGraphRunner(model, pgr, dev, max_model_len=pages * BS, buckets=(1, 2, 4))
    gr.capture()
    spec = [(5, 0, [0, 1, 2]), (0, 2, [3, 4]), (9, 3, [5, 6, 7, 8])]
    for step in range(3):
        rows = tuple(_row([17 + 5 * i + step], c + step, s, pg)
                     for i, (c, s, pg) in enumerate(spec))  # fmt: skip
        a = eager.forward(rows)
        b = gr.execute(RunBatch(rows))
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    assert gr.num_replays == 3
    for s in (0, 2, 3):
        torch.testing.assert_close(pgr.kda_state[:, s], pe.kda_state[:, s], rtol=2e-2, atol=2e-2)

