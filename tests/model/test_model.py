"""k3serve.model: cache-consistent forward, absorbed MLA, MoE routing, Block AttnRes.

Tiny shapes, float32/float64 on CPU. The whole-model tests use the ``k3-tiny`` preset with random
weights. Parameter counts and tensor shapes of the presets: ``test_model_shapes.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from k3serve.cache.pools import KVPools
from k3serve.cache.specs import CacheDtypes, KDAStateSpec, MLALatentSpec
from k3serve.config import PRESETS
from k3serve.kernels.mla import naive as mla_ref
from k3serve.kernels.naive import attn_res_mix, situ_glu
from k3serve.model.batch import make_batch
from k3serve.model.mla import MLAMixer
from k3serve.model.model import K3ForCausalLM
from k3serve.model.moe import MoE

torch.set_num_threads(1)  # 2 shared cores: extra intra-op threads only spin (40x slower here)

TINY = PRESETS["k3-tiny"]
BS = 4  # small pages so prompts span several, non-contiguous ones


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6))


@pytest.fixture(scope="module")
def tiny() -> K3ForCausalLM:
    torch.manual_seed(0)
    m = K3ForCausalLM(TINY).eval()
    with torch.no_grad():  # larger random weights than the init so every path moves the logits
        for n, p in m.named_parameters():
            if n.endswith(("_res_proj.weight", "e_score_correction_bias")):
                p.normal_(0.0, 0.5)
    return m


def pools(num_slots: int = 4, num_pages: int = 32) -> KVPools:
    return KVPools(TINY, num_slots=num_slots, num_pages=num_pages, block_size=BS)


def pages(first: int, n: int) -> list[int]:
    return [first + 3 * i for i in range(n)]  # strided: pages of one sequence are not adjacent



def test_pools_follow_the_cache_specs() -> None:
    """The allocated pools have the shapes and bytes the spec classes compute (the router and
    the kvstore size transfers from the specs, never from the tensors)."""
    pl = KVPools(TINY, num_slots=3, num_pages=5, block_size=BS, num_snapshots=2)
    mla = MLALatentSpec.from_config(TINY, BS, "float32")
    kda = KDAStateSpec.from_config(TINY, CacheDtypes.for_config(TINY, "float32"))
    assert pl.mla_latent.shape == (mla.num_layers, 5, *mla.page_shape())
    assert pl.kda_state.shape == (kda.num_layers, 3, *kda.state_shape())
    assert pl.conv_state.shape == (kda.num_layers, 3, *kda.conv_shape())
    assert pl.snap_state.shape[1] == pl.snap_conv.shape[1] == 2
    nb = pl.nbytes()
    assert nb["mla_latent"] == 5 * mla.page_size_bytes
    assert nb["kda_state"] + nb["conv_state"] == 3 * kda.slot_size_bytes
    assert nb["snap_state"] + nb["snap_conv"] == 2 * kda.snapshot_size_bytes

# ----------------------------------------------------------------------------- (a) whole model
@torch.no_grad()
def test_prefill_then_decode_equals_one_prefill(tiny: K3ForCausalLM) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, TINY.vocab_size, (13,))
    table = pages(2, 4)
    full = tiny(ids, make_batch([13], [0], [1], [table], BS, all_logits=True), pools())
    assert torch.allclose(full, tiny.forward_train(ids[None])[0], rtol=0, atol=1e-4)
    pl = pools()
    out = [tiny(ids[:7], make_batch([7], [0], [1], [table], BS), pl)]
    for i in range(7, 13):
        b = make_batch([1], [i], [1], [table], BS)
        assert b.is_decode
        out.append(tiny(ids[i : i + 1], b, pl))
    assert rel_err(torch.cat(out), full[6:]) < 1e-4


@torch.no_grad()
def test_prefill_from_carried_state_equals_one_pass(tiny: K3ForCausalLM) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, TINY.vocab_size, (21,))
    table = pages(1, 6)
    p1 = pools()
    full = tiny(ids, make_batch([21], [0], [0], [table], BS, all_logits=True), p1)
    p2 = pools()
    a = tiny(ids[:9], make_batch([9], [0], [3], [table], BS, all_logits=True), p2)
    b = tiny(ids[9:], make_batch([12], [9], [3], [table], BS, all_logits=True), p2)
    assert rel_err(torch.cat([a, b]), full) < 1e-4
    assert rel_err(p2.kda_state[:, 3], p1.kda_state[:, 0]) < 1e-4
    assert torch.allclose(p2.conv_state[:, 3], p1.conv_state[:, 0], atol=1e-5)


@torch.no_grad()
def test_varlen_batch_equals_each_alone(tiny: K3ForCausalLM) -> None:
    torch.manual_seed(3)
    lens, cached = [5, 11, 1], [0, 0, 0]
    seqs = [torch.randint(0, TINY.vocab_size, (n,)) for n in lens]
    tables = [pages(0, 2), pages(1, 3), pages(2, 1)]
    pl = pools()
    both = tiny(
        torch.cat(seqs), make_batch(lens, cached, [2, 0, 1], tables, BS, all_logits=True), pl
    )
    alone = [
        tiny(s, make_batch([len(s)], [0], [0], [t], BS, all_logits=True), pools())
        for s, t in zip(seqs, tables)
    ]
    assert rel_err(both, torch.cat(alone)) < 1e-4
    # then one decode step for all three together == each alone
    nxt = torch.randint(0, TINY.vocab_size, (3,))
    tables2 = [t + [40 + i] for i, t in enumerate(tables)]
    lg = tiny(nxt, make_batch([1, 1, 1], lens, [2, 0, 1], [t for t in tables2], BS), pl)
    for i, s in enumerate(seqs):
        ref = tiny(
            torch.cat([s, nxt[i : i + 1]]),
            make_batch([len(s) + 1], [0], [0], [tables2[i]], BS),
            pools(num_pages=48),
        )
        assert rel_err(lg[i : i + 1], ref) < 1e-4


@torch.no_grad()
def test_conv_state_holds_last_pre_conv_inputs_and_hook_order(tiny: K3ForCausalLM) -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, TINY.vocab_size, (6,))
    seen: dict[int, torch.Tensor] = {}
    j0 = TINY.kda_layers[1]
    mixer = tiny.model.layers[j0].self_attn

    def grab(mod: torch.nn.Module, args: tuple) -> None:
        seen[0] = args[0].clone()

    h = mixer.register_forward_pre_hook(grab)
    calls: list[int] = []
    pl = pools()

    def hook(i: int) -> None:
        calls.append(i)
        if i == j0:  # the layer's cache is written when the hook runs
            seen[1] = pl.kda_state[1, 2].clone()

    try:
        tiny(ids, make_batch([6], [0], [2], [pages(0, 2)], BS), pl, layer_hook=hook)
    finally:
        h.remove()
    x = seen[0]
    pre = torch.cat([mixer.q_proj(x), mixer.k_proj(x), mixer.v_proj(x)], -1)
    assert calls == list(range(TINY.num_layers))
    assert torch.equal(pl.conv_state[1, 2], pre[-(TINY.kda_conv_kernel - 1) :])
    assert seen[1].abs().sum() > 0 and torch.equal(seen[1], pl.kda_state[1, 2])


def test_forward_train_is_differentiable() -> None:
    cfg = TINY.replace(num_layers=4, mla_layers=(3,), attn_res_block_layers=2)
    m = K3ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 5))
    loss = F.cross_entropy(
        m.forward_train(ids)[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1)
    )
    loss.backward()
    grads = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
    for n in (
        "model.layers.0.self_attn.A_log",
        "model.layers.3.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.routed_expert_down_proj.weight",
        "model.embed_tokens.weight",
    ):
        assert grads[n] is not None and grads[n].abs().sum() > 0, n
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # tame init: near-uniform predictions


def test_bad_input_raises(tiny: K3ForCausalLM) -> None:
    with pytest.raises(ValueError, match="input_ids"):
        tiny(torch.zeros(3, dtype=torch.long), make_batch([2], [0], [0], [[0]], BS), pools())
    with pytest.raises(ValueError, match="block_tables"):
        make_batch([9], [0], [0], [[0]], BS)


# ----------------------------------------------------------------------------- (b) absorbed MLA
@torch.no_grad()
def test_absorbed_mla_decode_equals_naive() -> None:
    torch.manual_seed(5)
    cfg = TINY.replace(q_lora_rank=None)
    mla = MLAMixer(cfg, dtype=torch.float64)
    for p in mla.parameters():
        p.normal_(0.0, 0.3)
    pool = torch.randn(12, BS, cfg.mla_latent_dim, dtype=torch.float64)
    table = torch.tensor([[7, 2, 9, -1], [0, 5, 11, 3]])
    seq_lens = torch.tensor([10, 15])
    q = torch.randn(2, cfg.mla_num_heads, cfg.qk_head_dim, dtype=torch.float64)
    o = mla.absorbed_output(
        mla_ref.mla_decode_absorbed_paged(
            mla.absorbed_query(q).double(), pool, table, seq_lens, cfg.kv_lora_rank, mla.scale
        )
    )
    for i in range(2):
        lat = mla_ref.gather_latents(pool, table[i], int(seq_lens[i]))
        ref = mla_ref.mla_attention_naive(
            q[i : i + 1],
            lat,
            mla.kv_b_proj.weight,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
            mla.scale,
            int(seq_lens[i]) - 1,
        )
        assert rel_err(o[i : i + 1].double(), ref) < 1e-5
    assert mla.scale == cfg.qk_head_dim**-0.5  # 1/sqrt(nope + rope), not of the absorbed width


# ----------------------------------------------------------------------------- (c) MoE
def brute_force_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, straight from the formulas (DeepSeek-V3 §2.1.2, DESIGN.md §2)."""
    cfg = moe.cfg
    out = []
    for xt in x.double():
        s = torch.sigmoid(moe.gate.weight.double() @ xt)
        chosen = sorted(
            range(cfg.n_routed_experts),
            key=lambda e: -(s[e] + moe.gate.e_score_correction_bias[e].double()),
        )[: cfg.num_experts_per_tok]
        w = torch.stack([s[e] for e in chosen])
        if cfg.norm_topk_prob:
            w = w / w.sum()
        w = w * cfg.routed_scaling_factor
        z = moe.routed_expert_down_proj.weight.double() @ xt if cfg.moe_latent_size else xt
        r = torch.zeros_like(z)
        for wi, e in zip(w, chosen):
            ex = moe.experts[e]
            g, u = ex.w1.weight.double() @ z, ex.w3.weight.double() @ z
            act = (
                situ_glu(g, u, cfg.situ_beta, cfg.situ_beta_linear)
                if cfg.hidden_act == "situ"
                else F.silu(g) * u
            )
            r = r + wi * (ex.w2.weight.double() @ act)
        if cfg.moe_latent_size:
            r = (
                r
                * torch.rsqrt(r.pow(2).mean() + cfg.rms_norm_eps)
                * moe.routed_expert_norm.weight.double()
            )
            r = moe.routed_expert_up_proj.weight.double() @ r
        sh = moe.shared_experts
        g, u = sh.gate_proj.weight.double() @ xt, sh.up_proj.weight.double() @ xt
        act = (
            situ_glu(g, u, cfg.situ_beta, cfg.situ_beta_linear)
            if cfg.hidden_act == "situ"
            else F.silu(g) * u
        )
        out.append(r + sh.down_proj.weight.double() @ act)
    return torch.stack(out)


