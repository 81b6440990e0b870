"""Prometheus: promtool checks of deploy/prometheus, the file-SD writer, and a real Prometheus
server scraping a live stack whose recorded hit rate equals the router's counters (1 %)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from deploy.service_discovery import ScrapeTarget, TargetWriter

PROM = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: `make sysdeps` installs Debian's prometheus")


def _promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, cwd=PROM,
                          timeout=120, check=False)


@needs_promtool
@pytest.mark.parametrize("args", [
    ("check", "config", "prometheus.yml"),
    ("check", "rules", "rules/k3serve.rules.yml"),
    ("test", "rules", "rules/k3serve_test.yml"),
], ids=["check-config", "check-rules", "test-rules"])
def test_promtool(args):
    r = _promtool(*args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


@needs_promtool
def test_promtool_test_rules_can_fail(tmp_path):
    """The rule tests compare values: a wrong expectation fails them."""
    shutil.copy(PROM / "rules" / "k3serve.rules.yml", tmp_path)
    text = (PROM / "rules" / "k3serve_test.yml").read_text()
    (tmp_path / "t.yml").write_text(text.replace("value: 0.492", "value: 0.5"))
    r = subprocess.run([PROMTOOL, "test", "rules", "t.yml"], capture_output=True, text=True,
                       cwd=tmp_path, timeout=120, check=False)
    assert r.returncode != 0 and "p99_rate1m" in r.stdout + r.stderr


def test_target_writer_replaces_a_restarted_worker_and_clears(tmp_path):
    w = TargetWriter(tmp_path, "d")
    assert json.loads((tmp_path / "workers.json").read_text()) == []
    w.set(ScrapeTarget("router", "http://127.0.0.1:8000", "router"))
    w.set(ScrapeTarget("decode-0", "http://127.0.0.1:4001", "worker", "decode"))
    w.set(ScrapeTarget("decode-0", "http://127.0.0.1:4002", "worker", "decode"))  # restart
    assert json.loads((tmp_path / "workers.json").read_text()) == [
        {"targets": ["127.0.0.1:4002"],
         "labels": {"component": "worker", "k3serve_name": "decode-0",
                    "k3serve_pool": "decode", "k3serve_deployment": "d"}}]
    assert json.loads((tmp_path / "router.json").read_text())[0]["targets"] == [
        "127.0.0.1:8000"]
    w.clear()
    assert json.loads((tmp_path / "router.json").read_text()) == []
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(ValueError, match="url"):
        ScrapeTarget("x", "127.0.0.1:1", "worker")
    with pytest.raises(ValueError, match="component"):
        ScrapeTarget("x", "http://127.0.0.1:1", "gpu")


PROMPT, CACHED, PREDICTED = ("k3serve:request_prompt_tokens_total",
                             "k3serve:request_cached_tokens_total",
                             "k3serve:router_predicted_cached_tokens_total")


def _router_counters(url: str) -> dict[tuple[str, str], float]:
    """``{(metric, worker): value}`` summed over other labels, plus ``(metric, "")`` totals."""
    sums: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (PROMPT, CACHED, PREDICTED):
            worker = line.split('worker="', 1)[1].split('"', 1)[0]
            v = float(line.rsplit(" ", 1)[1])
            for key in ((name, worker), (name, "")):
                sums[key] = sums.get(key, 0.0) + v
    return sums


def _sd_urls(sd_dir) -> set[str]:
    """Every ``http://host:port`` listed in the file-SD JSON files under ``sd_dir``."""
    out = set()
    for f in Path(sd_dir).glob("*.json"):
        for group in json.loads(f.read_text()):
            out |= {f"http://{t}" for t in group["targets"]}
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None,
                    reason="prometheus missing: `make sysdeps` installs Debian's prometheus")
def test_real_prometheus_records_the_routers_hit_rate(tmp_path):
    from deploy.launcher import start_stack
    from deploy.monitoring import Prometheus, prepare_config

    # the local launcher writes the file-SD targets itself (as the Ray backend does)
    stack = start_stack(model="k3-tiny", num_prefill=2, num_decode=1, block_size=16,
                        api_key="k", extra_worker_args=["--num-pages", "256"],
                        sd_dir=str(tmp_path / "targets"))
    prom = None
    try:
        health = httpx.get(f"{stack.url}/health", params={"detail": 1}, timeout=5,
                           headers={"Authorization": "Bearer k"}).json()
        assert {w["url"] for w in health["workers"]} | {stack.url} <= _sd_urls(tmp_path / "targets")
        prom = Prometheus(prepare_config(tmp_path / "run", 1.0, tmp_path / "targets", "k"),
                          tmp_path / "data")
        # wait for every target up and the router's zero-initialised counters scraped, so the
        # rate windows start at 0 (no extrapolation difference between the series)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            up = prom.targets_up()
            if len(up) == 4 and all(up.values()) and prom.query(
                    "k3serve:request_prompt_tokens_total"):
                break
            time.sleep(0.5)
        assert len(up) == 4 and all(up.values()), up
        # shared prefixes: each prompt repeated, so the second copy hits the first's cache
        headers = {"Authorization": "Bearer k"}
        words = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "a", "cat", "watches"]
        for i in range(4):
            prompt = " ".join(words[(i + j) % len(words)] for j in range(80))
            for _ in range(2):
                r = httpx.post(f"{stack.url}/v1/completions", headers=headers, timeout=120,
                               json={"model": "k3-tiny", "prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
        want = _router_counters(stack.url)
        assert want[CACHED, ""] > 0
        # until Prometheus has scraped the final counters and evaluated the rules after that
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            got = prom.query("sum(k3serve:request_prompt_tokens_total)")
            if got and float(got[0]["value"][1]) == want[PROMPT, ""]:
                break
            time.sleep(0.5)
        time.sleep(3.0)  # a few rule evaluations (1 s interval) after that scrape
        actual = want[CACHED, ""] / want[PROMPT, ""]
        predicted = want[PREDICTED, ""] / want[PROMPT, ""]
        rec = prom.query("k3serve:cache_hit_ratio:rate5m")
        assert rec, "recording rule produced no series"
        rec_actual = float(rec[0]["value"][1])
        assert rec_actual == pytest.approx(actual, rel=0.01)
        rec = prom.query("k3serve:predicted_hit_ratio:rate5m")
        assert float(rec[0]["value"][1]) == pytest.approx(predicted, rel=0.01)
        # per worker: every prefill worker that took prompts, against its own counters
        served = {w for (m, w), v in want.items() if m == PROMPT and w and v > 0}
        per_worker = {s["metric"]["worker"]: float(s["value"][1])
                      for s in prom.query("k3serve:cache_hit_ratio:worker_rate5m")}
        assert served and served <= set(per_worker)
        for w in served:
            assert per_worker[w] == pytest.approx(want[CACHED, w] / want[PROMPT, w], rel=0.01)
        print(f"hit rate: router counters {actual:.4f}, recorded {rec_actual:.4f} "
              f"(predicted {predicted:.4f}); per worker {per_worker}")
    finally:
        if prom is not None:
            prom.stop()
        stack.stop()
