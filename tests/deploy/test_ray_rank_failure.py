"""A multi-rank instance fails as a whole (deploy/ray_actors.py, k3serve/parallel/runner.py), on
the shared ``ray.cluster_utils.Cluster`` of 3 nodes × 2 logical GPUs (tests/deploy/conftest.py):
one prefill instance of 1 rank and two decode instances of 2 ranks each (ep 2), the tiny model
on the CPU.

During 8 greedy streams the rank-1 process of the decode instance serving most of them is
``kill -9``-ed (then, in the second case, ``SIGSTOP``-ed): the instance's rank 0 goes down too
(its actor kills it when a rank exits; a stopped rank makes its next collective time out within
the workers' ``--collective-timeout``, :data:`COLLECTIVE_TIMEOUT_S` here), the instance restarts
on fresh ports with fresh ranks and registers again, every stream completes with the fault-free
tokens (the router migrates them), and no rank process is left once the deployment stops.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (before import)
ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e '.[ray]'")

from deploy.ray_backend import deploy
from tests.deploy.test_ray_ranks import metric, ranks_config
from tests.parallel.ray_cluster import alive, assert_gone

MAX_TOKENS = 40
STREAMS = 8
#: the workers' ``--collective-timeout`` (seconds rank 0 waits on a stopped rank)
COLLECTIVE_TIMEOUT_S = 10.0


def prompts() -> list[str]:
    return [f"Story {i}: once upon a time in town number {i}," for i in range(STREAMS)]


@pytest.fixture(scope="module")
def oracle() -> list[str]:
    """The offline engine's greedy answers (text) to each prompt as a chat message."""
    import torch

    from k3serve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("k3-tiny", block_size=16, num_pages=256)
    ids = [list(llm.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                  add_generation_prompt=True, tokenize=True))
           for p in prompts()]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [llm.tokenizer.decode(o.token_ids) for o in outs]


def _stream_all(url: str, started: threading.Event) -> tuple[list[str], list[BaseException]]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none", timeout=180, max_retries=0)
    texts, errors = [""] * STREAMS, []
    first = [threading.Event() for _ in range(STREAMS)]

    def run(i: int, p: str) -> None:
        try:
            s = client.chat.completions.create(
                model="k3-tiny", messages=[{"role": "user", "content": p}],
                max_tokens=MAX_TOKENS, temperature=0.0, stream=True)
            for chunk in s:
                if chunk.choices and chunk.choices[0].delta.content:
                    texts[i] += chunk.choices[0].delta.content
                    first[i].set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
        finally:
            first[i].set()

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts())]
    for t in threads:
        t.start()
    for f in first:
        f.wait(120)
    started.set()
    for t in threads:
        t.join(240)
    return texts, errors


def _busiest_decode(stack) -> str:
    names = [n for n in stack.urls if n.startswith("decode")]
    return max(names, key=lambda n: metric(stack.urls[n], "k3serve:num_requests_running"))


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_failed_rank_restarts_its_instance_and_the_streams_complete(ray_cluster, tmp_path,
                                                                      oracle, fault):
    import httpx

    stack = deploy(ranks_config(tmp_path, 1, 2, decode=2, prefill_ep=1, nodes=6,
                                worker_args=("--collective-timeout", str(COLLECTIVE_TIMEOUT_S))),
                   ready_timeout=240)
    pids: set[int] = set()
    try:
        for hs in stack.ranks.values():
            pids |= {i["pid"] for i in ray.get([h.info.remote() for h in hs], timeout=60)}
        out: dict = {}
        started = threading.Event()
        t = threading.Thread(target=lambda: out.update(r=_stream_all(stack.url, started)))
        t.start()
        assert started.wait(150)
        victim = _busiest_decode(stack)
        old_url = stack.urls[victim]
        assert metric(old_url, "k3serve:num_requests_running") >= 1  # streams mid-way there
        rank0, rank1 = stack.ranks[victim]
        before = ray.get(rank0.info.remote(), timeout=30)
        pid = ray.get(rank1.info.remote(), timeout=30)["pid"]
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        # rank 0's process is replaced: by its actor (a rank exited) or by its own exit (the
        # collective timed out)
        failed_s = None
        while time.monotonic() - t0 < COLLECTIVE_TIMEOUT_S + 30:
            info = ray.get(rank0.info.remote(), timeout=30)
            if info["pid"] != before["pid"] or not alive(before["pid"]):
                failed_s = time.monotonic() - t0
                break
            time.sleep(0.2)
        assert failed_s is not None, "the instance was not declared failed"
        assert failed_s <= COLLECTIVE_TIMEOUT_S + 5, failed_s
        print(f"{fault}: instance declared failed after {failed_s:.1f} s")
        t.join(300)
        texts, errors = out["r"]
        assert not errors, errors
        assert texts == oracle
        assert metric(stack.url, "k3serve:router_migrations_total") >= 1
        # the instance came back: a new URL, registered and healthy, rank 1 a fresh process
        deadline = time.monotonic() + 180
        state: dict = {}
        while time.monotonic() < deadline:
            new_url = stack.refresh(timeout=30).get(victim)
            body = httpx.get(f"{stack.url}/health", params={"detail": 1}, timeout=5,
                             trust_env=False).json()
            state = {w["url"]: w["healthy"] for w in body["workers"]}
            if new_url != old_url and state.get(new_url):
                break
            time.sleep(0.5)
        assert new_url != old_url and state.get(new_url) and not state.get(old_url), state
        r1 = ray.get(rank1.info.remote(), timeout=30)
        assert r1["generation"] >= 2 and r1["pid"] != pid and alive(r1["pid"])
        for hs in stack.ranks.values():
            pids |= {i["pid"] for i in ray.get([h.info.remote() for h in hs], timeout=60)}
    finally:
        stack.stop()
    assert_gone(pids, "processes")
