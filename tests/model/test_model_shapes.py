"""k3serve.model on the meta device: parameter counts and published tensor shapes of the presets.

Nothing is allocated: the k3 preset (2.8 T parameters) is only built on the meta device. Building
its 82 k expert modules takes ~10-20 s of CPU, once per file.
"""

from __future__ import annotations

import pytest
import torch

from k3serve.config import PRESETS
from k3serve.model.model import K3ForCausalLM


@pytest.fixture(scope="module")
def meta_models() -> dict[str, K3ForCausalLM]:
    with torch.device("meta"):
        return {
            n: K3ForCausalLM(PRESETS[n], dtype=torch.bfloat16) for n in ("k3-tiny", "k3-mini", "k3")
        }


@pytest.mark.parametrize("name", ["k3-tiny", "k3-mini", "k3"])
def test_num_params_matches_config(meta_models: dict[str, K3ForCausalLM], name: str) -> None:
    m = meta_models[name]
    assert all(p.is_meta for p in m.parameters())
    assert m.num_params() == PRESETS[name].num_params


def test_k3_tensor_shapes(meta_models: dict[str, K3ForCausalLM]) -> None:
    m = meta_models["k3"]  # 250 k tensors: look names up instead of listing them all
    L = "model.layers."
    want = {
        "model.embed_tokens.weight": (163840, 7168),
        "lm_head.weight": (163840, 7168),
        "model.norm.weight": (7168,),
        "model.output_attn_res_proj.weight": (1, 7168),
        "model.output_attn_res_norm.weight": (7168,),
        L + "0.self_attention_res_proj.weight": (1, 7168),
        L + "0.mlp_res_norm.weight": (7168,),
        L + "0.self_attn.q_proj.weight": (12288, 7168),
        L + "0.self_attn.g_proj.weight": (12288, 7168),
        L + "0.self_attn.f_a_proj.weight": (128, 7168),
        L + "0.self_attn.f_b_proj.weight": (12288, 128),
        L + "0.self_attn.b_proj.weight": (96, 7168),
        L + "0.self_attn.o_proj.weight": (7168, 12288),
        L + "0.self_attn.dt_bias": (12288,),
        L + "0.self_attn.q_conv1d.weight": (12288, 1, 4),
        L + "0.self_attn.o_norm.weight": (128,),
        L + "0.self_attn.A_log": (96,),
        L + "0.mlp.gate_proj.weight": (33792, 7168),
        L + "0.mlp.down_proj.weight": (7168, 33792),
        L + "3.self_attn.q_a_proj.weight": (1536, 7168),
        L + "3.self_attn.q_a_layernorm.weight": (1536,),
        L + "3.self_attn.q_b_proj.weight": (18432, 1536),
        L + "92.self_attn.kv_a_proj_with_mqa.weight": (576, 7168),
        L + "92.self_attn.kv_a_layernorm.weight": (512,),
        L + "92.self_attn.kv_b_proj.weight": (24576, 512),
        L + "92.self_attn.g_proj.weight": (12288, 7168),
        L + "92.self_attn.o_proj.weight": (7168, 12288),
        L + "1.mlp.gate.weight": (896, 7168),
        L + "1.mlp.gate.e_score_correction_bias": (896,),
        L + "1.mlp.routed_expert_down_proj.weight": (3584, 7168),
        L + "1.mlp.routed_expert_norm.weight": (3584,),
        L + "1.mlp.routed_expert_up_proj.weight": (7168, 3584),
        L + "1.mlp.experts.895.w1.weight": (3072, 3584),
        L + "1.mlp.experts.0.w2.weight": (3584, 3072),
        L + "92.mlp.shared_experts.gate_proj.weight": (6144, 7168),
        L + "92.mlp.shared_experts.down_proj.weight": (7168, 6144),
    }
    for k, shape in want.items():
        assert tuple(m.get_parameter(k).shape) == shape, k
    attn = [layer.self_attn for layer in m.model.layers]
    assert sum(hasattr(a, "kv_b_proj") for a in attn) == 24
    assert sum(hasattr(a, "A_log") for a in attn) == 69
    assert len(m.model.layers[92].mlp.experts) == 896


def test_k3_mini_tensor_shapes(meta_models: dict[str, K3ForCausalLM]) -> None:
    sd = {k: tuple(v.shape) for k, v in meta_models["k3-mini"].state_dict().items()}
    assert sd.keys() == dict(meta_models["k3-mini"].named_parameters()).keys()
    L = "model.layers."
    want = {
        "model.embed_tokens.weight": (32768, 2048),
        L + "0.self_attn.q_proj.weight": (2048, 2048),
        L + "0.mlp.up_proj.weight": (8192, 2048),
        L + "3.self_attn.q_b_proj.weight": (3072, 768),
        L + "3.self_attn.kv_b_proj.weight": (4096, 512),
        L + "5.mlp.experts.63.w3.weight": (768, 1024),
        L + "5.mlp.shared_experts.up_proj.weight": (768, 2048),
        L + "23.self_attn.kv_a_proj_with_mqa.weight": (576, 2048),
    }
    for k, shape in want.items():
        assert sd.get(k) == shape, k
    assert sum(".self_attn.kv_b_proj.weight" in k for k in sd) == 6