@pytest.mark.parametrize("latent", [True, False], ids=["latent-situ", "plain-silu"])
@torch.no_grad()
def test_moe_equals_per_token_brute_force(latent: bool) -> None:
    torch.manual_seed(6)
    cfg = TINY.replace(
        hidden_size=32,
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_latent_size=24 if latent else None,
        hidden_act="situ" if latent else "silu",
    )
    moe = MoE(cfg)
    for p in moe.parameters():
        p.normal_(0.0, 0.4)
    moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.5, -0.5, 0.2, 0.0, 0.1]))
    x = torch.randn(9, cfg.hidden_size)
    ref = brute_force_moe(moe, x)
    assert rel_err(moe(x).double(), ref) < 1e-5
    # the bias changes the choice but not the weights: a huge bias forces expert 2 everywhere
    moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 100.0, 0.0, 0.0, 0.0]))
    _, idx = moe.gate(x)
    assert bool((idx == 2).any(-1).all())
    assert rel_err(moe(x).double(), brute_force_moe(moe, x)) < 1e-5


def test_situ_glu_is_bounded_swiglu() -> None:
    g = torch.tensor([-100.0, -1.0, 0.0, 0.5, 100.0], dtype=torch.float64)
    u = torch.tensor([1000.0, 2.0, 3.0, 0.01, -1000.0], dtype=torch.float64)
    y = situ_glu(g, u)
    want = [
        4 * math.tanh(a / 4) / (1 + math.exp(-a)) * 25 * math.tanh(b / 25)
        for a, b in zip(g.tolist(), u.tolist())
    ]
    assert torch.allclose(y, torch.tensor(want, dtype=torch.float64))
    assert y.abs().max() <= 100.0  # |gate| < 4, |up| < 25
    small = torch.tensor([0.01, -0.02], dtype=torch.float64)
    assert torch.allclose(situ_glu(small, small), F.silu(small) * small, rtol=1e-3)


