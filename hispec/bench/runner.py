"""The measuring loop: warm-up, then every prompt through every strategy, interleaved.

Procedure (docs/design.md, "Measuring"): all strategies share one process, one model folder and the
same prompt token ids; a warm-up generation per strategy first; then prompt by prompt, each
strategy in turn (the order rotates by one per prompt, so no strategy always runs first or
after the same neighbour); the same sampling parameters (with the same per-prompt seed when
sampling). A strategy that cannot run, or fails, is kept with the reason.
"""
from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass, field

from ..config import ConfigError, SamplingParams
from .memory import PeakMemory
from .strategies import Runner, Sample


@dataclass
class Record:
    """One prompt through one strategy."""

    prompt_index: int
    sample: Sample
    peak_memory_bytes: int | None
    memory_added_bytes: int | None = None  # peak minus the memory in use at the start

    @property
    def new_tokens(self) -> int:
        return len(self.sample.token_ids)

    @property
    def seconds(self) -> float:
        return self.sample.seconds


@dataclass
class BenchRun:
    prompts: list[Record]
    prompt_ids: list[list[int]]
    params: SamplingParams
    runners: list[Runner]
    agree_first: int = 32  # agreement with ar is also reported on the first N tokens
    records: dict[str, list[Record]] = field(default_factory=dict)  # label -> one per prompt, in prompt order

    @property
    def labels(self) -> list[str]:
        return [r.label for r in self.runners]

    def runner(self, label: str) -> Runner:
        return next(r for r in self.runners if r.label == label)


def encode_prompts(generator, prompts: list[Record], chat: bool | None) -> list[list[int]]:
    """Token ids of every prompt (chat template by default when the model has one), checked
    against the model's context before any timing starts."""
    max_pos = generator.model.cfg.max_position_embeddings
    out = []
    for p in prompts:
        ids = list(p.prompt_ids) if p.prompt_ids else generator.encode_prompt(p.prompt, chat)
        if len(ids) >= max_pos:
            raise ConfigError(f"prompt {p.id!r} has {len(ids)} tokens; the model's context is {max_pos}: "
                              "choose other prompts (--categories, --limit)")
        out.append(ids)
    return out


def prompt_params(params: SamplingParams, index: int, base_seed: int) -> SamplingParams:
    """The sampling parameters of prompt ``index``: every strategy gets the same seed for it."""
    if params.greedy:
        return params
    return dataclasses.replace(params, seed=base_seed + index)


def run_bench(generator, runners: list[Runner], prompts: list[Record], params: SamplingParams, *,
              chat: bool | None = None, warmup: int = 1, progress: bool | None = True,
              agree_first: int = 32) -> BenchRun:
    prompt_ids = encode_prompts(generator, prompts, chat)
    run = BenchRun(prompts, prompt_ids, params, runners, agree_first)
    base_seed = params.seed if params.seed is not None else random.randrange(2**31)
    device = generator.model.device
    _warm_up(run, warmup, base_seed)
    from tqdm import tqdm

    active = [r for r in runners if r.unavailable is None]
    bar = tqdm(total=len(prompts) * len(active), desc="bench", unit="gen", file=sys.stderr,
               disable=None if progress else True, dynamic_ncols=True)
    try:
        for i, ids in enumerate(prompt_ids):
            p = prompt_params(params, i, base_seed)
            shift = i % len(runners) if runners else 0
            for r in runners[shift:] + runners[:shift]:
                if r.unavailable is not None:
                    continue
                bar.set_postfix_str(f"{r.label} on {prompts[i].id}", refresh=False)
                try:
                    with (PeakMemory(device) if r.kind != "peer" else _NoMemory()) as mem:  # a peer's is not ours
                        sample = r.run(ids, p)
                except Exception as e:  # noqa: BLE001 - reported, the other strategies go on
                    _fail(run, r, f"failed on prompt {prompts[i].id!r}: {type(e).__name__}: {e}")
                    bar.total -= len(prompts) - i  # this prompt and the rest
                    continue
                run.records.setdefault(r.label, []).append(Record(i, sample, mem.bytes, mem.added))
                bar.update(1)
    finally:
        bar.close()
    return run


class _NoMemory:
    bytes = added = None

    def __enter__(self) -> "_NoMemory":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _warm_up(run: BenchRun, count: int, base_seed: int) -> None:
    """A short generation per strategy on the first prompts: loads lazily-loaded peers, warms
    caches and allocators. A strategy that fails here is marked unavailable."""
    if count <= 0:
        return
    params = dataclasses.replace(run.params, max_new_tokens=min(run.params.max_new_tokens, 16))
    for i, ids in enumerate(run.prompt_ids[:count]):
        for r in run.runners:
            if r.unavailable is not None:
                continue
            try:
                r.run(ids, prompt_params(params, i, base_seed))
            except Exception as e:  # noqa: BLE001
                _fail(run, r, f"failed in the warm-up: {type(e).__name__}: {e}")


def _fail(run: BenchRun, runner: Runner, reason: str) -> None:
    runner.unavailable = reason
    run.records.pop(runner.label, None)  # partial results would not compare with the others'
