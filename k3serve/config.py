"""Model configuration: one frozen dataclass, three presets, and Hugging Face ``config.json`` loading.

Pure Python (no torch): the router and the simulator read configs without the model.

The shapes follow the published K3 checkpoint (``docs/k3_tensor_names.md``).
Every architectural choice that differs between Kimi Linear and K3 is a field here, so one
model code path runs both:

==========================  ======================  ==========================
field                       Kimi Linear             K3
==========================  ======================  ==========================
``kda_gate_lower_bound``    ``None`` (softplus)     ``-5.0`` (bounded sigmoid)
``kda_output_gate_rank``    ``head_dim`` (low rank) ``None`` (full-rank g_proj)
``mla_output_gate``         ``False``               ``True``
``moe_latent_size``         ``None``                ``3584``
``hidden_act``              ``"silu"``              ``"situ"``
``attn_res_block_layers``   ``0`` (plain residual)  ``12``
==========================  ======================  ==========================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3serve.hf_config import hf_fields, read_config_json

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of a K3-architecture model (Kimi Linear is a special case).

    Layer indices are 0-based. Sizes are in elements unless the name says bytes.

    Raises:
        ValueError: from ``__post_init__`` when a field is out of range or inconsistent; the
            message names the field.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    mla_layers: tuple[int, ...]
    # --- KDA (Kimi Delta Attention; Kimi Linear arXiv 2510.26692 §3) ---
    kda_num_heads: int
    kda_head_dim: int  # K == V
    kda_conv_kernel: int = 4
    kda_gate_rank: int = 128  # f_a_proj: hidden -> rank -> H*K
    kda_gate_lower_bound: float | None = -5.0  # K3: g = lb * sigmoid(exp(A_log) * (f + dt_bias))
    kda_output_gate_rank: int | None = None  # None: full-rank g_proj (K3); int: g_a/g_b (Kimi Linear)
    # --- Gated MLA (DeepSeek-V2 §2.1, no rotary) ---
    mla_num_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_output_gate: bool = True
    # --- Feed-forward ---
    first_k_dense: int = 1
    dense_intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    moe_latent_size: int | None = None  # None: experts run at full width (Kimi Linear)
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    hidden_act: str = "situ"  # "situ" (K3) or "silu" (SwiGLU, Kimi Linear)
    situ_beta: float = 4.0
    situ_beta_linear: float = 25.0
    expert_quant: str | None = None  # None (bf16/fp32 experts) or "mxfp4"
    # --- Residual stream (Block AttnRes, arXiv 2603.15031) ---
    attn_res_block_layers: int = 0  # 0 = plain residual stream
    # --- Misc ---
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "bfloat16"  # weight / activation / MLA-cache dtype on GPU (CPU computes in fp32)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def need(cond: bool, fld: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"ModelConfig.{fld}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_layers", "kda_num_heads", "kda_head_dim"):
            need(isinstance(getattr(self, f), int) and getattr(self, f) > 0, f, "must be a positive int")
        need(self.kda_conv_kernel >= 1, "kda_conv_kernel", "must be >= 1")
        need(self.kda_gate_rank > 0, "kda_gate_rank", "must be > 0")
        need(
            self.kda_gate_lower_bound is None or self.kda_gate_lower_bound < 0,
            "kda_gate_lower_bound",
            "must be negative or None",
        )
        object.__setattr__(self, "mla_layers", tuple(int(i) for i in self.mla_layers))
        need(
            all(0 <= i < self.num_layers for i in self.mla_layers),
            "mla_layers",
            f"indices must lie in [0, {self.num_layers})",
        )
        need(len(set(self.mla_layers)) == len(self.mla_layers), "mla_layers", "duplicate index")
        if self.mla_layers:
            need(self.mla_num_heads > 0, "mla_num_heads", "must be > 0 when mla_layers is set")
            need(self.kv_lora_rank > 0, "kv_lora_rank", "must be > 0")
            need(self.qk_nope_head_dim > 0, "qk_nope_head_dim", "must be > 0")
            need(self.qk_rope_head_dim >= 0, "qk_rope_head_dim", "must be >= 0")
            need(self.v_head_dim > 0, "v_head_dim", "must be > 0")
            need(self.q_lora_rank is None or self.q_lora_rank > 0, "q_lora_rank", "must be > 0 or None")
        need(0 <= self.first_k_dense <= self.num_layers, "first_k_dense", "must lie in [0, num_layers]")
        if self.first_k_dense > 0:
            need(self.dense_intermediate_size > 0, "dense_intermediate_size", "must be > 0")
        if self.first_k_dense < self.num_layers:
            need(self.n_routed_experts > 0, "n_routed_experts", "must be > 0 for MoE layers")
            need(
                0 < self.num_experts_per_tok <= self.n_routed_experts,
                "num_experts_per_tok",
                f"must lie in [1, n_routed_experts={self.n_routed_experts}]",
            )
            need(self.moe_intermediate_size > 0, "moe_intermediate_size", "must be > 0")
            need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
            need(
                self.moe_latent_size is None or self.moe_latent_size > 0,
                "moe_latent_size",
                "must be > 0 or None",
            )
        need(self.hidden_act in ("situ", "silu"), "hidden_act", "must be 'situ' or 'silu'")
        need(self.expert_quant in (None, "mxfp4"), "expert_quant", "must be None or 'mxfp4'")
        if self.expert_quant == "mxfp4":
            width = self.moe_latent_size or self.hidden_size
            need(width % 32 == 0, "moe_latent_size", "MXFP4 needs the expert input width % 32 == 0")
            need(self.moe_intermediate_size % 32 == 0, "moe_intermediate_size", "MXFP4 needs % 32 == 0")
        need(self.attn_res_block_layers >= 0, "attn_res_block_layers", "must be >= 0")
        need(self.dtype in DTYPE_BYTES, "dtype", f"must be one of {sorted(DTYPE_BYTES)}")
        need(self.max_position_embeddings > 0, "max_position_embeddings", "must be > 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        for f in ("bos_token_id", "eos_token_id", "pad_token_id"):
            v = getattr(self, f)
            need(v is None or 0 <= v < self.vocab_size, f, f"must lie in [0, vocab_size={self.vocab_size})")

    # ------------------------------------------------------------------ layer layout
    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-based indices of KDA layers (every layer not in ``mla_layers``)."""
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.num_layers) if i not in mla)

    def is_mla(self, layer: int) -> bool:
        return layer in self.mla_layers

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense

    @property
    def num_kda_layers(self) -> int:
        return self.num_layers - len(self.mla_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.mla_layers)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_latent_dim(self) -> int:
        """Per-token, per-layer cached latent width: ``kv_lora_rank + qk_rope_head_dim`` (K3: 576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_conv_dim(self) -> int:
        """Channels through the short conv: q, k, v concatenated = ``3 * H * K`` (K == V)."""
        return 3 * self.kda_num_heads * self.kda_head_dim

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    # ------------------------------------------------------------------ cache sizes
    def kda_state_bytes_per_layer(self, conv_dtype_bytes: int | None = None) -> int:
        """Bytes of one sequence's KDA cache in one layer: fp32 ``[H, K, V]`` state + conv state.

        The conv state keeps the last ``kernel - 1`` pre-conv q, k, v inputs in the model dtype.
        """
        cb = self.dtype_bytes if conv_dtype_bytes is None else conv_dtype_bytes
        rec = self.kda_num_heads * self.kda_head_dim * self.kda_head_dim * 4
        conv = (self.kda_conv_kernel - 1) * self.kda_conv_dim * cb
        return rec + conv

    def kda_state_bytes_per_seq(self, conv_dtype_bytes: int | None = None) -> int:
        """Recurrent + conv state of all KDA layers for one sequence, in bytes."""
        return self.num_kda_layers * self.kda_state_bytes_per_layer(conv_dtype_bytes)

    def mla_latent_bytes_per_token(self, cache_dtype_bytes: int | None = None) -> int:
        """MLA latent cache of all MLA layers for one token, in bytes (K3: 24 × 576 × 2)."""
        b = self.dtype_bytes if cache_dtype_bytes is None else cache_dtype_bytes
        return self.num_mla_layers * self.mla_latent_dim * b

    # ------------------------------------------------------------------ parameter counts
    def _kda_params(self) -> int:
        d, h, k = self.hidden_size, self.kda_num_heads, self.kda_head_dim
        hk = h * k
        n = 3 * d * hk  # q, k, v
        n += d * self.kda_gate_rank + self.kda_gate_rank * hk  # f_a, f_b
        n += d * h  # b_proj
        if self.kda_output_gate_rank is None:
            n += d * hk  # g_proj
        else:
            n += d * self.kda_output_gate_rank + self.kda_output_gate_rank * hk  # g_a, g_b
        n += hk * d  # o_proj
        n += h + hk  # A_log, dt_bias
        n += 3 * hk * self.kda_conv_kernel  # conv weights
        n += k  # o_norm
        return n

    def _mla_params(self) -> int:
        d, h = self.hidden_size, self.mla_num_heads
        n = 0
        if self.q_lora_rank is None:
            n += d * h * self.qk_head_dim
        else:
            n += d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * self.qk_head_dim
        n += d * self.mla_latent_dim + self.kv_lora_rank  # kv_a_proj_with_mqa, kv_a_layernorm
        n += self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)  # kv_b_proj
        if self.mla_output_gate:
            n += d * h * self.v_head_dim  # g_proj
        n += h * self.v_head_dim * d  # o_proj
        return n

    def _expert_params(self) -> int:
        w = self.moe_latent_size or self.hidden_size
        return 3 * w * self.moe_intermediate_size

    def _moe_params(self, active: bool) -> int:
        d = self.hidden_size
        n = d * self.n_routed_experts + self.n_routed_experts  # gate + correction bias
        if self.moe_latent_size is not None:
            lat = self.moe_latent_size
            n += d * lat + lat + lat * d  # down, norm, up
        e = self.num_experts_per_tok if active else self.n_routed_experts
        n += e * self._expert_params()
        n += 3 * d * self.n_shared_experts * self.moe_intermediate_size
        return n

    def _count(self, active: bool) -> int:
        d = self.hidden_size
        n = self.vocab_size * d  # embed
        if not self.tie_word_embeddings:
            n += self.vocab_size * d
        n += d  # final norm
        if self.attn_res_block_layers:
            n += 2 * d  # output AttnRes norm + pseudo-query
        for i in range(self.num_layers):
            n += 2 * d  # input / post norms
            if self.attn_res_block_layers:
                n += 4 * d  # two (norm, pseudo-query) pairs
            n += self._mla_params() if self.is_mla(i) else self._kda_params()
            if self.is_moe(i):
                n += self._moe_params(active)
            else:
                n += 3 * d * self.dense_intermediate_size
        return n

    @property
    def num_params(self) -> int:
        """Total parameters (embedding and LM head included)."""
        return self._count(active=False)

    @property
    def num_active_params(self) -> int:
        """Parameters touched per token: routed experts counted ``num_experts_per_tok`` times."""
        return self._count(active=True)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Fields that fix the cache layout (for the layout fingerprint / hash salt)."""
        return {
            "name": self.name,
            "num_layers": self.num_layers,
            "mla_layers": list(self.mla_layers),
            "kda_num_heads": self.kda_num_heads,
            "kda_head_dim": self.kda_head_dim,
            "kda_conv_kernel": self.kda_conv_kernel,
            "mla_latent_dim": self.mla_latent_dim,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "vocab_size": self.vocab_size,
        }

    def info(self) -> dict[str, Any]:
        """Sizes for ``k3serve info`` (bytes at the configured cache dtype)."""
        return {
            "name": self.name,
            "num_params": self.num_params,
            "num_active_params": self.num_active_params,
            "num_layers": self.num_layers,
            "num_kda_layers": self.num_kda_layers,
            "num_mla_layers": self.num_mla_layers,
            "kda_state_bytes_per_seq": self.kda_state_bytes_per_seq(),
            "kda_recurrent_state_bytes_per_seq": self.num_kda_layers
            * self.kda_num_heads
            * self.kda_head_dim**2
            * 4,
            "mla_latent_bytes_per_token": self.mla_latent_bytes_per_token(),
            "dtype": self.dtype,
            "max_position_embeddings": self.max_position_embeddings,
        }

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mla_layers"] = list(self.mla_layers)
        return d

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From our own ``to_dict`` form (``k3serve_config.json``). Unknown keys raise."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "hf") -> ModelConfig:
        """From a Hugging Face ``config.json`` dict (:func:`k3serve.hf_config.hf_fields` maps
        the fields).

        Raises:
            ValueError: unsupported ``model_type`` or missing fields (named).
        """
        return cls(name=name, **hf_fields(hf))


