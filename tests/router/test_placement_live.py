"""Placement on live stacks: an extension goes where its prefix was just computed, and a chat's
next turn reuses the previous answer with ``k3serve serve``'s defaults.

* P (3,072 characters), then P + 1 character right after P's answer, on a fresh stack of
  2 prefill + 1 decode workers and on one of 2 monolithic workers, no shared store: the
  extension reuses ≥ 3,008 tokens, all of them from the chosen worker's own cache
  (``scripts/placement_p_plus_one.py`` runs the same trial on 10 stacks per shape).
* ``k3serve serve`` with no flag but its port, then a two-turn chat through the ``openai``
  client: turn 2's ``cached_tokens`` passes the end of turn 1's prompt, into turn 1's answer
  (the decode side's state at the answer's end reaches the next turn's prefill through the
  shared store, on by default).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "k3-tiny"


def _script():
    spec = importlib.util.spec_from_file_location(
        "placement_p_plus_one", ROOT / "scripts" / "placement_p_plus_one.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["pd", "mono"])
def test_p_plus_one_reuses_p_on_the_worker_that_computed_it(shape, tmp_path):
    pp1 = _script()
    r = pp1.trial(shape, seed=7, log_dir=str(tmp_path))
    assert r["p_tokens"] == pp1.P_CHARS + 1 and r["p_cached"] == 0, r
    assert r["p1_cached"] >= pp1.MIN_CACHED, r
    assert r["p1_local"] >= pp1.MIN_CACHED, r  # a hit in the chosen worker's own cache
    assert r["p1_local"] == r["p1_cached"], r


def test_serve_defaults_two_turn_chat_reuses_the_previous_answer(tmp_path):
    from openai import OpenAI

    from deploy.local import free_port, mooncake_master_path

    try:
        mooncake_master_path()
    except FileNotFoundError as e:
        pytest.skip(f"the default store needs Mooncake: {e}")
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    p = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port)], cwd=ROOT,
                         stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        while "serving" not in (tmp_path / "serve.log").read_text():
            assert p.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "stack did not start"
            time.sleep(0.3)
        url = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "You answer questions about caches. " * 8},
                {"role": "user", "content": "How does a prefix cache decide what to reuse? " * 4}]
        one = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=96,
                                             temperature=0, extra_body={"ignore_eos": True})
        answer = one.choices[0].message.content
        assert one.usage.completion_tokens == 96
        msgs += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And what does it evict first?"}]
        two = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4,
                                             temperature=0)
        cached = two.usage.prompt_tokens_details.cached_tokens
        assert cached > one.usage.prompt_tokens, (cached, one.usage, two.usage)
    finally:
        p.terminate()
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
