"""Hugging Face ``config.json`` → the fields of :class:`k3serve.config.ModelConfig`, and the
reading of a model folder's config file (:func:`read_config_json`).

Two layouts: ``model_type`` ``kimi_linear`` (Kimi Linear), and K3's (a top-level dict with
``text_config`` holding the language model's fields). 1-based ``full_attn_layers`` become
0-based MLA layer indices; special token ids outside the vocabulary become ``None``. Pure
Python (no torch).
"""

from __future__ import annotations

from typing import Any

from k3serve.process import read_json_object


def hf_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~k3serve.config.ModelConfig` keyword arguments (all but ``name``) of a
    Hugging Face ``config.json`` dict.

    Raises:
        ValueError: unsupported ``model_type`` or missing fields (named).
    """
    if "text_config" in hf:
        hf = {**hf["text_config"], "_k3": True}
    mt = hf.get("model_type")
    if mt not in ("kimi_linear", "kimi_k3", "kimi_k3_text", None) and not hf.get("_k3"):
        raise ValueError(f"config.json: model_type {mt!r} is not supported (kimi_linear, K3)")

    def req(key: str, *alts: str) -> Any:
        for k in (key, *alts):
            if k in hf and hf[k] is not None:
                return hf[k]
        raise ValueError(f"config.json: missing field {key!r}")

    lin = hf.get("linear_attn_config") or {}
    n_layers = int(req("num_hidden_layers"))
    layer_types = hf.get("layer_types")
    if "full_attn_layers" in lin:  # 1-based in the checkpoint
        mla = tuple(int(i) - 1 for i in lin["full_attn_layers"])
    elif layer_types:
        mla = tuple(i for i, t in enumerate(layer_types) if t == "full_attention")
    else:
        mla = tuple(i for i in range(n_layers) if i and i % 4 == 0)
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types:
        first_dense = sum(1 for t in mlp_types if t == "dense")
    else:
        first_dense = int(hf.get("first_k_dense_replace", 1))
    is_k3 = bool(hf.get("_k3")) or "moe_latent_size" in hf or "attn_res_block_layers" in hf
    head_dim = int(lin.get("head_dim", hf.get("linear_head_dim", 128)))
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    vocab = int(req("vocab_size"))

    def tok(v: Any) -> int | None:
        return int(v) if v is not None and 0 <= int(v) < vocab else None

    return {
        "vocab_size": vocab,
        "hidden_size": int(req("hidden_size")),
        "num_layers": n_layers,
        "mla_layers": mla,
        "kda_num_heads": int(lin.get("num_heads", hf.get("linear_num_heads", 32))),
        "kda_head_dim": head_dim,
        "kda_conv_kernel": int(lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4))),
        "kda_gate_rank": int(lin.get("gate_low_rank_dim", hf.get("kda_gate_rank", head_dim))),
        "kda_gate_lower_bound": (
            float(lin.get("gate_lower_bound", hf.get("kda_gate_lower_bound", -5.0)))
            if is_k3
            else hf.get("kda_gate_lower_bound")
        ),
        "kda_output_gate_rank": (None if is_k3 else int(lin.get("output_gate_rank", head_dim))),
        "mla_num_heads": int(req("num_attention_heads")),
        "q_lora_rank": hf.get("q_lora_rank"),
        "kv_lora_rank": int(hf.get("kv_lora_rank", 512)),
        "qk_nope_head_dim": int(hf.get("qk_nope_head_dim", 128)),
        "qk_rope_head_dim": int(hf.get("qk_rope_head_dim", 64)),
        "v_head_dim": int(hf.get("v_head_dim") or 128),
        "mla_output_gate": bool(hf.get("mla_output_gate", is_k3)),
        "first_k_dense": first_dense,
        "dense_intermediate_size": int(hf.get("intermediate_size", 0)),
        "n_routed_experts": int(
            req("num_experts", "n_routed_experts", "num_local_experts")
        ),
        "num_experts_per_tok": int(req("num_experts_per_token", "num_experts_per_tok")),
        "n_shared_experts": int(hf.get("num_shared_experts", hf.get("n_shared_experts", 0)) or 0),
        "moe_intermediate_size": int(req("moe_intermediate_size")),
        "moe_latent_size": hf.get("moe_latent_size"),
        "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(hf.get("moe_renormalize", hf.get("norm_topk_prob", True))),
        "hidden_act": "situ" if hf.get("hidden_act") == "situ" else "silu",
        "expert_quant": hf.get("expert_quant"),
        "attn_res_block_layers": int(hf.get("attn_res_block_layers", 0) or 0),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-5)),
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(
            hf.get("model_max_length", hf.get("max_position_embeddings", 4096))
        ),
        "dtype": {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16"}.get(
            str(hf.get("torch_dtype", hf.get("dtype", "bfloat16"))), "bfloat16"
        ),
        "bos_token_id": tok(hf.get("bos_token_id")),
        "eos_token_id": tok(eos),
        "pad_token_id": tok(hf.get("pad_token_id")),
    }


def read_config_json(path: str) -> dict[str, Any]:
    """The JSON object in the model config file ``path`` (``config.json`` or
    ``k3serve_config.json``).

    Raises:
        ValueError: ``model:`` and ``path``: the file cannot be read, is not JSON, or holds
            something other than an object.
    """
    return read_json_object(path, "model")


__all__ = ["hf_fields", "read_config_json"]
