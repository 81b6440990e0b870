"""Expert load counters (k3serve/parallel/counters.py + the MoE's ``expert_load`` buffer)."""

from __future__ import annotations

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from k3serve.config import PRESETS
from k3serve.model.batch import make_batch
from k3serve.model.model import K3ForCausalLM
from k3serve.parallel import counters
from k3serve.prometheus import render


def _model() -> K3ForCausalLM:
    torch.manual_seed(0)
    return K3ForCausalLM(PRESETS["k3-tiny"]).eval()


def test_counts_match_router_choices() -> None:
    m = _model()
    cfg = m.cfg
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i, moe in counters.moe_layers(m).items():
        def grab(mod, args, out, i=i):
            seen[i] = seen.get(i, torch.zeros(cfg.n_routed_experts, dtype=torch.int64)) + \
                torch.bincount(out[1].reshape(-1), minlength=cfg.n_routed_experts)
        hooks.append(moe.gate.register_forward_hook(grab))
    with torch.no_grad():
        m.forward_train(ids)
    for h in hooks:
        h.remove()
    load = counters.expert_load(m)
    assert sorted(load) == [i for i in range(cfg.num_layers) if cfg.is_moe(i)]
    for i, c in load.items():
        np.testing.assert_array_equal(c, seen[i].numpy())
        assert c.sum() == 18 * cfg.num_experts_per_tok
    assert counters.expert_load_array(m).shape == (len(load), cfg.n_routed_experts)
    counters.reset_expert_load(m)
    assert counters.expert_load_array(m).sum() == 0


def test_counts_accumulate_over_cached_forwards_and_export() -> None:
    from k3serve.cache.pools import KVPools

    m = _model()
    cfg = m.cfg
    pools = KVPools(cfg, num_slots=2, num_pages=4, block_size=16)
    with torch.inference_mode():
        b = make_batch([5, 3], [0, 0], [0, 1], [[0], [1]], 16)
        m(torch.randint(0, cfg.vocab_size, (8,)), b, pools)
        b = make_batch([1, 1], [5, 3], [0, 1], [[0], [1]], 16)
        m(torch.randint(0, cfg.vocab_size, (2,)), b, pools)
    arr = counters.expert_load_array(m)
    assert (arr.sum(1) == 10 * cfg.num_experts_per_tok).all()
    reg = CollectorRegistry()
    reg.register(counters.ExpertLoadCollector(lambda: counters.expert_load(m), {"worker": "w0"}))
    body = render(reg)[0].decode()
    layer = min(counters.expert_load(m))
    line = f'k3serve:expert_routed_tokens_total{{expert="0",layer="{layer}",worker="w0"}}'
    assert line in body
    assert f"{line} {float(arr[0, 0])}" in body
    # the counters are no checkpoint tensors
    assert not any("expert_load" in k for k in m.state_dict())
