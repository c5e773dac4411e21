"""``hispec probe``, ``hispec train-exits`` and ``hispec tune``."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from ..paths import portable
from ..settings import StrategyName
from .config import PRECISIONS, TEACHER_PRECISIONS


def _command(sub, name: str, func, help: str, description: str) -> argparse.ArgumentParser:
    """A subcommand with the model options, registered for ``_command_line``."""
    from ..options import add_model_options

    p = sub.add_parser(name, help=help, description=description)
    add_model_options(p)
    p.set_defaults(func=func)
    _PARSERS[name] = p
    return p


def register(sub) -> None:
    p = _command(sub, "probe", cmd_probe, help="per-layer agreement with the final layer (table + PNG)",
                 description="Top-1/top-5 agreement of every exit layer with the final layer over the "
                             "model's own greedy continuations of the prompts.")
    p.add_argument("--data", required=True, metavar="FILE", help="prompts (JSONL, or a named source)")
    p.add_argument("--limit", type=int, default=16, help="number of prompts (default 16)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--out", metavar="PNG", default=None, help="write the agreement curve here")
    p.add_argument("--json", action="store_true", help="print the table as JSON")

    p = _command(sub, "train-exits", cmd_train_exits,
                 help="collect data and distil exits in one command (base model frozen)",
                 description="The whole exit pipeline in one resumable command: teacher passes over reference "
                             "replies and/or the model's own greedy continuations (made by the engine), then "
                             "distillation of an exit at each layer (the same collector and distiller as "
                             "collect-exits and distill-exits).")
    p.set_defaults(quantize="none")  # exits are distilled from the float32 reference; they run on any weights
    p.add_argument("--layers", required=True, help="exit layers, e.g. 4,8")
    _add_data_options(p)
    p.add_argument("--eval-data", default=None, metavar="FILE",
                   help="held-out prompts, continued by the model, for the before/after agreement "
                        "(default: every 20th training record)")
    p.add_argument("--eval-limit", type=int, default=32)
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--out", required=True, metavar="DIR", help="where heads.safetensors + manifest.json go")
    p.add_argument("--work", default=None, metavar="DIR",
                   help="data folders and checkpoints (default: OUT/work; large: keep it out of a package)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="the data folders' parent (default: WORK/cache): teacher/ (replies) and own/ (continuations)")
    p.add_argument("--mode", default="both", choices=["self", "teacher", "both"],
                   help="the model's own continuations, teacher-forced replies, or both (default)")
    p.add_argument("--self-tokens", type=int, default=None, help="budget of continuation (reply) positions")
    p.add_argument("--teacher-tokens", type=int, default=None, help="budget of teacher-forced reply positions")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per continuation")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--max-response-tokens", type=int, default=384)
    p.add_argument("--batch-size", type=int, default=16, help="prompts the engine continues together")
    p.add_argument("--teacher-batch-tokens", type=int, default=2048, help="positions per teacher pass")
    _add_teacher_precision(p, "model")  # the shipped heads' recipe: the float32 reference
    _add_exit_options(p, design="linear", init="zero", vocab=0)
    p.add_argument("--vocab-layers", default=None,
                   help="the layers that get the restricted vocabulary (default: all of --layers)")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps per exit (0: --epochs instead)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the data when --steps is 0")
    p.add_argument("--batch-tokens", type=int, default=None,
                   help="positions per step (default: 512 for linear heads, 4096 padded positions for blocks)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=None,
                   help="weight of the CE on the teacher's argmax (default: 0 for linear heads, 0.2 for blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue an interrupted run (data and training)")
    p.add_argument("--no-ls-init", action="store_true", help="linear heads: start from the identity, not least squares")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="exits to keep at the other layers (e.g. the shipped heads): the set written to --out "
                        "holds them beside the new ones")
    p.add_argument("--no-progress", action="store_true")

    p = _command(sub, "collect-exits", cmd_collect_exits,
                 help="distillation data for exits: batched teacher passes, in shards",
                 description="Teacher passes over chat-formatted conversations (prompt + reply, or prompt + the "
                             "model's own greedy continuation with --mode self): the states entering the exit "
                             "layers and the final layer's top-k log-probs at every position, in resumable "
                             "shards (run again with the same --out to continue).")
    p.add_argument("--layers", required=True, help="layers whose input states are kept, e.g. 2,4,8 (0: the embeddings; the layer count: the final state, for exits that read it)")
    _add_data_options(p)
    p.add_argument("--out", required=True, metavar="DIR", help="the shard folder (large: keep it out of a package)")
    p.add_argument("--mode", default="teacher", choices=["teacher", "self"],
                   help="teacher (default): the records' replies; self: the model's own greedy continuations of "
                        "the prompts, made by the engine")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per continuation (--mode self)")
    p.add_argument("--batch-size", type=int, default=16, help="prompts the engine continues together (--mode self)")
    p.add_argument("--topk", type=int, default=32, help="teacher log-probs kept per position (default 32)")
    p.add_argument("--max-tokens", type=int, default=512, help="positions per conversation (default 512)")
    p.add_argument("--max-positions", type=int, default=None, help="stop when the folder holds this many")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop collecting after this long (what was collected is kept; run again to continue)")
    p.add_argument("--batch-tokens", type=int, default=4096, help="positions per teacher pass (default 4096)")
    _add_teacher_precision(p, "bfloat16")
    p.add_argument("--seed", type=int, default=0, help="record order")

    p = _command(sub, "distill-exits", cmd_distill_exits,
                 help="train exits (block or linear) on collect-exits shards, resumable",
                 description="Distil exits from the teacher shards of `hispec collect-exits` (KL to the final "
                             "layer's top-k + a small cross-entropy on its argmax), base model frozen; "
                             "checkpoints let a stopped run continue bit-identically (--resume).")
    p.add_argument("--data", required=True, nargs="+", metavar="DIR",
                   help="collect-exits folders (several: their sequences together, e.g. teacher-forced replies "
                        "and the model's own continuations)")
    p.add_argument("--layers", required=True, help="exit layers, e.g. 4 or 2,4 (their states must be in --data)")
    _add_exit_options(p, design="block", init="copy", vocab=8192)
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded positions per step")
    p.add_argument("--ce-weight", type=float, default=0.2)
    p.add_argument("--max-positions", type=int, default=None, help="train on the first N training positions of --data (the held-out records stay "
                        "those of the whole folder, so runs on growing N compare on the same positions)")
    p.add_argument("--heldout-every", type=int, default=50, help="hold out every N-th record (default 50)")
    p.add_argument("--eval-every", type=int, default=0, help="held-out agreement every N steps (0: at the end)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (continue with --resume)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, metavar="DIR", help="where heads.safetensors + manifest.json go")
    p.add_argument("--work", default=None, metavar="DIR", help="checkpoints (default: OUT/work)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoints in --work")
    p.add_argument("--keep", default=None, metavar="DIR",
                   help="exits to keep at the other layers (e.g. the shipped heads' deep linear head): the set "
                        "written to --out holds them beside the new ones")

    p = _command(sub, "tune", cmd_tune, help="choose L_d, L_i, N_d, N_i and the draft policy by measurement",
                 description="Measure per-phase costs and exit agreement on calibration prompts, predict "
                             "tokens/s of every configuration, check the best end to end, and write the "
                             "winner into the heads' manifest.")
    p.add_argument("--data", required=True, metavar="FILE", help="calibration prompts")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--validate", type=int, default=3,
                   help="check the best N hispec and N selfspec predictions end to end (0 = prediction only)")
    p.add_argument("--validate-prompts", type=int, default=4)
    p.add_argument("--draft-layers", default=None, help="restrict L_d candidates, e.g. 4,6")
    p.add_argument("--verify-layers", default=None, help="restrict L_i candidates")
    p.add_argument("--no-write", action="store_true", help="do not write the manifest")
    p.add_argument("--prune", action="store_true", help="keep only the heads the chosen settings use")
    p.add_argument("--json", action="store_true")


# ---- helpers --------------------------------------------------------------------------------

def _add_data_options(p) -> None:
    p.add_argument("--data", required=True, nargs="+", metavar="FILE",
                   help="JSONL files or named sources (sharegpt[:N[:OFFSET]], humaneval)")
    p.add_argument("--holdout", nargs="*", default=[], metavar="FILE",
                   help="prompts never to train on (e.g. the Spec-Bench file you evaluate on)")


def _add_teacher_precision(p, default: str) -> None:
    p.add_argument("--teacher-precision", default=default, choices=list(TEACHER_PRECISIONS),
                   help="bfloat16: on CPU the teacher's linear layers run as dense bfloat16 matrices of the model's "
                        "own weights (quantized ones dequantized), ~2-3x faster than the int4 decode kernel at "
                        f"prefill; model: the model's own kernels (on a GPU: always the model's own); default {default}")


def _add_exit_options(p, design: str, init: str, vocab: int) -> None:
    p.add_argument("--design", default=design, choices=["block", "block-final", "linear"],
                   help=f"block: one decoder layer over the exit states; block-final: that block also reads the "
                        f"previous position's final state (needs the final states); linear: a per-token head "
                        f"(default {design})")
    p.add_argument("--init", default=init, choices=["copy", "zero"],
                   help=f"block start: a copy of the last decoder layer, or that copy with zeroed output "
                        f"projections (default {init})")
    p.add_argument("--vocab", type=int, default=vocab,
                   help=f"restrict the exits to the K most frequent tokens (FR-Spec); 0 = full vocabulary "
                        f"(default {vocab})")
    p.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                   help="training step precision: bfloat16 autocast (float32 weights and optimizer state) or "
                        "float32; auto (default): bfloat16 where the hardware multiplies it (AVX512-BF16/AMX "
                        "CPUs, CUDA), 2-3x faster there")

def _layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    from ..options import UsageError

    try:
        return sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"layers must be comma-separated integers, got {text!r}") from None


def _prompt_ids(gen, specs: list[str], limit: int | None, max_prompt_tokens: int) -> list[list[int]]:
    from ..options import UsageError
    from .collect import encode_record
    from .sources import load_sources

    records, _ = load_sources(specs)
    out = []
    for r in records:
        p, _ = encode_record(gen, r, max_prompt_tokens, 0)
        if p is not None:
            out.append(p)
        if limit and len(out) >= limit:
            break
    if not out:
        raise UsageError(f"no usable prompts in {', '.join(specs)} (all longer than {max_prompt_tokens} tokens?)")
    return out


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _say_heads(gen) -> None:
    from ..model.exits import describe

    manifest = gen.exits.manifest if gen.exits else None
    if manifest is None:
        _say("no trained exit heads: every exit goes through the model's own final norm and output head")
    else:
        _say(f"{gen.exits.path}: {describe(manifest)}")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def _command_line(args, name: str) -> str:
    """The command that reproduces this run: every option that differs from its default."""
    parts = ["hispec", name]
    skip = {"help", "func", "command", "no_progress", "threads", "resume", "no_write", "json"}
    for action in _PARSERS[name]._actions:
        if action.dest in skip or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        if (value == action.default and action.dest != "model") or value is None:
            continue
        flag = action.option_strings[-1] if action.option_strings[-1].startswith("--") else action.option_strings[0]
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            parts.append(flag)
        elif isinstance(value, list):
            if value:
                parts += [flag] + [shlex.quote(portable(str(v), digest=False)) for v in value]
        else:
            parts += [flag, shlex.quote(portable(str(value), digest=False))]
    return " ".join(parts)


# ---- probe -------------------------------------------------------------------------------------
def cmd_probe(args) -> int:
    from ..options import load_generator
    from .probe import format_table, plot, probe

    gen = load_generator(args, progress=False)
    _say_heads(gen)
    prompts = _prompt_ids(gen, [args.data], args.limit, args.max_prompt_tokens)
    t0 = time.perf_counter()
    rows, positions = probe(gen.model, prompts, args.max_new_tokens, gen.eos_ids)
    spec = gen.recommended_spec
    marks = {spec.draft_layer: "L_d", spec.verify_layer: "L_i"} if spec else {}
    if args.json:
        print(json.dumps({"positions": positions, "layers": [dataclasses.asdict(r) for r in rows]}, indent=1))
    else:
        print(f"agreement with the final layer over {positions} generated positions "
              f"({len(prompts)} prompts, {time.perf_counter() - t0:.0f} s)")
        print(format_table(rows, marks))
    if args.out:
        path = plot(rows, Path(args.out), f"{args.model}: exit agreement ({positions} positions)", marks)
        _say(f"wrote {path}")
    return 0


# ---- collect-exits --------------------------------------------------------------------------
def cmd_collect_exits(args) -> int:
    from ..options import UsageError, load_generator
    from .config import TrainConfig
    from .sources import load_sources

    layers = _layers(args.layers)
    command = _command_line(args, "collect-exits")
    args.no_exits, args.exits = True, None
    gen = load_generator(args, progress=False)
    n = gen.model.num_layers
    if not layers or any(not 0 <= L <= n for L in layers):
        raise UsageError(f"--layers must be between 0 (the embeddings) and {n} (the final state) for this "
                         f"{n}-layer model, got {args.layers}")
    records, summary = load_sources(args.data, args.holdout, shuffle_seed=args.seed)
    cfg = TrainConfig(tuple(layers), topk=args.topk, token_cap=args.max_tokens, teacher_batch_tokens=args.batch_tokens,
                      teacher_precision=args.teacher_precision, max_new_tokens=args.max_new_tokens,
                      generate_batch=args.batch_size)
    meta = _collect(gen, records, Path(args.out), cfg, args.mode, summary, command, args.max_positions, "positions",
                    args.max_seconds)
    _say(f"{args.out}: {meta['positions']} positions ({meta['reply_positions']} in replies) from "
         f"{meta['sequences']} conversations, {meta.get('positions_per_s', 0)} positions/s")
    return 0


def _collect(gen, records, folder: Path, cfg, mode: str, summary: dict, command: str, budget: int | None,
             budget_of: str, max_seconds: float | None = None) -> dict:
    """One data folder: teacher passes over the records' replies (``teacher``) or over the
    model's own continuations of their prompts (``self``), resuming where the folder stopped."""
    from ..model.exits import model_identity
    from .collect import collect, continuations, encode_records, records_done

    start = records_done(folder)
    seqs = (continuations if mode == "self" else encode_records)(gen, records, cfg, start)
    meta = {"model": model_identity(gen.model)["weights_sha256"], "data": summary, "command": command,
            "dtype": str(gen.model.dtype).removeprefix("torch.")}
    if mode == "self":
        meta["source"] = {"continuations": {"max_new_tokens": cfg.max_new_tokens, "greedy": True}}
    return collect(gen.model, seqs, folder, cfg, meta, budget, budget_of, max_seconds, log=_say)


