"""Recorded paths carry no machine folders; shipped files carry none either."""
import hashlib
import re
from pathlib import Path

from hispec.paths import portable, portable_command

ROOT = Path(__file__).resolve().parents[1]


def test_inside_the_current_directory_is_relative(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "q.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    assert portable(tmp_path / "data" / "q.jsonl") == "data/q.jsonl"
    assert portable("data/q.jsonl") == "data/q.jsonl"
    assert portable(tmp_path / "data") == "data"


def test_outside_is_name_and_hash(tmp_path, monkeypatch):
    f = tmp_path / "outside" / "test.jsonl"
    f.parent.mkdir()
    f.write_bytes(b"abc\n")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    digest = hashlib.sha256(b"abc\n").hexdigest()[:12]
    assert portable(f) == f"test.jsonl#sha256:{digest}"
    assert portable(f, digest=False) == "test.jsonl"
    assert portable(f.parent) == "outside"
    assert portable_command(["bench", "--data", str(f), "--limit", "2"]) == "bench --data test.jsonl --limit 2"


def test_names_stay_as_given():
    assert portable("sharegpt") == "sharegpt" and portable("humaneval:3") == "humaneval:3"
    assert portable("default") == "default" and portable(None) is None
    assert portable("/no/such/folder/x.jsonl") == "x.jsonl"


def test_shipped_files_carry_no_machine_paths():
    machine = re.compile(r"(?<![\w.])/(work|tmp|home|root|Users|mnt|var)/")
    files = [ROOT / "BENCHMARKS.md", ROOT / "docs" / "benchmarks" / "history.md", ROOT / "README.md",
             *(ROOT / "hispec" / "exits").rglob("*.md"),
             *(ROOT / "hispec" / "exits").rglob("*.json")]
    for f in files:
        if f.is_file():
            hits = machine.findall(f.read_text(encoding="utf-8"))
            assert not hits, f"{f.relative_to(ROOT)} names machine folders: {hits}"
