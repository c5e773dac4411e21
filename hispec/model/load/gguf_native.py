"""A model that runs on its GGUF file's own blocks, loaded from the file alone: no float32 copy.

The decoder's linears and the output head are built from the file's blocks (``gguf_weights``),
the token embedding reads the file's rows in place (``gguf_embedding``), and only the small
tensors (norms, biases, QK-norms) and any linear left on float32 are dequantized. The folder beside
the file holds its config and tokenizer alone (``convert_gguf(..., weights=False)``). What stays
resident is the blocks repacked for the kernels (about their size in the file) and the embedding
rows a run has looked up; loading never holds more than one layer's float values at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ...kernels import hugepages
from ..decoder import DecoderModel
from .checkpoint import (ModelLoadError, fill_weights, native_parts, put_native, read_config, rope_buffers,
                         set_act_dtypes)
from .gguf_convert import _IGNORED_TENSORS, ARCHS, float_tensor
from .gguf_embedding import ROW_TYPES, GGUFEmbedding
from .gguf_weights import FUSED, gguf_tensors, release


def load_gguf_model(folder: str | Path, gguf: str | Path, refuse: bool = True) -> DecoderModel | None:
    """The model of ``gguf`` (config and tokenizer in ``folder``) on its own blocks, in eval mode on
    the CPU; None where none of its tensors runs natively and not ``refuse`` (``--quantize auto``:
    the caller loads the float32 copy), else ``native_parts``' ConfigError."""
    cfg = read_config(Path(folder))
    parts = native_parts(gguf, cfg, refuse)
    if parts is None:
        return None
    linears, head = parts
    arch = ARCHS[cfg.family]
    by_name = {t.name: t for t in gguf_tensors(gguf)}
    embed = by_name["token_embd.weight"]
    # the rows stay in the file unless the head needs the embedding's float values (tied, no block form)
    in_file = embed.tensor_type.name in ROW_TYPES and (head is not None or not cfg.tie_word_embeddings)
    skip = {f"blk.{name.split('.')[1]}.{p}.weight" for name in linears for p in FUSED[name.split(".")[2]]}
    skip |= {"token_embd.weight"} if in_file else set()
    skip |= {"output.weight"} if head is not None else set()
    elsewhere = {f"{name}.weight" for name in linears}
    elsewhere |= {"embed_tokens.weight"} if in_file else set()
    elsewhere |= {"lm_head.weight"} if head is not None else set()

    def floats(names):  # (Hugging Face name, float32 values) of these tensors, in this order
        for name in names:
            hf_name, values = float_tensor(by_name[name], arch, cfg.num_heads, cfg.num_kv_heads)
            yield hf_name, torch.from_numpy(values)

    def file_weight(name: str, _old) -> torch.Tensor:  # a linear's float values, for a dense prefill copy
        i, fused = name.split(".")[1:]
        return torch.cat([v for _, v in floats([f"blk.{i}.{p}.weight" for p in FUSED[fused]])])

    with torch.device("meta"):
        model = DecoderModel(cfg)
    rest = [n for n in by_name if n not in skip and n not in _IGNORED_TENSORS]
    fill_weights(model, floats(rest), torch.float32, frozenset(elsewhere))
    put_native(model, linears, head, file_weight)
    if in_file:
        model.embed_tokens = GGUFEmbedding(gguf, embed)
    rope_buffers(model)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"{Path(gguf).name}: no values for {', '.join(left[:4])}")
    model.eval().requires_grad_(False)
    set_act_dtypes(model)
    model.weight_format = "native"
    hugepages.gather(model)  # the rest (the linears and head are there already): same values
    release()
    hugepages.trim_heap()  # the load's freed scratch
    return model

