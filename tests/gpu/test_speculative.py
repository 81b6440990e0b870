"""Speculative decoding on the device: greedy output with n-gram speculation equals greedy
output without (k3-tiny, float32, Triton kernels: the verify forward's stacked prefill path
with its KDA input capture, the replay through the Triton decode-step kernel, the CUDA-graph
decode beside it); verify steps replay their captured CUDA graphs (one per (bucket, k)) and
give the eager verify's greedy tokens, and a replay's logits equal the graphs' computation run
eagerly (``CUDAGraphRunner.verify_padded``).

Run: ``pytest -m gpu tests/gpu/test_speculative.py`` on a CUDA machine (skipped on CPU; the
CPU suite's tests/spec/ covers the same on the torch kernels).
"""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.config import EngineConfig
from k3serve.engine.cuda_graphs import CUDAGraphRunner
from k3serve.engine.engine import LLMEngine
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.spec import SpecConfig
from k3serve.model.checkpoint import load_model
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer
from tests.spec.helpers import repo_prompts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_on_device(method):
    net, cfg, folder = load_model("k3-tiny", "cuda", torch.float32)
    tok = get_tokenizer(folder)
    prompts = repo_prompts(tok, 16, 24, 200)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def run(spec):
        c = EngineConfig(num_pages=512, block_size=16, num_slots=16, num_snapshots=16,
                         speculative=spec)
        eng = LLMEngine(net, cfg, tok, c, device="cuda", dtype=torch.float32)
        for i, p in enumerate(prompts):
            eng.add_request(f"g{i}", p, params)
        done = {}
        while len(done) < len(prompts):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        return [done[f"g{i}"] for i in range(len(prompts))], eng

    ref, _ = run(None)
    sc = SpecConfig(method, 4, ngram_min=2, ngram_max=8, draft_model="k3-tiny",
                    cost_per_token=0.0)
    got, eng = run(sc)
    assert eng.spec.stats.accepted > 0
    same = sum(g == r for g, r in zip(got, ref))
    assert same == len(prompts), f"{same}/{len(prompts)} identical"


def _engine(net, cfg, tok, spec, graphs: bool) -> LLMEngine:
    c = EngineConfig(num_pages=512, block_size=16, num_slots=16, num_snapshots=16,
                     speculative=spec, cuda_graphs=graphs)
    return LLMEngine(net, cfg, tok, c, device="cuda", dtype=torch.float32)


def _greedy(eng: LLMEngine, groups, params) -> list[list[int]]:
    """Each group's prompts added together and run to the end, one group after another."""
    out = []
    for g, prompts in enumerate(groups):
        for i, p in enumerate(prompts):
            eng.add_request(f"{g}-{i}", p, params)
        done = {}
        while len(done) < len(prompts):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        out += [done[f"{g}-{i}"] for i in range(len(prompts))]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_verify_steps_replay_cuda_graphs_and_equal_eager(method):
    net, cfg, folder = load_model("k3-tiny", "cuda", torch.float32)
    tok = get_tokenizer(folder)
    prompts = repo_prompts(tok, 6, 24, 200)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sc = SpecConfig(method, 4, ngram_min=2, ngram_max=8, draft_model="k3-tiny",
                    cost_per_token=0.0)
    # batch 1 (every verify batch is uniform: it replays), then all six together
    groups = [[p] for p in prompts[:3]] + [prompts]
    eager_eng = _engine(net, cfg, tok, sc, graphs=False)
    eager = _greedy(eager_eng, groups, params)
    assert not isinstance(eager_eng.runner, CUDAGraphRunner)
    eng = _engine(net, cfg, tok, sc, graphs=True)
    r = eng.runner
    assert isinstance(r, CUDAGraphRunner)
    # buckets 1 … 16 (16 slots), k = 1 … 4: every planned shape captured
    assert set(r.verify_graphs) == set(r.verify_shapes) >= {(b, 4) for b in (1, 2, 4)}
    got = _greedy(eng, groups, params)
    assert got == eager
    assert eng.spec.stats.accepted > 0
    assert r.num_verify_replays > 0, (r.num_verify_replays, r.num_verify_eager)
    assert r.num_verify_replays + r.num_verify_eager == eng.spec.stats.steps

    # one verify step three ways: the replay, its computation run eagerly, the eager verify
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"v{i}", p, SamplingParams(temperature=0, max_tokens=200))
    seqs = [eng.requests[f"v{i}"].seqs[0] for i in range(3)]
    # until admitted (``target`` is set at admission) and prefilled (chunked when over the
    # budget)
    while any(s.target == 0 or s.is_prefill for s in seqs):
        eng.step()
    rows = []
    for s in seqs:
        eng.cm.allocate(s.seq_id, 5)
        rows.append(Row([s.token_ids[-1], 11, 12, 13, 14], s.num_computed,
                        eng.cm.slot(s.seq_id), eng.cm.block_table(s.seq_id)))
    before = r.num_verify_replays
    lg, cap = r.verify(RunBatch(tuple(rows)))
    assert r.num_verify_replays == before + 1
    pad_lg, pad_cap = r.verify_padded(rows, 4, 4)
    ref_lg, ref_cap = ModelRunner.verify(r, RunBatch(tuple(rows)))
    assert lg.shape == pad_lg.shape == ref_lg.shape == (15, cfg.vocab_size)
    assert cap.cu_seqlens == pad_cap.cu_seqlens == ref_cap.cu_seqlens == (0, 5, 10, 15)
    assert (lg - pad_lg).abs().max().item() <= 1e-5
    assert (lg - ref_lg).abs().max().item() <= 1e-3
    for j, x in cap.layers.items():
        assert (x.k - pad_cap.layers[j].k).abs().max().item() <= 1e-5
        assert (x.pre - ref_cap.layers[j].pre).abs().max().item() <= 1e-3
