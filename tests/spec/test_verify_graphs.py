"""Verify steps under CUDA graphs, the parts that run on CPU: the ``(bucket, k)`` shape plan,
eligibility, the static buffers' layout and refusals, the padded static verify (per-query MLA
path, padding rows) against the eager verify, and the capture / replay bookkeeping of
:class:`~k3serve.engine.cuda_graphs.CUDAGraphRunner` with a stand-in graph object that re-runs
the recorded function — greedy tokens equal the plain engine's, and verify steps replay.
(tests/gpu/test_speculative.py runs the real graphs.)"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from k3serve.cache.pools import KVPools
from k3serve.engine.config import EngineConfig
from k3serve.engine.cuda_graphs import CUDAGraphRunner
from k3serve.engine.engine import LLMEngine
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.spec import Proposal, SpecConfig
from k3serve.engine.spec.build import build_speculator
from k3serve.engine.spec.verify_graphs import StaticVerifyBuffers, verify_eligible, verify_shapes
from k3serve.model.capture import replay
from k3serve.sampling import SamplingParams
from tests.spec.helpers import GREEDY, repo_prompts, run

SLOTS, PAGES, B = 24, 256, 16


def test_verify_shapes():
    assert verify_shapes((1, 2, 4, 8, 16, 32, 48), 4, 32, 16, 512) == tuple(
        (b, k) for k in range(1, 5) for b in (1, 2, 4, 8, 16, 32))
    # the smallest bucket holding max_batch; b·(k+1) within the token budget; k+1 ≤ a page
    assert verify_shapes((1, 2, 4, 8, 16), 3, 5, 16, 1 << 20) == tuple(
        (b, k) for k in range(1, 4) for b in (1, 2, 4, 8))
    assert verify_shapes((1, 2, 4, 8), 4, 8, 16, 20) == (
        (1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (1, 3), (2, 3), (4, 3),
        (1, 4), (2, 4), (4, 4))
    assert verify_shapes((1, 2), 8, 2, 4, 100) == ((1, 1), (2, 1), (1, 2), (2, 2), (1, 3),
                                                   (2, 3))
    assert verify_shapes((1, 2), 0, 2, 16, 100) == ()
    assert verify_shapes((1, 2), 4, 0, 16, 100) == ()
    with pytest.raises(ValueError, match="max_k"):
        verify_shapes((1,), -1, 1, 16, 10)
    with pytest.raises(ValueError, match="buckets"):
        verify_shapes((0, 1), 1, 1, 16, 10)


def _rows(n: int, q: int, c: int = 5) -> tuple[Row, ...]:
    return tuple(Row(list(range(q)), c, i, [2 * i, 2 * i + 1]) for i in range(n))


def test_verify_eligible():
    shapes = verify_shapes((1, 2, 4), 4, 4, 16, 512)
    assert verify_eligible(RunBatch(_rows(3, 5)), shapes) == (4, 4)
    assert verify_eligible(RunBatch(_rows(1, 2)), shapes) == (1, 1)
    assert verify_eligible(RunBatch(_rows(2, 1)), shapes) is None  # plain decode rows
    assert verify_eligible(RunBatch(_rows(5, 3)), shapes) is None  # above the buckets
    assert verify_eligible(RunBatch(_rows(1, 6)), shapes) is None  # k = 5 not captured
    mixed = _rows(1, 3) + (Row([1, 2], 5, 1, [2, 3]),)
    assert verify_eligible(RunBatch(mixed), shapes) is None  # unequal rows
    assert verify_eligible(RunBatch(_rows(1, 3), lambda i: None), shapes) is None  # a hook
    assert verify_eligible(RunBatch(()), shapes) is None


def test_static_verify_buffers_layout_and_refusals():
    sv = StaticVerifyBuffers(4, 3, 64, 16, scratch_slot=9, scratch_page=7, device="cpu")
    rows = (Row([11, 12, 13], 15, 2, [3, 4]), Row([21, 22, 23], 0, 5, [6]))
    sv.fill(rows, 4, 2)
    q, t = 3, 4 * 4
    ids = sv.input_ids.tolist()
    assert ids[:q * 4] == [11, 12, 13, 21, 22, 23] + [0] * 6
    # row 0 crosses a page: position 15 → page 3 offset 15; 16, 17 → page 4
    assert sv.slot_mapping[:12].tolist() == [3 * 16 + 15, 4 * 16, 4 * 16 + 1, 96, 97, 98,
                                             112, 113, 114, 112, 113, 114]
    assert sv.num_cached[:4].tolist() == [15, 0, 0, 0]
    assert sv.state_slots[:4].tolist() == [2, 5, 9, 9]
    assert sv.block_table[:4, :2].tolist() == [[3, 4], [6, -1], [7, -1], [7, -1]]
    assert sv.block_table[:4, 2:].eq(-1).all()
    assert len(ids) == t
    fb = sv.batch(4, 2)
    assert fb.cu_seqlens.tolist() == [0, 3, 6, 9, 12] and fb.query_len == 3
    assert fb.capture is not None and fb.capture.cu_seqlens == (0, 3, 6, 9, 12)
    assert fb.num_tokens == 12 and fb.rows_for_logits().tolist() == list(range(12))
    assert sv.batch(4, 2).capture is not fb.capture  # a fresh capture per forward
    with pytest.raises(ValueError, match="tokens"):
        sv.fill((Row([1, 2], 0, 0, [0]),), 1, 2)
    with pytest.raises(ValueError, match="block_table"):
        sv.fill((Row([1, 2, 3], 15, 0, [0]),), 1, 2)  # position 17 needs a second page
    with pytest.raises(ValueError, match="max_model_len"):
        sv.fill((Row([1, 2, 3], 62, 0, [0, 1, 2, 3]),), 1, 2)
    with pytest.raises(ValueError, match="do not fit"):
        sv.fill(_rows(2, 3), 1, 2)
    with pytest.raises(ValueError, match="exceed a page"):
        StaticVerifyBuffers(1, 16, 64, 16, 0, 0, "cpu")


def _graph_engine(tiny, sc: SpecConfig | None, buckets=(1, 2, 4), max_batch=4,
                  proposer=None) -> LLMEngine:
    """An engine over a CPU ``CUDAGraphRunner`` (pools with one scratch slot and page beyond
    what the cache manager hands out), speculating with ``sc`` (verify graphs for batches of
    up to ``max_batch`` rows; ``proposer`` replaces the one ``sc`` names)."""
    net, cfg, tok = tiny
    c = EngineConfig(num_pages=PAGES, block_size=B, num_slots=SLOTS, num_snapshots=32)
    pools = KVPools(cfg, SLOTS + 1, PAGES + 1, B, 32, torch.float32, "cpu")
    k = sc.num_speculative_tokens if sc is not None else 0
    runner = CUDAGraphRunner(net, pools, "cpu", min(cfg.max_position_embeddings, PAGES * B),
                             buckets=buckets, verify_k=k, verify_max_batch=max_batch,
                             max_num_batched_tokens=c.max_num_batched_tokens,
                             scratch_slot=SLOTS, scratch_page=PAGES)  # fmt: skip
    eng = LLMEngine(net, cfg, tok, c, runner=runner)
    if sc is not None:  # the engine refuses speculation with a given runner: attach it here
        eng.spec = build_speculator(dataclasses.replace(c, speculative=sc), cfg,
                                    eng.inputs.grammar, eng.max_model_len,
                                    torch.device("cpu"), torch.float32, proposer)
    return eng


def test_padded_static_verify_equals_eager_verify(tiny):
    eng = _graph_engine(tiny, SpecConfig("ngram", 4))
    runner = eng.runner
    prompts = repo_prompts(tiny[2], 3, 20, 60)
    for i, p in enumerate(prompts):
        eng.add_request(f"x{i}", p, SamplingParams(temperature=0, max_tokens=3))
    eng.step()  # prefill
    seqs = [eng.requests[f"x{i}"].seqs[0] for i in range(3)]
    rows = []
    for s in seqs:
        eng.cm.allocate(s.seq_id, 4)
        rows.append(Row([s.token_ids[-1], 7, 8, 9], s.num_computed, eng.cm.slot(s.seq_id),
                        eng.cm.block_table(s.seq_id)))
    rows = tuple(rows)
    ref_lg, ref_cap = ModelRunner.verify(runner, RunBatch(rows))  # the eager verify
    lg, cap = runner.verify_padded(rows, 4, 3)  # three rows padded to bucket 4
    assert lg.shape == ref_lg.shape == (12, tiny[1].vocab_size)
    assert cap.cu_seqlens == ref_cap.cu_seqlens == (0, 4, 8, 12)
    assert (lg - ref_lg).abs().max().item() <= 1e-5  # absorbed decode kernel vs prefill path
    assert torch.equal(lg.argmax(-1), ref_lg.argmax(-1))
    assert sorted(cap.layers) == sorted(ref_cap.layers)
    for j, x in cap.layers.items():
        y = ref_cap.layers[j]
        for a, b in ((x.pre, y.pre), (x.k, y.k), (x.v, y.v), (x.g, y.g), (x.beta, y.beta)):
            assert a.shape == b.shape and (a - b).abs().max().item() <= 1e-5
    # the replayed states agree too
    pools = eng.pools
    slots = [r.slot for r in rows]
    states = []
    for c in (cap, ref_cap):
        before = (pools.kda_state.clone(), pools.conv_state.clone())
        replay(c, pools.kda_state, pools.conv_state, [0, 1, 2], slots, [0, 0, 0], [4, 2, 1])
        states.append((pools.kda_state[:, slots].clone(), pools.conv_state[:, slots].clone()))
        pools.kda_state.copy_(before[0])
        pools.conv_state.copy_(before[1])
    assert (states[0][0] - states[1][0]).abs().max().item() <= 1e-5
    assert (states[0][1] - states[1][1]).abs().max().item() <= 1e-5


class ReRun:
    """A stand-in for ``torch.cuda.CUDAGraph``: :meth:`replay` re-runs the recorded function
    (which writes its logits into the static buffer and refills its capture in place)."""

    def __init__(self, fn):
        self.fn, self.replays = fn, 0

    def replay(self) -> None:
        self.fn()
        self.replays += 1


def rerun_recorder(recorded: list):
    def record(fn):
        out = fn()
        g = ReRun(fn)
        recorded.append(g)
        return g, out

    return record


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_verify_replays_recorded_graphs_and_greedy_equals_plain(tiny, greedy20, method):
    sc = SpecConfig(method, 3, ngram_min=2, ngram_max=6, draft_model="k3-tiny",
                    cost_per_token=0.0)
    prompts, ref = greedy20[0][:3], greedy20[1][:3]
    params = GREEDY
    eng = _graph_engine(tiny, sc)
    recorded: list = []
    eng.runner.capture_verify(rerun_recorder(recorded))
    assert sorted(eng.runner.verify_graphs) == sorted(
        (b, k) for b in (1, 2, 4) for k in (1, 2, 3))
    assert len(recorded) == 9
    for one in range(2):  # batch 1 (every verify batch uniform), then all three at once
        todo = prompts[:1] if one == 0 else prompts
        got = [o.outputs[0].token_ids for o in run(eng, todo, params)]
        assert got == ref[: len(todo)]
    r = eng.runner
    assert r.num_verify_replays > 0 and r.num_verify_replays == sum(g.replays for g in recorded)
    assert r.num_verify_replays + r.num_verify_eager == eng.spec.stats.steps
    assert eng.spec.stats.accepted > 0


class Repeat:
    """Proposes the last token as often as asked: every row of a step carries the same number
    of tokens, so the verify steps replay graphs at any batch size."""

    def propose(self, seqs, num_tokens):
        return [Proposal([s.token_ids[-1]] * n) for s, n in zip(seqs, num_tokens)]


def test_recorded_verify_graphs_keep_their_chunk_tables(tiny, greedy20, monkeypatch):
    """The chunked KDA launches a verify graph records read chunk tables cached per
    ``cu_seqlens`` tensor (:mod:`k3serve.kernels.kda.chunk_triton`); a CUDA graph replays them
    at their capture-time addresses, so they must stay allocated for as long as the graph can
    be replayed. Here with 20 verify shapes (buckets 1…16, k 1…4: more layouts than a bounded
    cache held — the four largest shapes' tables were freed at capture, the device's illegal
    memory access at batch > 1) and 16 sequences decoding: every recorded graph's tables are
    still alive after the capture and after the steps, and greedy output equals plain. The
    tables are built by the kernel's own cache; the math runs the torch reference."""
    pytest.importorskip("triton")
    from k3serve.kernels import dispatch
    from k3serve.kernels.kda import chunk_triton

    reference = dispatch.chunk_kda
    seen: list = []

    def chunk_kda(q, k, v, g, beta, *args, cu_seqlens=None, cu_seqlens_host=None, **kw):
        if cu_seqlens is not None:  # the tables the Triton launch would read
            seen.append(chunk_triton._plan(cu_seqlens, q.shape[0], q.shape[1], q.device,
                                           cu_seqlens_host))  # fmt: skip
        return reference(q, k, v, g, beta, *args, cu_seqlens=cu_seqlens,
                         cu_seqlens_host=cu_seqlens_host, **kw)  # fmt: skip

    monkeypatch.setattr(dispatch, "chunk_kda", chunk_kda)
    sc = SpecConfig("ngram", 4, cost_per_token=0.0)
    eng = _graph_engine(tiny, sc, buckets=(1, 2, 4, 8, 16), max_batch=16, proposer=Repeat())
    tables: list[list] = []

    def record(fn):
        seen.clear()
        out = fn()
        assert seen  # every KDA layer ran the chunked path over the shape's cu_seqlens
        tables.append([weakref.ref(t) for p in seen for t in (p.cidx, p.coff)])
        return ReRun(fn), out

    eng.runner.capture_verify(record)
    assert len(tables) == len(eng.runner.verify_shapes) == 20

    def freed() -> int:
        gc.collect()
        return sum(any(t() is None for t in ts) for ts in tables)

    assert freed() == 0
    prompts, ref = greedy20[0][:16], greedy20[1][:16]
    got = [o.outputs[0].token_ids for o in run(eng, prompts, GREEDY)]
    assert got == ref
    assert eng.runner.num_verify_replays > 0
    assert eng.runner.verify_graphs[(16, 4)].replays > 0  # 16 rows of 5 tokens
    assert freed() == 0


