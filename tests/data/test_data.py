"""One record type and one reader for every prompt and training file: what ``generate
--prompts`` accepts is what ``bench --data`` and ``train-exits --data`` accept."""
import json

import pytest

from hispec.data import DataError, Record, load_prompts, read_prompts
from hispec.train.sources import load_source

LINES = [{"question_id": 7, "category": "qa", "turns": ["first turn", "second"]},
         {"id": "p", "prompt": "plain", "response": "reply"},
         {"question": "Natalia sold clips to 48 friends. How many?", "answer": "48 #### 48"},
         {"prompt_ids": [5, 6, 7], "response_ids": [8]}]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_every_reader_accepts_every_form(tmp_path):
    path = write(tmp_path / "mixed.jsonl", LINES)
    for records in (read_prompts(path), load_prompts([str(path)]), load_source(str(path))):
        assert all(isinstance(r, Record) for r in records)
        assert [r.prompt for r in records] == ["first turn", "plain", LINES[2]["question"], ""]
        assert [r.response for r in records] == [None, "reply", "48 #### 48", None]
        assert records[3].prompt_ids == (5, 6, 7) and records[3].response_ids == (8,)
    ids = [r.id for r in read_prompts(path)]
    assert ids == ["7", "p", "3", "4"]  # ids default to the line number


def test_gsm8k_prompt_file_for_generate(tmp_path):
    path = write(tmp_path / "test.jsonl", [{"question": "1+1?", "answer": "2"}])
    (r,) = read_prompts(path)
    assert (r.id, r.prompt) == ("1", "1+1?")


def test_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: a line needs 'turns'"):
        read_prompts(bad)
    with pytest.raises(DataError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl")
    empty = write(tmp_path / "empty.jsonl", [{"prompt": "  "}])
    with pytest.raises(DataError, match="empty.jsonl:1: the prompt is empty"):
        read_prompts(empty)
