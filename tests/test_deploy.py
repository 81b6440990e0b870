"""deploy/: the Grafana dashboard and Prometheus config reference metrics that really exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from router.metrics import RouterMetrics
from worker.metrics import WorkerMetrics

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
NAME = re.compile(r"k3serve:[a-z0-9_]+")


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


def test_dashboard_first_panel_is_the_cache_hit_rate():
    dash = json.loads((DEPLOY / "grafana" / "k3serve-dashboard.json").read_text())
    first = min(dash["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    assert [t["expr"] for t in first["targets"]] == ["k3serve:cache_hit_rate"]


def test_every_dashboard_metric_is_exposed():
    dash = json.loads((DEPLOY / "grafana" / "k3serve-dashboard.json").read_text())
    used = {m for p in dash["panels"] for t in p["targets"] for m in NAME.findall(t["expr"])}
    assert len(used) >= 12
    exposed = _exposed()
    # histogram series (_bucket/_sum/_count) appear once a labelled child observed a value;
    # the family's TYPE line is there from the start
    base = {m: re.sub(r"_(bucket|sum|count)$", "", m) for m in used}
    missing = sorted(m for m in used if m not in exposed and base[m] not in exposed)
    assert not missing, f"dashboard uses metrics nobody exposes: {missing}"


@pytest.mark.parametrize("job", ["k3serve-router", "k3serve-workers"])
def test_prometheus_config_scrapes_router_and_workers(job):
    text = (DEPLOY / "prometheus.yml").read_text()
    assert f"job_name: {job}" in text and "metrics_path: /metrics" in text
