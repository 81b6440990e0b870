"""Safetensors checkpoints with the published K3 / Kimi-Linear tensor names.

Two on-disk layouts load into :class:`~k3serve.model.model.K3ForCausalLM`:

* **K3** (``moonshotai/Kimi-K3``): every language-model tensor under ``language_model.``, MoE
  layers under ``block_sparse_moe.``, routed experts in MXFP4 (``wN.weight_packed`` uint8
  ``[out, in/2]`` + ``wN.weight_scale`` uint8 ``[out, in/32]``, OCP MX v1.0; packing in
  ``k3serve/kernels/mxfp4.py``), ``A_log`` zero-padded to ``max(H, K)``, KDA conv / decay /
  output norm and the router bias in float32. The vision tower (``vision_tower.``,
  ``mm_projector.``) is skipped: k3serve serves text.
* **Kimi Linear** as ``transformers`` writes it with ``save_pretrained``: the same layer names
  without the prefix, experts as plain ``wN.weight``, ``A_log`` as ``[1, 1, H, 1]`` (and the
  dense layer 0 spelled ``block_sparse_moe.``: ``k3_names.published_aliases``). A file holding
  transformers' *in-memory* names (fused ``conv1d``, ``experts.gate_up_proj``, ``forget_gate.``)
  is renamed by ``k3serve.model.hf_import.convert_kimi_linear_state_dict`` first.

Our module names differ from the published ones only by ``mlp.`` for ``block_sparse_moe.`` on
MoE layers (``k3serve/model/k3_names.py`` holds the rules). MXFP4 experts are dequantised into
the float parameters at load (on the CPU or wherever the model lives), and the packed bytes are
kept: attached to each expert weight's module as non-persistent buffers ``weight_packed`` /
``weight_scale`` (and returned in :class:`LoadResult`) for the GPU path.

Every load is checked before any tensor is copied: tensors the model needs but the files lack,
tensors the files have but the model does not use, and tensors of the wrong shape or dtype are
reported together in one :class:`CheckpointError`; on error the model is left untouched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from k3serve.config import PRESETS, ModelConfig, load_config
from k3serve.kernels.mxfp4 import MXFP4_BLOCK, unpack_mxfp4
from k3serve.model import k3_names as names
from k3serve.model.checkpoint_files import CONFIG_FILE, checkpoint_files, read_headers

IGNORED_PREFIXES = ("vision_tower.", "mm_projector.")
"""K3 container tensors that are not part of the language model (skipped, not 'unexpected')."""

ASSETS_DIR = Path(__file__).resolve().parents[1] / "assets"
"""Embedded checkpoints: ``k3serve/assets/<preset>/`` (safetensors + ``k3serve_config.json``)."""

MAX_LISTED = 200
"""Names listed per category in a :class:`CheckpointError` message (the attributes hold all)."""

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_TORCH_TO_ST = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.bool: "BOOL",
}  # fmt: skip


class CheckpointError(ValueError):
    """A checkpoint that does not match the model, with every problem listed.

    Attributes:
        source: the files or folder read.
        missing: published names the model needs that no file holds.
        unexpected: published names present in the files that the model does not use.
        mismatched: ``"name: expected …, got …"`` for tensors of the wrong shape or dtype (and
            tensors stored in two files).
    """

    def __init__(
        self,
        source: str,
        missing: Iterable[str] = (),
        unexpected: Iterable[str] = (),
        mismatched: Iterable[str] = (),
    ) -> None:
        self.source = source
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        self.mismatched = sorted(mismatched)
        parts = [
            (
                f"checkpoint {source} does not match the model: {len(self.missing)} missing, "
                f"{len(self.unexpected)} unexpected, {len(self.mismatched)} mis-shaped tensor(s)"
            )
        ]
        for title, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("mis-shaped", self.mismatched),
        ):
            if items:
                parts.append(f"{title}:")
                parts.extend(f"  {x}" for x in items[:MAX_LISTED])
                if len(items) > MAX_LISTED:
                    parts.append(f"  … and {len(items) - MAX_LISTED} more")
        super().__init__("\n".join(parts))


@dataclass
class LoadResult:
    """What :func:`load_checkpoint` read.

    Attributes:
        layout: ``"k3"`` (``language_model.`` prefix) or ``"kimi_linear"`` (no prefix).
        files: the safetensors files read.
        num_tensors: stored tensors consumed (an MXFP4 pair counts 2).
        packed: our expert weight name (``model.layers.{i}.mlp.experts.{e}.wN.weight``) →
            ``(weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32])`` on the CPU,
            for every expert that was stored in MXFP4 (empty with ``keep_packed=False``).
        ignored: tensors skipped on purpose (K3's vision tower / projector).
    """

    layout: str
    files: list[Path]
    num_tensors: int = 0
    packed: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------- load
@dataclass
class _Plan:
    """How one of our state-dict tensors is filled from the files."""

    ours: str
    kind: str  # "plain" | "a_log" | "dense_expert" | "mxfp4_expert"
    sources: tuple[str, ...]


def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def _plan_load(
    sd: dict[str, torch.Tensor],
    headers: dict[str, tuple[Path | None, tuple[int, ...], str]],
    cfg: ModelConfig,
    prefix: str,
) -> tuple[list[_Plan], list[str], list[str], set[str]]:
    """Match our tensors to stored ones; return (plans, missing, mismatched, consumed names)."""
    plans: list[_Plan] = []
    missing: list[str] = []
    bad: list[str] = []
    used: set[str] = set()
    h = cfg.kda_num_heads

    def check(
        pub: str, want_shape: tuple[int, ...], floating: bool, want_dtype: str | None = None
    ) -> bool:
        _, shape, dtype = headers[pub]
        used.add(pub)
        ok_dtype = dtype in _FLOAT_DTYPES if floating else dtype == want_dtype
        if shape != want_shape or not ok_dtype:
            kind = "float" if floating else want_dtype
            bad.append(
                f"{pub}: expected {_shape_str(want_shape)} {kind}, got {_shape_str(shape)} {dtype}"
            )
            return False
        return True

    for ours, t in sd.items():
        if cfg.tie_word_embeddings and ours == "lm_head.weight":
            continue
        pub = names.to_published(ours, cfg, prefix)
        shape = tuple(t.shape)
        if names.is_expert_weight(ours):
            pk, sc = names.expert_weight_pair(pub)
            has_dense = pub in headers
            has_pair = pk in headers or sc in headers
            want_pair = cfg.expert_quant == "mxfp4"
            if has_pair and (want_pair or not has_dense):
                if shape[-1] % MXFP4_BLOCK:
                    bad.append(
                        f"{pk}: the model's {_shape_str(shape)} cannot be MXFP4 (in % 32 != 0)"
                    )
                    used.update(x for x in (pk, sc) if x in headers)
                    continue
                ok = True
                for name, want in (
                    (pk, (shape[0], shape[1] // 2)),
                    (sc, (shape[0], shape[1] // MXFP4_BLOCK)),
                ):
                    if name not in headers:
                        missing.append(name)
                        ok = False
                    else:
                        ok = check(name, want, floating=False, want_dtype="U8") and ok
                if ok:
                    plans.append(_Plan(ours, "mxfp4_expert", (pk, sc)))
            elif has_dense:
                if check(pub, shape, floating=True):
                    plans.append(_Plan(ours, "dense_expert", (pub,)))
            else:
                missing.extend((pk, sc) if want_pair else (pub,))
            continue
        if pub not in headers:
            alias = next((a for a in names.published_aliases(pub) if a in headers), None)
            if alias is None:
                missing.append(pub)
                continue
            pub = alias
        if pub.endswith("self_attn.A_log"):
            _, got, dtype = headers[pub]
            used.add(pub)
            allowed = {(h,), (1, 1, h, 1), (names.a_log_length(cfg),)}
            if got not in allowed or dtype not in _FLOAT_DTYPES:
                want = " or ".join(_shape_str(s) for s in sorted(allowed))
                bad.append(f"{pub}: expected {want} float, got {_shape_str(got)} {dtype}")
            else:
                plans.append(_Plan(ours, "a_log", (pub,)))
            continue
        floating = t.is_floating_point()
        if check(pub, shape, floating, None if floating else _TORCH_TO_ST.get(t.dtype)):
            plans.append(_Plan(ours, "plain", (pub,)))
    return plans, missing, bad, used


def load_checkpoint(
    model: nn.Module,
    folder_or_files: str | os.PathLike | Sequence[str | os.PathLike],
    cfg: ModelConfig,
    *,
    keep_packed: bool = True,
) -> LoadResult:
    """Fill every parameter and persistent buffer of ``model`` from a safetensors checkpoint.

    The layout (K3 with the ``language_model.`` prefix, or Kimi Linear without) is detected
    from the names. Stored floats are cast to each parameter's dtype; MXFP4 experts are
    dequantised (:func:`~k3serve.kernels.mxfp4.unpack_mxfp4`) into the parameter's dtype and,
    with ``keep_packed``, their bytes are attached to the expert's module as non-persistent
    buffers ``weight_packed`` / ``weight_scale`` (moved by ``model.to``) and returned. An
    expert stored both dense and packed is read in the form ``cfg.expert_quant`` prefers; the
    other form is reported as unexpected.

    Args:
        model: a :class:`~k3serve.model.model.K3ForCausalLM` built from ``cfg`` (any device
            except meta).
        folder_or_files: see :func:`checkpoint_files` (sharded ``*.index.json`` folders too).
        cfg: the model's config (MoE layers, A_log padding, tied embeddings, expert format).
        keep_packed: keep the MXFP4 bytes of experts stored packed.

    Returns:
        :class:`LoadResult`.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped tensors, all listed at once; nothing
            has been copied into ``model`` then.
        FileNotFoundError: see :func:`checkpoint_files`.
    """
    files = checkpoint_files(folder_or_files)
    source = (
        str(folder_or_files)
        if isinstance(folder_or_files, (str, os.PathLike))
        else str([str(f) for f in files])
    )
    headers, dups = read_headers(files)
    k3 = any(n.startswith(names.LANGUAGE_MODEL_PREFIX) for n in headers)
    prefix = names.LANGUAGE_MODEL_PREFIX if k3 else ""
    ignored = sorted(n for n in headers if k3 and n.startswith(IGNORED_PREFIXES))
    in_memory: dict[str, torch.Tensor] | None = None
    if not k3 and any(_TRANSFORMERS_RUNTIME.search(n) for n in headers):
        in_memory = _convert_transformers_runtime(files, cfg, source)
        headers = {n: (None, tuple(t.shape), _st_dtype(t)) for n, t in in_memory.items()}

    sd = model.state_dict()
    plans, missing, bad, used = _plan_load(sd, headers, cfg, prefix)
    if cfg.tie_word_embeddings:
        used.add(prefix + "lm_head.weight")  # tied: a stored copy is redundant, not an error
    skipped = set(ignored)
    unexpected = [n for n in headers if n not in used and n not in skipped]
    if missing or unexpected or bad or dups:
        raise CheckpointError(source, missing, unexpected, bad + dups)

    result = LoadResult(layout="k3" if k3 else "kimi_linear", files=files, ignored=ignored)
    if in_memory is not None:
        with torch.no_grad():
            for plan in plans:
                srcs = [in_memory[s] for s in plan.sources]
                result.num_tensors += len(srcs)
                _apply(model, sd[plan.ours], plan, srcs, cfg, result, keep_packed)
        return result

    by_file: dict[Path, list[str]] = {}
    for p in plans:
        for s in p.sources:
            by_file.setdefault(headers[s][0], []).append(s)
    pending: dict[str, torch.Tensor] = {}
    plan_of = {s: p for p in plans for s in p.sources}
    with torch.no_grad():
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in by_file.get(path, []):
                    pending[name] = f.get_tensor(name)
                    result.num_tensors += 1
                    plan = plan_of[name]
                    if all(s in pending for s in plan.sources):
                        _apply(
                            model,
                            sd[plan.ours],
                            plan,
                            [pending.pop(s) for s in plan.sources],
                            cfg,
                            result,
                            keep_packed,
                        )
    return result


_TRANSFORMERS_RUNTIME = re.compile(
    r"\.self_attn\.forget_gate\.|\.self_attn\.conv1d\.weight$|\.experts\.(gate_up_proj|down_proj)$"
)
"""Names only found in transformers' in-memory KimiLinear state dict (fused conv / experts)."""


def _st_dtype(t: torch.Tensor) -> str:
    return _TORCH_TO_ST.get(t.dtype, str(t.dtype))


def _convert_transformers_runtime(
    files: Sequence[Path], cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """Read a file holding transformers' *in-memory* KimiLinear names and rename it, via
    :func:`k3serve.model.hf_import.convert_kimi_linear_state_dict`, to published names.

    ``save_pretrained`` never writes these names; a ``safetensors.save_file`` of
    ``KimiLinearForCausalLM.state_dict()`` does. The whole checkpoint is read into memory.

    Raises:
        CheckpointError: a fused tensor the converter rejects (its message is listed).
    """
    from safetensors.torch import load_file

    from k3serve.model.hf_import import convert_kimi_linear_state_dict

    raw: dict[str, torch.Tensor] = {}
    for path in files:
        raw.update(load_file(str(path)))
    try:
        ours = convert_kimi_linear_state_dict(raw, cfg)
    except ValueError as e:
        raise CheckpointError(source, mismatched=[str(e)]) from e
    return {names.to_published(n, cfg, ""): t for n, t in ours.items()}


def _apply(
    model: nn.Module,
    dst: torch.Tensor,
    plan: _Plan,
    srcs: list[torch.Tensor],
    cfg: ModelConfig,
    result: LoadResult,
    keep_packed: bool,
) -> None:
    """Copy one planned tensor into the model (``dst`` shares the parameter's storage)."""
    if plan.kind == "mxfp4_expert":
        packed, scales = srcs
        dst.copy_(unpack_mxfp4(packed.to(dst.device), scales.to(dst.device), dtype=dst.dtype))
        if keep_packed:
            owner = model.get_submodule(plan.ours.rsplit(".", 1)[0])
            device = dst.device
            owner.register_buffer("weight_packed", packed.to(device), persistent=False)
            owner.register_buffer("weight_scale", scales.to(device), persistent=False)
            result.packed[plan.ours] = (packed, scales)
        return
    src = srcs[0]
    if plan.kind == "dense_expert":  # drop packed bytes of an earlier load: they'd be stale
        owner = model.get_submodule(plan.ours.rsplit(".", 1)[0])
        for buf in ("weight_packed", "weight_scale"):
            if buf in dict(owner.named_buffers(recurse=False)):
                delattr(owner, buf)
    if plan.kind == "a_log":
        src = src.reshape(-1)[: cfg.kda_num_heads]
    dst.copy_(src.to(dst.dtype))


# ---------------------------------------------------------------------- model loading
class LoadedModel(NamedTuple):
    """What :func:`load_model` returns.

    Attributes:
        model: a :class:`~k3serve.model.model.K3ForCausalLM` in eval mode on the device.
        config: its :class:`~k3serve.config.ModelConfig`.
        folder: the checkpoint folder its weights were read from, ``None`` for random init
            (``checkpoint_identity(folder)`` / ``random_init_identity(seed)`` name them).
    """

    model: nn.Module
    config: ModelConfig
    folder: str | None


def load_model(
    source: str | os.PathLike | ModelConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    random_init: bool = False,
) -> LoadedModel:
    """Build a model and load its weights: the one loader (offline ``LLM``, the workers,
    ``scripts/eval_bpb.py`` and the benchmarks call it).

    Sources:

    * a :class:`~k3serve.config.ModelConfig`: that shape, random weights (no file to read);
    * a preset name: the checkpoint embedded in ``k3serve/assets/<preset>/`` (its
      ``k3serve_config.json`` wins over the preset if it has one);
    * a checkpoint folder with ``k3serve_config.json`` (ours) or ``config.json`` (Hugging
      Face) and safetensors (K3 or Kimi-Linear names, checked strictly by
      :func:`load_checkpoint`).

    Weights are never made up silently: a preset without an embedded checkpoint raises unless
    ``random_init`` asks for random weights.

    Args:
        source: see above.
        device: where the model goes.
        dtype: parameter dtype (CPU computes in float32; KDA ``A_log``/``dt_bias`` and the
            router bias stay float32).
        seed: the random-init seed (the global torch RNG is left as it was).
        random_init: random weights for the preset's / folder's shape; no weights are read.

    Returns:
        :class:`LoadedModel` ``(model, config, folder)``.

    Raises:
        FileNotFoundError: a preset without embedded weights and ``random_init=False``; a
            folder without safetensors (from :func:`checkpoint_files`).
        ValueError: unknown preset / folder without a config (from ``load_config``).
        CheckpointError: the weights do not match the model (nothing is loaded then).
    """
    from k3serve.model.model import K3ForCausalLM

    folder: Path | None = None
    if isinstance(source, ModelConfig):
        cfg = source
    elif str(source) in PRESETS:
        key = str(source)
        cfg = PRESETS[key]
        embedded = ASSETS_DIR / key
        if not random_init:
            if not (embedded.is_dir() and any(embedded.glob("*.safetensors"))):
                raise FileNotFoundError(
                    f"model {key!r}: no embedded checkpoint in {embedded} (expected "
                    "*.safetensors); pass random_init=True for random weights, or a checkpoint "
                    "folder"
                )
            folder = embedded
            if (embedded / CONFIG_FILE).exists():
                cfg = load_config(str(embedded))
    else:
        cfg = load_config(os.fspath(source))  # ValueError: neither a preset nor a folder
        folder = None if random_init else Path(source)
    # Weights read from a folder replace the init: build straight on an accelerator then (the
    # CPU init of a multi-billion-parameter model takes minutes; random init stays on the CPU
    # so that a seed gives the same weights on every device).
    dev = torch.device(device)
    build_on = dev if folder is not None and dev.type == "cuda" else torch.device("cpu")
    with torch.random.fork_rng(devices=[build_on] if build_on.type == "cuda" else []):
        torch.manual_seed(seed)
        with build_on:
            model = K3ForCausalLM(cfg, dtype=dtype)
    if folder is not None:
        load_checkpoint(model, folder, cfg)
    return LoadedModel(model.to(device).eval(), cfg, None if folder is None else str(folder))


__all__ = [
    "ASSETS_DIR",
    "CheckpointError",
    "LoadResult",
    "LoadedModel",
    "load_checkpoint",
    "load_model",
]
