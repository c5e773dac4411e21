"""scripts/synthetic-gguf.py: random-weight GGUFs with a published model's shapes load in hispec
and generate (2 layers and a small vocabulary here); K-quants go through llama.cpp's
llama-quantize, a clear error where it is not built."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from hispec.config import SamplingParams  # noqa: E402
from hispec.generate import Generator  # noqa: E402
from hispec.model.load import registry  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "synthetic-gguf.py"


@pytest.fixture(scope="module")
def synthetic():
    spec = importlib.util.spec_from_file_location("synthetic_gguf", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _fields(path: Path) -> tuple[dict, dict]:
    r = gguf.GGUFReader(path)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.") or "_id" in k}
    return meta, {t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist()))) for t in r.tensors}


def _generate(path: Path, tmp_path: Path, monkeypatch, n: int = 4) -> list[int]:
    monkeypatch.setattr(registry, "models_dir", lambda: tmp_path / "models")  # the conversion stays in tmp_path
    gen = Generator.from_pretrained(str(path), exits=False, progress=False)
    ids = gen.encode_prompt("hello there", None)
    assert ids and max(ids) < gen.model.cfg.vocab_size
    out = gen.generate(ids, SamplingParams(max_new_tokens=n, ignore_eos=True), "ar")
    assert len(out.token_ids) == n
    return out.token_ids


def test_llama_1b_shaped_q8_0_loads_and_generates(synthetic, tmp_path, monkeypatch):
    out = tmp_path / "l1b.gguf"
    assert synthetic.main(["--shape", "llama-3.2-1b", "--type", "Q8_0", "--out", str(out), "--layers", "2",
                           "--vocab", "512"]) == 0
    meta, tensors = _fields(out)
    assert meta["general.architecture"] == "llama" and meta["llama.block_count"] == 2
    assert (meta["llama.embedding_length"], meta["llama.feed_forward_length"]) == (2048, 8192)
    assert (meta["llama.attention.head_count"], meta["llama.attention.head_count_kv"]) == (32, 8)
    assert meta["llama.rope.freq_base"] == 500000.0 and meta["general.file_type"] == 7  # MOSTLY_Q8_0
    assert meta["tokenizer.ggml.bos_token_id"] == 510 and meta["tokenizer.ggml.eos_token_id"] == 511
    assert tensors["token_embd.weight"] == ("Q8_0", (512, 2048)) and "output.weight" not in tensors  # tied
    assert tensors["blk.1.attn_k.weight"] == ("Q8_0", (512, 2048))  # 8 KV heads x 64
    assert tensors["blk.1.ffn_down.weight"] == ("Q8_0", (2048, 8192))
    assert tensors["blk.0.attn_norm.weight"] == ("F32", (2048,))
    w = gguf.quants.dequantize(gguf.GGUFReader(out).tensors[2].data, gguf.GGMLQuantizationType.Q8_0)
    assert 0.015 < float(np.std(w)) < 0.025  # normal, standard deviation 0.02
    assert not list(tmp_path.glob("*.tmp*"))
    _generate(out, tmp_path, monkeypatch)


def test_shapes_table(synthetic):
    """The published configs' numbers, and tensors of the right sizes (no file written)."""
    s = synthetic.SHAPES
    assert (s["qwen2.5-1.5b"].hidden, s["qwen2.5-1.5b"].kv_heads, s["qwen2.5-1.5b"].ffn, s["qwen2.5-1.5b"].vocab) == \
        (1536, 2, 8960, 151936)
    assert (s["llama-3.1-8b"].layers, s["llama-3.1-8b"].ffn, s["llama-3.1-8b"].tied) == (32, 14336, False)
    names = dict(synthetic.tensor_list(s["llama-3.1-8b"], 32, 128256))
    params = sum(int(np.prod(v)) for v in names.values())
    assert 8.0e9 < params < 8.1e9 and names["output.weight"] == (128256, 4096)  # Llama 3.1 8B: 8.03B
    qwen = dict(synthetic.tensor_list(s["qwen2.5-1.5b"], 28, 151936))
    assert qwen["blk.0.attn_k.bias"] == (256,) and "output.weight" not in qwen
    assert 1.5e9 < sum(int(np.prod(v)) for v in qwen.values()) < 1.6e9  # Qwen2.5-1.5B: 1.54B


def test_k_quant_without_llama_quantize_is_a_clear_error(synthetic, tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_PEERS", str(tmp_path / "no-peers"))
    with pytest.raises(SystemExit, match="install-peers.sh llama.cpp-tools"):
        synthetic.main(["--shape", "llama-3.2-1b", "--type", "Q4_K_M", "--out", str(tmp_path / "x.gguf"),
                        "--layers", "1", "--vocab", "512"])
    assert not list(tmp_path.glob("x.gguf*"))


def test_q4_k_m_by_llama_quantize(synthetic, tmp_path, monkeypatch):
    quantize = synthetic.default_llama_quantize()
    if not quantize.is_file():
        pytest.skip(f"llama.cpp's llama-quantize is not built ({quantize}): scripts/install-peers.sh llama.cpp-tools")
    out = tmp_path / "l1b-q4km.gguf"
    assert synthetic.main(["--shape", "llama-3.2-1b", "--type", "Q4_K_M", "--out", str(out), "--layers", "1",
                           "--vocab", "512", "--threads", "2"]) == 0
    _, tensors = _fields(out)
    assert tensors["blk.0.ffn_up.weight"][0] == "Q4_K" and tensors["blk.0.attn_norm.weight"][0] == "F32"
    assert not list(tmp_path.glob("*.tmp*"))  # the F16 intermediate is gone
    _generate(out, tmp_path, monkeypatch, n=2)
