"""``hispec bench --batch-sizes``: throughput per batch size, outputs checked against ar."""
from __future__ import annotations

import json

import pytest

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
        assert row["ar"]["paired_speedup_vs_ar"] is None
        for label in ("selfspec", "hispec"):
            ratios = [a / s for a, s in zip(row["ar"]["round_seconds"], row[label]["round_seconds"])]
            assert row[label]["paired_speedup_vs_ar"] == round(sum(ratios) / 2, 3)  # the median of 2
    assert "| batch size |" in capsys.readouterr().out


def test_median_run_picks_the_middle_round():
    from hispec.bench.batched import _median_run

    runs = [(3.0, [[1, 2]]), (1.0, [[1, 2]]), (2.0, [[1, 2]])]
    r = _median_run(runs)
    assert r["seconds"] == 2.0 and r["tokens"] == 2 and r["tokens_per_second"] == 1.0
    assert r["round_seconds"] == [3.0, 1.0, 2.0] and len(r["token_ids"]) == 3


def test_paired_ratios_outlast_a_machine_that_switches_speed():
    """Rounds in a slow stretch for both engines: the medians of each engine's rounds compare a
    fast round of one with a slow round of the other; the median of the rounds' own ratios does not."""
    from hispec.bench.batched import _paired

    ar = [3.0, 3.0, 3.0, 4.4, 4.4]  # seconds per round: fast three times, then slow
    other = [6.0, 8.8, 6.0, 8.8, 8.8]  # half ar's speed; the machine slowed between the engines in round 2
    assert sorted(ar)[2] / sorted(other)[2] == pytest.approx(3.0 / 8.8)  # the medians: a third
    assert _paired(ar, other, 64, 64) == 0.5
    assert _paired(ar, [1.5, 2.2, 2.2, 2.2, 2.2], 32, 64) == 1.0  # half the tokens in half the time
    assert _paired(ar, [], 64, 64) is None


@pytest.mark.parametrize("seed", [["--seed", "4"], []])
def test_sampled_batch_sizes_are_checked_against_ar(tiny_text_model_dir, tmp_path, seed, monkeypatch):
    """Each prompt draws with its own seed (``--seed`` + its index, or a random base), the same for every
    strategy, batch size and round: each strategy's sampled outputs are ``ar``'s (checked), and no two
    prompts share a seed (the same prompt twice draws twice)."""
    from hispec.llm import LLM

    seen = []
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params=None, **kw: (
        seen.append(params), generate(self, prompts, params, **kw))[1])
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n"
                               for i, p in enumerate(["hello", "1+1=", "abc", "the cat", "hello"])))
    out = tmp_path / "out"
    assert main(["bench", "--model", str(tiny_text_model_dir), "--data", str(prompts), "--strategies",
                 "ar,selfspec,hispec,lookup", "--batch-sizes", "1,4", "--max-new-tokens", "8", "--ignore-eos",
                 "--temperature", "0.9", *seed, "--rounds", "1", "--out", str(out), "--no-progress",
                 "--no-plots"]) == 0
    runs = [p for p in seen if isinstance(p, list) and len(p) == 5]
    seeds = [p.seed for p in runs[0]]
    assert all([p.seed for p in run] == seeds for run in runs) and len(set(seeds)) == 5
    assert seeds[0] == 4 or not seed
    for row in json.loads((out / "batch_results.json").read_text())["batch_sizes"].values():
        assert all(r["identical_to_ar"] is True for r in row.values())