# ----------------------------------------------------------------------------- (d) Block AttnRes
def test_attn_res_zero_query_is_equal_weights() -> None:
    a = torch.tensor([[1.0, 2.0, 3.0]])
    b = torch.tensor([[4.0, -2.0, 0.0]])
    c = torch.tensor([[-1.0, 0.0, 6.0]])
    gamma = torch.tensor([0.3, -2.0, 5.0])
    out = attn_res_mix([a, b, c], gamma, torch.zeros(1, 3), 1e-5)
    assert torch.allclose(out, torch.tensor([[4.0 / 3, 0.0, 3.0]]))


def test_attn_res_hand_computed_two_sources() -> None:
    a = torch.tensor([[3.0, 4.0]])  # rms = sqrt(12.5)
    b = torch.tensor([[1.0, -1.0]])  # rms = 1
    w = torch.tensor([[1.0, 0.0]])
    la, lb = 3.0 / math.sqrt(12.5), 1.0  # w · RMSNorm(v), gamma = 1, eps ~ 0
    pa = math.exp(la) / (math.exp(la) + math.exp(lb))
    want = pa * a + (1 - pa) * b
    assert torch.allclose(attn_res_mix([a, b], torch.ones(2), w, 1e-12), want, atol=1e-6)
    assert torch.equal(attn_res_mix([a], torch.ones(2), w, 1e-5), a)  # one source: itself


