"""The tensors of a GGUF file, read from its header alone (memory-mapped data, nothing copied).

``gguf.GGUFReader`` parses every metadata value into numpy views one part at a time: the default
model's tokenizer (49k tokens, 48k merges) takes it ~2.4 s, paid by every load that reads the
file's own 4-bit blocks. The weights need only the tensor infos, so this reader steps over the
metadata values (string arrays by their lengths, fixed-size arrays by arithmetic) and reads the
``general.alignment`` key alone: ~0.1 s. The tensors it gives are what ``GGUFReader.tensors``
gives for the same file (name, type, GGML-order shape, data as the same numpy view: float types
by element, quantized ones as uint8 rows of blocks; a test compares the two on every tensor).

Layout (GGUF v2 and v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata
count u64; metadata (key string, value type u32, value); tensor infos (name string, n_dims u32,
dims u64 x n_dims, type u32, offset u64); padding to the alignment; the data. A string is a u64
length and its bytes; an array is its element type u32, count u64 and elements.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np

MAGIC = b"GGUF"
# value type -> its size in bytes (fixed-size types); 8: string, 9: array
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
FLOAT_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}  # as GGUFReader: by element; other types as uint8 bytes


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGML order: innermost dimension first
    data: np.ndarray  # a view of the file
    data_offset: int  # from the start of the file
    n_bytes: int


class _Cursor:
    """Reads little-endian values from ``buf`` at ``pos``."""

    def __init__(self, buf, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(f"{self.path.name}: the GGUF header ends early (at byte {self.pos})")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out[0] if len(out) == 1 else out

    def string(self) -> bytes:
        n = self.take("<Q")
        out = bytes(self.buf[self.pos:self.pos + n])
        if len(out) != n:
            raise ValueError(f"{self.path.name}: the GGUF header ends early (at byte {self.pos})")
        self.pos += n
        return out

    def skip_value(self, vtype: int) -> None:
        if vtype in FIXED:
            self.pos += FIXED[vtype]
        elif vtype == STRING:
            n = self.take("<Q")  # (not ``self.pos += self.take(...)``: that adds to the position before the take)
            self.pos += n
        elif vtype == ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype in FIXED:
                self.pos += FIXED[etype] * count
            else:
                for _ in range(count):
                    self.skip_value(etype)
        else:
            raise ValueError(f"{self.path.name}: unknown GGUF metadata value type {vtype} at byte {self.pos}")


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _header(path: Path) -> tuple[np.ndarray, _Cursor, int, int]:
    """``(the file memory-mapped, a cursor after the header, tensor count, metadata count)``;
    ``ValueError`` for a file that is not GGUF (v2 or later)."""
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), path)
    if bytes(mm[:4]) != MAGIC:
        raise ValueError(f"{path.name} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version, n_tensors, n_kv = cur.take("<I"), cur.take("<Q"), cur.take("<Q")
    if version < 2:
        raise ValueError(f"{path.name}: GGUF version {version} is not supported (2 and later)")
    return mm, cur, n_tensors, n_kv


def read_metadata(path: str | Path, keys) -> dict:
    """The values of the metadata ``keys`` that the GGUF file at ``path`` has and that are numbers,
    booleans or strings (arrays are stepped over), read from its header alone."""
    keys = {k.encode() for k in keys}
    _, cur, _, n_kv = _header(Path(path))
    out = {}
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("<I")
        if key in keys and vtype in _SCALARS:
            out[key.decode()] = cur.take(_SCALARS[vtype])
        elif key in keys and vtype == STRING:
            out[key.decode()] = cur.string().decode("utf-8", "replace")
        else:
            cur.skip_value(vtype)
    return out


def read_tensors(path: str | Path) -> list[GGUFTensor]:
    """The tensors of the GGUF file at ``path`` (see the module's docstring). An unknown tensor
    type raises ``gguf_errors.GGUFTypeError`` naming the tensor; a file that is not GGUF, or is
    cut short, raises ``ValueError``."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from .gguf_errors import GGUFTypeError

    path = Path(path)
    mm, cur, n_tensors, n_kv = _header(path)
    alignment = 32
    for _ in range(n_kv):
        key, vtype = cur.string(), cur.take("<I")
        if key == b"general.alignment" and vtype == 4:
            alignment = cur.take("<I")
        else:
            cur.skip_value(vtype)
    infos = []
    for _ in range(n_tensors):
        name = cur.string().decode("utf-8")
        n_dims = cur.take("<I")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        type_id, offset = cur.take("<I"), cur.take("<Q")
        try:
            ttype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFTypeError(f"GGUF tensor {name!r} in {path.name} has type id {type_id}, unknown to the "
                                "installed gguf package: hispec cannot read it") from None
        infos.append((name, dims, ttype, offset))
    start = -(-cur.pos // alignment) * alignment
    out = []
    for name, dims, ttype, offset in infos:
        block, size = GGML_QUANT_SIZES[ttype]
        n = int(np.prod(dims)) if dims else 1
        n_bytes = n * size // block
        at = start + offset
        if at + n_bytes > len(mm):
            raise ValueError(f"{path.name}: tensor {name!r} lies past the end of the file")
        np_dims = tuple(reversed(dims))
        if ttype.name in FLOAT_DTYPES:
            data = mm[at:at + n_bytes].view(FLOAT_DTYPES[ttype.name]).reshape(np_dims)
        else:  # rows of blocks, as GGUFReader's quant_shape_to_byte_shape
            data = mm[at:at + n_bytes].reshape(*np_dims[:-1], np_dims[-1] // block * size)
        out.append(GGUFTensor(name, ttype, np.array(dims, dtype=np.uint64), data, at, n_bytes))
    return out
