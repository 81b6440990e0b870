"""Fuzz the router's public API from its own OpenAPI schema with ``schemathesis``.

:func:`fuzz` draws cases for ``/v1/*`` and ``/health`` — positive (valid by the schema) and
negative — from ``schemathesis`` strategies inside one Hypothesis run, caps the generation
sizes (``max_tokens``, ``n``, batch length) so a case costs milliseconds against fake
workers, sends each to a live router and tallies the answers. Used by
``tests/router/test_fuzz_api.py`` (CI, ≥ 300 cases) and ``benchmarks/fuzz_api.py`` (≥ 1 000).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as seed_
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

#: (path, method) of the public operations fuzzed.
OPERATIONS = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"),
              ("/v1/models", "GET"), ("/v1/models/{model_id}", "GET"), ("/health", "GET")]
#: Caps on generation sizes (a case must stay cheap).
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "top_logprobs": 2}


@dataclass
class FuzzStats:
    """Tally of one :func:`fuzz` run: ``codes[(label, mode)][status]`` and the 5xx cases."""

    codes: dict[tuple[str, str], Counter] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    rejected_valid: Counter = field(default_factory=Counter)  # 4xx codes of positive cases
    call_s: float = 0.0  # seconds spent in the HTTP calls (the rest: generating cases)
    slowest: list[tuple[float, int, str, str]] = field(default_factory=list)

    @property
    def cases(self) -> int:
        return sum(sum(c.values()) for c in self.codes.values())

    def count(self, mode: str, status: int | None = None, prefix: str = "") -> int:
        return sum(n for (label, m), c in self.codes.items()
                   if m == mode and label.split(" ", 1)[1].startswith(prefix)
                   for s, n in c.items() if status is None or s == status)

    def table(self) -> str:
        rows = [f"{'operation':32s} {'mode':9s} statuses"]
        for (label, mode), c in sorted(self.codes.items()):
            rows.append(f"{label:32s} {mode:9s} " +
                        " ".join(f"{s}:{n}" for s, n in sorted(c.items())))
        return "\n".join(rows)


def _cap(body: Any) -> Any:
    if isinstance(body, dict):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = CAPS["max_tokens"]  # the default would run to max_model_len
        for k, cap in CAPS.items():
            v = body.get(k)
            if isinstance(v, int | float) and not isinstance(v, bool) and v > cap:
                body[k] = cap
        p = body.get("prompt")
        if isinstance(p, list) and len(p) > 4 and not all(isinstance(x, int) for x in p):
            body["prompt"] = p[:4]
    return body


def fuzz(url: str, openapi: dict[str, Any], cases: int, seed: int = 0,
         timeout_s: float = 30.0) -> FuzzStats:
    """Send about ``cases`` generated cases to the router at ``url``.

    Args:
        url: The router's base URL.
        openapi: Its OpenAPI schema (``app.openapi()``).
        cases: Hypothesis examples to run (one HTTP call each).
        seed: Hypothesis seed (runs are reproducible).
        timeout_s: Timeout of one call, seconds.

    Returns:
        The tally; ``server_errors`` lists every answer ≥ 500 (as curl commands).
    """
    schema = schemathesis.openapi.from_dict(openapi)
    strategies = []
    for path, method in OPERATIONS:
        op = schema[path][method]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(op.as_strategy(generation_mode=mode).map(
                lambda c, m=mode.value: (m, c)))
    stats = FuzzStats()

    @seed_(seed)
    @settings(max_examples=cases, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(strategies))
    def run(drawn: tuple[str, Any]) -> None:
        mode, case = drawn
        if isinstance(case.body, dict):
            case.body = _cap(case.body)
        t0 = time.perf_counter()
        try:
            r = case.call(base_url=url, timeout=timeout_s)
            status = r.status_code
        except Exception as e:  # noqa: BLE001 - a dropped connection is a server failure
            status = 599
            stats.server_errors.append(f"{case.as_curl_command(base_url=url)}  -> {e!r}")
        else:
            if mode == "positive" and 400 <= status < 500:
                try:
                    err = r.json()["error"]
                    why = f"{err.get('code')} {err.get('param')} {err.get('message')[:90]}"
                except (ValueError, KeyError, TypeError):
                    why = "?"
                stats.rejected_valid[f"{case.operation.label} {status} {why}"] += 1
            if status >= 500:
                stats.server_errors.append(
                    f"{case.as_curl_command(base_url=url)}  -> {status} {r.text[:200]}")
        dt = time.perf_counter() - t0
        stats.call_s += dt
        stats.slowest.append((dt, status, case.operation.label, str(case.body)[:300]))
        stats.slowest.sort(reverse=True)
        del stats.slowest[5:]
        stats.codes.setdefault((case.operation.label, mode), Counter())[status] += 1

    run()
    return stats