# ---- distill-exits --------------------------------------------------------------------------
def cmd_distill_exits(args) -> int:
    from ..options import UsageError, load_generator
    from ..model.exits import model_identity
    from .collect import read_meta
    from .config import TrainConfig, resolve_precision
    from .distill import distill_layers

    layers = _layers(args.layers)
    command = _command_line(args, "distill-exits")
    args.no_exits, args.exits = True, None
    gen = load_generator(args, progress=False)
    model = gen.model
    folders = [Path(d) for d in args.data]
    metas = [read_meta(f) for f in folders]
    for f, meta in zip(folders, metas):
        if meta.get("model") != model_identity(model)["weights_sha256"]:
            raise UsageError(f"{f} was collected with another model")
    work = Path(args.work) if args.work else Path(args.out) / "work"
    cfg = TrainConfig(epochs=args.epochs, batch_tokens=args.batch_tokens, lr=args.lr, ce_weight=args.ce_weight,
                      seed=args.seed, eval_every=args.eval_every,
                      precision=resolve_precision(args.precision, model.device))
    try:
        exits, results = distill_layers(model, folders, layers or [], cfg, args.design, args.init, args.vocab,
                                        heldout_every=args.heldout_every, max_positions=args.max_positions,
                                        work=work, resume=args.resume, max_steps=args.max_steps, log=_say)
    except ValueError as e:
        raise UsageError(str(e)) from None
    data = {"folder": folders[0].name if len(folders) == 1 else [f.name for f in folders],
            "positions": {str(L): r.positions for L, r in results.items()},
            "collect": metas[0].get("command") if len(folders) == 1 else [m.get("command") for m in metas],
            "heldout_every": args.heldout_every}
    _save_exits(args, model, exits, results, data, cfg, command)
    return 0


