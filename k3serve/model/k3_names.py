"""Published checkpoint tensor names of K3 / Kimi Linear, and how ours map onto them (no torch).

The rules below reproduce the tensor list of the released Kimi-K3 checkpoint
(``moonshotai/Kimi-K3``: ``language_model.`` prefix, MoE under ``block_sparse_moe.``, MXFP4
experts) and, without the prefix, the Kimi-Linear layout that ``transformers`` writes with
``save_pretrained`` (it converts its runtime layout back to these names). Where each rule was
confirmed is written up in ``docs/k3_tensor_names.md``; ``scripts/gen_k3_tensor_list.py``
turns them into ``tests/data/k3_tensors.json``.

Naming, per decoder layer ``i`` (0-based), prefix ``[language_model.]model.layers.{i}.``:

* every layer: ``input_layernorm``, ``post_attention_layernorm``; with Block AttnRes also
  ``self_attention_res_norm``/``_proj`` and ``mlp_res_norm``/``_proj`` (proj ``[1, d]``).
* KDA layers, ``self_attn.``: ``q/k/v_proj``, ``q/k/v_conv1d`` ``[H·K, 1, W]``, ``f_a_proj``,
  ``f_b_proj``, ``b_proj``, ``g_proj`` (full rank, K3) or ``g_a_proj``/``g_b_proj`` (Kimi
  Linear), ``A_log``, ``dt_bias``, ``o_norm``, ``o_proj``.
* MLA layers, ``self_attn.``: ``q_a_proj``/``q_a_layernorm``/``q_b_proj`` (or ``q_proj``
  without q-LoRA), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``g_proj`` (K3
  output gate), ``o_proj``.
* dense layers (``i < first_k_dense``): ``mlp.gate_proj/up_proj/down_proj``.
* MoE layers: ``block_sparse_moe.gate.weight``, ``block_sparse_moe.gate.e_score_correction_bias``,
  ``routed_expert_down_proj``/``routed_expert_norm``/``routed_expert_up_proj`` (latent MoE),
  ``shared_experts.gate_proj/up_proj/down_proj`` (all shared experts fused, width
  ``n_shared · I``), ``experts.{e}.w1/w3`` (gate/up ``[I, W]``) and ``w2`` (down ``[W, I]``),
  stored as ``.weight`` or, MXFP4, as ``.weight_packed`` ``U8 [out, in/2]`` + ``.weight_scale``
  ``U8 [out, in/32]`` (see ``k3serve/kernels/mxfp4.py``).

Model level: ``model.embed_tokens``, ``model.norm``, ``model.output_attn_res_norm``/``_proj``
(AttnRes), ``lm_head`` (absent when tied). Our modules use the same names with ``mlp.`` instead
of ``block_sparse_moe.`` for MoE layers and without the ``language_model.`` prefix.

Dtypes are safetensors strings: ``"BF16"`` etc. for the model dtype, ``"F32"`` for the KDA conv
weights, ``A_log``, ``dt_bias``, ``o_norm`` and the router correction bias (as in K3's shards).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from k3serve.config import ModelConfig

LANGUAGE_MODEL_PREFIX = "language_model."
"""Prefix of every language-model tensor in the K3 (multimodal container) checkpoint."""

MOE_MODULE = "block_sparse_moe"
"""Module name of the sparse MoE block in published checkpoints (ours: ``mlp``)."""

LISTING_FORMAT = "k3serve-tensor-list-v1"

DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}

Spec = tuple[tuple[int, ...], str]
"""``(shape, safetensors dtype)`` of one tensor."""

F32_SUFFIXES = (
    "_conv1d.weight",
    "self_attn.A_log",
    "self_attn.dt_bias",
    "self_attn.o_norm.weight",
    "gate.e_score_correction_bias",
)
"""Name endings of tensors K3 stores in float32 whatever the model dtype (KDA conv taps, decay,
output norm; router correction bias)."""

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.(\d+)\.(w[123])\.weight$")


def is_f32_tensor(name: str) -> bool:
    """Whether the published tensor ``name`` is stored in float32 (see :data:`F32_SUFFIXES`)."""
    return name.endswith(F32_SUFFIXES)


def a_log_length(cfg: ModelConfig) -> int:
    """Stored length of a KDA layer's ``A_log`` in the K3 layout: ``max(H, K)``.

    K3 ships ``A_log`` as ``F32 [128]`` for 96 heads: the first ``H`` entries are used, the
    rest is zero padding (readers narrow to ``[:H]``). The padding to the head dim is inferred
    from that one checkpoint (SGLang's loader documents it as "[head_dim]").
    """
    return max(cfg.kda_num_heads, cfg.kda_head_dim)


def _dt(cfg: ModelConfig) -> str:
    return DTYPE_NAMES[cfg.dtype]


def expert_templates(cfg: ModelConfig) -> dict[str, Spec]:
    """Tensors of one routed expert, relative to ``…block_sparse_moe.experts.{e}.``."""
    width = cfg.moe_latent_size or cfg.hidden_size
    inter = cfg.moe_intermediate_size
    out: dict[str, Spec] = {}
    for w, (rows, cols) in (("w1", (inter, width)), ("w2", (width, inter)), ("w3", (inter, width))):
        if cfg.expert_quant == "mxfp4":
            out[f"{w}.weight_packed"] = ((rows, cols // 2), "U8")
            out[f"{w}.weight_scale"] = ((rows, cols // 32), "U8")
        else:
            out[f"{w}.weight"] = ((rows, cols), _dt(cfg))
    return out


def layer_templates(cfg: ModelConfig) -> dict[str, dict[str, Spec]]:
    """Per-layer tensor templates by layer kind, names relative to ``model.layers.{i}.``.

    Returns:
        ``{"every": …, "kda": …, "mla": …, "dense": …, "moe": …}``; a layer holds ``every`` plus
        one of ``kda``/``mla`` plus one of ``dense``/``moe`` (experts: :func:`expert_templates`).
    """
    d, bf = cfg.hidden_size, _dt(cfg)
    every: dict[str, Spec] = {
        "input_layernorm.weight": ((d,), bf),
        "post_attention_layernorm.weight": ((d,), bf),
    }
    if cfg.attn_res_block_layers:
        every.update(
            {
                "self_attention_res_norm.weight": ((d,), bf),
                "self_attention_res_proj.weight": ((1, d), bf),
                "mlp_res_norm.weight": ((d,), bf),
                "mlp_res_proj.weight": ((1, d), bf),
            }
        )

    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    hk, r = h * k, cfg.kda_gate_rank
    a = "self_attn."
    kda: dict[str, Spec] = {
        a + "q_proj.weight": ((hk, d), bf),
        a + "k_proj.weight": ((hk, d), bf),
        a + "v_proj.weight": ((hk, d), bf),
        a + "q_conv1d.weight": ((hk, 1, cfg.kda_conv_kernel), "F32"),
        a + "k_conv1d.weight": ((hk, 1, cfg.kda_conv_kernel), "F32"),
        a + "v_conv1d.weight": ((hk, 1, cfg.kda_conv_kernel), "F32"),
        a + "f_a_proj.weight": ((r, d), bf),
        a + "f_b_proj.weight": ((hk, r), bf),
        a + "b_proj.weight": ((h, d), bf),
    }
    if cfg.kda_output_gate_rank is None:
        kda[a + "g_proj.weight"] = ((hk, d), bf)
    else:
        kda[a + "g_a_proj.weight"] = ((cfg.kda_output_gate_rank, d), bf)
        kda[a + "g_b_proj.weight"] = ((hk, cfg.kda_output_gate_rank), bf)
    kda.update(
        {
            a + "A_log": ((a_log_length(cfg),), "F32"),
            a + "dt_bias": ((hk,), "F32"),
            a + "o_norm.weight": ((k,), "F32"),
            a + "o_proj.weight": ((d, hk), bf),
        }
    )

    mla: dict[str, Spec] = {}
    if cfg.mla_layers:
        hm = cfg.mla_num_heads
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            mla[a + "q_proj.weight"] = ((hm * qk, d), bf)
        else:
            mla[a + "q_a_proj.weight"] = ((cfg.q_lora_rank, d), bf)
            mla[a + "q_a_layernorm.weight"] = ((cfg.q_lora_rank,), bf)
            mla[a + "q_b_proj.weight"] = ((hm * qk, cfg.q_lora_rank), bf)
        mla[a + "kv_a_proj_with_mqa.weight"] = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, d), bf)
        mla[a + "kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), bf)
        mla[a + "kv_b_proj.weight"] = (
            (hm * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
            bf,
        )
        if cfg.mla_output_gate:
            mla[a + "g_proj.weight"] = ((hm * cfg.v_head_dim, d), bf)
        mla[a + "o_proj.weight"] = ((d, hm * cfg.v_head_dim), bf)

    dense: dict[str, Spec] = {}
    if cfg.first_k_dense:
        di = cfg.dense_intermediate_size
        dense = {
            "mlp.gate_proj.weight": ((di, d), bf),
            "mlp.up_proj.weight": ((di, d), bf),
            "mlp.down_proj.weight": ((d, di), bf),
        }

    moe: dict[str, Spec] = {}
    if cfg.first_k_dense < cfg.num_layers:
        m, e = MOE_MODULE + ".", cfg.n_routed_experts
        moe[m + "gate.weight"] = ((e, d), bf)
        moe[m + "gate.e_score_correction_bias"] = ((e,), "F32")
        if cfg.moe_latent_size is not None:
            lat = cfg.moe_latent_size
            moe[m + "routed_expert_down_proj.weight"] = ((lat, d), bf)
            moe[m + "routed_expert_norm.weight"] = ((lat,), bf)
            moe[m + "routed_expert_up_proj.weight"] = ((d, lat), bf)
        if cfg.n_shared_experts:
            si = cfg.n_shared_experts * cfg.moe_intermediate_size
            moe[m + "shared_experts.gate_proj.weight"] = ((si, d), bf)
            moe[m + "shared_experts.up_proj.weight"] = ((si, d), bf)
            moe[m + "shared_experts.down_proj.weight"] = ((d, si), bf)
    return {"every": every, "kda": kda, "mla": mla, "dense": dense, "moe": moe}


def global_templates(cfg: ModelConfig) -> dict[str, Spec]:
    """Model-level tensors (names without the ``language_model.`` prefix)."""
    d, bf = cfg.hidden_size, _dt(cfg)
    out: dict[str, Spec] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, d), bf),
        "model.norm.weight": ((d,), bf),
    }
    if cfg.attn_res_block_layers:
        out["model.output_attn_res_norm.weight"] = ((d,), bf)
        out["model.output_attn_res_proj.weight"] = ((1, d), bf)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((cfg.vocab_size, d), bf)
    return out


def layer_sets(cfg: ModelConfig) -> dict[str, list[int]]:
    """0-based layer indices of each template kind."""
    n = cfg.num_layers
    return {
        "every": list(range(n)),
        "kda": list(cfg.kda_layers),
        "mla": list(cfg.mla_layers),
        "dense": [i for i in range(n) if not cfg.is_moe(i)],
        "moe": [i for i in range(n) if cfg.is_moe(i)],
    }


def compact_listing(cfg: ModelConfig, prefix: str = LANGUAGE_MODEL_PREFIX) -> dict[str, Any]:
    """The full tensor list in compact form (templates + layer sets), JSON-serialisable.

    Expand with :func:`expand_listing`; ``num_tensors``, ``total_bytes`` and
    ``expanded_sha256`` describe the expanded list so a reader can check its expansion.
    """
    listing = {"model": cfg.name, **compact_listing_no_digest(cfg, prefix)}
    specs = expand_listing(listing)
    listing["num_tensors"] = len(specs)
    listing["total_bytes"] = sum(tensor_bytes(s) for s in specs.values())
    listing["expanded_sha256"] = listing_digest(specs)
    return listing


def _jsonable(t: dict[str, Spec]) -> dict[str, list[Any]]:
    return {name: [list(shape), dtype] for name, (shape, dtype) in t.items()}


def expand_listing(listing: dict[str, Any]) -> dict[str, Spec]:
    """All tensors ``{published name: (shape, dtype)}`` of a :func:`compact_listing`.

    Raises:
        ValueError: an unknown ``format``.
    """
    if listing.get("format") != LISTING_FORMAT:
        raise ValueError(f"tensor listing: format {listing.get('format')!r} != {LISTING_FORMAT!r}")
    prefix = listing["prefix"]
    out: dict[str, Spec] = {}
    for name, (shape, dtype) in listing["global"].items():
        out[prefix + name] = (tuple(shape), dtype)
    templates = listing["layer_templates"]
    for kind, layers in listing["layer_sets"].items():
        tmpl = [(n, (tuple(s), dt)) for n, (s, dt) in templates[kind].items()]
        for i in layers:
            lp = prefix + listing["layer_prefix"].format(i=i)
            for n, spec in tmpl:
                out[lp + n] = spec
    experts = [(n, (tuple(s), dt)) for n, (s, dt) in listing["expert_template"].items()]
    for i in listing["layer_sets"]["moe"]:
        lp = prefix + listing["layer_prefix"].format(i=i)
        for e in range(listing["num_experts"]):
            ep = lp + listing["expert_prefix"].format(e=e)
            for n, spec in experts:
                out[ep + n] = spec
    return out


def tensor_specs(cfg: ModelConfig, prefix: str = LANGUAGE_MODEL_PREFIX) -> dict[str, Spec]:
    """All published tensors of ``cfg`` (expanded); ``prefix=""`` gives the Kimi-Linear layout."""
    return expand_listing(compact_listing_no_digest(cfg, prefix))


def compact_listing_no_digest(
    cfg: ModelConfig, prefix: str = LANGUAGE_MODEL_PREFIX
) -> dict[str, Any]:
    """:func:`compact_listing` without the (expansion-costly) summary fields."""
    moe = cfg.first_k_dense < cfg.num_layers
    return {
        "format": LISTING_FORMAT,
        "prefix": prefix,
        "layer_prefix": "model.layers.{i}.",
        "expert_prefix": MOE_MODULE + ".experts.{e}.",
        "num_experts": cfg.n_routed_experts if moe else 0,
        "global": _jsonable(global_templates(cfg)),
        "layer_sets": layer_sets(cfg),
        "layer_templates": {k: _jsonable(v) for k, v in layer_templates(cfg).items()},
        "expert_template": _jsonable(expert_templates(cfg)) if moe else {},
    }


_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8}


def tensor_bytes(spec: Spec) -> int:
    """Bytes of one stored tensor."""
    n = 1
    for s in spec[0]:
        n *= s
    return n * _DTYPE_BYTES[spec[1]]


def listing_digest(specs: dict[str, Spec]) -> str:
    """SHA-256 of the canonical text ``name\\tshape\\tdtype\\n`` over names in sorted order."""
    h = hashlib.sha256()
    for name in sorted(specs):
        shape, dtype = specs[name]
        h.update(f"{name}\t{json.dumps(list(shape))}\t{dtype}\n".encode())
    return h.hexdigest()


# ---------------------------------------------------------------------- our names <-> published
def layer_of(name: str) -> int | None:
    """Decoder layer index of a name relative to the model root, or ``None``."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def to_published(name: str, cfg: ModelConfig, prefix: str = LANGUAGE_MODEL_PREFIX) -> str:
    """Our state-dict name -> published name (``mlp.`` -> ``block_sparse_moe.`` on MoE layers).

    Expert weights keep ``.weight`` here; with MXFP4 they are stored as the pair
    ``.weight_packed``/``.weight_scale`` (:func:`expert_weight_pair`).
    """
    i = layer_of(name)
    if i is not None and cfg.is_moe(i):
        head = f"model.layers.{i}."
        if name.startswith(head + "mlp."):
            name = head + MOE_MODULE + "." + name[len(head) + 4 :]
    return prefix + name


def from_published(name: str, cfg: ModelConfig, prefix: str = LANGUAGE_MODEL_PREFIX) -> str | None:
    """Published name -> our state-dict name, or ``None`` when it lacks ``prefix``."""
    if not name.startswith(prefix):
        return None
    name = name[len(prefix) :]
    i = layer_of(name)
    if i is not None:
        head = f"model.layers.{i}."
        if name.startswith(head + MOE_MODULE + "."):
            name = head + "mlp." + name[len(head) + len(MOE_MODULE) + 1 :]
    return name


def published_aliases(name: str) -> tuple[str, ...]:
    """Other spellings of a published name that readers should accept.

    ``transformers`` (5.x) writes Kimi Linear with ``save_pretrained`` by reversing its load-time
    rename ``block_sparse_moe.`` -> ``mlp.`` on every layer, so the dense layer 0 comes out as
    ``model.layers.0.block_sparse_moe.gate_proj.weight`` instead of the original ``mlp.``.
    """
    m = re.match(r"^(.*model\.layers\.\d+\.)mlp\.(.*)$", name)
    return (m.group(1) + MOE_MODULE + "." + m.group(2),) if m else ()


def is_expert_weight(name: str) -> bool:
    """Whether a name (ours or published) is a routed expert's ``w1/w2/w3.weight``."""
    return _EXPERT_RE.search(name) is not None


def expert_weight_pair(published_weight_name: str) -> tuple[str, str]:
    """``….wN.weight`` -> (``….wN.weight_packed``, ``….wN.weight_scale``)."""
    base = published_weight_name[: -len("weight")]
    return base + "weight_packed", base + "weight_scale"


__all__ = [
    "LANGUAGE_MODEL_PREFIX",
    "MOE_MODULE",
    "a_log_length",
    "compact_listing",
    "expand_listing",
    "expert_templates",
    "expert_weight_pair",
    "from_published",
    "global_templates",
    "is_expert_weight",
    "is_f32_tensor",
    "layer_of",
    "layer_sets",
    "layer_templates",
    "listing_digest",
    "published_aliases",
    "tensor_bytes",
    "tensor_specs",
    "to_published",
]
