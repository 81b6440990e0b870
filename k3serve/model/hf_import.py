"""Load a Kimi Linear checkpoint (Hugging Face folder) into K3ForCausalLM.

Two naming schemes reach us, and both map onto ours (the K3 names, docs/k3_tensor_names.md):

=====================================================  ==========================================
checkpoint (Moonshot format; ``save_pretrained``)      ours
=====================================================  ==========================================
``layers.{i}.block_sparse_moe.*``                      ``layers.{i}.mlp.*``
``self_attn.A_log`` ``[1, 1, H, 1]``                   ``self_attn.A_log`` ``[H]``
``experts.{e}.w1|w2|w3.weight``                        same
=====================================================  ==========================================

transformers' in-memory names (``KimiLinearForCausalLM.state_dict()``) are accepted too:
``self_attn.forget_gate.{f_a_proj,f_b_proj,dt_bias,A_log}`` → ``self_attn.*``; the fused
``self_attn.conv1d.weight [3HK, 1, W]`` → ``q_conv1d | k_conv1d | v_conv1d``; the fused experts
``experts.gate_up_proj [E, 2I, d]`` (gate rows first) → ``w1 | w3`` and ``experts.down_proj
[E, d, I]`` → ``w2``.
"""

from __future__ import annotations

import glob
import json
import os
import re

import torch

from k3serve.config import ModelConfig
from k3serve.model.model import K3ForCausalLM


def convert_kimi_linear_state_dict(
    sd: dict[str, torch.Tensor], cfg: ModelConfig
) -> dict[str, torch.Tensor]:
    """Rename / reshape a Kimi Linear state dict to K3ForCausalLM names.

    Args:
        sd: tensors by checkpoint name (Moonshot format or transformers' in-memory names).
        cfg: the model config (head counts to split fused tensors).

    Returns:
        A new dict keyed by our names (tensors are views or reshapes, not copies, where possible).

    Raises:
        ValueError: a fused tensor whose shape does not match ``cfg`` (the name is given).
    """
    out: dict[str, torch.Tensor] = {}
    hk = cfg.kda_num_heads * cfg.kda_head_dim
    for name, t in sd.items():
        name = name.replace(".block_sparse_moe.", ".mlp.").replace(
            ".self_attn.forget_gate.", ".self_attn."
        )
        if name.endswith("self_attn.A_log"):
            out[name] = t.reshape(-1)
        elif name.endswith("self_attn.conv1d.weight"):
            if t.shape[0] != 3 * hk:
                raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [{3 * hk}, 1, W]")
            base = name[: -len("conv1d.weight")]
            for part, w in zip("qkv", t.split(hk, 0)):
                out[f"{base}{part}_conv1d.weight"] = w
        elif name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.w1.weight"] = t[e, :inter]
                out[f"{base}{e}.w3.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.w2.weight"] = t[e]
        else:
            out[name] = t
    return out


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"path: no *.safetensors in {path!r}")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    return sd


def load_kimi_linear(
    path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> K3ForCausalLM:
    """Build K3ForCausalLM from a Kimi Linear Hugging Face folder (``config.json`` + safetensors).

    Args:
        path: folder written by ``KimiLinearForCausalLM.save_pretrained`` (or a Moonshot release).
        dtype: parameter dtype (CPU: float32).
        device: where the model lives.

    Returns:
        The model in eval mode, every parameter loaded (strict).

    Raises:
        ValueError: not a ``kimi_linear`` config, group-limited routing (``num_expert_group`` > 1
            with ``topk_group`` < ``num_expert_group``, not implemented), a missing or unexpected
            tensor (names listed).
    """
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    if hf.get("model_type") != "kimi_linear":
        raise ValueError(f"config.json: model_type {hf.get('model_type')!r} is not 'kimi_linear'")
    groups = int(hf.get("num_expert_group", hf.get("n_group", 1)) or 1)
    if groups > 1 and int(hf.get("topk_group", groups) or groups) < groups:
        raise ValueError(
            "config.json: num_expert_group/topk_group: group-limited routing is not supported"
        )
    cfg = ModelConfig.from_hf_config(hf, name=os.path.basename(path.rstrip("/")))
    sd = convert_kimi_linear_state_dict(_read_safetensors(path), cfg)
    if cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    with torch.device(device):
        model = K3ForCausalLM(cfg, dtype=dtype)
    want = model.state_dict()
    missing = sorted(set(want) - set(sd))
    unexpected = sorted(k for k in set(sd) - set(want) if not re.search(r"rotary_emb|inv_freq", k))
    if missing or unexpected:
        raise ValueError(f"checkpoint: missing {missing[:8]}… unexpected {unexpected[:8]}…")
    with torch.no_grad():
        for k, p in want.items():
            src = sd[k]
            if src.shape != p.shape:
                raise ValueError(
                    f"checkpoint: {k} has shape {tuple(src.shape)}, expected {tuple(p.shape)}"
                )
            p.copy_(src)
    return model.eval()


__all__ = ["convert_kimi_linear_state_dict", "load_kimi_linear"]