def _save_exits(args, model, exits: dict, results: dict, data: dict, cfg, command: str) -> None:
    """The exits and their manifest in ``args.out`` (with the exits of ``args.keep`` beside them)."""
    from ..model.exits import Manifest, model_identity, save_heads

    added = sum(e.num_added_params() for e in exits.values())
    design = {"kind": args.design, "added_params": added,
              "added_fraction": round(added / sum(p.numel() for p in model.parameters()), 5)}
    if args.design != "linear":
        design["init"] = args.init
    manifest = Manifest(model_identity(model, args.model), sorted(exits), design, data=data,
                        training={"command": command, "config": cfg.training(),
                                  "per_layer": {str(L): r.training for L, r in results.items()}},
                        agreement={str(L): r.agreement for L, r in results.items()})
    if args.keep:
        _keep_exits(args.keep, model, exits, manifest)
    save_heads(args.out, exits, manifest)
    size = (Path(args.out) / "heads.safetensors").stat().st_size
    _say(f"wrote {args.out} ({size / 1e6:.1f} MB): " + ", ".join(
        f"layer {L} top-1 {r.agreement['top1_before']:.3f} -> {r.agreement['top1_after']:.3f}"
        for L, r in results.items()))


def _keep_exits(folder: str, model, exits: dict, manifest) -> None:
    """Add the exits of ``folder`` at layers ``exits`` lacks, with their manifest entries (their
    agreement was measured by their own recipe, named under ``kept``)."""
    from ..model.exits import load_heads

    kept, source = load_heads(folder, model)
    added = sorted(L for L in kept if L not in exits)
    for L in added:
        exits[L] = kept[L]
        if str(L) in source.agreement:
            manifest.agreement[str(L)] = source.agreement[str(L)]
    manifest.training["kept"] = {"folder": Path(folder).name, "layers": added,
                                 "design": {str(L): source.kind_of(L) for L in added},
                                 "command": source.training.get("command")}
    _say(f"kept the exits of {folder} at layers {', '.join(map(str, added)) or 'none'}")


