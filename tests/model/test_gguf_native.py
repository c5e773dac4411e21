"""A GGUF model loaded from the file alone (``hispec/model/load/gguf_native.py``): no float32 copy
on disk, the embedding read in place (``gguf_embedding.py``, ``csrc/dequant.c``), and the same
model, bit for bit, as the float32 folder with the file's blocks put in (the path it replaces).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from hispec.kernels import binding, hugepages  # noqa: E402
from hispec.model.load import gguf_embedding, gguf_weights  # noqa: E402
from hispec.model.load.gguf_embedding import ROW_TYPES, GGUFEmbedding  # noqa: E402
from tests.model.test_gguf_types import DECODER_TYPES, Q4_K_M, _logits, _random_k_blocks, _tiny_llama_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
SIZES = gguf.constants.GGML_QUANT_SIZES


def _rows(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """``[n, row bytes]`` rows of ``kind`` holding random weights (K-quants: random blocks)."""
    rng = np.random.default_rng(seed)
    if kind in ("Q4_K", "Q6_K"):
        return _random_k_blocks(kind, n, k, rng)
    w = (rng.standard_normal((n, k)) * 0.1).astype(np.float32)
    if kind == "F32":
        return w.view(np.uint8)
    if kind == "F16":
        return w.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(w, Q[kind])


def _reference(kind: str, raw: np.ndarray) -> np.ndarray:
    """gguf's own dequantization of ``raw``'s rows (what the float32 copy holds)."""
    if kind in ("F32", "F16"):
        return raw.view(np.float32 if kind == "F32" else np.float16).astype(np.float32)
    return gguf.quants.dequantize(raw, Q[kind]).astype(np.float32)


@pytest.mark.parametrize("kind", ROW_TYPES)
def test_rows_equal_gguf_dequantization(kind):
    """``hs_dequant_rows`` gives gguf's float32 values bit for bit, rows in any order and repeated,
    and the scaled ones as a float32 product of them (DecoderModel.embed's)."""
    lib = binding.library()
    if lib is None:
        pytest.skip("no C library here")
    k = 512
    raw = np.ascontiguousarray(_rows(kind, 9, k))
    ref = _reference(kind, raw).reshape(9, k)
    ids = np.array([4, 0, 8, 4, 1], dtype=np.int64)
    row_bytes = raw.shape[1]
    assert lib.hs_dequant_row_bytes(int(Q[kind].value), k) == row_bytes
    for scale in (1.0, 25.3):
        out = np.empty((len(ids), k), np.float32)
        rc = lib.hs_dequant_rows(int(Q[kind].value), raw.ctypes.data, row_bytes, ids.ctypes.data, len(ids), k,
                                 ctypes.c_float(scale), out.ctypes.data)
        want = ref[ids] if scale == 1.0 else ref[ids] * np.float32(scale)
        assert rc == 0 and np.array_equal(out.view(np.uint32), want.view(np.uint32))
    assert lib.hs_dequant_rows(int(Q[kind].value), raw.ctypes.data, row_bytes + 1, ids.ctypes.data, 1, k,
                               ctypes.c_float(1.0), out.ctypes.data) == -1


def test_rows_of_other_types_are_not_read():
    lib = binding.library()
    if lib is None:
        pytest.skip("no C library here")
    assert lib.hs_dequant_row_bytes(int(Q.Q5_K.value), 256) == -1
    assert lib.hs_dequant_row_bytes(int(Q.Q8_0.value), 48) == -1  # not whole blocks


@pytest.mark.parametrize("library", [True, False])
@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "F16"])
def test_embedding_reads_the_files_rows(tmp_path, monkeypatch, kind, library):
    """A GGUFEmbedding over a file's tensor looks rows up as gguf dequantizes them, with the C library
    or without it (the gguf package's own code), any id shape; ids out of range are refused."""
    from hispec.model.load.gguf_index import read_tensors

    if not library:
        monkeypatch.setattr(gguf_embedding, "_library", lambda: None)
    raw = _rows(kind, 48, 256)
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_tensor("token_embd.weight", raw, raw_dtype=Q[kind])
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    emb = GGUFEmbedding(tmp_path / "t.gguf", read_tensors(tmp_path / "t.gguf")[0])
    assert (emb.num_embeddings, emb.embedding_dim) == (48, 256)
    ref = torch.from_numpy(_reference(kind, raw).reshape(48, 256))
    ids = torch.tensor([[3, 47], [0, 3]])
    assert torch.equal(emb(ids), ref[ids])
    assert torch.equal(emb(torch.tensor([5]), scale=16.0), ref[[5]] * torch.tensor(16.0))
    assert torch.equal(emb.flat_sample(37, 50), ref.reshape(-1)[::37][:50])
    with pytest.raises(IndexError):
        emb(torch.tensor([48]))


def _both(tmp_path, **kw):
    """The tiny file's model loaded the new way (from the file, its folder without weights) and the
    old way (the float32 folder, then the file's blocks put in)."""
    from hispec.model.load.checkpoint import load_model
    from hispec.model.load.gguf_convert import WEIGHTS_FILE, convert_gguf
    from hispec.model.load.gguf_native import load_gguf_model

    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src, **kw)
    meta = convert_gguf(src, tmp_path / "meta", progress=False, weights=False)
    assert not (meta / WEIGHTS_FILE).exists()
    native = load_gguf_model(meta, src)
    full = convert_gguf(src, tmp_path / "full", progress=False)
    return native, load_model(full, quantize="native", gguf=src)


