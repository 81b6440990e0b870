"""A multi-rank instance fails as a whole (k3serve/parallel/runner.py, ranks.py), without Ray:

* a follower that hangs (``SIGSTOP``) makes rank 0's next op raise within the collective
  timeout, and rank 0's process exits with ``INSTANCE_FAILED_EXIT``;
* a follower placed elsewhere joins through rank 0's ``TCPStore`` (the rendezvous line), and
  the two ranks' forward equals the one-process forward;
* a follower ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; rank 0
  drains, then ends its followers): the instance keeps serving;
* the rendezvous line round-trips; a spec refuses a timeout ≤ 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3serve.parallel.rendezvous import format_rendezvous, parse_rendezvous
from k3serve.parallel.runner import INSTANCE_FAILED_EXIT, InstanceSpec

ROOT = Path(__file__).resolve().parents[2]

RANK0 = """
import os, signal, sys, time
from k3serve.parallel.runner import InstanceSpec, Row
from k3serve.parallel.ranks import start_instance, start_remote_instance

def main():
    mode = sys.argv[1]
    spec = InstanceSpec(tp=1, ep=2, num_pages=8, num_slots=2, collective_timeout_s=3.0)
    if mode in ("stop", "int"):
        r = start_instance(spec)
    else:
        r = start_remote_instance(spec, "127.0.0.1")
    r.zero_slots([0])
    logits = r.forward([Row([5, 6, 7], 0, 0, [0])])
    print("logits", logits[0, :4].tolist(), flush=True)
    if mode == "stop":
        pid = r.follower_pids()[0]
        os.kill(pid, signal.SIGSTOP)
        print("stopped", time.monotonic(), flush=True)
        try:
            r.forward([Row([8], 3, 0, [0])])  # ends this process (instance_failed)
        finally:
            os.kill(pid, signal.SIGKILL)
    if mode == "int":  # a terminal's Ctrl-C reaches every process of the group
        os.kill(r.follower_pids()[0], signal.SIGINT)
        time.sleep(0.5)
        logits = r.forward([Row([8], 3, 0, [0])])
        print("after SIGINT", logits[0, :4].tolist(), flush=True)
    r.close()

if __name__ == "__main__":
    main()
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}


def test_a_stopped_follower_fails_rank_0_within_the_collective_timeout(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    p = subprocess.Popen([sys.executable, str(script), "stop"], env=_env(), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        stopped = None
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("stopped"):
                stopped = time.monotonic()
                break
        assert stopped is not None, "rank 0 did not get to its second forward"
        rc = p.wait(timeout=60)
        waited = time.monotonic() - stopped
        rest = p.stdout.read()
    finally:
        p.kill()
        p.wait()
    assert rc == INSTANCE_FAILED_EXIT, rest
    assert "instance failed in forward" in rest
    assert waited < 3.0 + 20  # the 3 s timeout (and a loaded machine's slack)


def test_a_follower_ignores_sigint_and_the_instance_keeps_serving(tmp_path):
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    r = subprocess.run([sys.executable, str(script), "int"], env=_env(), text=True,
                       capture_output=True, cwd=tmp_path, timeout=120, check=False)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert "after SIGINT" in r.stdout and "KeyboardInterrupt" not in out, out


def test_a_follower_placed_elsewhere_joins_through_the_rendezvous_line(tmp_path):
    import torch

    from k3serve.parallel.runner import RankRunner, Row

    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    p0 = subprocess.Popen([sys.executable, str(script), "remote"], env=_env(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    p1 = None
    try:
        assert p0.stdout is not None
        got = None
        for line in p0.stdout:
            got = parse_rendezvous(line)
            if got:
                break
        assert got is not None
        addr, spec_json = got
        p1 = subprocess.Popen([sys.executable, "-m", "k3serve.parallel.ranks", "--store", addr,
                               "--rank", "1", "--spec", spec_json], env=_env(), cwd=ROOT)
        rest = p0.stdout.read()
        assert p0.wait(timeout=120) == 0, rest
        assert p1.wait(timeout=60) == 0
    finally:
        for p in (p0, p1):
            if p is not None:
                p.kill()
                p.wait()
    logits = [float(x) for x in rest.split("logits", 1)[1].strip().split("]")[0][1:].split(",")]
    torch.set_num_threads(1)
    ref = RankRunner(InstanceSpec(num_pages=8, num_slots=2))
    ref.zero_slots([0])
    want = ref.forward([Row([5, 6, 7], 0, 0, [0])])[0, :4].tolist()
    assert logits == pytest.approx(want, rel=1e-4, abs=1e-5)


def test_rendezvous_line_and_timeout_field():
    line = format_rendezvous("10.0.0.1:4567", '{"tp": 2}')
    assert parse_rendezvous("[decode-0] " + line) == ("10.0.0.1:4567", '{"tp": 2}')
    assert parse_rendezvous("listening on http://x") is None
    with pytest.raises(ValueError, match="collective_timeout_s"):
        InstanceSpec(collective_timeout_s=0)
