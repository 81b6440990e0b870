"""Cluster totals of the decode workers' speculative-decoding counters on the router's
``/metrics``.

Each worker reports its counters since it started (:class:`~k3serve.messages.SpecCounters`,
``WorkerLoad.spec``) with the cache events the router polls (router/index_sync.py), the same
load report the router balances on. At scrape time :class:`SpecTotals` sums the latest report
of every worker it has seen::

    k3serve:spec_verify_steps_total                          verify forwards
    k3serve:spec_verify_rows_total                           sequence-steps verified
    k3serve:spec_proposed_tokens_total                       proposals verified
    k3serve:spec_accepted_tokens_total                       proposals accepted
    k3serve:spec_emitted_tokens_total                        tokens verify steps appended
    k3serve:spec_accepted_tokens_per_position_total{position}  rows accepting position j

(the workers' own ``k3serve:spec_*`` names, without the ``worker`` / ``role`` labels). The
acceptance rate and mean accepted length come from the counters, as with vLLM's
``vllm:spec_decode_*``::

    rate(k3serve:spec_accepted_tokens_total[5m]) / rate(k3serve:spec_proposed_tokens_total[5m])
    rate(k3serve:spec_emitted_tokens_total[5m]) / rate(k3serve:spec_verify_rows_total[5m])

The totals never go down: a worker that restarted (another event epoch) starts from zero, so
its previous counters are kept aside and added; a worker that left keeps its last counters in
the sum. What a worker counted after its last report before it died is not in the sum. Every
router replica polls every worker, so each answers the same totals (its own view, not summed
over replicas). Nothing is exposed until a worker reported speculative counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, Metric

from k3serve.messages import SpecCounters, WorkerLoad

SPEC_COUNTERS = ("verify_steps", "verify_rows", "proposed_tokens", "accepted_tokens",
                 "emitted_tokens")
"""The summed :class:`SpecCounters` fields, each exposed as ``k3serve:spec_<field>_total``."""

_DOCS = {
    "verify_steps": "Speculative verify forwards, all decode workers.",
    "verify_rows": "Sequence-steps verified speculatively, all decode workers.",
    "proposed_tokens": "Speculative tokens proposed (and verified), all decode workers.",
    "accepted_tokens": "Speculative tokens the target accepted, all decode workers.",
    "emitted_tokens": "Tokens speculative verify steps appended, all decode workers.",
}


class ReportingWorker(Protocol):
    """What :class:`SpecTotals` reads of a worker (``router.workers.Worker``)."""

    url: str
    reported: WorkerLoad | None
    reported_epoch: str | None


def _flat(c: SpecCounters) -> dict[str | int, int]:
    """A report's counters by field name, and per position by the position (an int)."""
    out: dict[str | int, int] = {k: getattr(c, k) for k in SPEC_COUNTERS}
    out.update(enumerate(c.accepted_per_position))
    return out


@dataclass
class _Seen:
    """One worker's latest counters (of event epoch ``epoch``) and those of its earlier
    lives (``retired``)."""

    epoch: str | None
    last: dict[str | int, int]
    retired: dict[str | int, int] = field(default_factory=dict)


class SpecTotals:
    """Prometheus collector of the cluster's speculative-decoding totals.

    Args:
        workers: the registered workers now (called at every scrape).
    """

    def __init__(self, workers: Callable[[], Iterable[ReportingWorker]]) -> None:
        self._workers = workers
        self._seen: dict[str, _Seen] = {}

    def update(self) -> None:
        """Fold the workers' latest reports in: a new event epoch retires the previous
        counters; within one epoch a counter that went down (an older answer) is ignored."""
        for w in list(self._workers()):
            load = w.reported
            if load is None or load.spec is None:
                continue
            now = _flat(load.spec)
            s = self._seen.get(w.url)
            if s is None:
                self._seen[w.url] = _Seen(w.reported_epoch, now)
            elif s.epoch != w.reported_epoch:
                for k, v in s.last.items():
                    s.retired[k] = s.retired.get(k, 0) + v
                s.epoch, s.last = w.reported_epoch, now
            else:
                s.last = {k: max(s.last.get(k, 0), now.get(k, 0)) for k in s.last.keys() | now}

    def totals(self) -> dict[str | int, int]:
        """The sums after :meth:`update`: by :data:`SPEC_COUNTERS` name, and accepted rows by
        position (int keys). Empty while no worker reported speculative counters."""
        self.update()
        out: dict[str | int, int] = {}
        for s in self._seen.values():
            for part in (s.retired, s.last):
                for k, v in part.items():
                    out[k] = out.get(k, 0) + v
        return out

    def collect(self) -> Iterator[Metric]:
        t = self.totals()
        if not t:
            return
        for k in SPEC_COUNTERS:
            yield CounterMetricFamily(f"k3serve:spec_{k}", _DOCS[k], value=t.get(k, 0))
        pos = CounterMetricFamily(
            "k3serve:spec_accepted_tokens_per_position",
            "Verified rows whose proposal at this position (0-based) was accepted, all "
            "decode workers.", labels=["position"])
        for j in sorted(k for k in t if isinstance(k, int)):
            pos.add_metric([str(j)], t[j])
        yield pos


__all__ = ["SPEC_COUNTERS", "ReportingWorker", "SpecTotals"]