def test_attn_res_off_is_plain_residual() -> None:
    cfg = TINY.replace(num_layers=2, mla_layers=(1,), attn_res_block_layers=0)
    m = K3ForCausalLM(cfg)
    assert not any("res_proj" in n for n, _ in m.named_parameters())
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        x = m.model.embed_tokens(ids[0])
        cu = torch.tensor([0, 5])
        for layer in m.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cu)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        want = m.lm_head(m.model.norm(x))
        assert torch.allclose(m.forward_train(ids)[0], want, atol=1e-6)


def test_make_batch_slots_and_host_copy() -> None:
    """``make_batch``'s vectorised slot mapping equals the per-token formula ``page · B +
    offset`` on random ragged layouts (cached prefixes, spare pages, any page order), and its
    host copy (``ForwardBatch.host``) equals the device tensors."""
    import random

    rng = random.Random(0)
    for _ in range(50):
        n, bs = rng.randint(1, 4), rng.choice([1, 3, 16])
        lens = [rng.randint(1, 30) for _ in range(n)]
        cached = [rng.randint(0, 30) for _ in range(n)]
        tables = [
            rng.sample(range(500), -(-(c + m) // bs) + rng.randint(0, 2))
            for c, m in zip(cached, lens)
        ]
        b = make_batch(lens, cached, list(range(n)), tables, bs)
        ref = [t[p // bs] * bs + p % bs for t, c, m in zip(tables, cached, lens)
               for p in range(c, c + m)]  # fmt: skip
        assert b.slot_mapping.tolist() == ref
        assert list(b.host.cu_seqlens) == b.cu_seqlens.tolist()
        assert list(b.host.num_cached) == b.num_cached.tolist() == cached
        assert [list(r) for r in b.host.block_table] == tables
        assert b.is_decode == all(m == 1 for m in lens)