def _every_fourth(num_layers: int, last_too: bool) -> tuple[int, ...]:
    """0-based MLA layers for 1-based 4, 8, …; K3 also makes the last layer MLA."""
    layers = [i for i in range(num_layers) if (i + 1) % 4 == 0]
    if last_too and (num_layers - 1) not in layers:
        layers.append(num_layers - 1)
    return tuple(layers)


# Byte-level tokenizer: 256 byte ids then special tokens (see k3serve/tokenizer).
TINY_VOCAB = 272

_K3_CHOICES: dict[str, Any] = {
    "kda_gate_lower_bound": -5.0,  # g = lb · sigmoid(exp(A_log) · (f + dt_bias))
    "kda_output_gate_rank": None,  # full-rank KDA output gate
    "mla_output_gate": True,
    "first_k_dense": 1,
    "hidden_act": "situ",
    "dtype": "bfloat16",
}
"""What every K3-architecture preset shares, whatever its size."""

_K3_WIDE_HEADS: dict[str, Any] = {
    "kda_head_dim": 128,
    "kda_gate_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
"""K3's per-head widths (k3-mini keeps them; k3-tiny shrinks them)."""


def _k3_preset(name: str, *, heads: int, **shape: Any) -> ModelConfig:
    """A preset of the K3 architecture: :data:`_K3_CHOICES`, ``heads`` KDA and MLA heads, and
    the ``shape`` fields given (keyword names of :class:`ModelConfig`)."""
    return ModelConfig(
        name=name, kda_num_heads=heads, mla_num_heads=heads, **_K3_CHOICES, **shape
    )


PRESETS: dict[str, ModelConfig] = {
    # CI model: a few M parameters, every K3 feature on. The embedded checkpoint is trained
    # on the Python standard library (scripts/train_tiny.py).
    "k3-tiny": _k3_preset(
        "k3-tiny",
        heads=4,
        vocab_size=TINY_VOCAB,
        hidden_size=256,
        num_layers=8,
        mla_layers=(3, 7),
        kda_head_dim=64,
        kda_gate_rank=32,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        dense_intermediate_size=512,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        moe_latent_size=128,
        routed_scaling_factor=2.5,
        attn_res_block_layers=4,
        max_position_embeddings=8192,
        bos_token_id=256,
        eos_token_id=257,
        pad_token_id=258,
    ),
    # One H200: pinned shape (DESIGN.md §2) so rooflines can't drift.
    "k3-mini": _k3_preset(
        "k3-mini",
        heads=16,
        **_K3_WIDE_HEADS,
        vocab_size=32768,
        hidden_size=2048,
        num_layers=24,
        mla_layers=_every_fourth(24, last_too=False),
        q_lora_rank=768,
        dense_intermediate_size=8192,
        n_routed_experts=64,
        num_experts_per_tok=8,
        n_shared_experts=1,
        moe_intermediate_size=768,
        moe_latent_size=1024,
        routed_scaling_factor=2.5,
        attn_res_block_layers=6,
        max_position_embeddings=131072,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    ),
    # The published K3 shape: capacity planning and config loading, not instantiated here.
    "k3": _k3_preset(
        "k3",
        heads=96,
        **_K3_WIDE_HEADS,
        vocab_size=163840,
        hidden_size=7168,
        num_layers=93,
        mla_layers=_every_fourth(93, last_too=True),
        q_lora_rank=1536,
        dense_intermediate_size=33792,
        n_routed_experts=896,
        num_experts_per_tok=16,
        n_shared_experts=2,
        moe_intermediate_size=3072,
        moe_latent_size=3584,
        routed_scaling_factor=1.0,
        expert_quant="mxfp4",
        attn_res_block_layers=12,
        max_position_embeddings=1048576,
        bos_token_id=163584,
        eos_token_id=163586,
        pad_token_id=163839,
    ),
}


def load_config(name_or_dir: str) -> ModelConfig:
    """A preset name, or a folder with ``k3serve_config.json`` (ours) or ``config.json`` (HF).

    Raises:
        ValueError: unknown preset / folder without a config (the message lists the presets),
            or a config file that cannot be read, is not a JSON object or does not describe a
            model of this family (the message names the file).
    """
    if name_or_dir in PRESETS:
        return PRESETS[name_or_dir]
    if os.path.isdir(name_or_dir):
        ours = os.path.join(name_or_dir, "k3serve_config.json")
        if os.path.exists(ours):
            return _read_config(ours, ModelConfig.from_dict)
        hf = os.path.join(name_or_dir, "config.json")
        if os.path.exists(hf):
            name = os.path.basename(name_or_dir.rstrip("/"))
            return _read_config(hf, lambda d: ModelConfig.from_hf_config(d, name=name))
        raise ValueError(f"model: folder {name_or_dir!r} has no config.json")
    raise ValueError(f"model: {name_or_dir!r} is neither a preset {sorted(PRESETS)} nor a folder")


def _read_config(path: str, build: Callable[[dict[str, Any]], ModelConfig]) -> ModelConfig:
    """``build`` applied to the JSON object in ``path`` (:func:`read_config_json`); every way
    the file can be wrong is a ``ValueError`` that starts ``model:`` and names ``path``."""
    doc = read_config_json(path)
    try:
        return build(doc)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"model: {path} cannot be used ({e})") from None


__all__ = ["PRESETS", "TINY_VOCAB", "ModelConfig", "load_config"]
