"""Greedy output with speculation equals greedy output without, token for token: n-gram
lookup, k3-tiny drafting for k3-tiny, and a deliberately bad (random-weight) draft, at
k ∈ {1, 4, 8}, on 20 prompts cut from this repository's sources. The bad draft is a
two-layer random-weight model with k3-tiny's vocabulary (cheap, and seldom right)."""

from __future__ import annotations

import dataclasses

import pytest

from k3serve.engine.spec import SpecConfig
from tests.spec.helpers import GREEDY, make_engine, run


def _spec(method: str, k: int, draft=None) -> SpecConfig:
    # cost 0: a proposal costs nothing; the policy proposes up to k tokens per step
    return SpecConfig(method, k, ngram_min=2, ngram_max=6, draft_model=draft,
                      cost_per_token=0.0)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("proposer", ["ngram", "draft", "bad-draft"])
def test_greedy_equals_plain(tiny, greedy20, proposer, k):
    prompts, reference = greedy20
    if proposer == "ngram":
        sc = _spec("ngram", k)
    elif proposer == "draft":
        sc = _spec("draft", k, "k3-tiny")
    else:
        bad = dataclasses.replace(tiny[1], name="bad-draft", num_layers=2, mla_layers=(1,))
        sc = _spec("draft", k, bad)
    eng = make_engine(tiny, sc)
    got = [o.outputs[0].token_ids for o in run(eng, prompts, GREEDY)]
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g == r, f"prompt {i}: {g} != {r}"
    st = eng.spec.stats
    assert st.steps > 0 and st.proposed > 0
    if proposer == "draft":
        assert st.accepted >= 0.9 * st.proposed  # the target drafting for itself
    if proposer == "bad-draft":
        assert st.accepted <= 0.2 * st.proposed
