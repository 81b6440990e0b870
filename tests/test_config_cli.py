"""ModelConfig validation and loading, ``k3serve info``, and the light ``import k3serve``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from k3serve.config import PRESETS, ModelConfig, load_config

TINY = PRESETS["k3-tiny"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"kda_num_heads": -2}, "kda_num_heads"),
        ({"mla_layers": (3, 99)}, "mla_layers"),
        ({"mla_layers": (3, 3)}, "mla_layers"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"kda_gate_lower_bound": 1.0}, "kda_gate_lower_bound"),
        ({"dtype": "int8"}, "dtype"),
        ({"eos_token_id": 10_000}, "eos_token_id"),
        ({"expert_quant": "mxfp4", "moe_intermediate_size": 100}, "moe_intermediate_size"),
        ({"expert_quant": "nf4"}, "expert_quant"),
        ({"mla_num_heads": 0}, "mla_num_heads"),
        ({"first_k_dense": 1, "dense_intermediate_size": 0}, "dense_intermediate_size"),
    ],
)
def test_inconsistent_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}\b"):
        TINY.replace(**changes)


def test_presets_match_design_card():
    k3 = PRESETS["k3"]
    assert k3.num_kda_layers == 69 and k3.num_mla_layers == 24
    assert k3.mla_layers[-2:] == (91, 92) and k3.mla_layers[0] == 3
    # DESIGN.md §2: one KDA state ≈ 414 MiB + 14.6 MiB conv; MLA 24 × 576 × 2 B per token.
    assert k3.num_kda_layers * 96 * 128 * 128 * 4 / 2**20 == pytest.approx(414.0, abs=0.1)
    conv = k3.kda_state_bytes_per_seq() - k3.num_kda_layers * 96 * 128 * 128 * 4
    assert conv / 2**20 == pytest.approx(14.6, abs=0.1)
    assert k3.mla_latent_bytes_per_token() == 24 * 576 * 2
    assert 2.7e12 < k3.num_params < 2.9e12
    mini = PRESETS["k3-mini"]
    assert 4.2e9 < mini.num_params < 4.5e9 and 1.2e9 < mini.num_active_params < 1.4e9
    assert TINY.num_params * 2 <= 16 * 2**20  # bf16 checkpoint fits the 16 MiB budget


# sha256 of each preset's sorted to_dict(), first 16 hex digits: a preset value changed by
# accident (e.g. while factoring the presets' shared fields) fails here; a deliberate change
# updates the digest in the same commit.
PRESET_DIGESTS = {"k3-tiny": "7291d9efee11cdac", "k3-mini": "97e74e56923f385e", "k3": "cc6ad010c938249f"}


def test_preset_values_are_pinned_and_share_the_k3_choices():
    import hashlib

    for name, cfg in PRESETS.items():
        blob = json.dumps(cfg.to_dict(), sort_keys=True).encode()
        assert hashlib.sha256(blob).hexdigest()[:16] == PRESET_DIGESTS[name], name
        assert cfg.name == name and cfg.kda_num_heads == cfg.mla_num_heads
        assert (cfg.kda_gate_lower_bound, cfg.kda_output_gate_rank, cfg.first_k_dense) == (
            -5.0, None, 1)
        assert (cfg.hidden_act, cfg.dtype, cfg.mla_output_gate) == ("situ", "bfloat16", True)
    assert set(PRESET_DIGESTS) == set(PRESETS)


def test_from_hf_kimi_linear_dict():
    hf = {
        "model_type": "kimi_linear", "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 2, "kv_lora_rank": 16,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": None,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 4,
        "num_experts_per_token": 2, "num_shared_experts": 1, "routed_scaling_factor": 2.0,
        "first_k_dense_replace": 1, "eos_token_id": 1,
        "linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    }
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.mla_layers == (3,) and cfg.kda_layers == (0, 1, 2)
    assert cfg.kda_gate_lower_bound is None and cfg.hidden_act == "silu"
    assert cfg.moe_latent_size is None and cfg.attn_res_block_layers == 0
    assert cfg.kda_output_gate_rank == 16 and not cfg.mla_output_gate
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_hf_config({**hf, "model_type": "llama"})
    bad = dict(hf)
    del bad["moe_intermediate_size"]
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ModelConfig.from_hf_config(bad)


def test_from_hf_k3_text_config_layout(tmp_path):
    text = {
        "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 2,
        "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "q_lora_rank": 32, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 2,
        "moe_latent_size": 32, "hidden_act": "situ", "attn_res_block_layers": 2,
        "linear_attn_config": {"head_dim": 16, "num_heads": 2, "kda_layers": [1, 2, 3],
                               "full_attn_layers": [4, 5]},
    }
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text, "vision_config": {}}))
    cfg = load_config(str(tmp_path))
    assert cfg.mla_layers == (3, 4) and cfg.kda_gate_lower_bound == -5.0
    assert cfg.kda_output_gate_rank is None and cfg.mla_output_gate
    assert cfg.moe_latent_size == 32 and cfg.attn_res_block_layers == 2
    # our own format round-trips
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_load_config_errors(tmp_path):
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("no-such-model")
    with pytest.raises(ValueError, match="no config.json"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("file,text,want", [
    ("config.json", "{not json", ("model: {path} is not valid JSON (Expecting property name "
                                  "enclosed in double quotes: line 1 column 2 (char 1))")),
    ("config.json", "[1, 2]", "model: {path} is not a JSON object"),
    ("config.json", "{}",
     "model: {path} cannot be used (config.json: missing field 'num_hidden_layers')"),
    ("config.json", '{"text_config": []}', "model: {path} cannot be used ("),
    ("k3serve_config.json", "{}", "model: {path} cannot be used (ModelConfig.__init__() missing"),
    ("config.json", None, "model: cannot read {path} (Is a directory)"),
])
def test_load_config_names_a_config_file_it_cannot_use(tmp_path, file, text, want):
    """A model folder whose config file cannot be read, is not JSON or describes no model:
    one ``ValueError`` naming the field (``model``) and the file, never a raw parser error."""
    path = tmp_path / file
    if text is None:
        path.mkdir()
    else:
        path.write_text(text)
    with pytest.raises(ValueError) as e:
        load_config(str(tmp_path))
    assert str(e.value).startswith(want.format(path=path)), str(e.value)


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_info_json_keys_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from cli.main import main\n"
        "sys.exit(main(['info', '--model', 'k3', '--json']))\n"
    )
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    for key in ("num_params", "num_active_params", "kda_state_bytes_per_seq",
                "mla_latent_bytes_per_token"):
        assert isinstance(info[key], int) and info[key] > 0
    assert info["kda_state_bytes_per_seq"] == PRESETS["k3"].kda_state_bytes_per_seq()
    r = _run("-m", "cli", "info", "--model", "k3-mini")
    assert r.returncode == 0 and "KDA state / sequence" in r.stdout
    r = _run("-m", "cli", "info", "--model", "nope")
    assert r.returncode == 2 and "neither a preset" in r.stderr


def test_light_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import k3serve, k3serve.config, k3serve.protocol, k3serve.cache.hashing\n"
        "import k3serve.tokenizer, k3serve.sampling\n"
        "from k3serve.tokenizer import get_tokenizer\n"
        "tok = get_tokenizer('k3-tiny'); assert tok.decode(tok.encode('héllo')) == 'héllo'\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
        "try:\n"
        "    k3serve.LLM\n"
        "except ImportError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('k3serve.LLM imported without torch?')\n"
    )
    r = _run("-c", code)
    assert r.returncode == 0, r.stderr
