"""A token embedding that stays in its GGUF file: rows read from the memory-mapped blocks.

A step embeds a handful of tokens, but a float32 copy of the table is 4-8x its size in the file
(Gemma 3 270M: 671 MB for a 178 MB Q8_0 table; Llama 3.1 8B: 2.1 GB for 0.4 GB of Q4_K). Here the
table is the file's own bytes, mapped copy-on-write and never written, so only the pages of the
rows a run has embedded are resident. A row is dequantized when it is looked up, by the C
library's ``hs_dequant_rows`` (the fused decode step calls the same function), each value as the
gguf package's numpy dequantization computes it: the same float32 values as the float32 copy,
bit for bit (a test compares them for every type read). Without the C library the rows are
dequantized by the gguf package itself.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
from torch import nn

# the GGML types read here (gguf's GGMLQuantizationType names; ids in hispec_kernels.h's enum)
ROW_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K")


class GGUFEmbedding(nn.Module):
    """``nn.Embedding``'s lookup over a GGUF tensor's rows ``[num_embeddings, row_bytes]`` (uint8,
    memory-mapped): ``forward(ids [...]) -> [..., embedding_dim]`` float32."""

    def __init__(self, path: str | Path, tensor) -> None:
        super().__init__()
        kind = tensor.tensor_type
        if kind.name not in ROW_TYPES:
            raise ValueError(f"{tensor.name} is {kind.name}: rows of {', '.join(ROW_TYPES)} are read in place")
        self.embedding_dim, self.num_embeddings = (int(d) for d in tensor.shape[:2])
        self.type_name, self.type_id = kind.name, int(kind.value)
        row_bytes = int(tensor.n_bytes) // self.num_embeddings
        # copy-on-write: writable for torch, never written, so the pages stay the file's
        mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=int(tensor.data_offset),
                           shape=(self.num_embeddings, row_bytes))
        self.rows = torch.from_numpy(mapped)  # [V, row_bytes]: not a buffer (never moved or gathered)
        lib = _library()
        if lib is not None and lib.hs_dequant_row_bytes(self.type_id, self.embedding_dim) != row_bytes:
            raise ValueError(f"{tensor.name}: {row_bytes} bytes a row do not hold {self.embedding_dim} {kind.name} values")

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.type_name} rows in the file"

    @property
    def nbytes(self) -> int:
        return self.rows.numel()

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """The rows of ``ids`` as float32, times ``scale`` (rounded once more) where it is not 1."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < self.num_embeddings):
            raise IndexError(f"token id out of range for an embedding of {self.num_embeddings} rows")
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        lib = _library()
        if lib is not None:
            rc = lib.hs_dequant_rows(self.type_id, self.rows.data_ptr(), self.rows.shape[1], flat.data_ptr(),
                                     flat.numel(), self.embedding_dim, ctypes.c_float(scale), out.data_ptr())
            assert rc == 0, rc
        else:
            from gguf import GGMLQuantizationType
            from gguf.quants import dequantize

            kind = GGMLQuantizationType(self.type_id)
            rows = self.rows.numpy()[flat.numpy()]
            if kind.name in ("F32", "F16"):
                rows = rows.view(np.float32 if kind.name == "F32" else np.float16)
            out = torch.from_numpy(np.ascontiguousarray(dequantize(rows, kind), dtype=np.float32))
            if scale != 1.0:
                out = out * torch.tensor(scale, dtype=torch.float32)
        return out.reshape(*ids.shape, self.embedding_dim)

    def flat_sample(self, step: int, count: int) -> torch.Tensor:
        """``table.reshape(-1)[::step][:count]`` of the float32 table, from the rows it touches only."""
        index = torch.arange(count, dtype=torch.int64) * step
        index = index[index < self.num_embeddings * self.embedding_dim]
        rows, cols = index // self.embedding_dim, index % self.embedding_dim
        wanted = torch.unique(rows)
        table = self(wanted)  # [R, H]
        return table[torch.searchsorted(wanted, rows), cols]


def _library():
    from ...kernels import binding

    return binding.library()
