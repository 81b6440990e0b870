"""Served speculative decoding: greedy output of decode workers that speculate (n-gram at
k = 1 and 8, k3-tiny drafting for k3-tiny at k = 4) equals the offline engine's without
speculation, token for token, on 20 prompts — served 1P+1D (reserve → prefill → transfer →
decode) and monolithic (``/internal/generate`` on the decode worker); the decode workers'
``/metrics`` carry the speculation counters, and their load reports carry the same counters,
which the router sums (``router.spec_metrics``)."""

from __future__ import annotations

import asyncio
import types

import httpx
import pytest

from k3serve.messages import CacheEvents
from router.spec_metrics import SPEC_COUNTERS, SpecTotals
from tests.worker_procs import HEADERS, Proc, _metric, _request, _stream, stop_all

CONFIGS = [("ngram", 1), ("draft", 4), ("ngram", 8)]
SAMPLING = {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("spec-served")
    procs = [Proc("prefill", "p-spec", 16, logs)]
    for method, k in CONFIGS:
        extra = ("--speculative", method, "--num-speculative-tokens", str(k),
                 "--speculative-draft-model", "k3-tiny")
        procs.append(Proc("decode", f"d-{method}-{k}", 16, logs, extra=extra))
    try:
        for p in procs:
            p.wait_ready()
        yield procs[0], procs[1:]
    finally:
        stop_all(procs)


async def _monolithic(c: httpx.AsyncClient, D: Proc, rid: str, ids: list[int]) -> list[int]:
    r = await c.post(D.url + "/internal/generate",
                     json={"request_id": rid, "prompt_token_ids": ids, "sampling": SAMPLING})
    assert r.status_code == 200, r.text
    first = r.json()
    rest, _ = await _stream(c, D.url, rid, first)
    return [first["token_id"], *rest]


def test_served_greedy_equals_offline(stack, greedy20):
    P, decoders = stack
    prompts, ref = greedy20

    async def all_runs():  # every worker, both modes, all prompts at once
        async with httpx.AsyncClient(headers=HEADERS, timeout=600) as c:
            jobs = []
            for D in decoders:
                jobs += [_request(c, P, D, f"{D.port}-pd-{i}", p, SAMPLING)
                         for i, p in enumerate(prompts)]
                jobs += [_monolithic(c, D, f"{D.port}-mono-{i}", p)
                         for i, p in enumerate(prompts)]
            got = await asyncio.gather(*jobs)
            n, out = len(prompts), {}
            for j, D in enumerate(decoders):
                part = got[2 * n * j : 2 * n * (j + 1)]
                out[D] = ([g[0] for g in part[:n]], part[n:])
            return out

    results = asyncio.run(all_runs())
    for D, (pd, mono) in results.items():
        for i, r in enumerate(ref):
            assert pd[i] == r, f"{D.log.stem} 1P+1D prompt {i}: {pd[i]} != {r}"
            assert mono[i] == r, f"{D.log.stem} monolithic prompt {i}: {mono[i]} != {r}"
        proposed = _metric(D.url, "k3serve:spec_proposed_tokens_total")
        accepted = _metric(D.url, "k3serve:spec_accepted_tokens_total")
        assert proposed > 0 and 0 <= accepted <= proposed
        rate = _metric(D.url, "k3serve:spec_acceptance_rate")
        assert rate == pytest.approx(accepted / proposed)
        assert _metric(D.url, "k3serve:spec_mean_accepted_length") >= 1.0
    _router_totals_match_workers(decoders)


def _router_totals_match_workers(decoders) -> None:
    """The load report each decode worker answers the router's poll with
    (``GET /internal/cache_events``) carries its ``/metrics`` spec counters; the router's
    totals over those reports are their sums."""
    seen = []
    for D in decoders:
        r = httpx.get(D.url + "/internal/cache_events", headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
        ev = CacheEvents.model_validate(r.json())
        assert ev.load is not None and ev.load.spec is not None
        seen.append(types.SimpleNamespace(url=D.url, reported=ev.load, reported_epoch=ev.epoch))
    totals = SpecTotals(lambda: seen).totals()
    for k in SPEC_COUNTERS:
        want = sum(_metric(D.url, f"k3serve:spec_{k}_total") for D in decoders)
        assert totals[k] == want > 0, k
    positions = sorted(k for k in totals if isinstance(k, int))
    assert positions == list(range(len(positions))) and 4 <= len(positions) <= 8
    for j in positions:
        want = sum(_metric(D.url, "k3serve:spec_accepted_tokens_per_position_total",
                           position=str(j)) for D in decoders)
        assert totals[j] == want
    assert totals[0] >= totals[positions[-1]] and sum(totals[j] for j in positions) == \
        totals["accepted_tokens"]