# ---- train-exits ----------------------------------------------------------------------------
def cmd_train_exits(args) -> int:
    from ..options import UsageError, load_generator
    from .config import TrainConfig, resolve_precision
    from .distill import distill_layers
    from .sources import load_sources

    layers = _layers(args.layers)
    command = _command_line(args, "train-exits")
    args.no_exits, args.exits = True, None  # train from the model's own head
    gen = load_generator(args, progress=not args.no_progress)
    model = gen.model
    n = model.num_layers
    if not layers or any(not 1 <= L < n for L in layers):
        raise UsageError(f"--layers must be between 1 and {n - 1} for this {n}-layer model, got {args.layers}")
    vocab_layers = _layers(args.vocab_layers) or layers
    if not set(vocab_layers) <= set(layers):
        raise UsageError(f"--vocab-layers {args.vocab_layers} must be among --layers {args.layers}")
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    cache = Path(args.cache) if args.cache else work / "cache"
    if cache.is_dir() and any(cache.glob("*/meta.json")) and not args.resume and args.cache is None:
        raise UsageError(f"{cache} exists: pass --resume to continue it, or another --out/--work")
    records, summary = load_sources(args.data, args.holdout, shuffle_seed=args.seed)
    if not records:
        raise UsageError("no training records left after removing the held-out prompts")
    _say(f"{summary['records']} training records ({summary['with_response']} with a response); "
         f"{summary['dropped_as_held_out']} dropped as held out")
    linear = args.design == "linear"
    cfg = TrainConfig(
        layers=tuple(sorted(set(layers) | ({n} if linear or args.design == "block-final" else set()))),
        max_prompt_tokens=args.max_prompt_tokens,
        token_cap=args.max_prompt_tokens + max(args.max_response_tokens, args.max_new_tokens),
        max_new_tokens=args.max_new_tokens, generate_batch=args.batch_size,
        teacher_batch_tokens=args.teacher_batch_tokens, teacher_precision=args.teacher_precision,
        steps=args.steps or None, epochs=args.epochs, batches="tokens" if linear else "sequences",
        batch_tokens=args.batch_tokens or (512 if linear else 4096), lr=args.lr,
        ce_weight=args.ce_weight if args.ce_weight is not None else (0.0 if linear else 0.2),
        min_lr_ratio=0.1 if linear else 0.05, warmup=50 if linear else 20, weight_decay=0.0 if linear else 0.01,
        checkpoint_every=200 if linear else 50, seed=args.seed, ls_init=linear and not args.no_ls_init,
        precision=resolve_precision(args.precision, model.device))
    folders, metas = [], {}
    for mode, name, budget in (("teacher", "teacher", args.teacher_tokens), ("self", "own", args.self_tokens)):
        if args.mode in (mode, "both"):
            folders.append(cache / name)
            metas[name] = _collect(gen, records, cache / name, cfg, mode, summary, command, budget, "reply_positions")
    if not any(m["reply_positions"] for m in metas.values()):
        raise UsageError("the data gave no training positions")
    held_folders = None
    if args.eval_data:
        eval_records, eval_summary = load_sources([args.eval_data])
        ecfg = dataclasses.replace(cfg, max_prompt_tokens=max(args.max_prompt_tokens, 2048),
                                   token_cap=max(args.max_prompt_tokens, 2048) + args.eval_max_new_tokens,
                                   max_new_tokens=args.eval_max_new_tokens)
        _collect(gen, eval_records[:args.eval_limit], work / "eval", ecfg, "self", eval_summary, command, None,
                 "positions")
        held_folders = [work / "eval"]
    try:
        exits, results = distill_layers(model, folders, layers, cfg, args.design, args.init, args.vocab, vocab_layers,
                                        always=sorted(gen.eos_ids), heldout_every=20, held_folders=held_folders,
                                        work=work / "checkpoints", resume=args.resume, log=_say)
    except ValueError as e:
        raise UsageError(str(e)) from None
    data = {**summary, "collected": {k: {f: m.get(f) for f in ("positions", "reply_positions", "sequences", "seconds")}
                                     for k, m in metas.items()},
            "positions": {str(L): r.positions for L, r in results.items()},
            "heldout": portable(args.eval_data) or "every 20th training record"}
    _save_exits(args, model, exits, results, data, cfg, command)
    print("held-out agreement with the final layer, before -> after:")
    print(f"{'layer':>5}  {'top-1':>15}  {'top-5':>15}")
    for L, r in results.items():
        a = r.agreement
        print(f"{L:>5}  {a['top1_before']:>6.3f} -> {a['top1_after']:.3f}  "
              f"{a['top5_before']:>6.3f} -> {a['top5_after']:.3f}")
    print(f"next: hispec tune --model {args.model} --exits {out} --data PROMPTS")
    return 0


