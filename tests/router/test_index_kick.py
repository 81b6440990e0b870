"""A prefill's answer pulls that worker's cache events at once (``WorkerPool.kick``).

With the poll loop slowed to a minute, only the pull that the answer triggers can put the first
request's blocks into the router's index before the second, identical request is placed: the
second request's predicted cached tokens must equal the worker's actual reuse, and be > 0.
"""

from __future__ import annotations

from tests.router_fakes import MODEL, Stack


def _sums(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(name))


def test_prefill_answer_pulls_the_workers_events_before_the_next_request():
    stack = Stack(num_prefill=2, num_decode=1, poll_interval_s=60.0)
    try:
        prompt = "kick the index " * 12
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        m0 = stack.metrics()
        stack.wait_indexed(snapshots=1)  # only the kick's pull can bring it within 60 s
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        m1 = stack.metrics()
        cached = (_sums(m1, "k3serve:request_cached_tokens_total")
                  - _sums(m0, "k3serve:request_cached_tokens_total"))
        pred = (_sums(m1, "k3serve:router_predicted_cached_tokens_total")
                - _sums(m0, "k3serve:router_predicted_cached_tokens_total"))
        assert cached > 0
        assert pred == cached
    finally:
        stack.close()
