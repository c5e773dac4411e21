"""GGUF files of every supported architecture (llama, qwen2, qwen3, gemma3) against transformers'
own GGUF loading, and clear errors for files that are not GGUF, cut short, or of another
architecture.

Each tiny random model is built with transformers, written as a GGUF file the way llama.cpp's
converter writes one (llama's Q/K rows permuted, Gemma's norms stored as ``1 + w``; F32, or Q8_0
for the matrices), converted by hispec and run by hispec's decoder; transformers loads the same
file with ``from_pretrained(..., gguf_file=...)`` (dequantized). Logits and greedy tokens agree.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from hispec.config import SamplingParams  # noqa: E402
from hispec.generate import Generator  # noqa: E402
from hispec.model.load import gguf_convert as gc  # noqa: E402
from hispec.model.load.checkpoint import load_model  # noqa: E402
from hispec.model.load.gguf_convert import GGUFArchError, GGUFFileError, convert_gguf  # noqa: E402

from .test_gguf_convert import _llamacpp_permute, _tiny_tokens  # noqa: E402

Q = gguf.GGMLQuantizationType


def _gemma3():
    # head_dim 256 as in Gemma 3: transformers' GGUF loading scales queries by its default
    # query_pre_attn_scalar (256), llama.cpp by head_dim ** -0.5
    return transformers.Gemma3TextConfig(
        vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=256, sliding_window=6,
        query_pre_attn_scalar=256, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                              bos_token_id=1, eos_token_id=2),
    "qwen2": lambda: transformers.Qwen2Config(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0,
                                              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen3": lambda: transformers.Qwen3Config(vocab_size=261, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    # (head_dim 128: transformers' GGUF loading of qwen3 does not read the file's key_length)
    "gemma3": _gemma3,  # 7 layers: the sixth attends globally, the others over a window of 6
}


def _hf_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[arch](), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(0.2 * noise if p.ndim == 1 else (0.4 if "embed" in name else 0.15) * noise)
    return model.eval()


def _gguf_names(arch: gc.Arch, layers: int) -> dict[str, str]:
    """HF name -> GGUF name (the inverse of the converter's maps)."""
    inv = {v: k for k, v in gc._GLOBAL_NAME_MAP.items()}
    suffixes = {**gc._LAYER_SUFFIX_MAP, **gc._BIASES, **arch.layer_names}
    for i in range(layers):
        for g, h in suffixes.items():
            inv[f"model.layers.{i}.{h}"] = f"blk.{i}.{g}"
    return inv


def _write_gguf(path, model, arch_name: str, qtype=Q.F32) -> None:
    """``model`` as llama.cpp's converter writes it (metadata keys prefixed by the architecture)."""
    cfg, arch = model.config, gc.ARCHS[arch_name]
    tokens, types, merges = _tiny_tokens()
    w = gguf.GGUFWriter(str(path), arch_name)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base((rope.get("full_attention") or rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch_name == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    names = _gguf_names(arch, cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, arr = names[hf_name], t.detach().float().numpy()
        if arch.permuted and name.endswith("attn_q.weight"):
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif arch.permuted and name.endswith("attn_k.weight"):
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        elif arch.norm_offset and name.endswith("norm.weight"):
            arr = arr + np.float32(arch.norm_offset)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == Q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _transformers_from_gguf(src) -> torch.nn.Module:
    """transformers' own GGUF loading (dequantized), with ``accelerate`` as from_pretrained needs
    it, else the same code path by hand."""
    if importlib.util.find_spec("accelerate") is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name,
                                                                 dtype=torch.float32).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model.eval()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_family_matches_transformers_gguf_loading(tmp_path, arch, qtype):
    src = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(src, _hf_model(arch), arch, qtype)
    folder = convert_gguf(src, tmp_path / "out", progress=False)
    ours = load_model(folder)
    ref = _transformers_from_gguf(src)
    assert ours.cfg.family == {"gemma3": "gemma3"}.get(arch, arch)
    if arch == "gemma3":
        assert ours.cfg.sliding_layers == (0, 1, 2, 3, 4, 6) and ours.cfg.sliding_window == 6
    ids = torch.randint(3, 261, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
        hf = ref.generate(torch.tensor([ids[:5]]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                          eos_token_id=None, pad_token_id=0)[0, 5:].tolist()
    gen = Generator(ours, block_size=4)
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner

    cfg = ours.cfg
    blocks = BlockManager(16, 4, cfg.num_layers)
    pool = KVPool(cfg.num_layers, 16, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    blocks.add_sequence(0)
    got = ours.exit_logits(LayerRunner(ours, blocks, pool).forward(0, 0, torch.tensor(ids), 0, cfg.num_layers),
                           cfg.num_layers)
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    out = gen.generate(ids[:5], SamplingParams(max_new_tokens=16, ignore_eos=True), "ar")
    assert out.token_ids == hf


def _valid(tmp_path):
    src = tmp_path / "tiny.gguf"
    _write_gguf(src, _hf_model("llama"), "llama")
    return src


def test_truncated_file_is_a_clear_error(tmp_path):
    src = _valid(tmp_path)
    data = src.read_bytes()
    for n, what in ((len(data) // 2, "past the end"), (200, "ends early")):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        with pytest.raises(GGUFFileError, match=what):
            convert_gguf(cut, tmp_path / f"out{n}", progress=False)
        assert not (tmp_path / f"out{n}").exists()


@pytest.mark.parametrize("content", [b"just some text\n", b""], ids=["text", "empty"])
def test_not_a_gguf_file_is_a_clear_error(tmp_path, content):
    src = tmp_path / "notes.gguf"
    src.write_bytes(content)
    with pytest.raises(GGUFFileError, match="not a readable GGUF file"):
        convert_gguf(src, tmp_path / "out", progress=False)


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    src = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(src), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFArchError, match=r"'phi3' is not supported \(supported: llama, qwen2, qwen3, gemma3\)"):
        convert_gguf(src, tmp_path / "out", progress=False)


def test_cli_bad_file_is_one_line(tmp_path, capsys):
    from hispec.cli import main

    src = tmp_path / "notes.gguf"
    src.write_text("not a model\n")
    assert main(["generate", "--model", str(src), "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hispec: error: notes.gguf is not a readable GGUF file"), err
