"""Prompt files: JSONL in Spec-Bench form or ``{"id", "prompt"}``, validated line by line."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class PromptFileError(ValueError):
    """A prompt file is missing, unreadable or malformed; the message names the line."""


@dataclass(frozen=True)
class Prompt:
    id: str
    prompt: str
    category: str | None = None


def parse_prompt_line(record: object, where: str) -> Prompt:
    if not isinstance(record, dict):
        raise PromptFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise PromptFileError(f"{where}: 'turns' must be a non-empty list of strings")
        text, pid = turns[0], record.get("question_id", record.get("id"))
    elif "prompt" in record:
        text, pid = record["prompt"], record.get("id", record.get("question_id"))
        if not isinstance(text, str):
            raise PromptFileError(f"{where}: 'prompt' must be a string")
    else:
        raise PromptFileError(f"{where}: a line needs 'turns' (Spec-Bench form) or 'prompt'")
    if not text.strip():
        raise PromptFileError(f"{where}: the prompt is empty")
    category = record.get("category")
    return Prompt(str(pid) if pid is not None else "", text, str(category) if category is not None else None)


def read_prompts(path: str | Path) -> list[Prompt]:
    """All prompts of a JSONL file; ids default to the line number. Blank lines are skipped."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PromptFileError(f"prompt file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"cannot read prompt file {path}: {e}") from None
    prompts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptFileError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        p = parse_prompt_line(record, where)
        prompts.append(p if p.id else Prompt(str(number), p.prompt, p.category))
    if not prompts:
        raise PromptFileError(f"prompt file {path} holds no prompts")
    return prompts
