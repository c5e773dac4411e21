"""``Generator`` on a tensor-parallel group: what ``--tensor-parallel-size N`` loads.

Rank 0 (this process) gets a ``Generator`` whose model is the leader of the group (see
``runtime.py``); everything built on a ``Generator`` -- ``generate``, ``LLM``, the server --
runs on it unchanged. Exit heads are found and checked as in one process: the weight
fingerprint is read from the checkpoint's slices (no rank holds the full tensors).
"""
from __future__ import annotations

import atexit
import math
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import safe_open

from .comm import DEFAULT_TIMEOUT_S

_SAMPLES = 1024  # as hispec.model.exits samples each fingerprint tensor


def generator_from_args(args, progress: bool = True):
    """The ``Generator`` the model and parallelism options describe: over a group of
    ``--tensor-parallel-size`` processes when N > 1, else ``options.load_generator``'s."""
    from ..options import UsageError, load_generator, load_options

    tp = getattr(args, "tensor_parallel_size", 1)
    if tp == 1:
        return load_generator(args, progress)
    opts = load_options(args)  # checks the options, tp >= 1 among them
    if opts["kv_cache_dtype"] != "auto":
        raise UsageError("--kv-cache-dtype: tensor-parallel workers keep the model's dtype; leave it at auto")
    if opts["device"].startswith("cuda") and torch.cuda.device_count() < tp:
        raise UsageError(f"--tensor-parallel-size {tp}: only {torch.cuda.device_count()} CUDA device(s) here")
    if opts["allow_pickle"]:
        raise UsageError("--tensor-parallel-size reads safetensors only (each rank reads its slices); "
                         "convert pickle checkpoints first")
    return tp_generator(args.model, tp, device=opts["device"], dtype=opts["dtype"] or torch.float32,
                        exits=opts["exits"], threads=args.threads, progress=progress, exit_on_failure=True)


def tp_generator(name_or_path: str, world_size: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 exits: str | Path | bool = True, threads: int | None = None, progress: bool = True,
                 exit_on_failure: bool = False, timeout_s: float = DEFAULT_TIMEOUT_S):
    """A ``Generator`` over ``world_size`` ranks (this process is rank 0; the others are started here)."""
    from ..generate import Generator, load_tokenizer
    from ..model.load.registry import resolve_model
    from .runtime import start_group

    folder = resolve_model(name_or_path, progress=progress)
    model = start_group(folder, world_size, device=device, dtype=dtype, threads=threads, timeout_s=timeout_s,
                        exit_on_failure=exit_on_failure)
    atexit.register(model.shutdown)
    gen = Generator(model, load_tokenizer(folder))
    gen.model_path = folder
    if exits is not False:
        attach_exits_tp(gen, folder, None if exits is True else Path(exits), dtype)
    return gen


def attach_exits_tp(gen, folder: Path, path: Path | None, dtype: torch.dtype):
    """``hispec.model.exits.attach_exits`` for a sharded model: identity checked on a view of the
    checkpoint, heads built on the sharded model (their adapters replicated)."""
    from ..model.exits import ExitHeadError, attach, find_heads, identity_mismatch, load_heads, read_manifest

    view = identity_view(folder, gen.model.full_cfg, dtype)
    if path is None:
        path = find_heads(view, folder)
        if path is None:
            return None
    if not Path(path).exists():
        raise ExitHeadError(f"--exits {path}: no such folder")
    manifest = read_manifest(path)
    why = identity_mismatch(view, manifest.base_model)
    if why:
        raise ExitHeadError(f"the exit heads in {path} were trained for another model ({why}); "
                            "pass --no-exits or heads for this model")
    heads, manifest = load_heads(path, gen.model, check_identity=False)
    attach(gen, heads, manifest, Path(path))
    return manifest


def identity_view(folder: Path, cfg, dtype: torch.dtype) -> SimpleNamespace:
    """An object that ``hispec.model.exits.model_identity`` reads like the full model: the full
    config, and for each fingerprinted tensor the very values it samples (read row by row)."""
    from ..model.load.checkpoint import internal_name

    n = cfg.num_layers
    wanted = {"embed_tokens.weight", "norm.weight", "layers.0.qkv_proj.weight", f"layers.{n // 2}.o_proj.weight",
              f"layers.{n - 1}.input_norm.weight", f"layers.{n - 1}.qkv_proj.weight"}
    where: dict[str, dict] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                mapped = internal_name(key, cfg.family)
                if mapped and mapped[0] in wanted:
                    where.setdefault(mapped[0], {})[mapped[1]] = (f, key)
    samples = {name: _sampled(parts, dtype) for name, parts in where.items()}
    layers = [SimpleNamespace() for _ in range(n)]
    for name, t in samples.items():
        if name.startswith("layers."):
            _, i, mod, _ = name.split(".")
            setattr(layers[int(i)], mod, SimpleNamespace(weight=t))
    return SimpleNamespace(cfg=cfg, layers=layers, embed_tokens=SimpleNamespace(weight=samples["embed_tokens.weight"]),
                           norm=SimpleNamespace(weight=samples["norm.weight"]))


def _sampled(parts: dict, dtype: torch.dtype) -> torch.Tensor:
    """The strided sample ``flat[::step][:1024]`` of a (possibly q/k/v-fused) tensor, reading only its rows."""
    order = [p for p in ("q", "k", "v") if p in parts] or [None]
    handles = {p: safe_open(str(parts[p][0]), framework="pt") for p in order}
    slices = {p: handles[p].get_slice(parts[p][1]) for p in order}
    shapes = {p: slices[p].get_shape() for p in order}
    if len(shapes[order[0]]) == 1:
        flat = slices[order[0]][:].to(dtype)
        step = max(1, flat.numel() // _SAMPLES)
        return flat[::step][:_SAMPLES]
    cols = shapes[order[0]][1]
    row_starts, total = {}, 0
    for p in order:
        row_starts[p] = total
        total += shapes[p][0]
    numel = total * cols
    step = max(1, numel // _SAMPLES)
    count = min(_SAMPLES, math.ceil(numel / step))
    out, rows = [], {}
    for k in range(count):
        r, c = divmod(k * step, cols)
        if r not in rows:
            p = max((q for q in order if row_starts[q] <= r), key=lambda q: row_starts[q])
            rows[r] = slices[p][r - row_starts[p]:r - row_starts[p] + 1][0].to(dtype)
        out.append(rows[r][c])
    return torch.stack(out)