class Uneven:
    """Proposes the last token ``1 + seq_id % 3`` times (at most as often as asked): the rows
    of a step carry different numbers of proposals."""

    def __init__(self):
        self.mixed_steps = 0

    def propose(self, seqs, num_tokens):
        ks = [min(n, 1 + s.seq_id % 3) for s, n in zip(seqs, num_tokens)]
        self.mixed_steps += len(set(ks)) > 1
        return [Proposal([s.token_ids[-1]] * k) for s, k in zip(seqs, ks)]


def run_three_watching_verify(eng, greedy20) -> list[tuple[int, ...]]:
    """Run three greedy prompts to the end, check their tokens equal the plain engine's, and
    return the row lengths of every verify batch the runner got."""
    seen: list[tuple[int, ...]] = []
    verify = eng.runner.verify

    def spy(batch):
        seen.append(tuple(len(r.token_ids) for r in batch.rows))
        return verify(batch)

    eng.runner.verify = spy
    prompts, ref = greedy20[0][:3], greedy20[1][:3]
    got = [o.outputs[0].token_ids for o in run(eng, prompts, GREEDY)]
    assert got == ref
    return seen


def test_rows_with_fewer_proposals_are_padded_into_the_captured_shape(tiny, greedy20):
    """Three rows proposing 1, 2 and 3 tokens run as one replay of shape (4, 3): the shorter
    rows padded after their proposals, their padding's logits unread and its KDA inputs not
    replayed. Every verify step replays, and the greedy tokens equal the plain engine's."""
    prop = Uneven()
    eng = _graph_engine(tiny, SpecConfig("ngram", 3, cost_per_token=0.0), proposer=prop)
    recorded: list = []
    eng.runner.capture_verify(rerun_recorder(recorded))
    assert eng.runner.verify_replays(3, 3) and not ModelRunner.verify_replays(eng.runner, 3, 3)
    seen = run_three_watching_verify(eng, greedy20)
    assert prop.mixed_steps > 0  # the rows did propose different numbers of tokens ...
    assert all(len(set(s)) == 1 for s in seen)  # ... and every verify batch was uniform
    r = eng.runner
    assert r.num_verify_eager == 0 and r.num_verify_replays == eng.spec.stats.steps > 0
    assert r.verify_graphs[(4, 3)].replays > 0
    # the padding is not counted as proposed: at most 1 + 2 + 3 proposals per step
    assert eng.spec.stats.proposed <= 6 * eng.spec.stats.steps


def test_uneven_rows_run_as_proposed_without_captured_graphs(tiny, greedy20):
    """The eager runner replays no graph: rows keep their own lengths (no padding compute)."""
    prop = Uneven()
    eng = _graph_engine(tiny, SpecConfig("ngram", 3, cost_per_token=0.0), proposer=prop)
    assert not eng.runner.verify_graphs  # nothing captured: every verify runs eagerly
    seen = run_three_watching_verify(eng, greedy20)
    assert any(len(set(s)) > 1 for s in seen)
