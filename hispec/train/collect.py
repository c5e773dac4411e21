"""The one collector: sequences in (teacher-forced replies, or the model's own greedy
continuations made by the engine), teacher passes over them (``teacher.py``), shards out.

Exits learn from whole sequences (a block attends over every earlier position; a linear head
reads one position), so every exit command collects the same data: per position, the states
entering the chosen layers and the final layer's top-k log-probabilities of the next token.

A data folder holds ``meta.json`` and shards ``shard-NNNNN.safetensors``; per shard, for ``S``
sequences of ``N`` positions in all:

- ``offsets``  ``[S + 1]`` int64: sequence ``s`` is rows ``offsets[s] .. offsets[s + 1] - 1``
- ``first``    ``[S]`` int32: the first row (within its sequence) whose next token is reply text
- ``record``   ``[S]`` int32: the record index (for held-out splits by record)
- ``tokens``   ``[N]`` int32: the input token ids
- ``h.{L}``    ``[N, H]`` float16: the hidden state entering layer ``L``
- ``top_ids``  ``[N, K]`` int32, ``top_logp`` ``[N, K]`` float16: the final layer's top-k
  log-probabilities of the next token at each position (every position is a target)

``meta.json`` records how many records were consumed, so an interrupted collection resumes
where it stopped (``collect`` with the same folder); records are processed in a fixed order.
"""
from __future__ import annotations

import json
import shlex
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .config import TrainConfig
from .sources import TextRecord
from .teacher import TeacherPass

FORMAT = "hispec-distill-sequences"
MIN_TOKENS = 16  # shorter sequences teach little and would crowd a batch
Seq = tuple[int, list[int], int]  # (record index, token ids, first reply row)


