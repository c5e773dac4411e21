"""The one record type for prompts and training text, and the parser for every JSON line form."""
from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """A data file or data set cannot be read (missing, malformed, unknown, not installed); the
    message names the file and line, or says how to install what is missing."""


@dataclass(frozen=True)
class Record:
    """A prompt and, optionally, a reference response (text, or token ids for models without a
    tokenizer), with its id, category and where it came from."""

    prompt: str
    response: str | None = None
    source: str = ""  # file:line or set:id, for messages
    prompt_ids: tuple[int, ...] | None = None
    response_ids: tuple[int, ...] | None = None
    id: str = ""
    category: str | None = None

    @property
    def has_response(self) -> bool:
        return self.response is not None or self.response_ids is not None


FORMS = "'turns' (Spec-Bench form), 'prompt', 'question' (GSM8K) or 'prompt_ids'"


def parse_record(obj: object, where: str) -> Record:
    """One record from a JSON object of any supported form:

    - Spec-Bench / MT-Bench ``{"question_id", "category", "turns": [...]}`` (the first turn);
    - ``{"id", "prompt"[, "response" | "completion"][, "category"]}`` (HumanEval: ``task_id``,
      ``canonical_solution``);
    - GSM8K ``{"question", "answer"}``;
    - token ids ``{"prompt_ids": [...][, "response_ids": [...]]}``.
    """
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    pid = next((obj[k] for k in ("id", "question_id", "task_id") if obj.get(k) is not None), None)
    pid = "" if pid is None else str(pid)
    category = None if obj.get("category") is None else str(obj["category"])
    if "prompt_ids" in obj:
        p, r = obj["prompt_ids"], obj.get("response_ids")
        if not (isinstance(p, list) and p and all(isinstance(t, int) for t in p)):
            raise DataError(f"{where}: 'prompt_ids' must be a non-empty list of token ids")
        if r is not None and not (isinstance(r, list) and all(isinstance(t, int) for t in r)):
            raise DataError(f"{where}: 'response_ids' must be a list of token ids")
        return Record("", None, where, tuple(p), tuple(r) if r else None, pid, category)
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise DataError(f"{where}: 'turns' must be a non-empty list of strings")
        prompt, response, key = turns[0], None, "turns"
    else:
        key = next((k for k in ("prompt", "question") if k in obj), None)
        if key is None:
            raise DataError(f"{where}: a line needs {FORMS}")
        prompt = obj[key]
        response = obj.get("answer") if key == "question" else next(
            (obj[k] for k in ("response", "completion", "canonical_solution") if k in obj), None)
        if not isinstance(prompt, str):
            raise DataError(f"{where}: '{key}' must be a string")
        if response is not None and not isinstance(response, str):
            raise DataError(f"{where}: the response must be a string")
    if not prompt.strip():
        raise DataError(f"{where}: the prompt is empty ('{key}')")
    return Record(prompt, response or None, where, id=pid, category=category)
