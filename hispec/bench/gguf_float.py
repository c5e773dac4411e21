"""F32 / F16 GGUF copies of a quantized GGUF, for llama.cpp peers on the same weights.

hispec's float32 model of a GGUF is its tensors dequantized (``gguf_convert``). Benchmarking
llama.cpp on "the same weights" in float therefore needs a GGUF holding exactly those values:
every quantized tensor dequantized (``gguf.quants.dequantize``, the same function the
converter uses) and stored as F32, or rounded once to F16 for the F16 file; 1-D tensors
(norms) stay F32, as llama.cpp expects. Metadata (architecture, tokenizer, chat template) is
copied unchanged apart from ``general.file_type``. Files are cached under
``$HISPEC_HOME/peers/gguf/<tag>``, the tag a hash of the source file's path (two sources of the same
name are two caches; a copy older than its source is written again).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

FLOAT_TYPES = {"F32": (np.float32, 0), "F16": (np.float16, 1)}  # name -> (numpy dtype, LlamaFileType)


def cache_dir() -> Path:
    from ..model.load.registry import hispec_home

    return hispec_home() / "peers" / "gguf"


def float_gguf(src: Path, kind: str, out_dir: Path | None = None) -> Path:
    """Path of the ``kind`` (F32 or F16) copy of ``src``, written on first use."""
    if kind not in FLOAT_TYPES:
        raise ValueError(f"float GGUF kind must be one of {', '.join(FLOAT_TYPES)}, got {kind!r}")
    src = Path(src)
    if out_dir is None:
        out_dir = cache_dir() / hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:10]
    out = out_dir / f"{src.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if out.is_file() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        _write(src, tmp, kind)
        tmp.replace(out)  # atomic: a half-written file is never found
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write(src: Path, dst: Path, kind: str) -> None:
    import gguf

    dtype, file_type = FLOAT_TYPES[kind]
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by the writer itself
        value = file_type if key == "general.file_type" else field.contents()
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub_type)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # numpy, row-major ([out, in] for a linear)
        data = np.ascontiguousarray(data, dtype=np.float32 if data.ndim == 1 else dtype)
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
