"""``benchmarks/router_relay.py --interleave``: every tree's router up at once on the same fake
workers, rounds interleaved, per-round ratios to the first tree (one small run; the figures are
measured, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_interleaved_run_writes_every_tree_s_rounds_and_ratios(tmp_path):
    out = tmp_path / "relay.json"
    r = subprocess.run([sys.executable, "benchmarks/router_relay.py", "--interleave",
                        "--src", f"{ROOT},{ROOT}", "--rounds", "2", "--requests", "4",
                        "--concurrency", "2", "--tokens", "6", "--token-delay", "0.002",
                        "--idle-s", "0.5", "--json", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=180, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert {k: d[k] for k in ("requests", "concurrency", "tokens", "events", "token_delay_s",
                              "rounds")} == {"requests": 4, "concurrency": 2, "tokens": 6,
                                             "events": "each", "token_delay_s": 0.002,
                                             "rounds": 2}
    first, second = d["interleaved"]
    assert first["src"] == second["src"] == str(ROOT)
    for t in (first, second):
        assert len(t["rounds"]) == 2
        for rnd in t["rounds"]:
            assert rnd["tokens"] == 6  # every request streamed all its tokens
            assert 1 <= rnd["chunks"] <= 6 + 2  # a chunk per token at most, + role and usage
        assert len(t["ratio_us_per_token"]["rounds"]) == 2
    # ratios are to the first tree, round by round
    # (None where the first tree's round measured no CPU: below the clock's tick)
    assert first["ratio_us_per_token"]["rounds"] == [
        1.0 if b["us_per_token"] > 0 else None for b in first["rounds"]]
    assert second["ratio_us_per_token"]["rounds"] == [
        a["us_per_token"] / b["us_per_token"] if b["us_per_token"] > 0 else None
        for a, b in zip(second["rounds"], first["rounds"])]
    # the printed table names both trees with their medians
    assert r.stdout.count(f"| {ROOT.name} | ") == 2
    assert f"{second['us_per_token']:.1f} µs" in r.stdout


def test_bad_arguments_are_refused_in_one_line_before_anything_starts():
    for args, line in ((["--rounds", "0"], "--rounds: must be ≥ 1, got 0"),
                       (["--requests", "0"], "--requests: must be ≥ 1, got 0"),
                       (["--tokens", "1"], "--tokens: must be ≥ 2, got 1"),
                       (["--token-delay", "nan"],
                        "--token-delay: must be a finite number ≥ 0, got nan"),
                       (["--idle-s", "-1"], "--idle-s: must be a finite number ≥ 0, got -1.0"),
                       (["--src", "/nonexistent"],
                        "--src: '/nonexistent' is not a k3serve source tree (no router/ folder)")):
        r = subprocess.run([sys.executable, "benchmarks/router_relay.py", "--interleave", *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
            f"router_relay.py: error: {line}"), (args, r.stderr)