# ---- sequences ------------------------------------------------------------------------------------
def encode_record(gen, rec: TextRecord, max_prompt_tokens: int, max_response_tokens: int
                  ) -> tuple[list[int] | None, list[int] | None]:
    """(prompt ids, response ids) in the model's chat format; prompt None if it is too long."""
    if rec.prompt_ids is not None:
        prompt = list(rec.prompt_ids)
        response = list(rec.response_ids)[:max_response_tokens] if rec.response_ids else None
        return (prompt if len(prompt) <= max_prompt_tokens else None), response
    prompt = gen.encode_prompt(rec.prompt)
    if len(prompt) > max_prompt_tokens:
        return None, None
    if rec.response is None:
        return prompt, None
    tok = gen.tokenizer
    if gen.has_chat_template():
        full = tok.apply_chat_template([{"role": "user", "content": rec.prompt},
                                        {"role": "assistant", "content": rec.response}], tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        response = ids[len(prompt):] if ids[:len(prompt)] == prompt else tok(rec.response, add_special_tokens=False)["input_ids"]
    else:
        response = tok(rec.response, add_special_tokens=False)["input_ids"]
    return prompt, response[:max_response_tokens] or None


def encode_records(gen, records: list[TextRecord], cfg: TrainConfig, start: int = 0) -> Iterator[Seq]:
    """Teacher-forced sequences: ``(record index, prompt + reply ids, first reply row)`` in the
    model's chat format, for the records from ``start`` that have a reply and a short enough prompt."""
    for i in range(start, len(records)):
        prompt, reply = encode_record(gen, records[i], cfg.max_prompt_tokens, cfg.token_cap)
        if prompt is not None and reply:
            yield i, (prompt + reply)[:cfg.token_cap], len(prompt) - 1


def continuations(gen, records: list[TextRecord], cfg: TrainConfig, start: int = 0) -> Iterator[Seq]:
    """On-policy sequences: each prompt (records from ``start``) and the model's own greedy
    continuation, made by the engine ``cfg.generate_batch`` prompts at a time (lazily: a
    collection that stops early generates no more). The last new token is left out (nothing
    after it is generated), so every reply row's next token is the model's own choice."""
    todo = []
    for i in range(start, len(records)):
        prompt, _ = encode_record(gen, records[i], cfg.max_prompt_tokens, 0)
        if prompt is not None:
            todo.append((i, prompt))
        if len(todo) == cfg.generate_batch or (todo and i == len(records) - 1):
            new = greedy_continuations(gen.model, [p for _, p in todo], cfg.max_new_tokens, gen.eos_ids,
                                       cfg.generate_batch)
            for (rec, prompt), y in zip(todo, new):
                yield rec, (prompt + y[:-1])[:cfg.token_cap], len(prompt) - 1
            todo = []


@torch.inference_mode()
def greedy_continuations(model, prompts: list[list[int]], max_new_tokens: int, eos_ids, batch_size: int = 16
                         ) -> list[list[int]]:
    """The model's greedy continuation of each prompt, decoded by the engine (plain ``ar``,
    continuous batching of up to ``batch_size`` sequences): the same tokens ``hispec generate``
    gives. Stops at an end-of-sequence id (included) or after ``max_new_tokens``."""
    from ..config import EngineConfig, SamplingParams
    from ..engine.build import build_engine
    from ..settings import StrategyName

    if not prompts:
        return []
    longest = min(max(map(len, prompts)) + max_new_tokens, model.cfg.max_position_embeddings)
    engine = build_engine(model, StrategyName.AR, EngineConfig(max_batch_size=batch_size, adaptive=False),
                          eos_ids=frozenset(eos_ids), seq_tokens=longest, num_seqs=min(batch_size, len(prompts)))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    ids = [engine.add_request(list(p), params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise out.error
                done[out.request_id] = out.token_ids
    return [list(done[r]) for r in ids]


def batches(seqs: Iterable[Seq], batch_tokens: int) -> Iterator[list[Seq]]:
    """Group ``(record, ids, first)`` into batches of at most ``batch_tokens`` positions."""
    batch, n = [], 0
    for s in seqs:
        if batch and n + len(s[1]) > batch_tokens:
            yield batch
            batch, n = [], 0
        batch.append(s)
        n += len(s[1])
    if batch:
        yield batch


# ---- shards ---------------------------------------------------------------------------------------
def portable_meta(value):
    """``value`` (a meta.json tree) with no absolute path of this machine: paths and the paths in
    command lines are recorded as :func:`hispec.paths.portable` records them (relative to the
    current directory, else a file's name and hash)."""
    from ..paths import portable, portable_command

    if isinstance(value, dict):
        return {portable_meta(k): portable_meta(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_meta(v) for v in value]
    if not isinstance(value, str) or "/" not in value:
        return value
    if " " in value:  # a command line
        try:
            return portable_command(shlex.split(value))
        except ValueError:
            return value
    return portable(value) if Path(value).is_absolute() else value


class ShardWriter:
    """Shards plus ``meta.json`` (progress, totals, timings), written atomically."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        f = self.folder / "meta.json"
        if f.is_file():
            old = portable_meta(json.loads(f.read_text()))
            old["config"] = {"precision": "model", **old.get("config", {})}  # older folders: the model's kernels
            for key in ("format", "model", "config"):
                if old.get(key) != meta.get(key):
                    raise ValueError(f"{folder} was collected with another {key} ({old.get(key)!r}); "
                                     "use another folder to collect with these settings")
            meta = old
        else:
            meta = {**portable_meta(meta), "records_done": 0, "shards": 0, "positions": 0, "reply_positions": 0,
                    "sequences": 0, "seconds": 0.0}
        self.meta = meta
        self._pending: list[tuple[list[Seq], dict]] = []
        self._save_meta()

    def add(self, batch: list[Seq], rows: dict[str, torch.Tensor]) -> None:
        self._pending.append((batch, rows))

    def pending(self, key: str) -> int:
        """Positions (``positions``) or reply positions (``reply_positions``) not yet written."""
        seqs = [s for b, _ in self._pending for s in b]
        return sum(len(ids) - (f if key == "reply_positions" else 0) for _, ids, f in seqs)

    def flush(self, records_done: int, seconds: float) -> None:
        """Write the pending batches as one shard and record the progress."""
        if not self._pending:
            return
        seqs = [s for b, _ in self._pending for s in b]
        lengths = torch.tensor([len(ids) for _, ids, _ in seqs])
        tensors = {k: torch.cat([r[k] for _, r in self._pending]).contiguous() for k in self._pending[0][1]}
        tensors.update(offsets=torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                       first=torch.tensor([f for _, _, f in seqs], dtype=torch.int32),
                       record=torch.tensor([r for r, _, _ in seqs], dtype=torch.int32))
        n = self.meta["shards"]
        tmp = self.folder / f"shard-{n:05d}.safetensors.tmp"
        save_file(tensors, str(tmp))
        tmp.replace(self.folder / f"shard-{n:05d}.safetensors")
        m = self.meta
        m["shards"], m["records_done"] = n + 1, records_done
        m["positions"] += int(lengths.sum())
        m["reply_positions"] += int(sum(len(ids) - f for _, ids, f in seqs))
        m["sequences"] += len(seqs)
        m["seconds"] = round(m["seconds"] + seconds, 1)
        m["positions_per_s"] = round(m["positions"] / max(m["seconds"], 1e-9), 1)
        self._pending = []
        self._save_meta()

    def _save_meta(self) -> None:
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=1))
        tmp.replace(self.folder / "meta.json")


def collect(model, seqs: Iterable[Seq], folder: Path, cfg: TrainConfig, meta: dict, budget: int | None = None,
            budget_of: str = "positions", max_seconds: float | None = None, log=None) -> dict:
    """Teacher passes over ``seqs`` = ``(record index, ids, first reply row)`` in a fixed order,
    resuming after the records already in ``folder``; stops once the folder holds ``budget``
    ``positions`` (or ``reply_positions``: ``budget_of``; None: all records), or after
    the first batch that ends ``max_seconds`` after the start (what was collected is written; a
    rerun continues). Returns the meta."""
    writer = ShardWriter(folder, {"format": FORMAT, **meta, "config": cfg.collection()})
    done = writer.meta["records_done"]
    teacher = TeacherPass(model, cfg)
    todo = ((r, ids[:cfg.token_cap], f) for r, ids, f in seqs
            if r >= done and MIN_TOKENS <= min(len(ids), cfg.token_cap) and f < min(len(ids), cfg.token_cap))
    t0 = start = time.perf_counter()
    last = done
    for batch in batches(todo, cfg.teacher_batch_tokens):
        if budget is not None and writer.meta[budget_of] + writer.pending(budget_of) >= budget:
            break
        writer.add(batch, teacher([ids for _, ids, _ in batch]))
        last = batch[-1][0] + 1
        if writer.pending("positions") >= cfg.shard_positions:
            writer.flush(last, time.perf_counter() - t0)
            t0 = time.perf_counter()
            if log:
                m = writer.meta
                log(f"{folder}: {m['positions']} positions ({m['reply_positions']} in replies), "
                    f"{m['records_done']} records, {m['positions_per_s']} positions/s")
        if max_seconds is not None and time.perf_counter() - start >= max_seconds:
            if log:
                log(f"{folder}: stopped after {max_seconds:g} s (--max-seconds); run again to continue")
            break
    writer.flush(last, time.perf_counter() - t0)
    return writer.meta


# ---- reading --------------------------------------------------------------------------------------
def read_meta(folder: Path) -> dict:
    f = Path(folder) / "meta.json"
    if not f.is_file():
        raise FileNotFoundError(f"{folder} holds no distillation data (no meta.json)")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder} is not a sequence-distillation folder (format {meta.get('format')!r})")
    return meta


def records_done(folder: Path) -> int:
    """Records a folder has consumed (0 for a new folder): where a resumed collection starts."""
    return read_meta(folder)["records_done"] if (Path(folder) / "meta.json").is_file() else 0


def shard_paths(folder: Path) -> list[Path]:
    return [Path(folder) / f"shard-{n:05d}.safetensors" for n in range(read_meta(folder)["shards"])]


def read_shard(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in keys}
