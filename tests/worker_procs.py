"""Worker processes for the tests that start real prefill/decode workers (tests/worker,
tests/kvstore): start/stop with the cluster token, and the router's reserve → prefill → stream
done by hand over the internal HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from deploy import forkserver

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "disagg-test-token"
HEADERS = {"X-K3serve-Cluster-Token": TOKEN}
MAX_TOKENS = 6


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    def __init__(self, role: str, name: str, block_size: int, log_dir: Path, pages: int = 512,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None):
        """``python -m {role}.worker`` on a free loopback port; ``extra`` flags come last (they
        override the defaults here); ``env``: more environment variables (``K3SERVE_KV_*``)."""
        self.log = log_dir / f"{name}.log"
        self._env = dict(os.environ, K3SERVE_CLUSTER_TOKEN=TOKEN, K3SERVE_TEST_HOOKS="1",
                         K3SERVE_WORKER_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
        self._args = (role, name, block_size, pages, extra)
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self._spawn()

    def _spawn(self) -> None:
        role, name, block_size, pages, extra = self._args
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["--host", "127.0.0.1", "--port", str(self.port), "--model", "k3-tiny",
                "--block-size", str(block_size), "--num-pages", str(pages), "--num-slots", "32",
                "--worker-id", name, "--device", "cpu", "--log-level", "info",
                "--drain-timeout", "3", *extra]  # stop(): short drain
        if forkserver.enabled(self._env):  # as the launcher starts its workers
            self.p = forkserver.ForkServer.shared(self._env).spawn(
                f"{role}.worker", args, self._env, cwd=str(ROOT), log=str(self.log))
        else:
            self.p = subprocess.Popen([sys.executable, "-m", f"{role}.worker", *args], cwd=ROOT,
                                      env=self._env, stdout=self._out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait for ``/health`` 200; a worker whose port was taken between ``_free_port`` and
        its bind (exit status ``EXIT_PORT_IN_USE``) is started again on another port."""
        from deploy.launcher import PORT_RETRIES
        from worker.serve import EXIT_PORT_IN_USE

        t_end = time.monotonic() + timeout
        retries = PORT_RETRIES
        with httpx.Client(timeout=1) as client:  # one TLS context for the whole wait
            while time.monotonic() < t_end:
                rc = self.p.poll()
                if rc == EXIT_PORT_IN_USE and retries:
                    retries -= 1
                    self._spawn()
                    continue
                assert rc is None, f"worker exited ({rc}):\n{self.log.read_text()[-3000:]}"
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise AssertionError(f"worker not ready:\n{self.log.read_text()[-3000:]}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds."""
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._out.close()


def stop_all(procs, timeout: float = 15.0) -> None:
    """Stop every :class:`Proc` of ``procs`` at once: SIGTERM to all, then wait (SIGKILL after
    ``timeout`` seconds) — the drains overlap instead of adding up."""
    procs = list(procs)
    for p in procs:
        if p.p.poll() is None:
            p.p.terminate()
    for p in procs:
        p.stop(timeout)


def _sampling(seed: int = 7) -> dict:
    return {"temperature": 0.0, "max_tokens": MAX_TOKENS, "seed": seed}


async def _stream(c: httpx.AsyncClient, d_url: str, rid: str,
                  first: dict) -> tuple[list[int], str | None]:
    """Tokens #2.. from the decode worker; ``first``: the prefill worker's answer (token #1)."""
    toks, finish = [], None
    body = {"request_id": rid, "token_id": first["token_id"], "logprob": first["logprob"]}
    async with c.stream("POST", d_url + "/internal/stream", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            assert "error" not in ev, ev
            toks += ev["token_ids"]
            finish = ev["finish_reason"] or finish
    return toks, finish


async def _first(c: httpx.AsyncClient, P: Proc, D: Proc, rid: str, ids: list[int],
                 sampling: dict | None = None, prefill_sampling: dict | None = None,
                 **extra) -> dict:
    """reserve → prefill, as the router does; returns the prefill answer (token #1)."""
    sampling = sampling or _sampling()
    r = await c.post(D.url + "/internal/reserve",
                     json={"request_id": rid, "prompt_token_ids": ids, "sampling": sampling,
                           "n": 1})
    assert r.status_code == 200, r.text
    res = r.json()
    p = await c.post(P.url + "/internal/prefill", json={
        "request_id": rid, "prompt_token_ids": ids, "sampling": prefill_sampling or sampling,
        "ticket": res["ticket"], "bootstrap_addr": res["bootstrap_addr"], "snapshot_at": [],
        "cache_salt": None, **extra})
    assert p.status_code == 200, p.text
    return p.json()


async def _request(c: httpx.AsyncClient, P: Proc, D: Proc, rid: str, ids: list[int],
                   sampling: dict | None = None, prefill_sampling: dict | None = None,
                   **extra) -> tuple[list[int], dict]:
    """reserve → prefill → stream, as the router does; returns (all tokens, prefill answer).

    ``sampling`` goes to both workers (default :func:`_sampling`); ``prefill_sampling``, when
    given, to the prefill worker instead (a test device: the router sends the same to both).
    """
    first = await _first(c, P, D, rid, ids, sampling, prefill_sampling, **extra)
    rest, finish = await _stream(c, D.url, rid, first)
    assert finish in ("stop", "length")
    return [first["token_id"], *rest], first


def _metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " "))
               and all(w in line.split("}", 1)[0] for w in want))


def children(pid: int) -> list[int]:
    """The live and zombie processes whose parent is ``pid`` (from ``/proc``)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(d.name))
    return out


def components(pid: int) -> list[int]:
    """The processes launcher ``pid`` started: its children, with its fork server
    (deploy/forkserver.py, titled ``k3serve forkserver``) replaced by the server's children."""
    out = []
    for k in children(pid):
        try:
            title = Path(f"/proc/{k}/cmdline").read_text().strip("\0 ")
        except OSError:
            continue
        out += children(k) if title == "k3serve forkserver" else [k]
    return out


def session_left(pid: int) -> list[str]:
    """Pids (as strings) of the processes still in the session ``pid`` leads, zombies aside
    (``/proc/N/stat``: field 6 is the session id, field 3 the state)."""
    left = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == pid and fields[0] != "Z":
            left.append(d)
    return left
