"""k3serve runs Kimi Linear exactly like transformers' KimiLinearForCausalLM (same logits, same greedy tokens).

A tiny random KimiLinear (float32) is saved with ``save_pretrained`` and loaded through
``k3serve.model.hf_import``. Prefill logits of several prompts (one varlen batch on our side) must
match transformers' within max relative error 1e-4, and 32 greedy decode steps must give the same
tokens. transformers is forced onto its pure-PyTorch KDA / conv path (fla-core is installed but
its Triton kernels do not run on CPU): the functions are swapped for the torch references the
wrappers were built from, and the test checks those references actually ran.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
M = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")

from k3serve.cache.pools import KVPools
from k3serve.model.batch import make_batch
from k3serve.model.hf_import import convert_kimi_linear_state_dict, load_kimi_linear

torch.set_num_threads(1)  # 2 shared cores: extra intra-op threads only spin

TORCH_PATHS = (
    "chunk_kimi_delta_attention",
    "recurrent_kimi_delta_attention",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
BS = 4
STEPS = 32


@pytest.fixture(scope="module")
def torch_path_calls():
    """Route transformers' KDA / conv calls to their pure-PyTorch references; count the calls."""
    calls = {n: 0 for n in TORCH_PATHS}
    saved = {n: getattr(M, n) for n in TORCH_PATHS}

    def counting(name, fn):
        def f(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return f

    for n in TORCH_PATHS:
        ref = getattr(saved[n], "__wrapped__", saved[n])
        assert ref.__module__ == M.__name__  # the reference defined in modeling_kimi_linear
        setattr(M, n, counting(n, ref))
    yield calls
    for n, f in saved.items():
        setattr(M, n, f)


@pytest.fixture(scope="module")
def pair(tmp_path_factory, torch_path_calls):
    torch.manual_seed(0)
    cfg = transformers.KimiLinearConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        linear_head_dim=16,
        linear_num_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        routed_scaling_factor=2.5,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    ref = transformers.KimiLinearForCausalLM(cfg).float().eval()
    with torch.no_grad():  # bigger weights than the 0.02 init: clear argmax margins, busy routing
        for n, p in ref.named_parameters():
            if p.ndim >= 2 and "conv" not in n:
                p.normal_(0.0, 0.15 if "embed" not in n and "lm_head" not in n else 1.0)
            elif n.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    path = tmp_path_factory.mktemp("kimi_linear")
    ref.save_pretrained(path)
    ours = load_kimi_linear(str(path))
    return ref, ours


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 96, (n,), generator=g) for n in (7, 13, 1)]


@torch.no_grad()
def test_prefill_logits_match(pair, torch_path_calls) -> None:
    ref, ours = pair
    ps = prompts()
    tables = [[3 * i + 4 * j for j in range(8)] for i in range(len(ps))]
    pools = KVPools(ours.cfg, num_slots=4, num_pages=128, block_size=BS)
    b = make_batch([len(p) for p in ps], [0] * len(ps), [3, 0, 2], tables, BS, all_logits=True)
    got = ours(torch.cat(ps), b, pools)
    want = torch.cat([ref(p[None]).logits[0] for p in ps])
    err = float((got - want).abs().max() / want.abs().max())
    assert err <= 1e-4, err
    assert (
        torch_path_calls["chunk_kimi_delta_attention"] > 0
        and torch_path_calls["causal_conv1d_fn"] > 0
    )


def hf_greedy(ref, prompt: torch.Tensor, steps: int) -> list[int]:
    """transformers' own cached decode (recurrent KDA step, conv update), argmax, no EOS rules."""
    out = ref(prompt[None], use_cache=True)
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = ref(torch.tensor([[toks[-1]]]), cache=out.cache, use_cache=True)
        toks.append(int(out.logits[0, -1].argmax()))
    return toks


@torch.no_grad()
def test_greedy_decode_matches(pair, torch_path_calls) -> None:
    ref, ours = pair
    ps = prompts()[:2]
    want = [hf_greedy(ref, p, STEPS) for p in ps]
    assert (
        torch_path_calls["recurrent_kimi_delta_attention"] > 0
        and torch_path_calls["causal_conv1d_update"] > 0
    )
    pools = KVPools(ours.cfg, num_slots=2, num_pages=64, block_size=BS)
    tables = [[2 * j + i for j in range(16)] for i in range(2)]
    nxt = ours(
        torch.cat(ps), make_batch([len(p) for p in ps], [0, 0], [1, 0], tables, BS), pools
    ).argmax(-1)
    got, lens = [nxt], [len(p) for p in ps]
    for _ in range(STEPS - 1):
        nxt = ours(nxt, make_batch([1, 1], lens, [1, 0], tables, BS), pools).argmax(-1)
        lens = [n + 1 for n in lens]
        got.append(nxt)
    got_t = torch.stack(got, 1)
    for i in range(2):
        assert got_t[i].tolist() == want[i]
    assert len(set(got_t.flatten().tolist())) > 3  # not a degenerate repeat of one token


def test_transformers_in_memory_names_map_too(pair) -> None:
    ref, ours = pair
    sd = convert_kimi_linear_state_dict(ref.state_dict(), ours.cfg)
    mine = ours.state_dict()
    assert set(sd) == set(mine)
    for k, v in mine.items():
        assert torch.equal(sd[k].reshape(v.shape), v), k


def test_group_limited_routing_is_refused(tmp_path) -> None:
    (tmp_path / "config.json").write_text(
        '{"model_type": "kimi_linear", "num_expert_group": 4, "topk_group": 2}'
    )
    with pytest.raises(ValueError, match="num_expert_group"):
        load_kimi_linear(str(tmp_path))
