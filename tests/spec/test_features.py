"""Speculation with n > 1, logprobs and stop strings, a grammar, a migration mid-stream,
the prefix cache (blocks, snapshots, events: accepted tokens only) and the replay itself."""

from __future__ import annotations

import json

import torch

from k3serve.engine.runner import Row, RunBatch
from k3serve.engine.spec import NgramProposer, SpecConfig
from k3serve.sampling import SamplingParams
from k3serve.structured import json_object_grammar
from tests.spec.helpers import make_engine, repo_prompts, run

NGRAM = SpecConfig("ngram", 4, ngram_min=2, ngram_max=6, cost_per_token=0.0)


class Recording(NgramProposer):
    """Prompt lookup that records which ``(request, choice)`` it proposed for."""

    def __init__(self):
        super().__init__(2, 6)
        self.seen: set = set()

    def propose(self, seqs, num_tokens):
        out = super().propose(seqs, num_tokens)
        self.seen |= {(s.request.request_id, s.choice) for s, p in zip(seqs, out) if p.tokens}
        return out


def test_n2_logprobs_and_stop_strings(tiny):
    prompts = repo_prompts(tiny[2], 3, 30, 60)
    params = SamplingParams(n=2, temperature=0, max_tokens=16, logprobs=2, stop=["):"])
    ref = run(make_engine(tiny), prompts, params)
    rec = Recording()
    got = run(make_engine(tiny, NGRAM, proposer=rec), prompts, params)
    for g, r in zip(got, ref):
        for go, ro in zip(g.outputs, r.outputs):
            assert go.token_ids == ro.token_ids and go.text == ro.text
            assert go.finish_reason == ro.finish_reason
            assert torch.allclose(torch.tensor(go.logprobs), torch.tensor(ro.logprobs), atol=1e-4)
            assert [[t for t, _ in x] for x in go.top_logprobs] == [
                [t for t, _ in x] for x in ro.top_logprobs]  # fmt: skip
    assert {c for _, c in rec.seen} == {0, 1}  # both choices speculated


def test_grammar(tiny):
    tok = tiny[2]
    params = SamplingParams(max_tokens=40, temperature=0.0, grammar=json_object_grammar(),
                            skip_special_tokens=False, stop_token_ids=tok.stop_token_ids)
    prompt = tok.encode('Answer in JSON: {"name": "k3serve", "layers": 8} -> ')
    ref = run(make_engine(tiny), [prompt], params)[0].outputs[0]
    eng = make_engine(tiny, NGRAM)
    got = run(eng, [prompt], params)[0].outputs[0]
    assert got.token_ids == ref.token_ids
    assert eng.spec.stats.proposed > 0
    if got.finish_reason == "stop":
        json.loads(got.text)


def test_grammar_row_without_proposals_beside_a_proposing_row(tiny):
    """A grammar row that proposes nothing in a step whose other row does still samples under
    its grammar's mask: the output equals the plain engine's (it emitted a forbidden token and
    the step raised before)."""
    tok = tiny[2]
    g = SamplingParams(max_tokens=30, temperature=0.0, grammar=json_object_grammar(),
                       skip_special_tokens=False, stop_token_ids=tok.stop_token_ids)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [tok.encode('Answer in JSON: {"name": "k3serve", "layers": 8} -> '),
               tok.encode("one two three four " * 12)]
    ref = run(make_engine(tiny), prompts, [g, p])
    eng = make_engine(tiny, SpecConfig("ngram", 4, ngram_min=2, ngram_max=6,
                                       cost_per_token=0.0))
    got = run(eng, prompts, [g, p])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert eng.spec.stats.accepted > 0


def test_migration_mid_stream(tiny):
    prompt = repo_prompts(tiny[2], 1, 50, 51)[0]
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True)):
        a = make_engine(tiny, NGRAM)
        a.add_request("m", prompt, params)
        outs: list[int] = []
        while len(outs) < 9:  # decode a few speculative steps, then move the request
            for o in a.step():
                outs = list(o.outputs[0].token_ids)
        a.abort_request("m")
        tails = []
        for _ in range(2):  # two fresh workers continue from the same tokens
            b = make_engine(tiny, NGRAM)
            b.add_request("m", prompt, params, output_token_ids=outs)
            done = None
            while done is None:
                done = next((o for o in b.step() if o.finished), None)
            tails.append(done.outputs[0].token_ids)
        assert tails[0] == tails[1] and tails[0][: len(outs)] == outs
        if params.is_greedy:
            ref = run(make_engine(tiny), [prompt], params)[0].outputs[0].token_ids
            assert tails[0] == ref


def test_prefix_cache_sees_accepted_tokens_only(tiny):
    prompts = repo_prompts(tiny[2], 4, 20, 60)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engines = [make_engine(tiny), make_engine(tiny, NGRAM)]
    outs = [run(e, prompts, params) for e in engines]
    assert engines[1].spec.stats.accepted > 0
    states = [e.cache_state() for e in engines]
    for key in ("blocks", "snapshots"):
        assert sorted(states[0][key]) == sorted(states[1][key]), key
    # the next turn (prompt + answer) hits the end-of-request snapshot equally
    nxt = [p + o.outputs[0].token_ids + p[:5] for p, o in zip(prompts, outs[0])]
    short = SamplingParams(temperature=0, max_tokens=1)
    hits = [[o.num_cached_tokens for o in run(e, nxt, short)] for e in engines]
    assert hits[0] == hits[1] and sum(hits[0]) > 0


def test_replay_in_segments_is_bitwise_replay_in_one(tiny):
    eng = make_engine(tiny)
    prompt = repo_prompts(tiny[2], 1, 30, 31)[0]
    eng.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=3))
    eng.step()
    seq = eng.requests["x"].seqs[0]
    slot = eng.cm.slot(seq.seq_id)
    eng.cm.allocate(seq.seq_id, 6)
    row = Row([seq.token_ids[-1], 5, 6, 7, 8, 9], seq.num_computed, slot,
              eng.cm.block_table(seq.seq_id))
    _, cap = eng.runner.verify(RunBatch((row,)))
    pools = eng.pools
    before = (pools.kda_state.clone(), pools.conv_state.clone())
    eng.runner.replay(cap, [0], [slot], [0], [5])
    one = (pools.kda_state[:, slot].clone(), pools.conv_state[:, slot].clone())
    pools.kda_state.copy_(before[0])
    pools.conv_state.copy_(before[1])
    eng.runner.replay(cap, [0], [slot], [0], [2])
    eng.runner.replay(cap, [0], [slot], [2], [3])
    assert torch.equal(pools.kda_state[:, slot], one[0])
    assert torch.equal(pools.conv_state[:, slot], one[1])
    # the conv history is an exact copy of the last W−1 captured pre-conv inputs
    w1 = pools.conv_state.shape[2]
    for j, x in cap.layers.items():
        assert torch.equal(one[1][j], x.pre[5 - w1 : 5])


def test_warm_up_runs_verify_shapes_and_leaves_no_trace(tiny):
    from k3serve.engine.warmup import warm_up

    eng = make_engine(tiny, NGRAM, max_num_batched_tokens=48)
    rep = warm_up(eng, force=True)
    plain = warm_up(make_engine(tiny, max_num_batched_tokens=48), force=True)
    assert rep.num_forwards > plain.num_forwards
    assert not eng.pools.kda_state.any() and not eng.pools.conv_state.any()
