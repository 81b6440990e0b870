"""The supernode's shape scaled down (``supernode-64.yaml``: tp 8 × dp 2, ep 16): a decode
instance of tp 2 × dp 2 attention groups with ep 4 as Ray actors, its ranks on both nodes of a
2 × 2 logical-GPU part of the shared ``ray.cluster_utils.Cluster`` (tests/deploy/conftest.py; its
third 2-GPU node holds the tp-2 prefill instance its transfers pair with), the tiny model on the
CPU (gloo, float32):

* every rank of both instances joined (rank ≥ 1 processes run ``k3serve.parallel.ranks``),
  rank 0 registered (``/internal/info`` says tp 2 / ep 4), the decode instance's 4 ranks sit
  2 + 2 on two nodes (Ray's state API);
* three concurrent chat completions (slots on both attention groups) equal the single-process
  offline engine's greedy tokens, every transfer over Mooncake (0 fallbacks).
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (before import)
ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e '.[ray]'")

from deploy.ray_backend import deploy
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from tests.deploy.test_ray_ranks import metric, rank_nodes, ranks_config
from tests.parallel.ray_cluster import alive, assert_gone

MAX_TOKENS = 5
CHATS = [[{"role": "user", "content": c}] for c in
         ("The capital of France is", "Once upon a time", "1, 2, 3, 4,")]


def oracle_texts() -> list[str]:
    """The single-process offline engine's greedy answers to ``CHATS``."""
    import torch

    from k3serve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("k3-tiny", block_size=16, num_pages=64)
    ids = [list(llm.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True))
           for m in CHATS]
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [llm.tokenizer.decode(o.token_ids) for o in outs]


def test_tp2_dp2_ep4_instance_spans_two_nodes_and_matches_the_offline_engine(ray_cluster,
                                                                              tmp_path):
    import httpx
    from openai import OpenAI

    want = oracle_texts()
    stack = deploy(ranks_config(tmp_path, tp=2, ep=4, prefill_ep=2, nodes=3, gpus_per_node=2,
                                max_restarts=1), ready_timeout=240)
    pids: list[int] = []
    try:
        nodes = rank_nodes(stack)
        assert len(nodes["decode-0"]) == 4
        assert sorted(Counter(nodes["decode-0"]).values()) == [2, 2], nodes  # 2 nodes
        assert not set(nodes["prefill-0"]) & set(nodes["decode-0"]), nodes
        for hs in stack.ranks.values():
            infos = ray.get([h.info.remote() for h in hs], timeout=60)
            pids += [i["pid"] for i in infos]
            assert all(i["generation"] == 1 and alive(i["pid"]) for i in infos[1:]), infos
        info = httpx.get(stack.urls["decode-0"] + "/internal/info", timeout=10,
                         trust_env=False, headers={CLUSTER_TOKEN_HEADER: stack.cluster_token})
        assert info.status_code == 200, info.text
        assert (info.json()["tp"], info.json()["ep"]) == (2, 4)
        client = OpenAI(base_url=f"{stack.url}/v1", api_key="none", timeout=180)

        def ask(messages):
            r = client.chat.completions.create(model="k3-tiny", messages=messages,
                                               max_tokens=MAX_TOKENS, temperature=0.0)
            return r.choices[0].message.content

        with ThreadPoolExecutor(len(CHATS)) as ex:
            got = list(ex.map(ask, CHATS))
        assert got == want
        assert metric(stack.urls["decode-0"], "k3serve:kv_transfer_fallbacks_total") == 0
        assert metric(stack.urls["prefill-0"], "k3serve:kv_transfers_total") >= len(CHATS)
    finally:
        stack.stop()
    assert_gone(pids, "rank processes")
