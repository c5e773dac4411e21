"""``hispec bench`` end to end on a tiny random model with a character tokenizer: every strategy
and both peers, results.json with every field, report.md, the plots, unavailable peers reported."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hispec.bench import strategies as st
from hispec.bench.strategies import StrategySpec, expand_early_exit, parse_strategies
from hispec.cli import main
from hispec.config import ConfigError

FIELDS = ("tokens_per_second", "tokens_per_second_median", "speedup_vs_ar", "identical_to_ar",
          "mean_accepted_length", "acceptance", "phase_seconds", "verification_wall", "peak_memory_bytes",
          "kv_cache_bytes")
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 6-layer Llama whose exits mostly agree with its last layer, plus a character tokenizer."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=2))
    with torch.no_grad():
        for layer in model.model.layers[1:]:  # small residual updates: exits agree, long accepted runs
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    folder = tmp_path_factory.mktemp("bench-tiny")
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 127)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                               pad_token="</s>").save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-data") / "question.jsonl"
    records = [{"question_id": 1, "category": "writing", "turns": ["Write a poem about the sea."]},
               {"question_id": 2, "category": "math", "turns": ["What is 12 times 7?"]},
               {"question_id": 3, "category": "math", "turns": ["Not selected by --limit."]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def bench(tiny_model, prompt_file, out, *extra: str) -> int:
    return main(["bench", "--model", str(tiny_model), "--data", str(prompt_file), "--limit", "1", "--per-category",
                 "--max-new-tokens", "8", "--out", str(out), "--no-progress", "--threads", "1", *extra])


@pytest.fixture(scope="module")
def results(tiny_model, prompt_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-out")
    strategies = "ar,selfspec,selfspec:heuristic,hispec,hispec:svip:w=6,hf,hf-early-exit,hf-early-exit:9"
    rc = bench(tiny_model, prompt_file, out, "--strategies", strategies, "--hf-exit-layers", "1,2")
    assert rc == 0
    return out, json.loads((out / "results.json").read_text())


def test_results_json_has_every_field(results):
    _, r = results
    assert {"machine", "model", "commit", "config", "strategies"} <= set(r)
    assert {"cpu", "threads", "torch", "device"} <= set(r["machine"])
    assert r["model"]["num_layers"] == 6
    assert r["model"]["kernels"] == [] and r["model"]["weight_format"] == "none"  # float weights: no kernels
    assert r["config"]["num_prompts"] == 2 and r["config"]["max_new_tokens"] == 8
    assert list(r["strategies"]) == ["ar", "selfspec", "selfspec:heuristic", "hispec", "hispec:svip:w=6", "hf",
                                     "hf-early-exit:1", "hf-early-exit:2", "hf-early-exit:9"]
    for label, e in r["strategies"].items():
        assert set(FIELDS) <= set(e), label
        if not e["available"]:
            continue
        assert e["tokens_per_second"] > 0 and e["tokens_per_second_median"] > 0, label
        assert e["identical_to_ar"] is True, label
        assert set(e["per_category"]) == {"writing", "math"}
        for cat in e["per_category"].values():
            assert set(FIELDS) <= set(cat)
            assert cat["num_prompts"] == 1 and cat["identical_to_ar"] is True
        assert e["peak_memory_bytes"] > 0 and e["kv_cache_bytes"] > 0, label


def test_own_strategies_report_speculation_metrics(results):
    _, r = results
    s = r["strategies"]
    assert s["ar"]["speedup_vs_ar"] == 1.0 and s["ar"]["mean_accepted_length"] == 1.0
    assert set(s["hispec"]["acceptance"]) - {"lookup->final"} == {"draft->intermediate", "intermediate->final"}
    assert set(s["selfspec"]["acceptance"]) == {"draft->final"}
    level = s["hispec"]["acceptance"]["draft->intermediate"]
    assert level["draft_tokens"] > 0 and 0 <= level["acceptance_rate"] <= 1
    assert len(level["acceptance_per_position"]) >= 1
    assert s["hispec"]["mean_accepted_length"] > 1.0  # the agreeing model accepts drafts
    assert s["hispec"]["phase_seconds"]["draft"] > 0 and s["hispec"]["verification_wall"] > 0
    assert s["hispec"]["spec"]["window"] == 4 and s["hispec:svip:w=6"]["spec"]["window"] == 6
    assert s["hispec:svip:w=6"]["spec"]["draft_policy"] == "svip"
    assert s["selfspec:heuristic"]["spec"]["draft_policy"] == "heuristic"
    assert s["hispec"]["kv_overhead_vs_ar_bytes"] >= 0
    assert s["hf"]["acceptance"] is None and s["hf"]["speedup_vs_ar"] > 0
    # decoding alone: hispec's strategies, whose prefill is timed; transformers' peers end to end only
    assert s["ar"]["decode_speedup_vs_ar"] == 1.0 and s["hf"]["decode_tokens_per_second"] is None
    for label in ("ar", "hispec", "selfspec"):
        e = s[label]
        prefill = e["phase_seconds"]["prefill"]
        assert 0 < prefill < e["seconds"], label
        decode = e["seconds"] - prefill  # a few ms here: "seconds" is rounded to 0.1 ms
        rounding = e["new_tokens"] * 1e-4 / decode ** 2
        assert e["decode_tokens_per_second"] == pytest.approx(e["new_tokens"] / decode, rel=0.02, abs=rounding)
        assert e["decode_tokens_per_second"] > e["tokens_per_second"], label


def test_unavailable_peer_is_reported_with_its_reason(results):
    _, r = results
    e = r["strategies"]["hf-early-exit:9"]
    assert e["available"] is False and "outside 1..5" in e["reason"]
    assert e["tokens_per_second"] is None
    out, _ = results
    assert "hf-early-exit:9" in (out / "report.md").read_text()


def test_report_and_plots_are_written(results):
    out, r = results
    report = (out / "report.md").read_text()
    for heading in ("## Overall", "## Per category", "## Acceptance per position", "## Time per phase",
                    "## Verification wall and memory", "## Targets"):
        assert heading in report
    assert "`hispec`" in report and "writing" in report
    pngs = ["speedup.png", "acceptance.png", "phases.png"]
    if HAS_MATPLOTLIB:
        for name in pngs:
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({name})" in report
    assert r["targets"]["all_identical_to_ar"] is True


def test_peer_that_cannot_load_is_reported(tiny_model, prompt_file, tmp_path, monkeypatch):
    monkeypatch.setattr(st, "_load_hf", lambda gen: (None, "transformers cannot load it: for the test"))
    assert bench(tiny_model, prompt_file, tmp_path, "--strategies", "ar,hf", "--no-plots", "--warmup", "0") == 0
    e = json.loads((tmp_path / "results.json").read_text())["strategies"]["hf"]
    assert e["available"] is False and "for the test" in e["reason"]


@pytest.mark.parametrize("seed", [["--seed", "3"], []])
def test_sampled_runs_are_checked_against_ar(tiny_model, prompt_file, tmp_path, seed):
    """A sampled run gives every strategy each prompt's seed (``--seed`` plus its index, or a random base),
    so hispec's strategies write ``ar``'s texts and are checked against it as greedy runs are."""
    assert bench(tiny_model, prompt_file, tmp_path, "--strategies", "ar,selfspec,hispec", "--temperature", "0.8",
                 *seed, "--no-plots") == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["strategies"]["hispec"]["identical_to_ar"] is True and r["targets"]["all_identical_to_ar"] is True
    assert r["strategies"]["selfspec"]["identical_to_ar"] is True
    assert r["config"]["sampling"]["seed"] == (3 if seed else None)


def test_unknown_strategy_and_dataset_are_clear_errors(tiny_model, prompt_file, tmp_path, capsys):
    assert bench(tiny_model, prompt_file, tmp_path, "--strategies", "ar,medusa") == 2
    assert "unknown strategy 'medusa'" in capsys.readouterr().err
    assert main(["bench", "--model", str(tiny_model), "--data", "nosuchset", "--out", str(tmp_path)]) == 2
    assert "unknown data set 'nosuchset'" in capsys.readouterr().err
    assert bench(tiny_model, prompt_file, tmp_path, "--strategies", "hispec:d=9") == 2
    assert "strategy 'hispec:d=9'" in capsys.readouterr().err


def test_strategy_syntax():
    specs = parse_strategies("ar, hispec:svip:d=2:i=4:k=3:w=8:t=1.5,selfspec:heuristic,hf-early-exit:3,hf")
    assert [s.kind for s in specs] == ["ar", "hispec", "selfspec", "hf-early-exit", "hf"]
    assert specs[1].draft_policy == "svip"
    assert specs[1].overrides == {"draft_layer": 2, "verify_layer": 4, "num_draft": 3, "window": 8,
                                  "svip_threshold": 1.5}
    assert specs[3].exit_layer == 3
    for bad, message in (("ar:svip", "takes no options"), ("hispec:fast", "unknown option 'fast'"),
                         ("hispec:k=x", "needs a number"), ("hf-early-exit:x", "the exit layer"),
                         ("ar,ar", "twice"), ("", "empty"), ("eagle", "unknown strategy")):
        with pytest.raises(ConfigError, match=message):
            parse_strategies(bad)
    expanded = expand_early_exit([StrategySpec("hf-early-exit", "hf-early-exit"),
                                  StrategySpec("hf-early-exit:4", "hf-early-exit", exit_layer=4)], [2, 4])
    assert [s.label for s in expanded] == ["hf-early-exit:2", "hf-early-exit:4"]


def test_benchmarks_markdown_from_results(results, capsys):
    from hispec.bench.report import main as report_main

    out, _ = results
    assert report_main([str(out / "results.json"), "--benchmarks"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Benchmarks") and "## Where the time goes" in text and "- `hispec` (" in text
    assert "python -m hispec.bench.report" in text


def test_adaptive_runs_and_tree_options(tiny_model, prompt_file, tmp_path):
    """``--adaptive`` decodes each prompt as ``hispec generate`` does (recorded, and said in the
    report); trees and lookup branches are strategy options."""
    assert bench(tiny_model, prompt_file, tmp_path, "--strategies", "ar,hispec:m=3:b=2,lookup:b=2", "--adaptive",
                 "--no-plots") == 0
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["config"]["adaptive"] is True
    assert r["strategies"]["hispec:m=3:b=2"]["identical_to_ar"] is True
    assert r["strategies"]["lookup:b=2"]["identical_to_ar"] is True
    assert "adaptive (plain steps" in (tmp_path / "report.md").read_text()
    specs = parse_strategies("hispec:m=3:b=2:l=6:p=0.15,lookup:b=4")
    assert specs[0].overrides == {"tree_width": 3, "lookup_branches": 2, "lookup_max_draft": 6, "tree_min_prob": 0.15}
    assert specs[1].overrides == {"lookup_branches": 4}
