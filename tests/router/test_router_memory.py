"""The router's memory after large bodies (router/memory.py): a router process (``python -m
router``, fake workers) given 12 bodies of 2.4–3.7 MiB — valid ones served 200 (JSON padded
with whitespace), valid JSON whose prompts pass the model length (400), chat requests of many
long messages (400) — and one past ``--max-body-bytes`` (413, nothing read), comes back to
within 20 MiB of its RSS before them, and never passes it by more than 64 MiB meanwhile.

A resource bound, not a speed figure: without the trim the RSS stayed at +48 MiB."""

from __future__ import annotations

import json
import time

import httpx
from test_replicas import ReplicaStack

from deploy.fake_workers import MODEL

MiB = 1 << 20
AFTER_BOUND = 20 * MiB
PEAK_BOUND = 64 * MiB


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _bodies(k: int) -> tuple[str, bytes, int]:
    """(path, body, expected status) of the k-th large body."""
    word = "lorem ipsum dolor "
    kind = k % 3
    if kind == 0:  # valid and served: 4 short prompts, the JSON padded to 3 MiB
        body = json.dumps({"model": MODEL, "prompt": [f"pad {k} {j}" for j in range(4)],
                           "max_tokens": 2}) + " " * (3 * MiB)
        return "/v1/completions", body.encode(), 200
    if kind == 1:  # one 3.7 MiB prompt: past the model length
        body = json.dumps({"model": MODEL, "prompt": word * 210_000, "max_tokens": 1})
        return "/v1/completions", body.encode(), 400
    body = json.dumps({"model": MODEL, "max_tokens": 1,  # 200 long messages, 2.4 MiB
                       "messages": [{"role": "user", "content": word * 700}] * 200})
    return "/v1/chat/completions", body.encode(), 400


def test_the_router_s_rss_comes_back_after_large_bodies():
    s = ReplicaStack(1)
    try:
        pid = s.proc.pid
        with httpx.Client(timeout=120) as c:
            for i in range(3):
                r = c.post(s.url + "/v1/completions", json={
                    "model": MODEL, "prompt": f"warm {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
            time.sleep(1.5)
            base = _rss(pid)
            peak = base
            headers = {"content-type": "application/json"}
            for k in range(12):
                path, body, want = _bodies(k)
                r = c.post(s.url + path, content=body, headers=headers)
                assert r.status_code == want, (k, r.status_code, r.text[:200])
                peak = max(peak, _rss(pid))
            r = c.post(s.url + "/v1/completions", content=b" " * (5 * MiB), headers=headers)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
            time.sleep(2.5)  # the trimmer runs every second once a large body was read
            after = _rss(pid)
        print(f"router RSS: {base / MiB:.1f} MiB before, peak {peak / MiB:.1f}, "
              f"{after / MiB:.1f} after 12 bodies of 2.4-3.7 MiB")
        assert after - base <= AFTER_BOUND, (base / MiB, after / MiB)
        assert peak - base <= PEAK_BOUND, (base / MiB, peak / MiB)
    finally:
        s.close()