# ---- tune ----------------------------------------------------------------------------------------
def cmd_tune(args) -> int:
    from ..options import UsageError, load_generator
    from ..model.exits import read_manifest, save_heads, write_manifest
    from .tune import (SearchSpace, collect_traces, format_table, measure_costs, measure_end_to_end, search,
                       trace_agreement)

    gen = load_generator(args, progress=False)
    _say_heads(gen)
    model = gen.model
    n = model.num_layers
    manifest = gen.exits.manifest if gen.exits else None
    heads_path = gen.exits.path if gen.exits else None
    layers = sorted(model.exits) or list(range(1, n))  # no heads: the shared head at every layer (LayerSkip)
    prompts = _prompt_ids(gen, [args.data], args.limit, args.max_prompt_tokens)
    _say(f"measuring costs ({len(layers)} exits) ...")
    costs = measure_costs(model)
    _say(f"tracing {len(prompts)} greedy continuations ...")
    traces = collect_traces(model, prompts, layers, args.max_new_tokens, gen.eos_ids)
    agree = {L: trace_agreement(traces, L) for L in layers}
    space = SearchSpace(draft_layers=tuple(_layers(args.draft_layers) or ()) or None,
                        verify_layers=tuple(_layers(args.verify_layers) or ()) or None)
    cands, ar = search(traces, costs, layers, space)
    if not cands:
        raise UsageError("no configuration to tune: give at least one exit layer below the last")
    ar_tps = ar.tokens_per_second
    best_hi = [c for c in cands if c.strategy == StrategyName.HISPEC][:args.validate]
    best_self = [c for c in cands if c.strategy == StrategyName.SELFSPEC][:args.validate]
    chosen = {}
    if args.validate:
        _say(f"checking the best {len(best_hi)} hispec and {len(best_self)} selfspec settings end to end ...")
        checked = best_hi + best_self
        _, speedups = measure_end_to_end(gen, prompts[:args.validate_prompts], checked, args.max_new_tokens)
        for c, s in zip(checked, speedups):
            c.measured_speedup = s
        key = lambda c: c.measured_speedup  # noqa: E731
    else:
        key = lambda c: c.predicted.tokens_per_second  # noqa: E731
    for name, group in ((StrategyName.HISPEC, best_hi), (StrategyName.SELFSPEC, best_self)):
        if group:
            chosen[name] = max(group, key=key)
    rows = [c.row(ar_tps) for c in cands]
    shown = [c.row(ar_tps) for c in best_hi + best_self] + [r for r in rows[:20]]
    seen, table = set(), []
    for r in shown:
        k = json.dumps(r, sort_keys=True)
        if k not in seen:
            seen.add(k)
            table.append(r)
    from ..config import SPEC_FIELDS
    rec, rec_self = ({k: getattr(chosen[name].spec, k) for k in SPEC_FIELDS} if name in chosen else {}
                     for name in (StrategyName.HISPEC, StrategyName.SELFSPEC))
    if args.json:
        print(json.dumps({"costs": costs.to_dict(), "agreement": agree, "ar_predicted_tokens_per_s": ar_tps,
                          "table": table, "recommended": rec, "recommended_selfspec": rec_self}, indent=1))
    else:
        print("per-phase costs (ms): " + json.dumps(costs.to_dict()))
        print("top-1 agreement with the final layer on the calibration continuations: " +
              " ".join(f"L{L} {a:.3f}" for L, a in agree.items()))
        print(f"predicted ar: {ar_tps:.2f} tokens/s; candidates (best predicted first; 'meas x' = measured "
              "speedup over ar, interleaved):")
        print(format_table(table, limit=40))
        for name, r in ((StrategyName.HISPEC, rec), (StrategyName.SELFSPEC, rec_self)):
            if r:
                print(f"chosen {name}: " + " ".join(f"{k}={v}" for k, v in r.items()))
    if args.no_write:
        return 0
    if manifest is None or heads_path is None:
        _say("no exit heads attached: nothing to write (pass --exits DIR to tune a set of heads)")
        return 0
    used = {rec.get("draft_layer"), rec.get("verify_layer"), rec_self.get("draft_layer")} - {None, n}
    manifest.recommended, manifest.recommended_selfspec = rec, rec_self
    manifest.tuning = {"command": _command_line(args, "tune"), "costs_ms": costs.to_dict(),
                       "agreement_top1": {str(L): round(a, 4) for L, a in agree.items()},
                       "ar_predicted_tokens_per_s": round(ar_tps, 3), "table": table[:30],
                       "positions": sum(len(t.y) for t in traces)}
    if args.prune:
        heads = {L: h for L, h in model.exits.items() if L in used}
        added = sum(h.num_added_params() for h in heads.values())
        manifest.design = {**manifest.design, "added_params": added,
                           "added_fraction": round(added / sum(p.numel() for p in model.parameters()), 5),
                           "pruned_from_layers": sorted(model.exits)}
        save_heads(heads_path, heads, manifest)  # the agreement of every trained layer stays on record
        _say(f"kept the heads at layers {sorted(heads)}")
    else:
        write_manifest(Path(heads_path), manifest)
    read_manifest(Path(heads_path))  # validate what was written
    _say(f"wrote the recommended settings into {heads_path}/manifest.json")
    return 0
