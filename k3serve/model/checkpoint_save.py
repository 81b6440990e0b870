"""Writing a model as a K3-layout safetensors checkpoint (the layout
:func:`k3serve.model.checkpoint.load_checkpoint` reads)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3serve.model import k3_names as names
from k3serve.model.checkpoint_files import CONFIG_FILE, INDEX_FILE, SHARD_RE, SINGLE_FILE


def save_checkpoint(
    model: nn.Module,
    folder: str | os.PathLike,
    cfg: ModelConfig,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write ``model`` as a K3-layout safetensors checkpoint plus ``k3serve_config.json``.

    Names are the published K3 ones (``language_model.`` prefix, ``block_sparse_moe.``);
    ``A_log`` is zero-padded to ``max(H, K)`` and, like the other K3 float32 tensors
    (:data:`~k3serve.model.k3_names.F32_SUFFIXES`), stored in float32. With
    ``cfg.expert_quant == "mxfp4"`` routed experts are stored packed: the bytes attached at load
    when they still decode to the current weight, else :func:`pack_mxfp4` of the weight (lossy
    unless the weight is on the MXFP4 grid). Earlier ``model*.safetensors`` files and the index
    in ``folder`` are removed first, so the folder holds exactly one checkpoint.

    Args:
        model: the model to save (tied ``lm_head`` is not written).
        folder: output folder (created).
        cfg: the model's config (written as ``k3serve_config.json``).
        dtype: store the other float tensors in this dtype (default: as they are, lossless).
        max_shard_bytes: split into ``model-0000i-of-0000n.safetensors`` + index when the
            total exceeds this; ``None`` writes one ``model.safetensors``.

    Returns:
        The files written (safetensors, index if sharded, config).
    """
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if SHARD_RE.match(old.name) or old.name == INDEX_FILE:
            old.unlink()

    tensors: dict[str, torch.Tensor] = {}
    for ours, t in model.state_dict().items():
        if cfg.tie_word_embeddings and ours == "lm_head.weight":
            continue
        pub = names.to_published(ours, cfg)
        t = t.detach().cpu()
        if names.is_expert_weight(ours) and cfg.expert_quant == "mxfp4":
            pk, sc = names.expert_weight_pair(pub)
            tensors[pk], tensors[sc] = _packed_for(model, ours, t)
            continue
        if pub.endswith("self_attn.A_log"):
            padded = torch.zeros(names.a_log_length(cfg), dtype=torch.float32)
            padded[: t.numel()] = t.reshape(-1).float()
            t = padded
        if names.is_f32_tensor(pub):
            t = t.float()
        elif dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        tensors[pub] = t.contiguous()

    written: list[Path] = []
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})
        written.append(out / SINGLE_FILE)
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in shard})
            written.append(out / fname)
        with open(out / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        written.append(out / INDEX_FILE)
    with open(out / CONFIG_FILE, "w") as f:
        json.dump(cfg.to_dict(), f, indent=2)
        f.write("\n")
    written.append(out / CONFIG_FILE)
    return written


def _packed_for(
    model: nn.Module, ours: str, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 bytes of an expert weight: the attached ones if they still decode to it."""
    owner = model.get_submodule(ours.rsplit(".", 1)[0])
    packed = getattr(owner, "weight_packed", None)
    scales = getattr(owner, "weight_scale", None)
    if isinstance(packed, torch.Tensor) and isinstance(scales, torch.Tensor):
        packed, scales = packed.cpu(), scales.cpu()
        if torch.equal(unpack_mxfp4(packed, scales, weight.dtype), weight):
            return packed.contiguous(), scales.contiguous()
    return pack_mxfp4(weight)


__all__ = ["save_checkpoint"]
