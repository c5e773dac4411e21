"""``hispec bench --summary FILE``: BENCHMARKS.md's summary rewritten from result files, the
history around it kept byte for byte."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hispec.bench import summary
from hispec.bench.batched import write_batch_outputs
from hispec.cli import main
from hispec.options import UsageError

ROOT = Path(__file__).resolve().parents[2]
HEAD = "# Benchmarks\n\nIntro, kept.\n\n"
HISTORY = "\n\n## 2026-01-01: an old entry\n\n| a | b |\n| --- | --- |\n| 1.0 | 2.0 |\n\nNo newline at the end"


def markdown(inner: str = "the old summary\n") -> str:
    return f"{HEAD}{summary.START}\n{inner}{summary.END}{HISTORY}"


def results_json(created: str, ar: float, peer: float, cpu: str = "Test CPU") -> dict:
    """A results.json as ``hispec bench`` writes it (the fields the summary reads)."""
    return {
        "created": created, "commit": "abc1234",
        "machine": {"cpu": cpu, "cpu_count": 2, "threads": 2, "load_average_at_start": [1.25, 1.0, 1.0],
                    "load_average_at_end": [1.75, 1.0, 1.0]},
        "model": {"name": "default", "dtype": "float32", "weight_format": "native"},
        "config": {"command": "hispec bench --data p.jsonl --strategies ar,hispec --peers llama.cpp:q4_1",
                   "num_prompts": 4, "max_new_tokens": 32, "batch_size": 1},
        "strategies": {
            "ar": {"kind": "ar", "available": True, "tokens_per_second": ar, "tokens_per_second_median": ar + 1,
                   "identical_to_ar": True, "agreement_with_ar": None},
            "hispec": {"kind": "hispec", "available": True, "tokens_per_second": ar / 2,
                       "tokens_per_second_median": None, "identical_to_ar": True, "agreement_with_ar": None},
            "hf": {"kind": "hf", "available": False, "reason": "not installed", "tokens_per_second": None},
            "llama.cpp:q4_1": {"kind": "peer", "available": True, "weights": "model.Q4_1.gguf",
                               "tokens_per_second": peer, "tokens_per_second_median": None,
                               "identical_to_ar": False,
                               "agreement_with_ar": {"prompts": 4, "identical": 3, "first_n_identical": 4}},
        },
    }


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_only_the_text_between_the_markers_changes(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(markdown())
    write(tmp_path / "results.json", results_json("2026-12-03T10:00:00+0000", 80.0, 40.0))
    assert main(["bench", "--summary", str(md), "--results", str(tmp_path / "results.json")]) == 0
    text = md.read_text()
    assert text.startswith(HEAD + summary.START + "\n") and text.endswith(summary.END + HISTORY)
    inner = text[len(HEAD) + len(summary.START):-len(summary.END + HISTORY)]
    assert "the old summary" not in inner and "## Current summary" in inner
    assert "| hispec `ar` (native) | 80.0 | 81.0 | 1.00x | reference |" in inner
    assert "| hispec `hispec` (native) | 40.0 | – | 0.50x | yes |" in inner
    assert "| `llama.cpp:q4_1` (model.Q4_1.gguf) | 40.0 | – | 0.50x | 3/4 |" in inner
    assert "`hf`" not in inner  # it did not run
    assert "Test CPU, 2 threads of 2 CPUs, 2026-12-03" in inner
    assert "load average 1.25 -> 1.75" in inner and "commit `abc1234`" in inner
    assert "`hispec bench --data p.jsonl --strategies ar,hispec --peers llama.cpp:q4_1`" in inner

    # again, from other files: replaced again, the history still as it was
    write(tmp_path / "results.json", results_json("2026-12-04T10:00:00+0000", 90.0, 45.0))
    assert main(["bench", "--summary", str(md), "--results", str(tmp_path / "results.json")]) == 0
    again = md.read_text()
    assert again.endswith(summary.END + HISTORY) and again.count(summary.START) == 1
    assert "| 90.0 |" in again and "| 80.0 |" not in again


def test_decode_ratio_leaves_the_prefill_out(tmp_path):
    """Batch-1 files with hispec's phase timings get a ``decode vs ar`` column: from the file's
    ``decode_tokens_per_second``, or for older files from its seconds less the prefill phase."""
    data = results_json("2026-12-03T10:00:00+0000", 80.0, 40.0)
    s = data["strategies"]
    # ar: 64 tokens in 1.0 s of which 0.5 s prefill -> 128 tokens/s decoding (older file: no field)
    s["ar"] |= {"new_tokens": 64, "seconds": 1.0, "phase_seconds": {"prefill": 0.5}}
    s["hispec"]["decode_tokens_per_second"] = 160.0  # a newer file's own field
    inner = summary.render([summary.read(write(tmp_path / "results.json", data))[0]], ["runs"])
    assert "| engine / weights | tokens/s | per-prompt median | vs `ar` | decode vs `ar` | same ids as `ar` |" in inner
    assert "| hispec `ar` (native) | 80.0 | 81.0 | 1.00x | 1.00x | reference |" in inner
    assert "| hispec `hispec` (native) | 40.0 | – | 0.50x | 1.25x | yes |" in inner
    assert "| `llama.cpp:q4_1` (model.Q4_1.gguf) | 40.0 | – | 0.50x | – | 3/4 |" in inner  # peers: end to end
    del s["ar"]["phase_seconds"]  # no decode figure for ar: no column
    assert "decode vs" not in "\n".join(summary.table(summary.read(write(tmp_path / "r2.json", data))[0]))


def test_runs_on_other_kernels_are_other_comparisons(tmp_path):
    """The kernels a run's weights used (recorded since the 4-bit kernel is chosen per machine or by
    HISPEC_Q4_KERNEL) name its rows, and a run on other kernels is not replaced by a newer one."""
    q4, q8a = (results_json(day, ar, 40.0) for day, ar in (("2026-12-03T10:00:00+0000", 80.0),
                                                          ("2026-12-04T10:00:00+0000", 90.0)))
    q4["model"]["kernels"], q8a["model"]["kernels"] = ["q4", "q8"], ["q8a", "q8a8"]
    write(tmp_path / "q4.json", q4)
    write(tmp_path / "q8a.json", q8a)
    shown = summary.latest([c for f in summary.result_files([tmp_path]) for c in summary.read(f)])
    assert sorted(c.rows[0].weights for c in shown) == ["native on q4/q8", "native on q8a/q8a8"]
    assert "| hispec `ar` (native on q8a/q8a8) | 90.0 |" in "\n".join(summary.table(shown[0]))


def test_sampled_runs_are_other_comparisons(tmp_path):
    """A run with sampling (``--temperature``) says so in its title and setup line and does not stand
    in for a newer or older greedy run of the same engines."""
    greedy, sampled = (results_json(day, ar, 40.0) for day, ar in (("2026-12-03T10:00:00+0000", 80.0),
                                                                   ("2026-12-04T10:00:00+0000", 90.0)))
    greedy["config"]["sampling"] = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None}
    sampled["config"]["sampling"] = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 1}
    write(tmp_path / "greedy.json", greedy)
    write(tmp_path / "sampled.json", sampled)
    shown = summary.latest([c for f in summary.result_files([tmp_path]) for c in summary.read(f)])
    assert {c.sampling: c.rows[0].tokens_per_second for c in shown} == {
        None: 80.0, "temperature 0.7, top-p 0.9, seed 1": 90.0}
    text = summary.render(shown, ["runs"])
    assert "### Batch 1, sampled: ar, hispec, llama.cpp:q4_1" in text and "sampled: temperature 0.7" in text
    assert text.count("### Batch 1: ar, hispec, llama.cpp:q4_1") == 1


def test_newest_run_of_each_comparison(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    write(runs / "old.json", results_json("2026-12-01T10:00:00+0000", 50.0, 25.0))
    write(runs / "new.json", results_json("2026-12-02T10:00:00+0000", 60.0, 30.0))
    write(runs / "other-machine.json", results_json("2026-11-01T10:00:00+0000", 10.0, 5.0, cpu="Other CPU"))
    shown = summary.latest([c for f in summary.result_files([runs]) for c in summary.read(f)])
    assert [(c.machine.split(",")[0], c.rows[0].tokens_per_second) for c in shown] == [("Test CPU", 60.0),
                                                                                      ("Other CPU", 10.0)]


def test_batch_results_give_one_comparison_per_batch_size(tmp_path):
    row = {"tokens": 64, "seconds": 1.0, "round_seconds": [1.0], "adaptive": None}
    results = {"1": {"ar": row | {"tokens_per_second": 20.0, "speedup_vs_ar": 1.0, "identical_to_ar": True},
                     "vllm": row | {"tokens_per_second": 10.0, "speedup_vs_ar": 0.5, "identical_to_ar": False,
                                    "agreement_with_ar": {"prompts": 4, "identical": 4, "first_n_identical": 4}}},
               "16": {"ar": row | {"tokens_per_second": 100.0, "speedup_vs_ar": 1.0, "identical_to_ar": True},
                      "vllm": row | {"tokens_per_second": 125.0, "speedup_vs_ar": 1.25, "identical_to_ar": None,
                                     "agreement_with_ar": None}}}
    meta = {"machine": {"cpu": "Test CPU", "threads": 2, "cpu_count": 2}, "model": "default", "num_prompts": 4,
            "created": "2026-12-03T10:00:00+0000", "weights": "float32",
            "peers": {"vllm": {"kind": "peer", "weights": "model, float32"}}, "max_new_tokens": 16,
            "adaptive": True, "rounds": 3, "commit": None, "command": "hispec bench --batch-sizes 1,16"}
    write_batch_outputs(results, meta, tmp_path, plots=False)
    comparisons = summary.read(tmp_path / "batch_results.json")
    assert [c.batch_size for c in comparisons] == [1, 16]
    text = "\n".join(summary.table(comparisons[1]))
    assert "| hispec `ar` (float32) | 100.0 | 1.00x | reference |" in text
    assert "| `vllm` (model, float32) | 125.0 | 1.25x | – |" in text
    assert "4/4" in "\n".join(summary.table(comparisons[0]))
    assert "median of 3 interleaved rounds" in summary.render(comparisons, ["x"])


def test_sampled_batch_runs_are_other_comparisons(tmp_path):
    """A batched run records its sampling; a sampled one is its own comparison, titled so."""
    row = {"tokens": 64, "seconds": 1.0, "round_seconds": [1.0], "adaptive": None, "identical_to_ar": True}
    meta = {"machine": {"cpu": "Test CPU", "threads": 2, "cpu_count": 2}, "model": "default", "num_prompts": 4,
            "weights": "float32", "peers": {}, "max_new_tokens": 16, "adaptive": True, "rounds": 3, "commit": None,
            "command": "hispec bench --batch-sizes 8"}
    for name, day, temperature in (("greedy", "03", 0.0), ("sampled", "04", 0.7)):
        results = {"8": {"ar": row | {"tokens_per_second": 20.0 + temperature, "speedup_vs_ar": 1.0}}}
        sampling = {"temperature": temperature, "top_k": 0, "top_p": 0.9, "seed": None}
        write_batch_outputs(results, meta | {"created": f"2026-12-{day}T10:00:00+0000", "sampling": sampling},
                            tmp_path / name, plots=False)
    shown = summary.latest([c for f in summary.result_files([tmp_path]) for c in summary.read(f)])
    assert {c.sampling: c.rows[0].tokens_per_second for c in shown} == {None: 20.0, "temperature 0.7, top-p 0.9": 20.7}
    assert "### Batch 8, sampled: ar" in summary.render(shown, ["x"])


@pytest.mark.parametrize("text", ["no markers", f"{summary.END}\n{summary.START}",
                                  f"{summary.START}{summary.START}{summary.END}"])
def test_markers_must_be_there_once_and_in_order(text):
    with pytest.raises(UsageError, match="summary:start"):
        summary.replace_section(text, "new")


def test_bad_inputs_are_clear_errors(tmp_path, capsys):
    md = tmp_path / "B.md"
    md.write_text(markdown())
    not_results = write(tmp_path / "x.json", {"hello": 1})
    assert main(["bench", "--summary", str(md), "--results", str(not_results)]) == 2
    assert "not a hispec bench result file" in capsys.readouterr().err
    assert main(["bench", "--summary", str(md), "--results", str(tmp_path / "missing")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert md.read_text() == markdown()  # nothing written on an error
    assert main(["bench", "--results", str(not_results)]) == 2
    assert "--results goes with --summary" in capsys.readouterr().err
    assert main(["bench"]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_benchmarks_md_summary_is_what_the_command_makes():
    """The repository's summary is the command's output from docs/benchmarks/results: it can be
    regenerated, the kept result files hold every figure it shows, and it stays short (one table
    per kind of comparison, the history in its own file)."""
    target = ROOT / "BENCHMARKS.md"
    text = target.read_text(encoding="utf-8")
    inner = text.split(summary.START)[1].split(summary.END)[0]
    made, shown, older = summary.make(target, [ROOT / "docs" / "benchmarks" / "results"])
    assert inner == f"\n{made}\n"
    assert len({c.kind for c in shown}) == len(shown) and inner.count("\n### Batch ") == len(shown)
    assert f"[the dated history]({summary.HISTORY})" in inner and (ROOT / summary.HISTORY).is_file()
    assert len(text.splitlines()) <= 400


def test_one_table_per_kind_older_ones_in_a_line(tmp_path):
    """The newest comparison of each kind (batch size, sampled, against other engines) gets a table,
    whatever its machine; every other comparison one line: ``ar``'s tokens/s, the others over it and
    its result file, linked where it lies beside the markdown file, as is the dated history."""
    runs = tmp_path / "docs" / "benchmarks" / "results"
    runs.mkdir(parents=True)
    peers_old = results_json("2026-12-01T10:00:00+0000", 50.0, 25.0)
    peers_new = results_json("2026-12-03T10:00:00+0000", 80.0, 40.0, cpu="Other CPU")  # newest, another machine
    own = results_json("2026-12-02T10:00:00+0000", 60.0, 0.0)
    del own["strategies"]["llama.cpp:q4_1"]
    own_variant = results_json("2026-12-01T09:00:00+0000", 70.0, 0.0)  # hispec in its own process: not a peer
    own_variant["strategies"]["llama.cpp:q4_1"] |= {"weights": "hispec --kv-cache-dtype bfloat16"}
    own_variant["strategies"]["ar:kv_cache_dtype=bfloat16"] = own_variant["strategies"].pop("llama.cpp:q4_1")
    sampled = results_json("2026-12-01T08:00:00+0000", 30.0, 15.0)
    sampled["config"]["sampling"] = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": 1}
    for name, data in (("peers-old", peers_old), ("peers-new", peers_new), ("own", own),
                       ("own-variant", own_variant), ("sampled", sampled)):
        write(runs / f"{name}.json", data)
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(markdown())
    text, shown, older = summary.make(md, [runs])
    assert [(c.kind, c.source) for c in shown] == [((1, False, True), "peers-new.json"),
                                                   ((1, False, False), "own.json"),
                                                   ((1, True, True), "sampled.json")]
    assert [c.source for c in older] == ["peers-old.json", "own-variant.json"]  # newest first
    assert text.count("\n### Batch 1") == 3 and "### Older comparisons" in text
    assert ("- Batch 1: ar, hispec, llama.cpp:q4_1 (Test CPU, 2 threads of 2 CPUs, 2026-12-01): ar 50.0 tokens/s; "
            "hispec 0.50x, llama.cpp:q4_1 0.50x. "
            "[`peers-old.json`](docs/benchmarks/results/peers-old.json)") in text
    assert "Source: [`own.json`](docs/benchmarks/results/own.json)." in text
    assert "[the dated history]" not in text and "the dated history." in text  # no history file: no link
    (tmp_path / summary.HISTORY).write_text("# history\n")
    assert main(["bench", "--summary", str(md)]) == 0  # default: docs/benchmarks/results beside the file
    written = md.read_text()
    assert f"[the dated history]({summary.HISTORY})" in written and written.endswith(summary.END + HISTORY)
    assert written.count("\n- Batch 1: ") == 2


def test_a_file_outside_the_markdown_files_folder_is_named_not_linked(tmp_path):
    md = tmp_path / "md" / "B.md"
    md.parent.mkdir()
    md.write_text(markdown())
    new = write(tmp_path / "new.json", results_json("2026-12-02T10:00:00+0000", 80.0, 40.0))
    old_data = results_json("2026-12-01T10:00:00+0000", 80.0, 40.0, cpu="Other CPU")
    old_data["strategies"]["hispec"]["identical_to_ar"] = False
    old = write(tmp_path / "old.json", old_data)
    text, shown, older = summary.make(md, [old, new])
    assert [c.source for c in shown] == ["new.json"] and [c.source for c in older] == ["old.json"]
    assert "Source: `new.json`." in text and "](" not in text
    assert text.endswith("hispec 0.50x (not `ar`'s ids), llama.cpp:q4_1 0.50x. `old.json`")


def test_summary_of_real_bench_runs(tiny_text_model_dir, tmp_path):
    """The files ``hispec bench`` writes (batch 1 and ``--batch-sizes``) summarised as they are."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": p}) + "\n" for i, p in enumerate(["hello", "1+1="])))
    common = ["bench", "--model", str(tiny_text_model_dir), "--data", str(prompts), "--max-new-tokens", "4",
              "--ignore-eos", "--no-progress", "--no-plots", "--threads", "1"]
    assert main(common + ["--strategies", "ar,hispec", "--out", str(tmp_path / "b1")]) == 0
    assert main(common + ["--strategies", "ar,selfspec", "--batch-sizes", "1,2", "--rounds", "1",
                          "--out", str(tmp_path / "bs")]) == 0
    md = tmp_path / "B.md"
    md.write_text(markdown())
    assert main(["bench", "--summary", str(md), "--results", str(tmp_path / "b1" / "results.json"),
                 "--results", str(tmp_path / "bs" / "batch_results.json")]) == 0
    text = md.read_text()
    assert text.endswith(summary.END + HISTORY)
    # batch 1, greedy, hispec alone: one kind, so one table (the newer run) and one line (the other)
    name = f" ({tiny_text_model_dir.name})"  # a model other than the default one is named
    assert text.count(f"### Batch 1{name}: ar, ") == 1 and text.count(f"\n- Batch 1{name}: ar, ") == 1
    assert sum(text.count(f"{h}Batch 1{name}: ar, {s} (") for h in ("### ", "\n- ") for s in ("hispec", "selfspec")) == 2
    assert text.count(f"### Batch 2{name}: ar, selfspec") == 1
    assert text.count("| reference |") == 2 and "load not recorded" not in text
    assert "date not recorded" not in text


def test_result_files_record_the_weight_kernels():
    """``weight_kernels``: the kernels of the model's quantized layers, as a result file records them."""
    import torch

    from hispec.bench.results import weight_kernels
    from hispec.kernels.quant import QuantLinear

    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False),
                                QuantLinear.from_float(torch.randn(64, 64), "int4", kernel="int4"),
                                QuantLinear.from_float(torch.randn(32, 64), "int8"))
    assert weight_kernels(model) == ["int4", "int8"]
    assert weight_kernels(torch.nn.Linear(4, 4)) == [] and weight_kernels(object()) == []
