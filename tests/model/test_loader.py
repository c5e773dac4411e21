"""Tests for ``hispec.model.load.checkpoint``: checkpoint layouts, refusals and error messages, name mapping.

Every folder is written here from a tiny random transformers model (no network).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from hispec.cache.block_manager import BlockManager  # noqa: E402
from hispec.cache.kv_cache import KVPool  # noqa: E402
from hispec.config import ConfigError  # noqa: E402
from hispec.model.runner import LayerRunner  # noqa: E402
from hispec.model.load.checkpoint import ModelLoadError, internal_name, load_model  # noqa: E402

IDS = [5, 17, 3, 42, 8, 29, 11, 40, 7, 23, 19]



def _tiny(family: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    common = dict(vocab_size=48, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    common.update(kw)
    if family == "opt":
        cfg = transformers.OPTConfig(ffn_dim=64, dropout=0.0, **common)
    else:
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[family]
        cfg = cls(intermediate_size=64, num_key_value_heads=2, initializer_range=0.2, **common)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # move norm weights / biases off 1 / 0 so every tensor matters
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _logits(model, ids: list[int] = IDS) -> torch.Tensor:
    cfg = model.cfg
    blocks = BlockManager(8, 4, cfg.num_layers)
    pool = KVPool(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    blocks.add_sequence(0)
    h = LayerRunner(model, blocks, pool).forward(0, 0, torch.tensor(ids), 0, cfg.num_layers)
    return model.exit_logits(h, cfg.num_layers)


def _assert_matches(folder: Path, hf, **load_kw) -> None:
    model = load_model(folder, **load_kw)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(_logits(model), want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    hf = _tiny("llama")
    folder = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(folder)
    return hf, folder


@pytest.fixture
def llama_copy(llama, tmp_path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(llama[1], dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _edit_config(folder: Path, edit) -> None:
    f = folder / "config.json"
    cfg = json.loads(f.read_text())
    edit(cfg)
    f.write_text(json.dumps(cfg))


# --------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------
def test_single_file_loads(llama):
    _assert_matches(llama[1], llama[0])


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_sharded_safetensors(family, tmp_path):
    hf = _tiny(family, seed=1)
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(shards) > 2
    _assert_matches(tmp_path, hf)


def test_sharded_index_names_a_missing_shard(tmp_path):
    _tiny("llama", seed=1).save_pretrained(tmp_path, max_shard_size="20KB")
    victim = sorted(tmp_path.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"missing.*{victim.name}"):
        load_model(tmp_path)


def test_loads_other_dtype(llama):
    model = load_model(llama[1], dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.inv_freq.dtype == torch.float32 and model.inv_freq.device.type == "cpu"
    assert not any(p.requires_grad for p in model.parameters()) and not model.training


def _write_pickle_only(hf, folder: Path) -> None:
    hf.save_pretrained(folder, safe_serialization=False)
    if not (folder / "pytorch_model.bin").is_file():  # transformers 5 always writes safetensors
        for f in folder.glob("*.safetensors*"):
            f.unlink()
        torch.save(hf.state_dict(), folder / "pytorch_model.bin")
    assert not list(folder.glob("*.safetensors"))


def test_pickle_refused_unless_allowed(llama, tmp_path):
    hf = llama[0]
    _write_pickle_only(hf, tmp_path)
    with pytest.raises(ModelLoadError, match="pickle") as err:
        load_model(tmp_path)
    assert "pytorch_model.bin" in str(err.value) and "allow" in str(err.value)
    _assert_matches(tmp_path, hf, allow_pickle=True)


def test_safetensors_preferred_over_pickle(llama, llama_copy):
    torch.save({"garbage": torch.zeros(1)}, llama_copy / "pytorch_model.bin")
    _assert_matches(llama_copy, llama[0])


# --------------------------------------------------------------------------------------
# bad folders
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,shape", [
    ("model.layers.0.mlp.down_proj.weight", (32, 63)),  # a plain tensor
    ("model.layers.1.self_attn.k_proj.weight", (32, 32)),  # one part of the fused q/k/v
    ("model.embed_tokens.weight", (47, 32)),
])
def test_wrong_shape_names_tensor_and_shapes(llama_copy, name, shape):
    want = {}

    def edit(t):
        want["shape"] = tuple(t[name].shape)
        t[name] = torch.zeros(shape)

    _edit_weights(llama_copy, edit)
    with pytest.raises(ModelLoadError) as err:
        load_model(llama_copy)
    msg = str(err.value)
    assert name in msg and str(shape) in msg and str(want["shape"]) in msg, msg


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(llama_copy)


def test_invalid_config_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(llama_copy)


def test_config_lacks_field(llama_copy):
    _edit_config(llama_copy, lambda c: c.pop("num_hidden_layers"))
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_model(llama_copy)


def test_unsupported_model_type(llama_copy):
    _edit_config(llama_copy, lambda c: c.update(model_type="gpt2"))
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'.*supported: llama"):
        load_model(llama_copy)


def test_unsupported_rope_scaling(llama_copy):
    _edit_config(llama_copy, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                  "rope_theta": 10000.0}))
    with pytest.raises((ModelLoadError, ConfigError), match="yarn"):
        load_model(llama_copy)


def test_missing_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_no_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(llama_copy)


def test_missing_tensor(llama_copy):
    _edit_weights(llama_copy, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensor.*layers\.1\.post_norm\.weight"):
        load_model(llama_copy)


def test_missing_part_of_fused_tensor(llama_copy):
    _edit_weights(llama_copy, lambda t: t.pop("model.layers.0.self_attn.v_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"layers\.0\.qkv_proj.*\bv\b"):
        load_model(llama_copy)


def test_missing_lm_head_of_untied_model(llama_copy):
    _edit_weights(llama_copy, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="lm_head"):
        load_model(llama_copy)


def test_unexpected_tensor(llama_copy):
    def edit(t):
        t["model.layers.2.mlp.down_proj.weight"] = t["model.layers.1.mlp.down_proj.weight"].clone()

    _edit_weights(llama_copy, edit)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.down_proj\.weight'"):
        load_model(llama_copy)


# --------------------------------------------------------------------------------------
# tied embeddings
# --------------------------------------------------------------------------------------
def test_tied_model_ignores_a_saved_lm_head(tmp_path):
    hf = _tiny("qwen3", seed=2, tie_word_embeddings=True, head_dim=8)
    hf.save_pretrained(tmp_path)
    _edit_weights(tmp_path, lambda t: t.update({"lm_head.weight": torch.randn(48, 32)}))
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight
    _assert_matches(tmp_path, hf)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_tie_word_embeddings_defaults_to_false(family, tmp_path):
    """A config.json without the key is untied, as in transformers (Qwen2Config defaults to False)."""
    hf = _tiny(family, seed=3, tie_word_embeddings=False)
    hf.save_pretrained(tmp_path)
    _edit_config(tmp_path, lambda c: c.pop("tie_word_embeddings", None))
    assert transformers.AutoConfig.from_pretrained(tmp_path).tie_word_embeddings is False
    model = load_model(tmp_path)
    assert not model.cfg.tie_word_embeddings
    _assert_matches(tmp_path, hf)


# --------------------------------------------------------------------------------------
# internal_name
# --------------------------------------------------------------------------------------
LLAMA_NAMES = {
    "model.embed_tokens.weight": ("embed_tokens.weight", None),
    "model.norm.weight": ("norm.weight", None),
    "lm_head.weight": ("lm_head.weight", None),
    "model.layers.0.input_layernorm.weight": ("layers.0.input_norm.weight", None),
    "model.layers.3.post_attention_layernorm.weight": ("layers.3.post_norm.weight", None),
    "model.layers.0.self_attn.q_proj.weight": ("layers.0.qkv_proj.weight", "q"),
    "model.layers.0.self_attn.k_proj.weight": ("layers.0.qkv_proj.weight", "k"),
    "model.layers.12.self_attn.v_proj.weight": ("layers.12.qkv_proj.weight", "v"),
    "model.layers.0.self_attn.o_proj.weight": ("layers.0.o_proj.weight", None),
    "model.layers.1.mlp.gate_proj.weight": ("layers.1.gate_up_proj.weight", "gate"),
    "model.layers.1.mlp.up_proj.weight": ("layers.1.gate_up_proj.weight", "up"),
    "model.layers.1.mlp.down_proj.weight": ("layers.1.down_proj.weight", None),
}
QWEN_NAMES = {  # Qwen2 biases, Qwen3 q/k norms
    "model.layers.0.self_attn.q_proj.bias": ("layers.0.qkv_proj.bias", "q"),
    "model.layers.0.self_attn.k_proj.bias": ("layers.0.qkv_proj.bias", "k"),
    "model.layers.0.self_attn.v_proj.bias": ("layers.0.qkv_proj.bias", "v"),
    "model.layers.2.self_attn.q_norm.weight": ("layers.2.q_norm.weight", None),
    "model.layers.2.self_attn.k_norm.weight": ("layers.2.k_norm.weight", None),
}
OPT_NAMES = {
    "model.decoder.embed_tokens.weight": ("embed_tokens.weight", None),
    "model.decoder.embed_positions.weight": ("embed_positions.weight", None),
    "model.decoder.final_layer_norm.weight": ("norm.weight", None),
    "model.decoder.final_layer_norm.bias": ("norm.bias", None),
    "model.decoder.project_in.weight": ("project_in.weight", None),
    "model.decoder.project_out.weight": ("project_out.weight", None),
    "model.decoder.layers.0.self_attn_layer_norm.weight": ("layers.0.input_norm.weight", None),
    "model.decoder.layers.0.self_attn_layer_norm.bias": ("layers.0.input_norm.bias", None),
    "model.decoder.layers.0.self_attn.q_proj.bias": ("layers.0.qkv_proj.bias", "q"),
    "model.decoder.layers.0.self_attn.out_proj.weight": ("layers.0.o_proj.weight", None),
    "model.decoder.layers.0.self_attn.out_proj.bias": ("layers.0.o_proj.bias", None),
    "model.decoder.layers.5.final_layer_norm.weight": ("layers.5.post_norm.weight", None),
    "model.decoder.layers.5.final_layer_norm.bias": ("layers.5.post_norm.bias", None),
    "model.decoder.layers.5.fc1.weight": ("layers.5.fc1.weight", None),
    "model.decoder.layers.5.fc2.bias": ("layers.5.fc2.bias", None),
    # original metaseq/fairseq-style names without the "model." prefix
    "decoder.layers.0.fc1.weight": ("layers.0.fc1.weight", None),
    "decoder.embed_tokens.weight": ("embed_tokens.weight", None),
}


@pytest.mark.parametrize("hf_name,want", [*LLAMA_NAMES.items(), *QWEN_NAMES.items(), *OPT_NAMES.items()])
def test_internal_name_table(hf_name, want):
    assert internal_name(hf_name) == want


@pytest.mark.parametrize("hf_name", [
    "model.layers.0.self_attn.rotary_emb.inv_freq", "model.layers.0.mlp.experts.0.w1.weight",
    "transformer.h.0.attn.c_attn.weight", "model.layers.x.input_layernorm.weight", "model.norm.bias.extra",
])
def test_internal_name_unknown(hf_name):
    assert internal_name(hf_name) is None


@pytest.mark.parametrize("family,kw", [
    ("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 16}), ("opt", {}), ("llama", {"tie_word_embeddings": True}),
], ids=["llama", "qwen2", "qwen3", "opt", "llama-tied"])
def test_internal_name_covers_every_hf_tensor(family, kw):
    """Every tensor of a transformers model of each family maps onto a hispec parameter of the
    same (or, for fused q/k/v and gate/up, summed) shape."""
    from hispec.config import ModelConfig
    from hispec.model.decoder import DecoderModel

    hf = _tiny(family, **kw)
    cfg = ModelConfig.from_hf(hf.config.to_dict())
    with torch.device("meta"):
        ours = {k: v.shape for k, v in DecoderModel(cfg).state_dict().items()}
    fused: dict[str, list[tuple[str, torch.Size]]] = {}
    for hf_name, tensor in hf.state_dict().items():
        mapped = internal_name(hf_name)
        assert mapped is not None, hf_name
        name, part = mapped
        assert name in ours, (hf_name, name)
        if part is None:
            assert tensor.shape == ours[name], (hf_name, tensor.shape, ours[name])
        else:
            fused.setdefault(name, []).append((part, tensor.shape))
    for name, parts in fused.items():
        assert sorted(p for p, _ in parts) in (["k", "q", "v"], ["gate", "up"]), (name, parts)
        assert sum(s[0] for _, s in parts) == ours[name][0], (name, parts, ours[name])
    covered = {internal_name(n)[0] for n in hf.state_dict()}
    assert set(ours) - covered <= ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
