"""The router's ``/metrics`` sums the decode workers' speculative-decoding counters from their
load reports (``WorkerLoad.spec``): cluster totals that never go down through a worker's
restart or removal, an older report ignored, nothing exposed before a worker speculates."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from deploy.fake_workers import FINGERPRINT, MODEL
from k3serve.messages import Capacity, SpecCounters, WorkerInfo, WorkerLoad
from router.config import RouterConfig
from router.pipeline import Router
from router.workers import Worker


def scrape_spec(body: bytes) -> dict[str, float]:
    """``k3serve:spec_*`` samples of a ``/metrics`` body, ``name{position=j}`` where labelled."""
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            if s.name.startswith("k3serve:spec_"):
                lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[s.name + (f"{{{lab}}}" if lab else "")] = s.value
    return out


def _spec(steps, rows, prop, acc, emit, per_pos) -> WorkerLoad:
    return WorkerLoad(spec=SpecCounters(verify_steps=steps, verify_rows=rows,
                                        proposed_tokens=prop, accepted_tokens=acc,
                                        emitted_tokens=emit, accepted_per_position=per_pos))


def _router() -> Router:
    r = Router(RouterConfig(model=MODEL))
    for url in ("http://d0", "http://d1", "http://d2"):
        r.pool.workers[url] = Worker(url, WorkerInfo(
            role="decode", model=MODEL, fingerprint=FINGERPRINT, block_size=16,
            capacity=Capacity(num_pages=64, num_slots=8, num_snapshots=8)))
        r.pool.index.add_worker(url)
    return r


def test_router_sums_the_workers_spec_counters():
    router = _router()
    try:
        w = router.pool.workers
        assert scrape_spec(router.metrics.render()[0]) == {}  # nobody speculates yet
        w["http://d2"].report(WorkerLoad(running=1), "e2", 1)  # a worker that does not
        assert scrape_spec(router.metrics.render()[0]) == {}
        w["http://d0"].report(_spec(10, 20, 80, 60, 75, [18, 15, 14, 13]), "e0", 5)
        w["http://d1"].report(_spec(4, 4, 4, 1, 5, [1]), "e1", 3)
        got = scrape_spec(router.metrics.render()[0])
        assert got == {
            "k3serve:spec_verify_steps_total": 14, "k3serve:spec_verify_rows_total": 24,
            "k3serve:spec_proposed_tokens_total": 84, "k3serve:spec_accepted_tokens_total": 61,
            "k3serve:spec_emitted_tokens_total": 80,
            "k3serve:spec_accepted_tokens_per_position_total{position=0}": 19,
            "k3serve:spec_accepted_tokens_per_position_total{position=1}": 15,
            "k3serve:spec_accepted_tokens_per_position_total{position=2}": 14,
            "k3serve:spec_accepted_tokens_per_position_total{position=3}": 13,
        }
        body = router.metrics.render()[0].decode()
        assert "# TYPE k3serve:spec_proposed_tokens_total counter" in body
        assert 'worker="' not in "".join(ln for ln in body.splitlines() if "spec_" in ln)
        # an older answer of the same epoch (its seq below the applied one's) changes nothing
        w["http://d0"].report(_spec(9, 18, 70, 50, 66, [16, 14, 12, 8]), "e0", 4)
        assert scrape_spec(router.metrics.render()[0]) == got
        # d1 restarts (a new epoch, counters from 0): its earlier counters stay in the sum
        w["http://d1"].report(_spec(2, 2, 2, 2, 4, [2]), "e1b", 1)
        after = scrape_spec(router.metrics.render()[0])
        assert after["k3serve:spec_proposed_tokens_total"] == 86
        assert after["k3serve:spec_accepted_tokens_total"] == 63
        assert after["k3serve:spec_accepted_tokens_per_position_total{position=0}"] == 21
        # d0 leaves the cluster: the totals do not go down
        router.registry.remove("http://d0")
        assert scrape_spec(router.metrics.render()[0]) == after
        # rate and mean accepted length follow from the counters
        assert after["k3serve:spec_accepted_tokens_total"] / \
            after["k3serve:spec_proposed_tokens_total"] == 63 / 86
    finally:
        asyncio.run(router.close())


def test_spec_counters_validate():
    assert WorkerLoad().spec is None
    with pytest.raises(ValidationError):
        SpecCounters(proposed_tokens=-1)
    with pytest.raises(ValidationError):
        SpecCounters(accepted_per_position=[1, -2])
    c = SpecCounters.model_validate({"verify_steps": 3, "accepted_per_position": [2, 1]})
    assert WorkerLoad.model_validate({"spec": c.model_dump()}).spec == c
