"""Expert parallelism for the (latent) MoE: static-shape all-to-all dispatch and combine.

The MoE input ``z [T, W]`` (and the router's choices) are the same on every rank of a token
group of G ranks: the whole EP group (G = P: attention replicated or tensor-parallel over all
ranks), or one attention group of ``tp`` ranks when the instance runs ``dp = P / tp`` of them
(``k3serve.parallel.groups``: each group its own T_g tokens, G = tp). Each rank takes its own
chunk of ``S`` tokens of its group's — position t in the group: rows ``t·S … t·S+S−1``, zero
padding past T — with ``S = ⌈T / P⌉`` for one group and ``S = max_g ⌈T_g / tp⌉`` (an all-reduce
of the token counts) for several, so every (source, destination) block has the same size on
every rank (a group with no tokens sends only padding). Each rank sends its S·K token-choices to
the ranks holding the chosen copies of the experts, the receivers run their local experts, the
results come back, and an all-gather of the chunks over the token group restores ``[T, W]`` on
every rank of it::

    send[p]  [P, S·K, W+2]   block d, row s·K+k = (z_s, local slot, weight) if choice (s, k)
                              goes to rank d, else zeros with slot −1        (all_to_all #1)
    recv     [P, S·K, W+2]   block q = what rank q sent here
    back     [P, S·K, W]     w · E_slot(z) per received row, zeros elsewhere (all_to_all #2)
    out_p    [S, W]          Σ_d Σ_k back_from_d[s·K+k]           (all_gather, token group)

Static shapes — the MoonEP S×K idea (Kimi K3 report): every (source, destination) pair has a
fixed capacity of exactly S·K rows, the worst case (all of a rank's choices on one
destination), so no routing skew can overflow it and no token is ever dropped, and there is no
host synchronisation to size the buffers: the per-rank receive slot count is ``P·S·K`` whatever
the routing (``EPExperts.last_recv_slots``). The price is bandwidth: the payload is P× what a
perfectly balanced exchange would send (an overflow second round with capacity S·K/P·α would
trade that for a sync or an always-run second exchange; not built).

Redundant copies (``deploy.experts``): a choice of expert e goes to copy j of e with
probability ``fractions[j]`` — decided without communication from a fixed hash of (global token
index, k): ``u = frac((t·K + k)·φ)`` against the cumulative fractions, so it is deterministic,
the same on every rank, and splits the tokens by the plan.

The receiver's expert compute groups rows by local slot (a data-dependent gather: fine on CPU;
the GPU path would be a grouped GEMM over the receive buffer with device-side offsets — not
built here). ``routed_reference`` (all experts on one rank) is the reference beside it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from k3serve.parallel.expert_plan import LayerPlan, contiguous_plan

PHI = (math.sqrt(5.0) - 1.0) / 2.0  # golden-ratio hash: successive keys spread evenly in [0, 1)


class PlacementTables:
    """Device tables of one layer's placement.

    Attributes:
        copy_rank: ``[E, C]`` int64 rank of copy j of expert e (padded with the last copy).
        copy_slot: ``[E, C]`` int64 slot of that copy on its rank.
        copy_cum: ``[E, C]`` float64 cumulative fractions (last real one forced to 1 + pad 2.0).
        local: expert id of each local slot on ``rank``, ``[S_loc]``.
    """

    def __init__(self, plan: LayerPlan, rank: int, device: torch.device | str = "cpu") -> None:
        copies = plan.copies()
        e_num = max(copies) + 1
        c_max = max(len(v) for v in copies.values())
        cr = torch.zeros(e_num, c_max, dtype=torch.int64)
        cs = torch.zeros(e_num, c_max, dtype=torch.int64)
        cum = torch.full((e_num, c_max), 2.0, dtype=torch.float64)
        for e, lst in copies.items():
            acc = 0.0
            for j, (r, s) in enumerate(lst):
                acc += float(plan.fractions[r, s])
                cr[e, j], cs[e, j], cum[e, j] = r, s, acc
            cum[e, len(lst) - 1] = 1.0 + 1e-9  # rounding never leaves a choice unserved
            cr[e, len(lst):], cs[e, len(lst):] = cr[e, len(lst) - 1], cs[e, len(lst) - 1]
        self.copy_rank, self.copy_slot = cr.to(device), cs.to(device)
        self.copy_cum = cum.to(device)
        self.local = [int(e) for e in plan.slots[rank]]

    def choose(self, idx: torch.Tensor, token0: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pick a copy for every choice.

        Args:
            idx: ``[S, K]`` int64 chosen experts of tokens ``token0 … token0+S−1``.
            token0: global index of the first token (the hash key).

        Returns:
            ``(dest rank [S, K], slot on that rank [S, K])`` int64.
        """
        s, k = idx.shape
        key = (torch.arange(s, device=idx.device, dtype=torch.float64)[:, None] + token0) * k
        key = key + torch.arange(k, device=idx.device, dtype=torch.float64)
        u = torch.frac(key * PHI)
        j = (u[..., None] >= self.copy_cum[idx]).sum(-1)
        return self.copy_rank[idx].gather(-1, j[..., None])[..., 0], self.copy_slot[idx].gather(
            -1, j[..., None]
        )[..., 0]


