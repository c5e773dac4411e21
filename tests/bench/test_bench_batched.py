"""``hispec bench --batch-sizes``: throughput per batch size, outputs checked against ar."""
from __future__ import annotations

import json

from hispec.cli import main


def test_batch_sizes_writes_results_and_checks_outputs(tiny_text_model_dir, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                               for i, p in enumerate(["hello", "1+1=", "abc", "the cat", "xyz"])))
    out = tmp_path / "out"
    code = main(["bench", "--model", str(tiny_text_model_dir), "--data", str(prompts), "--strategies",
                 "ar,selfspec,hispec", "--batch-sizes", "1,2,4", "--max-new-tokens", "8", "--ignore-eos",
                 "--rounds", "2", "--out", str(out), "--no-progress", "--no-plots"])
    assert code == 0
    saved = json.loads((out / "batch_results.json").read_text())
    assert saved["rounds"] == 2
    results = saved["batch_sizes"]
    assert list(results) == ["1", "2", "4"]
    for row in results.values():
        assert set(row) == {"ar", "selfspec", "hispec"}
        for r in row.values():
            assert r["identical_to_ar"] is True and r["tokens"] == 5 * 8 and r["tokens_per_second"] > 0
            assert len(r["round_seconds"]) == 2 and r["seconds"] in r["round_seconds"]  # the median of 2: the slower
            assert r["seconds"] == max(r["round_seconds"])
    assert "| batch size |" in capsys.readouterr().out


def test_median_run_picks_the_middle_round():
    from hispec.bench.batched import _median_run

    runs = [(3.0, [[1, 2]]), (1.0, [[1, 2]]), (2.0, [[1, 2]])]
    r = _median_run(runs)
    assert r["seconds"] == 2.0 and r["tokens"] == 2 and r["tokens_per_second"] == 1.0
    assert r["round_seconds"] == [3.0, 1.0, 2.0] and len(r["token_ids"]) == 3
