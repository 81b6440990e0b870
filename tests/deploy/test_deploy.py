"""deploy/: the Grafana dashboard and the Prometheus config reference metrics that really exist
(exposed by the router or the workers, or recorded by deploy/prometheus/rules)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from router.metrics import RouterMetrics
from worker.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "k3serve.json"
NAME = re.compile(r"k3serve:[a-z0-9_:]+[a-z0-9_]")


def _exposed() -> set[str]:
    text = RouterMetrics().render()[0].decode()
    text += WorkerMetrics("w0", "prefill").render()[0].decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _recorded() -> dict[str, str]:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "rules" / "k3serve.rules.yml").read_text())
    return {r["record"]: r["expr"] for g in doc["groups"] for r in g["rules"]}


def _panels() -> list[dict]:
    dash = json.loads(DASHBOARD.read_text())
    return [p for p in dash["panels"] if p["type"] != "row"]


def _exposed_or_histogram(m: str, exposed: set[str]) -> bool:
    # histogram series (_bucket/_sum/_count) appear once a labelled child observed a value;
    # the family's TYPE line is there from the start
    return m in exposed or re.sub(r"_(bucket|sum|count)$", "", m) in exposed


def test_dashboard_first_row_is_the_cache_hit_rate_actual_vs_predicted_by_worker():
    dash = json.loads(DASHBOARD.read_text())
    rows = sorted((p for p in dash["panels"] if p["type"] == "row"),
                  key=lambda p: p["gridPos"]["y"])
    assert [r["title"] for r in rows] == ["Cache hit rate", "Latency", "Throughput and queues",
                                          "Transfers", "Store and cache"]
    first = min(_panels(), key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    exprs = [t["expr"] for t in first["targets"]]
    assert exprs[:2] == ["k3serve:cache_hit_ratio:worker_rate1m",
                         "k3serve:predicted_hit_ratio:worker_rate1m"]
    assert "sum by (worker)" in _recorded()[exprs[0]]


def test_every_dashboard_metric_is_exposed_or_recorded():
    used = {m for p in _panels() for t in p["targets"] for m in NAME.findall(t["expr"])}
    assert len(used) >= 20
    exposed, recorded = _exposed(), _recorded()
    missing = sorted(m for m in used if m not in recorded and not _exposed_or_histogram(m, exposed))
    assert not missing, f"dashboard uses metrics nobody exposes or records: {missing}"
    # and every recording rule reads exposed metrics only
    for name, expr in recorded.items():
        bad = [m for m in NAME.findall(expr) if not _exposed_or_histogram(m, exposed)]
        assert not bad, f"rule {name} reads {bad}"


@pytest.mark.parametrize("job,file", [("k3serve-router", "targets/router*.json"),
                                      ("k3serve-workers", "targets/workers*.json")])
def test_prometheus_config_scrapes_router_and_workers_through_file_sd(job, file):
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs[job]["metrics_path"] == "/metrics"
    assert jobs[job]["file_sd_configs"][0]["files"] == [file]
    assert cfg["rule_files"] == ["rules/*.rules.yml"]


def test_grafana_provisioning_points_at_the_dashboard_folder():
    prov = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "k3serve.yml").read_text())
    folder = DEPLOY.parent / prov["providers"][0]["options"]["path"]
    assert (folder / "k3serve.json").exists()
    ds = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "k3serve.yml").read_text())
    uids = {p["datasource"]["uid"] for p in _panels()}
    assert uids == {ds["datasources"][0]["uid"]}