@pytest.mark.parametrize("embed,tied", [("F32", False), ("Q8_0", True), ("Q6_K", True), ("Q4_K", False),
                                        ("Q5_K", True)])
def test_loaded_from_the_file_equals_the_float_folder_path(tmp_path, four_bit_kernel, embed, tied):
    """Every parameter, buffer and block-kernel tensor, the embedding's rows and the logits are the
    float folder path's, bit for bit; the embedding stays in the file (a tied head on the file's
    blocks, or an untied one) unless its type is not read in place (Q5_K here: float32, as before)."""
    four_bit_kernel("q8a" if binding.available() else "int4")
    native, ref = _both(tmp_path, types={**DECODER_TYPES}, embed=embed, tied=tied, vocab=272)
    assert native.weight_format == ref.weight_format == "native"
    assert isinstance(native.embed_tokens, GGUFEmbedding) == (embed != "Q5_K")
    mine = {**dict(native.named_parameters()), **dict(native.named_buffers())}
    theirs = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    theirs.pop("embed_tokens.weight") if embed != "Q5_K" else None
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    ids = torch.tensor([1, 40, 50, 60, 70, 80, 90, 100, 271])
    assert torch.equal(native.embed_tokens(ids), ref.embed_tokens(ids))
    assert torch.equal(_logits(native, ids), _logits(ref, ids))


def test_q4_k_m_like_file_from_the_file(tmp_path, four_bit_kernel):
    """Q4_K with Q6_K parts: the same layers as the float folder path (Q/K rows un-permuted)."""
    four_bit_kernel("q8a" if binding.available() else "int4")
    native, ref = _both(tmp_path, types=Q4_K_M, embed="Q6_K", tied=True, vocab=272)
    for a, b in zip(native.layers, ref.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            la, lb = getattr(a, name), getattr(b, name)
            assert (la.kernel, la.group, la.requantized) == (lb.kernel, lb.group, lb.requantized)
            assert torch.equal(la.qweight, lb.qweight) and torch.equal(la.qparams, lb.qparams), name
    ids = torch.tensor([1, 40, 50, 60])
    assert torch.equal(_logits(native, ids), _logits(ref, ids))


@pytest.mark.parametrize("kernel", ["q8a", "int4"])
def test_layers_mapped_in_pieces_are_the_whole(tmp_path, four_bit_kernel, monkeypatch, kernel):
    """Layers and head built a piece of CHUNK_ROWS rows at a time into their final tensors hold the
    bits of the ones built whole (the kernels' tiles go by rows); int4's packing is built whole."""
    if kernel == "q8a" and not binding.available():
        pytest.skip("no C library here")
    four_bit_kernel(kernel)
    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src, Q4_K_M, embed="Q6_K", tied=True, vocab=272)

    def built():
        layers, _ = gguf_weights.native_linears(src, 4, 2, permuted=False)
        return {**layers, "head": gguf_weights.native_head(src)}

    whole = built()
    monkeypatch.setattr(gguf_weights, "CHUNK_ROWS", 48)
    pieces = built()
    assert pieces["head"].out_features == 272
    for name, layer in whole.items():
        other = pieces[name]
        assert (other.kernel, other.group, other.requantized) == (layer.kernel, layer.group, layer.requantized)
        for a, b in ((other.qweight, layer.qweight), (other.qparams, layer.qparams),
                     *((other._exact[k], layer._exact[k]) for k in layer._exact)):
            assert torch.equal(a, b), name


def test_generator_from_a_gguf_file_writes_no_float_copy(tmp_path, monkeypatch, four_bit_kernel):
    """``Generator.from_pretrained(FILE.gguf)`` runs on the file's blocks with the embedding in the
    file, its folder holding config and tokenizer only; every strategy gives ``ar``'s ids (the fused
    decode step reads the embedding's rows in C++). ``--quantize none`` then adds the float32 weights
    to the same folder."""
    from hispec import Generator, SamplingParams
    from hispec.model.load.gguf_convert import WEIGHTS_FILE

    monkeypatch.setenv("HISPEC_HOME", str(tmp_path / "home"))
    four_bit_kernel("q8a" if binding.available() else "int4")
    src = tmp_path / "tiny.gguf"
    _tiny_llama_gguf(src, Q4_K_M, embed="Q8_0", tied=True, vocab=272)
    gen = Generator.from_pretrained(str(src), progress=False, exits=False, quantize="native")
    assert isinstance(gen.model.embed_tokens, GGUFEmbedding) and gen.gguf_path == src
    assert not (gen.model_path / WEIGHTS_FILE).exists()
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = gen.generate([1, 40, 50, 60, 70, 40, 50, 60], params, strategy="ar").token_ids
    for strategy in ("selfspec", "hispec", "lookup"):
        assert gen.generate([1, 40, 50, 60, 70, 40, 50, 60], params, strategy=strategy).token_ids == want, strategy
    float_gen = Generator.from_pretrained(str(src), progress=False, exits=False, quantize="none")
    assert float_gen.model_path == gen.model_path and (gen.model_path / WEIGHTS_FILE).is_file()


def test_gather_leaves_gathered_tensors():
    """hugepages.gather moves a tensor into an arena once: gathered again, it stays where it is."""
    if not hugepages.available():
        pytest.skip("no transparent huge pages here")
    layer = torch.nn.Linear(256, 256)
    assert hugepages.gather(layer, min_bytes=0) > 0 and hugepages.in_arena(layer.weight)
    where = layer.weight.data_ptr()
    assert hugepages.gather(layer, min_bytes=0) == 0 and layer.weight.data_ptr() == where
