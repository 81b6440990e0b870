"""``benchmarks/relay_floor.py --json PATH`` writes the figures it prints (one small run: one
relay, 2 streams of 4 tokens; the figures are measured, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_relay_floor_writes_its_figures_as_json(tmp_path):
    out = tmp_path / "sub" / "relay_floor.json"
    r = subprocess.run([sys.executable, "benchmarks/relay_floor.py", "--relays", "raw",
                        "--requests", "2", "--concurrency", "2", "--tokens", "4", "--rounds",
                        "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert {k: d[k] for k in ("benchmark", "requests", "concurrency", "tokens", "rounds")} == {
        "benchmark": "relay_floor", "requests": 2, "concurrency": 2, "tokens": 4, "rounds": 1}
    [row] = d["relays"]
    assert row["relay"] == "raw" and set(row) == {"relay", "ms_per_stream", "us_per_token",
                                                  "chunks"}
    assert set(d["units"]) == {"ms_per_stream", "us_per_token", "chunks"}
    # the printed table carries the same figures
    assert f"| raw | {row['ms_per_stream']:.2f} ms | {row['us_per_token']:.1f} µs |" in r.stdout
