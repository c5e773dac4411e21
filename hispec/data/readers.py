"""Reading files: JSONL (optionally gzip-compressed), ShareGPT's JSON array (possibly truncated),
and ``hispec generate --prompts`` files (validated whole before any work)."""
from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path
from typing import Iterable, Iterator

from .records import DataError, Record, parse_record


def read_jsonl_lines(lines: Iterable[str], source: str, default_category: str | None = None,
                     name: str | None = None) -> Iterator[Record]:
    """Records of JSONL lines; ids default to the line number, categories to ``default_category``.
    Errors name ``source:line``; records carry ``name:line`` (default: ``source``) as their source."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        r = parse_record(obj, where)
        yield dataclasses.replace(r, source=f"{name or source}:{number}", id=r.id or str(number),
                                  category=r.category or default_category)


def read_jsonl(path: Path, default_category: str | None = None) -> Iterator[Record]:
    """A JSONL file, gzip-compressed if its name ends in ``.gz``."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            yield from read_jsonl_lines(f, str(path), default_category, name=path.name)
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


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
        raise DataError("expected a JSON array")
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


def sharegpt_record(item: object, index: int, category: str = "sharegpt") -> Record | None:
    """The first human turn of a whole ShareGPT conversation (and, when the conversation opens
    with it, the reply that follows), or None if it has none."""
    if not isinstance(item, dict) or not isinstance(item.get("conversations"), list):
        return None
    conv = item["conversations"]
    for j, turn in enumerate(conv):
        if isinstance(turn, dict) and turn.get("from") == "human":
            text = turn.get("value")
            if not (isinstance(text, str) and text.strip()):
                return None
            reply = None
            if j == 0 and len(conv) > 1 and isinstance(conv[1], dict) and conv[1].get("from") == "gpt":
                reply = conv[1].get("value") if isinstance(conv[1].get("value"), str) else None
            pid = str(item.get("id", index))
            return Record(text, reply, f"sharegpt:{pid}", id=pid, category=category)
    return None


def read_sharegpt(path: Path, default_category: str = "sharegpt") -> Iterator[Record]:
    try:
        with open(path, encoding="utf-8") as f:
            for index, item in enumerate(iter_json_array(f)):
                r = sharegpt_record(item, index, default_category)
                if r is not None:
                    yield r
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read {path}: {e}") from None


def read_prompts(path: str | Path) -> list[Record]:
    """All records of a JSONL prompt file (any form ``parse_record`` reads); ids default to the
    line number; blank lines are skipped; the whole file is checked before anything runs."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"prompt file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read prompt file {path}: {e}") from None
    prompts = list(read_jsonl_lines(lines, str(path)))
    if not prompts:
        raise DataError(f"prompt file {path} holds no prompts")
    return prompts
