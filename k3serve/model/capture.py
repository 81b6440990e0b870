"""KDA inputs kept from a verify forward, and the replay of an accepted prefix.

A speculative verify forward feeds each sequence ``1 + k`` tokens (the last sampled token and
``k`` proposed ones) but only an accepted prefix of them may enter the recurrent state. With a
:class:`KDACapture` on the batch, every KDA layer reads its slots' states (initial state of the
chunked kernel, conv history) and writes neither; it keeps, per new token, the inputs of the
state update instead::

    pre   [T, 3·H·K]  pre-conv q | k | v inputs (the conv state is the last W−1 of them)
    k     [T, H, K]   L2-normalised keys        v    [T, H, V]
    g     [T, H, K]   log-decay (≤ 0)           beta [T, H]

(≈ 6·H·K values per token per layer, against ``H·K·V`` for a per-position state snapshot —
the replay idea of SGLang's ReplaySSM and the K3 report). :func:`replay` then advances each
slot over a chosen range of its tokens with the decode step kernel
(:func:`k3serve.kernels.dispatch.fused_recurrent_kda_step`, Kimi Linear arXiv 2510.26692 §3:
``S ← diag(exp g) S;  S ← S + β k (v − Sᵀk)ᵀ``) and shifts the conv history by exactly the
accepted pre-conv inputs, so the slot ends holding the state of the accepted tokens alone.
MLA latents need no replay: the verify forward writes every token's latent at its position,
positions past the accepted prefix are never read (attention reads ``seq_lens``) and are
overwritten by the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from k3serve.kernels import dispatch


@dataclass
class LayerInputs:
    """One KDA layer's state-update inputs for the forward's ``T`` new tokens (shapes above)."""

    pre: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


@dataclass
class KDACapture:
    """Per-layer KDA inputs of one verify forward (filled by the KDA mixers).

    Attributes:
        cu_seqlens: ``N+1`` host ints, the forward's row boundaries in the ``T`` tokens.
        layers: KDA layer index ``j`` (into ``kda_state``) → :class:`LayerInputs`.
    """

    cu_seqlens: tuple[int, ...]
    layers: dict[int, LayerInputs] = field(default_factory=dict)

    def put(self, j: int, pre: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor) -> None:
        """Keep layer ``j``'s inputs (tensors as documented in the module docstring)."""
        self.layers[j] = LayerInputs(pre, k, v, g.float(), beta.float())


@torch.inference_mode()
def replay(
    capture: KDACapture,
    kda_state: torch.Tensor,
    conv_state: torch.Tensor,
    rows: Sequence[int],
    slots: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
) -> None:
    """Advance slots over captured tokens: for each ``i``, row ``rows[i]``'s tokens
    ``[starts[i], starts[i] + lengths[i])`` (offsets inside the row) enter ``slots[i]``'s KDA
    and conv states, in every KDA layer. Mutates the pools.

    Every KDA layer is replayed at once: the pool ``[L_kda, S, H, K, V]`` is viewed as
    ``L_kda · S`` rows and step ``t`` advances all ``(layer, slot)`` pairs whose range has a
    ``t``-th token in one decode-step call; the index tables go to the device in one copy.
    The conv histories are gathered from ``[history ; captured pre-conv inputs]`` in one go.

    Args:
        capture: the verify forward's inputs.
        kda_state: ``[L_kda, S, H, K, V]`` float32 pool (contiguous).
        conv_state: ``[L_kda, S, W-1, C]`` pool (contiguous).
        rows, slots, starts, lengths: equal-length lists; ``lengths`` ≥ 0, distinct slots.

    Raises:
        ValueError: mismatched lists, a range outside its row, a capture without every KDA
            layer.
    """
    n = len(rows)
    if not (len(slots) == len(starts) == len(lengths) == n):
        raise ValueError("replay: rows, slots, starts, lengths differ in length")
    cu = capture.cu_seqlens
    for r, s, m in zip(rows, starts, lengths):
        if s < 0 or m < 0 or cu[r] + s + m > cu[r + 1]:
            raise ValueError(f"replay: tokens [{s}, {s + m}) outside row {r} ({cu[r + 1] - cu[r]})")
    live = [i for i in range(n) if lengths[i] > 0]
    if not live or not capture.layers:
        return
    dev = kda_state.device
    layers = sorted(capture.layers)
    nl, t_all, num_slots = len(layers), cu[-1], kda_state.shape[1]
    xs = [capture.layers[j] for j in layers]
    k = torch.stack([x.k for x in xs]).flatten(0, 1)  # [nl·T, H, K]
    v = torch.stack([x.v for x in xs]).flatten(0, 1)
    g = torch.stack([x.g for x in xs]).flatten(0, 1)
    beta = torch.stack([x.beta for x in xs]).flatten(0, 1)
    if layers != list(range(kda_state.shape[0])):
        raise ValueError(f"replay: the capture holds KDA layers {layers}, not all of them")
    pool = kda_state.view(-1, *kda_state.shape[2:])  # [L_kda·S, H, K, V], rows j·S + slot
    # host index tables: step t → (token row in [nl·T], pool row in [nl·S]) of active pairs
    steps, offs = [], [0]
    for t in range(max(lengths[i] for i in live)):
        act = [i for i in live if lengths[i] > t]
        steps += [li * t_all + cu[rows[i]] + starts[i] + t for li in range(nl) for i in act]
        steps += [layers[li] * num_slots + slots[i] for li in range(nl) for i in act]
        offs.append(len(steps))
    idx = torch.tensor(steps, dtype=torch.int64)
    idx = idx.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else idx.to(dev)
    for t in range(len(offs) - 1):
        a, b = offs[t], offs[t + 1]
        tok, sl = idx[a : (a + b) // 2], idx[(a + b) // 2 : b]
        kt = k.index_select(0, tok)
        dispatch.fused_recurrent_kda_step(kt, kt, v.index_select(0, tok),
                                          g.index_select(0, tok), beta.index_select(0, tok),
                                          pool, sl)  # fmt: skip
    # conv: new history = the last W−1 of [history ; accepted pre-conv inputs], per slot
    w1 = conv_state.shape[2]
    sl_live = [slots[i] for i in live]
    ext_idx = []
    for r_, i in enumerate(live):
        m, base = lengths[i], cu[rows[i]] + starts[i]
        for p in range(m, m + w1):  # position p of [history (w1) ; new (m)], the last w1
            ext_idx.append(r_ * w1 + p if p < w1 else len(live) * w1 + base + p - w1)
    pre = torch.stack([x.pre for x in xs]).to(conv_state.dtype)  # [nl, T, C]
    lj = torch.tensor(layers, device=dev)
    st = torch.tensor(sl_live, device=dev)
    hist = conv_state[lj][:, st].flatten(1, 2)  # [nl, N·w1, C]
    ext = torch.cat([hist, pre], 1)
    new = ext[:, torch.tensor(ext_idx, device=dev)].view(nl, len(live), w1, -1)
    conv_state[lj[:, None], st[None, :]] = new


__all__ = ["KDACapture", "LayerInputs", "replay"]
