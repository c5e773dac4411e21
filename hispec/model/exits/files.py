"""Exit heads on disk: ``heads.safetensors`` (float32 adapters or float16 blocks, subset ids) beside
``manifest.json``."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .errors import ExitHeadError
from .fingerprint import identity_mismatch
from .head import ExitHead, SharedOutput
from .manifest import FORMAT, Manifest, read_manifest, write_manifest

WEIGHTS_FILE = "heads.safetensors"
# stored precision per design: a block is a whole decoder layer (14 MB in float32 for SmolLM2)
STORED_DTYPE = {"linear": torch.float32, "block": torch.float16, "block-final": torch.float16}


def new_heads(model: nn.Module, layers: list[int], vocab_ids: dict[int, torch.Tensor | None] | None = None,
              design: str | dict[int, str] = "linear", init: str = "copy") -> dict[int, SharedOutput]:
    """Untrained exits of ``design`` (one for all, or one per layer) at ``layers`` (1 .. num_layers
    - 1), on the model's device and dtype: identity-initialised ``linear`` heads, or ``block`` exits
    (``init`` as in ``ExitBlock``)."""
    n = model.cfg.num_layers
    bad = [L for L in layers if not 1 <= L < n]
    if bad:
        raise ExitHeadError(f"exit layers must be between 1 and {n - 1} for this {n}-layer model, got {bad}")
    designs = design if isinstance(design, dict) else {L: design for L in layers}
    for d in set(designs.values()):
        if d not in STORED_DTYPE:
            raise ExitHeadError(f"unknown exit design {d!r} (known: {', '.join(STORED_DTYPE)})")
    vocab_ids = vocab_ids or {}

    def make(L: int) -> SharedOutput:
        if designs[L] in ("block", "block-final"):
            from .block import ExitBlock

            return ExitBlock(model, vocab_ids.get(L), init=init, reads_final=designs[L] == "block-final")
        return ExitHead(model, vocab_ids.get(L))

    return {L: make(L).to(device=model.device, dtype=model.dtype).eval().requires_grad_(False) for L in layers}


def save_heads(folder: str | Path, heads: dict[int, SharedOutput], manifest: Manifest) -> Path:
    """Write ``heads.safetensors`` (float32 adapters, float16 blocks) and ``manifest.json`` into
    ``folder``. A set may mix designs (e.g. a block at a shallow exit, a linear head at a deep one):
    the manifest's ``design.kind`` is then ``"mixed"`` and ``design.kinds`` names each layer's."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kinds = {L: h.kind for L, h in sorted(heads.items())}
    tensors = {}
    for L, head in sorted(heads.items()):
        for k, v in head.state_dict().items():
            if v is not None:
                tensors[f"{L}.{k}"] = v.detach().to("cpu", STORED_DTYPE[kinds[L]] if v.is_floating_point() else v.dtype
                                                   ).contiguous()
    manifest.layers = sorted(heads)
    manifest.design = {**{k: v for k, v in manifest.design.items() if k != "kinds"},
                       "kind": kinds[manifest.layers[0]] if len(set(kinds.values())) == 1 else "mixed",
                       **({"kinds": {str(L): k for L, k in kinds.items()}} if len(set(kinds.values())) > 1 else {}),
                       "vocab": {str(L): (int(h.vocab_ids.numel()) if h.restricted else None)
                                 for L, h in sorted(heads.items())}}
    tmp = folder / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": FORMAT})
    tmp.replace(folder / WEIGHTS_FILE)
    write_manifest(folder, manifest)
    return folder


def load_heads(folder: str | Path, model: nn.Module, check_identity: bool = True
               ) -> tuple[dict[int, SharedOutput], Manifest]:
    """Heads from ``folder`` for ``model``; ExitHeadError if they belong to another model."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    if check_identity:
        why = identity_mismatch(model, manifest.base_model)
        if why:
            name = manifest.base_model.get("name") or "another model"
            raise ExitHeadError(f"the exit heads in {folder} were trained for {name}, not this model ({why}); "
                                "train heads for this model with `hispec train-exits`, or pass --no-exits")
    wfile = folder / WEIGHTS_FILE
    if not wfile.is_file():
        raise ExitHeadError(f"{folder}: {WEIGHTS_FILE} is missing")
    try:
        tensors = load_file(str(wfile))
    except Exception as e:  # safetensors raises its own error types
        raise ExitHeadError(f"cannot read {wfile}: {e}") from None
    vocab = {L: tensors.get(f"{L}.vocab_ids") for L in manifest.layers}
    heads = new_heads(model, manifest.layers, vocab, design={L: manifest.kind_of(L) for L in manifest.layers})
    for L, head in heads.items():
        state = {k: tensors.get(f"{L}.{k}") for k in head.state_dict()}
        missing = [k for k, v in state.items() if v is None and k != "vocab_ids"]
        if missing:
            raise ExitHeadError(f"{wfile} lacks the tensors {', '.join(f'{L}.{k}' for k in missing)}")
        for k, v in state.items():
            if v is not None and tuple(v.shape) != tuple(head.state_dict()[k].shape):
                raise ExitHeadError(f"{wfile}: {L}.{k} has shape {tuple(v.shape)}, expected "
                                    f"{tuple(head.state_dict()[k].shape)}")
        head.load_state_dict({k: v.to(head.state_dict()[k].dtype) for k, v in state.items() if v is not None},
                             strict=False)
        head.to(device=model.device, dtype=model.dtype).eval().requires_grad_(False)
    return heads, manifest
