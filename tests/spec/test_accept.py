"""Speculative rejection sampling keeps the target distribution exactly (χ² over 20,000
seeded draws on a 6-token vocabulary, half with one-hot proposals and half with a draft's,
each half also tested alone), a deliberately wrong rule fails the same test (on 4,000 draws,
where its power is still certain), and
the policy turns speculation down with the batch and with low acceptance."""

from __future__ import annotations

import collections

import torch

from k3serve.engine.sampler import SamplingRow
from k3serve.engine.spec.accept import accept_sampled, draft_sample, residual
from k3serve.engine.spec.policy import SpecPolicy, best_num_tokens, expected_tokens
from k3serve.sampling import SamplingParams

V, DRAWS = 6, 20_000
LOGITS = torch.tensor([[1.2, 0.3, -0.5, 0.9, -1.5, 0.0],
                       [0.1, 1.4, 0.2, -0.3, 0.6, -2.0],
                       [0.5, -0.5, 1.0, 0.0, 0.3, 0.8]])  # fmt: skip
PARAMS = SamplingParams(temperature=0.9, top_k=5)
DRAFT_PARAMS = SamplingParams(temperature=1.0)
DRAFTS = [3, 1]
Q = torch.tensor([[0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
                  [0.05, 0.6, 0.05, 0.1, 0.1, 0.1]])  # fmt: skip


def _p(row: torch.Tensor) -> torch.Tensor:
    """The plain sampler's distribution for PARAMS: top-5 of softmax(x / 0.9)."""
    x = row / PARAMS.temperature
    x = x.masked_fill(x < x.topk(5).values[-1], float("-inf"))
    return torch.softmax(x, -1)


def chi2_pvalue(counts: list[int], probs: torch.Tensor) -> float:
    """Pearson's χ² goodness of fit over the tokens with p > 0 (p-value from the regularised
    upper incomplete gamma function)."""
    n = sum(counts)
    obs = torch.tensor(counts, dtype=torch.float64)
    exp = probs.double() * n
    keep = exp > 0
    assert float(obs[~keep].sum()) == 0, "a token outside the support was drawn"
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _draw(draft: bool, residual_fn=residual, seeds: range = range(DRAWS)):
    """First and second emitted tokens of one seeded verify row per seed of ``seeds``. The
    proposals are fixed (one-hot, a prompt-lookup proposer) or drawn from ``Q`` by
    ``draft_sample`` (a draft model with those distributions). Returns the two counts."""
    first, second = collections.Counter(), collections.Counter()
    dlog = Q.log()
    for seed in seeds:
        rows = [SamplingRow(PARAMS, seed, 40 + j, 0) for j in range(3)]
        drafts, probs = DRAFTS, None
        if draft:  # the draft's own filters: temperature 1, no top-k (q is what it reports)
            drows = [SamplingRow(DRAFT_PARAMS, seed, 40 + j) for j in range(2)]
            drafts, probs = draft_sample(dlog, drows)
        rows = [r._replace(output_token_ids=drafts[:j]) for j, r in enumerate(rows)]
        res = accept_sampled(LOGITS, drafts, probs, rows, None, residual_fn)
        first[res[0].token_id] += 1
        if len(res) > 1 and drafts[0] == DRAFTS[0]:
            second[res[1].token_id] += 1
    return [first[v] for v in range(V)], [second[v] for v in range(V)]


def test_rejection_sampling_keeps_target_distribution():
    """DRAWS seeded verify rows, the first half with one-hot proposals and the second with a
    draft's: the emitted tokens of all of them, and of each half, follow the target."""
    half = DRAWS // 2
    one_hot = _draw(False, seeds=range(half))
    drafted = _draw(True, seeds=range(half, DRAWS))
    both = [[a + b for a, b in zip(x, y)] for x, y in zip(one_hot, drafted)]
    for first, second in (both, one_hot, drafted):
        assert chi2_pvalue(first, _p(LOGITS[0])) > 1e-3
        # the second position's distribution given d_1 = 3 accepted
        assert sum(second) > sum(first) / 10
        assert chi2_pvalue(second, _p(LOGITS[1])) > 1e-3
    assert sum(both[0]) == DRAWS and sum(both[1]) > 2000


WRONG_DRAWS = 4_000
"""Draws of the wrong-rule test. Its first token is ``min(p, q) + (1 − Σ min(p, q))·p``
instead of ``p``: the χ² statistic's non-centrality is ``n·Σ (p' − p)² / p ≈ 0.117·n`` — about
470 at 4,000 draws (mean statistic ≈ 470, standard deviation ≈ 43), against 18.5 for
p = 0.001 at 4 degrees of freedom, so the test fails the rule with certainty at a fifth of
the draws (checked below from the two distributions)."""


def test_wrong_rule_fails():
    # resampling from p instead of max(0, p − q) after a rejection over-weights the draft
    p, q = _p(LOGITS[0]).double(), Q[0].double()
    wrong = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    keep = p > 0
    assert WRONG_DRAWS * float(((wrong - p)[keep] ** 2 / p[keep]).sum()) > 400
    first, _ = _draw(True, residual_fn=lambda p, q: p, seeds=range(WRONG_DRAWS))
    assert sum(first) == WRONG_DRAWS
    assert chi2_pvalue(first, _p(LOGITS[0])) < 1e-3


def test_policy():
    assert expected_tokens(1.0, 4) == 5 and abs(expected_tokens(0.5, 1) - 1.5) < 1e-12
    assert best_num_tokens(0.9, 8, 1, 1 / 64) == 8  # batch 1, good acceptance: all k
    assert best_num_tokens(0.9, 8, 64, 1 / 64) == 0  # batch 64: a plain step is cheaper
    assert best_num_tokens(0.0, 8, 1, 1 / 64) == 0  # nothing is ever accepted
    pol = SpecPolicy(k=4, max_batch_size=32, cost_per_token=1 / 64, probe_interval=3)
    assert pol.num_tokens("a", 1) == 4 and pol.num_tokens("a", 33) == 0
    for _ in range(30):
        pol.observe("a", 4, 0)
    got = [pol.num_tokens("a", 1) for _ in range(6)]
    assert got == [0, 0, 1, 0, 0, 1]  # off, with a one-token probe every 3 steps
    pol.forget("a")
    assert pol.num_tokens("a", 1) == 4
