"""Prometheus (and Grafana where installed) against a running k3serve stack; the hit-rate figure.

``python -m deploy.monitoring up --router-url URL`` (``make dashboards``): writes the file-SD
targets of the router and of every worker the router lists (``GET /health?detail=1``) unless a
launcher already writes them, copies ``deploy/prometheus`` into a run folder with the chosen
intervals, starts ``prometheus`` on 127.0.0.1 and, when ``grafana-server`` is installed, Grafana
with the provisioned dashboard (``deploy/grafana``). Runs until Ctrl-C.

``python -m deploy.monitoring figure --prometheus URL --minutes M --out docs/hit_rate.png``:
the dashboard's first panel (actual vs router-predicted hit rate by worker, and overall) over
the last M minutes, from Prometheus' ``query_range``, plotted with matplotlib.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from deploy.service_discovery import ScrapeTarget, TargetWriter
from k3serve.protocol import API_KEY_ENV

DEPLOY = Path(__file__).resolve().parent
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
# The hit-rate panel's queries (deploy/grafana/dashboards/k3serve.json, first row).
HIT_RATE_QUERIES = {
    "actual {worker}": "k3serve:cache_hit_ratio:worker_rate1m",
    "predicted {worker}": "k3serve:predicted_hit_ratio:worker_rate1m",
    "actual, all workers": "k3serve:cache_hit_ratio:rate1m",
    "predicted, all workers": "k3serve:predicted_hit_ratio:rate1m",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def write_targets_from_router(router_url: str, writer: TargetWriter,
                              api_key: str | None = None) -> None:
    """Make the router at ``router_url`` and the healthy workers it lists the file-SD targets.

    Raises:
        httpx.HTTPError: the router does not answer.
    """
    body = httpx.get(f"{router_url.rstrip('/')}/health", params={"detail": 1}, timeout=5.0,
                     trust_env=False, headers={"Authorization": f"Bearer {api_key}"}
                     if api_key else None).json()
    targets = [ScrapeTarget("router", router_url.rstrip("/"), "router")]
    targets += [ScrapeTarget(w["name"], w["url"], "worker", w["role"])
                for w in body.get("workers", ()) if w.get("healthy")]
    writer.replace_all(targets)


def prepare_config(run_dir: str | Path, interval_s: float = 5.0,
                   sd_dir: str | Path | None = None, api_key: str | None = None) -> Path:
    """Copy ``deploy/prometheus`` into ``run_dir`` with scrape and rule intervals of
    ``interval_s`` seconds; ``sd_dir`` (default ``run_dir/targets``) holds the targets;
    ``api_key``: the router's, sent as a bearer token on its scrapes (its ``/metrics`` asks
    for it when it has one).

    Returns:
        The path of the copied ``prometheus.yml``.
    """
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    shutil.copytree(PROMETHEUS_DIR / "rules", run / "rules", dirs_exist_ok=True)
    cfg = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    iv = f"{interval_s:g}s"
    cfg["global"] = {"scrape_interval": iv, "evaluation_interval": iv}
    sd = Path(sd_dir) if sd_dir is not None else run / "targets"
    for job in cfg["scrape_configs"]:
        for fsd in job["file_sd_configs"]:
            fsd["files"] = [str(sd / Path(f).name) for f in fsd["files"]]
            fsd["refresh_interval"] = iv
        if api_key and job["job_name"] == "k3serve-router":
            job["authorization"] = {"type": "Bearer", "credentials": api_key}
    out = run / "prometheus.yml"
    out.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out


class Prometheus:
    """A ``prometheus`` server process on 127.0.0.1 (``stop()`` ends it).

    Raises:
        FileNotFoundError: no ``prometheus`` binary (Debian package ``prometheus``).
        RuntimeError: it exited or did not become ready within ``timeout`` seconds.
    """

    def __init__(self, config: str | Path, data_dir: str | Path, port: int = 0,
                 timeout: float = 60.0) -> None:
        exe = shutil.which("prometheus")
        if exe is None:
            raise FileNotFoundError("prometheus: not installed (apt-get install prometheus)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [exe, f"--config.file={config}", f"--storage.tsdb.path={data_dir}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn",
             "--storage.tsdb.retention.time=1d"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1.0,
                             trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout:.0f} s")

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query: the ``result`` list of ``/api/v1/query``."""
        params = {"query": expr, **({"time": f"{at:.3f}"} if at is not None else {})}
        r = httpx.get(f"{self.url}/api/v1/query", params=params, timeout=10.0,
                      trust_env=False)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def targets_up(self) -> dict[str, bool]:
        r = httpx.get(f"{self.url}/api/v1/targets", timeout=5.0, trust_env=False).json()
        return {t["scrapeUrl"]: t["health"] == "up" for t in r["data"]["activeTargets"]}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def query_range(prom_url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    """``/api/v1/query_range`` result list (``values``: ``[[t, "v"], …]``)."""
    r = httpx.get(f"{prom_url}/api/v1/query_range", timeout=30.0, trust_env=False,
                  params={"query": expr, "start": start, "end": end, "step": step})
    r.raise_for_status()
    return r.json()["data"]["result"]


def plot_hit_rate(prom_url: str, start: float, end: float, out: str | Path,
                  step: float = 5.0) -> Path:
    """Plot the hit-rate panel's queries over ``[start, end]`` (unix seconds) to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.2), dpi=110)
    colors: dict[str, str] = {}
    palette = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4)
    for label, expr in HIT_RATE_QUERIES.items():
        for series in query_range(prom_url, expr, start, end, step):
            t = [(float(x) - start) / 60 for x, _ in series["values"]]
            v = [100 * float(y) for _, y in series["values"]]
            worker = series["metric"].get("worker", "")
            overall = "all workers" in label
            color = "black" if overall else colors.setdefault(worker, next(palette))
            predicted = label.startswith("predicted")
            ax.plot(t, v, label=label.format(worker=worker), color=color,
                    lw=(2.6 if overall else 1.6) if not predicted else 1.2,
                    ls=":" if predicted else "-", alpha=0.6 if overall and not predicted else 1)
    ax.set_xlabel("minutes into the run")
    ax.set_ylabel("prompt tokens reused (%)")
    ax.set_ylim(0, 100)
    ax.set_title("k3serve: cache hit rate, actual vs router-predicted (1 m rate)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _start_grafana(run: Path, prom_url: str, port: int) -> subprocess.Popen | None:
    exe = shutil.which("grafana-server") or shutil.which("grafana")
    if exe is None:
        return None
    prov = run / "provisioning"
    shutil.copytree(GRAFANA_DIR / "provisioning", prov, dirs_exist_ok=True)
    ds = prov / "datasources" / "k3serve.yml"
    ds.write_text(ds.read_text().replace("http://127.0.0.1:9090", prom_url))
    dash = prov / "dashboards" / "k3serve.yml"
    dash.write_text(dash.read_text().replace("deploy/grafana/dashboards",
                                             str(GRAFANA_DIR / "dashboards")))
    args = ([exe, "server"] if exe.endswith("grafana") else [exe]) + [
        "--homepath", "/usr/share/grafana",
        f"cfg:paths.provisioning={prov}", f"cfg:paths.data={run / 'grafana-data'}",
        "cfg:server.http_addr=127.0.0.1", f"cfg:server.http_port={port}"]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m deploy.monitoring", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start Prometheus (+ Grafana) against a running stack")
    up.add_argument("--router-url", default="http://127.0.0.1:8000")
    up.add_argument("--sd-dir", default=None,
                    help="targets a launcher writes (default: discover through the router)")
    up.add_argument("--port", type=int, default=9090)
    up.add_argument("--grafana-port", type=int, default=3000)
    up.add_argument("--interval", type=float, default=5.0, help="scrape/rule interval, s")
    up.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                    help=f"the router's API key (default: ${API_KEY_ENV})")
    fg = sub.add_parser("figure", help="plot the hit-rate panel's queries to a PNG")
    fg.add_argument("--prometheus", default="http://127.0.0.1:9090")
    fg.add_argument("--minutes", type=float, default=10.0)
    fg.add_argument("--out", default="docs/hit_rate.png")
    args = ap.parse_args(argv)
    if args.cmd == "figure":
        end = time.time()
        print(plot_hit_rate(args.prometheus, end - 60 * args.minutes, end, args.out))
        return 0
    run = Path(tempfile.mkdtemp(prefix="k3serve-monitoring-"))
    try:
        return up_in(run, args)
    except httpx.HTTPError as e:
        print(f"python -m deploy.monitoring: error: the router at {args.router_url}: "
              f"{e or type(e).__name__}", file=sys.stderr, flush=True)
        return 1
    except (FileNotFoundError, RuntimeError) as e:  # no prometheus; it exited or never got ready
        why = " ".join(str(e).split())[:500]
        print(f"python -m deploy.monitoring: error: {why}", file=sys.stderr, flush=True)
        return 1
    finally:  # the run folder (config copy, targets, Prometheus' data) goes with the run
        shutil.rmtree(run, ignore_errors=True)


def up_in(run: Path, args: argparse.Namespace) -> int:
    """``up``: Prometheus (+ Grafana) with their files in the folder ``run``, until SIGTERM /
    SIGINT or Prometheus' exit; returns 0.

    Raises:
        httpx.HTTPError: the router did not list its workers (``--sd-dir`` not given).
        FileNotFoundError: no ``prometheus``; RuntimeError: it exited or was not ready.
    """
    sd = Path(args.sd_dir) if args.sd_dir else run / "targets"
    writer = None
    if not args.sd_dir:
        writer = TargetWriter(sd)
        write_targets_from_router(args.router_url, writer, args.api_key)
    prom = Prometheus(prepare_config(run, args.interval, sd, args.api_key), run / "data",
                      args.port)
    graf = _start_grafana(run, prom.url, args.grafana_port)
    print(f"prometheus at {prom.url} (targets in {sd})", flush=True)
    print(f"grafana at http://127.0.0.1:{args.grafana_port}" if graf else
          "grafana-server is not installed: import deploy/grafana/dashboards/k3serve.json "
          "into your Grafana", flush=True)
    stopping = False

    def _stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping and prom.proc.poll() is None:
            if writer is not None:  # follow workers that restart on new ports
                try:
                    write_targets_from_router(args.router_url, writer)
                except httpx.HTTPError:
                    pass
            time.sleep(args.interval)
    finally:
        prom.stop()
        if graf is not None:
            graf.terminate()
            graf.wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