class EPExperts:
    """The routed-expert sum of one MoE layer over an EP group; a drop-in for ``MoE.routed_experts`` (arguments as ``MoE.routed_loop``).

    Args:
        moe: the layer's ``k3serve.model.moe.MoE`` (its ``experts[e].run`` computes expert e;
            only the local experts are used — the runner may free the others).
        plan: this layer's placement (``None``: contiguous, E / P experts per rank).
        rank: this rank in ``group``.
        world: EP group size P.
        group: the process group (None = default group).
        tokens: ``(G, t, group)`` — the token group this rank belongs to (its size, this rank's
            position in it, its process group), when the EP group runs several attention
            groups; None: every rank of ``group`` holds the same tokens.

    Raises:
        ValueError: the plan has another rank count than ``world`` or names an expert the
            layer lacks.
    """

    def __init__(
        self, moe, plan: LayerPlan | None, rank: int, world: int, group=None,
        tokens: tuple[int, int, object] | None = None,
    ) -> None:
        e_num = moe.cfg.n_routed_experts
        plan = plan if plan is not None else contiguous_plan(e_num, world)
        if plan.num_ranks != world:
            raise ValueError(f"plan: {plan.num_ranks} ranks, EP group has {world}")
        plan.validate(e_num)
        self.cfg = moe.cfg
        self.rank, self.world, self.group = rank, world, group
        self.tokens = tokens
        dev = moe.gate.weight.device
        self.tables = PlacementTables(plan, rank, dev)
        self.experts = [moe.experts[e] for e in self.tables.local]
        self.last_recv_slots = 0

    def __call__(
        self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """``Σ_e w_e E_e(z)`` for all T tokens, on every rank (same as ``MoE.routed_loop``).

        Args:
            z: ``[T, W]`` expert inputs (identical on every rank of the token group; T may
                differ between attention groups and be 0).
            weights: ``[T, K]`` float32 routing weights.
            idx: ``[T, K]`` int64 expert ids.

        Returns:
            ``[T, W]`` float32.
        """
        p, rank = self.world, self.rank
        t, k = idx.shape
        w = z.shape[1]
        if self.tokens is None:
            g_size, pos, g_group = p, rank, self.group
            s = -(-t // p)  # token slots per rank
        else:
            g_size, pos, g_group = self.tokens
            most = torch.tensor([-(-t // g_size)], dtype=torch.int64, device=z.device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.group)
            s = max(int(most.item()), 1)
        lo, hi = pos * s, min(pos * s + s, t)
        n = max(hi - lo, 0)
        zc = z.new_zeros(s, w, dtype=torch.float32)
        ic = idx.new_zeros(s, k)
        wc = weights.new_zeros(s, k, dtype=torch.float32)
        if n:
            zc[:n], ic[:n], wc[:n] = z[lo:hi].float(), idx[lo:hi], weights[lo:hi].float()
        valid = (torch.arange(s, device=z.device) < n)[:, None].expand(s, k).reshape(-1)
        dest, slot = self.tables.choose(ic, rank * s)
        dest, slot = dest.reshape(-1), slot.reshape(-1)
        onehot = (dest[None, :] == torch.arange(p, device=z.device)[:, None]) & valid[None, :]
        payload = torch.cat(
            [zc.repeat_interleave(k, 0), slot.float()[:, None], wc.reshape(-1, 1)], 1
        )  # [S·K, W+2]
        send = payload[None] * onehot[..., None]
        send[..., w] = torch.where(onehot, send[..., w], torch.full_like(send[..., w], -1.0))
        recv = torch.empty_like(send)  # [P, S·K, W+2]: fixed, whatever the routing
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        self.last_recv_slots = recv.shape[0] * recv.shape[1]
        flat = recv.view(-1, w + 2)
        rid = flat[:, w].round().long()
        y = torch.zeros(flat.shape[0], w, dtype=torch.float32, device=z.device)
        for j, expert in enumerate(self.experts):
            rows = torch.nonzero(rid == j)[:, 0]
            if rows.numel():
                out = expert.run(self.cfg, flat[rows, :w].to(z.dtype)).float()
                y[rows] = out * flat[rows, w + 1 : w + 2]
        back = torch.empty(p, s * k, w, dtype=torch.float32, device=z.device)
        dist.all_to_all_single(back, y.view(p, s * k, w), group=self.group)
        mine = back.view(p, s, k, w).sum((0, 2))  # [S, W]
        parts = [torch.empty_like(mine) for _ in range(g_size)]
        dist.all_gather(parts, mine, group=g_group)
        return torch.cat(parts, 0)[:t]


def routed_reference(
    moe, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Plain-torch reference of the routed sum, one token-choice at a time (float32).

    Shapes as ``EPExperts.__call__``.
    """
    out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32)
    for i in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[i, j])
            out[i] += weights[i, j].float() * moe.experts[e].run(moe.cfg, z[i : i + 1]).float()[0]
    return out


def install_ep(model, plans: list[LayerPlan] | None, rank: int, world: int, group=None,
               tokens: tuple[int, int, object] | None = None) -> None:
    """Give every MoE layer of ``model`` an ``EPExperts`` (mutates ``model``; ``plans`` in MoE
    layer order, None = contiguous everywhere; ``tokens`` as ``EPExperts``).

    Raises:
        ValueError: ``plans`` with another length than the number of MoE layers.
    """
    from k3serve.parallel.counters import moe_layers

    layers = list(moe_layers(model).values())
    if plans is not None and len(plans) != len(layers):
        raise ValueError(f"plans: {len(plans)} layers, the model has {len(layers)} MoE layers")
    for j, moe in enumerate(layers):
        moe.ep = EPExperts(moe, None if plans is None else plans[j], rank, world, group,
                           tokens)


def free_remote_experts(model) -> int:
    """Drop the weights of experts this rank does not hold (after ``install_ep``); returns the
    number of expert modules freed. Their parameters become empty tensors (the module tree and
    names stay)."""
    from k3serve.parallel.counters import moe_layers

    freed = 0
    for moe in moe_layers(model).values():
        if moe.ep is None:
            continue
        keep = set(moe.ep.tables.local)
        for e, ex in enumerate(moe.experts):
            if e in keep:
                continue
            for sub in (ex.w1, ex.w2, ex.w3):
                sub.weight = torch.nn.Parameter(sub.weight.new_empty(0), requires_grad=False)
            freed += 1
    return freed


__all__ = [
    "EPExperts",
    "PlacementTables",
    "free_remote_experts",
    "install_ep",
    "routed_reference",
]
