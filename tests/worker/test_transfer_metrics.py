"""The in-stack transfer figures of a prefill worker: each request's seconds from its last
layer ready to its last write confirmed (``PrefillState.write_tail_s``) and the counters
they feed (``WorkerMetrics.transfer``)."""

from __future__ import annotations

from types import SimpleNamespace

from prefill.state import PrefillState
from worker.metrics import WorkerMetrics


def _state(sender_at: float, first_at: float, stats: dict) -> PrefillState:
    r = PrefillState("r", [1, 2], None, "t", "a", None)  # type: ignore[arg-type]
    r.sender = SimpleNamespace(stats=stats)  # type: ignore[assignment]
    r.sender_at, r.first_at = sender_at, first_at
    return r


def test_write_tail() -> None:
    # sender made at 10.0, writes confirmed 0.5 s later; token #1 sampled at 10.2
    assert abs(_state(10.0, 10.2, {"t_written": 0.5}).write_tail_s() - 0.3) < 1e-9
    # the writes ended before the last layer: nothing was waited for
    assert _state(10.0, 10.6, {"t_written": 0.5}).write_tail_s() == 0.0
    assert _state(10.0, 10.2, {}).write_tail_s() is None  # not written yet
    assert _state(10.0, 0.0, {"t_written": 0.5}).write_tail_s() is None  # not sampled yet


def test_counters() -> None:
    m = WorkerMetrics("p0", "prefill")
    m.transfer(True, 1000, 0.9, 0.25)
    m.transfer(True, 500, 0.9, None)  # no tail known: bytes counted, not in the rate
    m.transfer(False, 300, None, 0.1)  # failed: not in the rate
    body = m.render()[0].decode()

    def val(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name + "{"))

    assert val("k3serve:kv_transfer_bytes_total") == 1800
    assert val("k3serve:kv_transfer_write_bytes_total") == 1000
    assert val("k3serve:kv_transfer_write_seconds_total") == 0.25
