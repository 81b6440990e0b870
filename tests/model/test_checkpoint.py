"""Checkpoints: the published K3 tensor list, save/load round trips, MXFP4 experts, bad files.

The committed list (tests/data/k3_tensors.json) is generated from the naming rules in
k3serve/model/k3_names.py; here it is checked against the model built on the meta device
(module names and shapes come from k3serve/model, written independently of the rules) and
against byte counts of the published K3 shards.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3serve.config import PRESETS, ModelConfig
from k3serve.kernels.mxfp4 import pack_mxfp4, unpack_mxfp4
from k3serve.model import checkpoint as ckpt
from k3serve.model import checkpoint_files as ckfiles
from k3serve.model import k3_names as names
from k3serve.model.checkpoint import CheckpointError, load_checkpoint, load_model
from k3serve.model.checkpoint_save import save_checkpoint
from k3serve.model.model import K3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
LIST_FILE = ROOT / "tests" / "data" / "k3_tensors.json"
TINY = PRESETS["k3-tiny"]
IDS = torch.tensor([[256, 100, 101, 102, 32, 40, 41, 58]])


def _model(cfg: ModelConfig, seed: int) -> K3ForCausalLM:
    torch.manual_seed(seed)
    m = K3ForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial values everywhere a loader could forget something
        for name, p in m.named_parameters():
            if name.endswith(("norm.weight", "_res_proj.weight", "e_score_correction_bias")):
                p.add_(torch.randn_like(p) * 0.05)
    return m


def _logits(m: K3ForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        return m.forward_train(IDS)


def _stored(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    headers, _ = ckfiles.read_headers(ckfiles.checkpoint_files(folder))
    return {n: (shape, dtype) for n, (_, shape, dtype) in headers.items()}


# ---------------------------------------------------------------------- the K3 tensor list
def test_committed_list_is_generated_from_the_rules():
    spec = importlib.util.spec_from_file_location("gen", ROOT / "scripts" / "gen_k3_tensor_list.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert LIST_FILE.read_text() == gen.render("k3"), "run scripts/gen_k3_tensor_list.py"


@pytest.fixture(scope="module")
def k3_list() -> dict[str, tuple[tuple[int, ...], str]]:
    listing = json.loads(LIST_FILE.read_text())
    specs = names.expand_listing(listing)
    assert len(specs) == listing["num_tensors"] == 497_052
    assert names.listing_digest(specs) == listing["expanded_sha256"]
    return specs


def test_k3_list_matches_published_shard_bytes(k3_list):
    """Byte totals of the published shards (model-00002-of-000096: layer 1 = KDA + MoE)."""
    lp = "language_model.model.layers.1."
    layer1 = {n[len(lp) :]: s for n, s in k3_list.items() if n.startswith(lp)}
    kda = [
        n for n in layer1 if n.startswith(("self_attn.", "self_attention_res", "input_layernorm"))
    ]
    moe = [n for n in layer1 if not n.startswith("block_sparse_moe.experts.") and n not in kda]
    expert0 = [n for n in layer1 if n.startswith("block_sparse_moe.experts.0.")]
    assert len(kda) == 17 and sum(names.tensor_bytes(layer1[n]) for n in kda) == 887_843_840
    assert len(moe) == 11 and sum(names.tensor_bytes(layer1[n]) for n in moe) == 379_900_416
    assert len(expert0) == 6 and sum(names.tensor_bytes(layer1[n]) for n in expert0) == 17_547_264
    assert layer1["block_sparse_moe.experts.0.w2.weight_packed"] == ((3584, 1536), "U8")
    assert layer1["block_sparse_moe.experts.0.w1.weight_scale"] == ((3072, 112), "U8")
    assert layer1["self_attn.A_log"] == ((128,), "F32")
    assert layer1["block_sparse_moe.gate.e_score_correction_bias"] == ((896,), "F32")
    # 69 KDA + 24 MLA layers; dense MLP only in layer 0; 896 experts in each of 92 MoE layers.
    assert sum(n.endswith("self_attn.A_log") for n in k3_list) == 69
    assert sum(n.endswith("self_attn.kv_b_proj.weight") for n in k3_list) == 24
    assert [n for n in k3_list if n.endswith("mlp.gate_proj.weight")] == [
        "language_model.model.layers.0.mlp.gate_proj.weight"
    ]
    assert sum(n.endswith("w2.weight_scale") for n in k3_list) == 92 * 896
    assert "language_model.lm_head.weight" in k3_list


def test_k3_list_counts_the_configured_parameters(k3_list):
    cfg = PRESETS["k3"]
    total = 0
    for name, (shape, _) in k3_list.items():
        n = 1
        for s in shape:
            n *= s
        if name.endswith("weight_packed"):
            n *= 2
        elif name.endswith("weight_scale"):
            n = 0
        elif name.endswith("A_log"):
            n = cfg.kda_num_heads  # 32 of the 128 entries are padding
        total += n
    assert total == cfg.num_params


def _meta_state_shapes(
    cfg: ModelConfig, monkeypatch, share_experts: bool
) -> dict[str, tuple[int, ...]]:
    """``{state-dict name: shape}`` of ``K3ForCausalLM(cfg)`` built on the meta device.

    With ``share_experts`` every routed-expert slot of a layer holds the same (meta) ``Expert``
    instance, built by the model's own ``Expert`` class: the state dict still names each slot
    (``experts.{e}.…``), but K3's 82 432 expert modules are not constructed one by one (that
    alone takes 30–200 s on a shared CI core).
    """
    import k3serve.model.moe as moe_mod

    if share_experts:
        real, cache = moe_mod.Expert, {}

        def shared(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            if key not in cache:
                cache[key] = real(*args, **kwargs)
            return cache[key]

        monkeypatch.setattr(moe_mod, "Expert", shared)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, dtype=torch.bfloat16)
    monkeypatch.undo()
    assert all(p.is_meta for p in model.parameters())
    return {n: tuple(t.shape) for n, t in model.state_dict().items()}


def test_shared_expert_build_names_like_the_real_one(monkeypatch):
    cfg = PRESETS["k3"].replace(
        num_layers=6, mla_layers=(3, 5), n_routed_experts=8, num_experts_per_tok=2
    )
    assert _meta_state_shapes(cfg, monkeypatch, True) == _meta_state_shapes(cfg, monkeypatch, False)


def test_k3_meta_model_names_and_shapes_match_committed_list(k3_list, monkeypatch):
    """The `k3` preset built on the meta device (nothing allocated), its state dict mapped to
    published names: exactly the committed list, shape for shape."""
    cfg = PRESETS["k3"]
    got: dict[str, tuple[int, ...]] = {}
    for ours, shape in _meta_state_shapes(cfg, monkeypatch, share_experts=True).items():
        pub = names.to_published(ours, cfg)
        if names.is_expert_weight(ours):
            pk, sc = names.expert_weight_pair(pub)
            got[pk] = (shape[0], shape[1] // 2)
            got[sc] = (shape[0], shape[1] // 32)
        elif pub.endswith("self_attn.A_log"):
            assert shape == (cfg.kda_num_heads,)
            got[pub] = (names.a_log_length(cfg),)
        else:
            got[pub] = shape
    assert len(got) == len(k3_list)
    want = {n: s for n, (s, _) in k3_list.items()}
    assert sorted(set(want) - set(got))[:20] == [], "in the list, not in the model"
    assert sorted(set(got) - set(want))[:20] == [], "in the model, not in the list"
    assert {n: s for n, s in got.items() if want[n] != s} == {}
    for pub in list(want)[::997]:  # the reverse mapping, on a sample
        ours = names.from_published(pub, cfg)
        assert ours is not None and ".block_sparse_moe." not in ours
        assert names.to_published(ours, cfg) == pub
    # Stored dtypes follow the rule: U8 experts, F32 for the K3 float32 set, else BF16.
    for n, (_, dt) in k3_list.items():
        expect = "U8" if ".experts." in n else ("F32" if names.is_f32_tensor(n) else "BF16")
        assert dt == expect, n


# ---------------------------------------------------------------------- save / load
@pytest.fixture(scope="module")
def tiny_saved(tmp_path_factory) -> tuple[Path, torch.Tensor, K3ForCausalLM]:
    folder = tmp_path_factory.mktemp("tiny")
    m = _model(TINY, seed=1)
    save_checkpoint(m, folder, TINY)
    return folder, _logits(m), m


def test_save_writes_published_names(tiny_saved):
    folder, _, _ = tiny_saved
    stored = _stored(folder)
    want = names.tensor_specs(TINY)
    assert {n: s for n, (s, _) in stored.items()} == {n: s for n, (s, _) in want.items()}
    assert {dt for _, dt in stored.values()} == {"F32"}  # a float32 model is saved as it is
    assert any(".block_sparse_moe.experts.7.w3.weight" in n for n in stored)
    assert not any(".layers.1.mlp." in n for n in stored)  # MoE layers use block_sparse_moe
    assert json.loads((folder / "k3serve_config.json").read_text()) == TINY.to_dict()


def test_save_load_round_trip_identical_logits(tiny_saved):
    folder, want, src = tiny_saved
    m = _model(TINY, seed=2)
    assert not torch.equal(m.lm_head.weight, src.lm_head.weight)
    res = load_checkpoint(m, folder, TINY)
    assert res.layout == "k3" and res.packed == {}
    assert res.num_tensors == len(names.tensor_specs(TINY))
    for (n1, p1), (n2, p2) in zip(src.state_dict().items(), m.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert torch.equal(_logits(m), want)


def test_sharded_save_and_load_model(tiny_saved, tmp_path):
    _, want, src = tiny_saved
    files = save_checkpoint(src, tmp_path, TINY, max_shard_bytes=4 << 20)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 1 and (tmp_path / ckfiles.INDEX_FILE).exists()
    model, cfg, folder = load_model(tmp_path)
    assert cfg == TINY and folder == str(tmp_path)
    assert torch.equal(_logits(model), want)


def test_bf16_save_stores_float32_set_in_float32(tiny_saved, tmp_path):
    _, _, src = tiny_saved
    save_checkpoint(src, tmp_path, TINY, dtype=torch.bfloat16)
    stored = _stored(tmp_path)
    assert stored["language_model.model.layers.0.self_attn.A_log"] == (
        (64,),
        "F32",
    )  # H=4 padded to K=64
    assert stored["language_model.model.layers.0.self_attn.q_conv1d.weight"][1] == "F32"
    assert (
        stored["language_model.model.layers.1.block_sparse_moe.gate.e_score_correction_bias"][1]
        == "F32"
    )
    assert stored["language_model.model.layers.0.self_attn.q_proj.weight"][1] == "BF16"
    a_log = load_file(str(tmp_path / "model.safetensors"))[
        "language_model.model.layers.0.self_attn.A_log"
    ]
    assert torch.equal(a_log[4:], torch.zeros(60))
    assert torch.equal(a_log[:4], src.model.layers[0].self_attn.A_log.detach())


# ---------------------------------------------------------------------- wrong checkpoints
def test_wrong_checkpoint_lists_every_problem(tiny_saved, tmp_path):
    folder, _, _ = tiny_saved
    sd = load_file(str(folder / "model.safetensors"))
    p = "language_model.model.layers."
    gone = [p + "2.self_attn.f_b_proj.weight", p + "5.block_sparse_moe.experts.3.w2.weight"]
    for n in gone:
        del sd[n]
    extra = [p + "2.self_attn.bogus.weight", "language_model.model.extra_norm.weight"]
    for n in extra:
        sd[n] = torch.zeros(3)
    reshaped = p + "3.self_attn.kv_b_proj.weight"
    sd[reshaped] = sd[reshaped][:-1].contiguous()
    retyped = p + "1.block_sparse_moe.gate.weight"
    sd[retyped] = torch.zeros(sd[retyped].shape, dtype=torch.int32)
    sd["vision_tower.patch_embed.proj.weight"] = torch.zeros(2)  # K3 container part: skipped
    save_file(sd, str(tmp_path / "model.safetensors"))

    m = _model(TINY, seed=3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError) as ei:
        load_checkpoint(m, tmp_path, TINY)
    err = ei.value
    assert isinstance(err, ValueError)
    assert err.missing == sorted(gone)
    assert err.unexpected == sorted(extra)
    assert [x.split(":")[0] for x in err.mismatched] == sorted([reshaped, retyped])
    msg = str(err)
    for n in gone + extra + [reshaped, retyped]:
        assert n in msg
    assert "2 missing, 2 unexpected, 2 mis-shaped" in msg
    assert "expected [256, 64] float, got [255, 64] F32" in msg and "got [8, 256] I32" in msg
    assert "vision_tower" not in msg
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # untouched


def test_missing_files_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(_model(TINY, 0), tmp_path / "nope", TINY)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_checkpoint(_model(TINY, 0), tmp_path, TINY)
    (tmp_path / ckfiles.INDEX_FILE).write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_checkpoint(_model(TINY, 0), tmp_path, TINY)


# ---------------------------------------------------------------------- MXFP4 experts
def test_mxfp4_experts_load_like_the_dequantised_float_model(tmp_path):
    cfg = TINY.replace(name="k3-tiny-mxfp4", expert_quant="mxfp4")  # latent 128, inter 128: % 32
    src = _model(cfg, seed=4)
    packed_ref: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    with torch.no_grad():  # put every expert weight on its MXFP4 grid: the float model
        for n, p in src.named_parameters():
            if names.is_expert_weight(n):
                packed_ref[n] = pack_mxfp4(p)
                p.copy_(unpack_mxfp4(*packed_ref[n], dtype=p.dtype))
    want = _logits(src)
    save_checkpoint(src, tmp_path, cfg)

    stored = _stored(tmp_path)
    e = "language_model.model.layers.4.block_sparse_moe.experts.5."
    assert stored[e + "w1.weight_packed"] == ((128, 64), "U8")
    assert stored[e + "w1.weight_scale"] == ((128, 4), "U8")
    assert stored[e + "w2.weight_packed"] == ((128, 64), "U8")
    assert not any(n.endswith(("w1.weight", "w2.weight", "w3.weight")) for n in stored)
    assert set(stored) == set(names.tensor_specs(cfg))

    dst = _model(cfg, seed=5)
    res = load_checkpoint(dst, tmp_path, cfg)
    assert len(res.packed) == 7 * 8 * 3 == len(packed_ref)
    ours = "model.layers.4.mlp.experts.5.w1.weight"
    assert torch.equal(res.packed[ours][0], packed_ref[ours][0])
    assert torch.equal(res.packed[ours][1], packed_ref[ours][1])
    module = dst.get_submodule("model.layers.4.mlp.experts.5.w1")
    assert torch.equal(module.weight_packed, packed_ref[ours][0])
    assert torch.equal(module.weight_scale, packed_ref[ours][1])
    assert "model.layers.4.mlp.experts.5.w1.weight_packed" not in dst.state_dict()  # not persistent
    assert torch.equal(_logits(dst), want)
    # Loading float experts afterwards drops the (now stale) packed bytes.
    dense = tmp_path / "dense"
    save_checkpoint(_model(TINY, seed=9), dense, TINY)
    load_checkpoint(dst, dense, cfg)
    assert not hasattr(module, "weight_packed") and not hasattr(module, "weight_scale")


def test_mxfp4_packed_bytes_are_the_checkpoint_bytes(tmp_path):
    """Packed bytes that are not what pack_mxfp4 would produce (a non-OCP scale choice) are kept
    as stored, dequantised faithfully, and written back unchanged."""
    cfg = TINY.replace(name="k3-tiny-mxfp4", expert_quant="mxfp4")
    src = _model(cfg, seed=6)
    save_checkpoint(src, tmp_path, cfg)
    sd = load_file(str(tmp_path / "model.safetensors"))
    name = "language_model.model.layers.2.block_sparse_moe.experts.1.w2.weight"
    g = torch.Generator().manual_seed(0)
    sd[name + "_packed"] = torch.randint(
        0, 256, sd[name + "_packed"].shape, dtype=torch.uint8, generator=g
    )
    sd[name + "_scale"] = torch.full_like(sd[name + "_scale"], 120)  # all codes small: scale 2^-7
    save_file(sd, str(tmp_path / "model.safetensors"))
    dst = _model(cfg, seed=7)
    load_checkpoint(dst, tmp_path, cfg)
    w = dst.get_parameter("model.layers.2.mlp.experts.1.w2.weight")
    assert torch.equal(w, unpack_mxfp4(sd[name + "_packed"], sd[name + "_scale"]))
    out = tmp_path / "again"
    save_checkpoint(dst, out, cfg)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor(name + "_packed"), sd[name + "_packed"])
        assert torch.equal(f.get_tensor(name + "_scale"), sd[name + "_scale"])


def test_dense_experts_load_into_an_mxfp4_config(tiny_saved):
    """A K3-layout checkpoint with float experts (e.g. dequantised offline) still loads."""
    folder, want, _ = tiny_saved
    m = _model(TINY.replace(expert_quant="mxfp4"), seed=8)
    res = load_checkpoint(m, folder, TINY.replace(expert_quant="mxfp4"))
    assert res.packed == {}
    assert torch.equal(_logits(m), want)


# ---------------------------------------------------------------------- Kimi Linear, presets
def test_kimi_linear_as_transformers_saves_it(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=16, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, intermediate_size=48,
        moe_intermediate_size=16, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 2,
                            "head_dim": 16, "short_conv_kernel_size": 4},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.KimiLinearForCausalLM(hf_cfg)
    hf.save_pretrained(tmp_path)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in stored  # the published names
    model, _, _ = load_model(tmp_path)
    got = model.state_dict()
    assert torch.equal(
        got["model.layers.1.mlp.experts.2.w3.weight"],
        stored["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
    )
    assert torch.equal(
        got["model.layers.0.self_attn.A_log"], stored["model.layers.0.self_attn.A_log"].reshape(-1)
    )
    assert torch.equal(
        got["model.layers.3.self_attn.kv_b_proj.weight"],
        stored["model.layers.3.self_attn.kv_b_proj.weight"],
    )
    # transformers' in-memory names (fused conv / experts), e.g. save_file(hf.state_dict()):
    # renamed through hf_import, then loaded to the same weights.
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    save_file(
        {k: v.contiguous() for k, v in hf.state_dict().items()}, str(runtime / "m.safetensors")
    )
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(str(runtime / "m.safetensors"))
    again = K3ForCausalLM(model.cfg)
    load_checkpoint(again, runtime, model.cfg)
    for k, v in again.state_dict().items():
        assert torch.equal(v, got[k]), k


def test_load_model_presets(tiny_saved, tmp_path, monkeypatch):
    folder, want, _ = tiny_saved
    monkeypatch.setattr(ckpt, "ASSETS_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="random_init=True"):
        load_model("k3-tiny")
    model, cfg, where = load_model("k3-tiny", random_init=True)
    assert cfg == TINY and not model.training and where is None
    (tmp_path / "k3-tiny").mkdir()
    for f in folder.iterdir():
        (tmp_path / "k3-tiny" / f.name).write_bytes(f.read_bytes())
    model, cfg, where = load_model("k3-tiny")
    assert torch.equal(_logits(model), want) and where == str(tmp_path / "k3-tiny")
    # random_init reads nothing even when the weights are there
    model, _, where = load_model("k3-tiny", random_init=True)
    assert where is None and not torch.equal(_logits(model), want)
    with pytest.raises(ValueError, match="neither a preset"):
        load_model("no-such-model")


def test_load_model_random_init_is_seeded_and_leaves_the_global_rng(tiny_saved, tmp_path):
    """The one loader (the offline LLM, the workers, eval_bpb and the benchmarks call it):
    a ModelConfig gives random weights from ``seed`` without moving the global RNG; a folder
    without safetensors and a folder without a config are refused, never random-filled."""
    small = TINY.replace(num_layers=2, mla_layers=(1,), attn_res_block_layers=0)
    before = torch.random.get_rng_state()
    a, cfg, where = load_model(small, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    b, _, _ = load_model(small, seed=3)
    c, _, _ = load_model(small, seed=4)
    assert cfg == small and where is None
    sa, sb, sc = (m.state_dict() for m in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)
    folder, _, _ = tiny_saved
    empty = tmp_path / "no_weights"
    empty.mkdir()
    (empty / ckfiles.CONFIG_FILE).write_text((folder / ckfiles.CONFIG_FILE).read_text())
    with pytest.raises(FileNotFoundError):
        load_model(empty)
    _, cfg, where = load_model(empty, random_init=True)  # asked for: the folder's shape
    assert cfg == TINY and where is None
    (tmp_path / "nothing_here").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        load_model(tmp_path / "nothing_here")
