"""The command line: output contract and bad input (one clear line on stderr, non-zero exit)."""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest

from hispec.cli import main


def run_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess (exit code, stdout and stderr as a user sees them)."""
    return subprocess.run([sys.executable, "-m", "hispec.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``main()`` in this process (fast), captured like a subprocess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse usage errors
            code = e.code
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("hispec: error:"), proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def tiny(tiny_text_model_dir):
    return str(tiny_text_model_dir)


def test_json_lines_have_the_contract_fields_and_strategies_agree(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n\n" +
                       json.dumps({"question_id": 7, "category": "math", "turns": ["1+1=", "z"]}) + "\n")
    records = {}
    for strategy in ("ar", "selfspec", "hispec"):
        code = main(["generate", "--model", tiny, "--prompts", str(prompts), "--json", "--strategy", strategy,
                     "--max-new-tokens", "12", "--ignore-eos"])
        assert code == 0
        records[strategy] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for recs in records.values():
        assert [r["id"] for r in recs] == ["a", "7"]
        for r in recs:
            assert set(r) >= {"id", "text", "token_ids", "new_tokens", "seconds", "tokens_per_second",
                              "strategy", "stats"}
            assert r["new_tokens"] == len(r["token_ids"]) == 12
    for strategy in ("selfspec", "hispec"):
        assert [r["token_ids"] for r in records[strategy]] == [r["token_ids"] for r in records["ar"]]
        assert records[strategy][0]["stats"]["levels"]


def test_streams_text_and_prints_stats(tiny):
    proc = run_process("generate", "hello", "--model", tiny, "--max-new-tokens", "10", "--ignore-eos", "--stats",
                       "--strategy", "hispec")
    assert proc.returncode == 0, proc.stderr
    assert "strategy hispec" in proc.stderr and "mean accepted length" in proc.stderr
    assert "adaptive rounds: speculate" in proc.stderr and "measured tokens/s per mode" in proc.stderr, proc.stderr
    as_json = run_cli("generate", "hello", "--model", tiny, "--max-new-tokens", "10", "--ignore-eos", "--json")
    assert proc.stdout == json.loads(as_json.stdout)["text"] + "\n"  # the streamed text is the whole text
    sampled = {s: run_process("generate", "hello", "--model", tiny, "--max-new-tokens", "10", "--ignore-eos",
                              "--stats", "--strategy", s, "--temperature", "0.8", "--seed", "1")
               for s in ("ar", "hispec")}
    assert sampled["hispec"].returncode == 0 and "adaptive rounds: speculate" in sampled["hispec"].stderr
    assert sampled["hispec"].stdout == sampled["ar"].stdout  # a seed's text, whatever drafted it


def test_bfloat16_kv_cache_from_the_command_line(tiny):
    args = ("generate", "hello", "--model", tiny, "--max-new-tokens", "10", "--ignore-eos", "--json")
    runs = {s: json.loads(run_cli(*args, "--kv-cache-dtype", "bfloat16", "--strategy", s).stdout)
            for s in ("ar", "hispec")}
    assert runs["hispec"]["token_ids"] == runs["ar"]["token_ids"] and len(runs["ar"]["token_ids"]) == 10
    proc = run_cli("generate", "hello", "--model", tiny, "--max-new-tokens", "4", "--kv-cache-dtype", "bfloat16",
                   "--stats")
    assert proc.returncode == 0 and "KV cache bfloat16" in proc.stderr, proc.stderr
    assert_clean_error(run_cli(*args, "--kv-cache-dtype", "bfloat16", "--tensor-parallel-size", "2"),
                       "--kv-cache-dtype")
    assert run_cli(*args, "--kv-cache-dtype", "float16").returncode != 0  # not a choice


def test_sampling_is_reproducible_with_a_seed(tiny):
    args = ("generate", "hello", "--model", tiny, "--max-new-tokens", "16", "--temperature", "1.0",
            "--top-p", "0.9", "--top-k", "50", "--json", "--ignore-eos")
    first = json.loads(run_cli(*args, "--seed", "5").stdout)["token_ids"]
    again = json.loads(run_cli(*args, "--seed", "5").stdout)["token_ids"]
    other = json.loads(run_cli(*args, "--seed", "6").stdout)["token_ids"]
    assert first == again and first != other


def test_prompt_longer_than_the_context(tiny):
    proc = run_cli("generate", "x" * 300, "--model", tiny, "--no-chat")  # context is 256
    assert_clean_error(proc, "context")


def test_models_lists_the_default(tmp_path):
    proc = run_process("models", env={"HISPEC_HOME": str(tmp_path)})
    assert proc.returncode == 0 and "smollm2-135m-instruct" in proc.stdout


def test_missing_prompt_file(tiny):
    assert_clean_error(run_cli("generate", "--model", tiny, "--prompts", "/nonexistent/p.jsonl"), "does not exist")


def test_malformed_jsonl_names_the_line(tiny, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n')
    assert_clean_error(run_cli("generate", "--model", tiny, "--prompts", str(f)), "bad.jsonl:3", "malformed JSON")


def test_jsonl_line_without_prompt(tiny, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "no prompt field"}\n')
    assert_clean_error(run_cli("generate", "--model", tiny, "--prompts", str(f)), "bad.jsonl:1")


def test_unknown_model():
    assert_clean_error(run_process("generate", "hi", "--model", "no-such-model"), "unknown model 'no-such-model'")


@pytest.mark.parametrize("flag,value,needle", [
    ("--temperature", "-1", "temperature"),
    ("--top-p", "0", "top_p"),
    ("--top-p", "1.5", "top_p"),
    ("--top-k", "-3", "top_k"),
    ("--max-new-tokens", "0", "max_new_tokens"),
])
def test_invalid_sampling_values(tiny, flag, value, needle):
    assert_clean_error(run_cli("generate", "hi", "--model", tiny, flag, value), needle)


@pytest.mark.parametrize("args,needle", [
    (["--strategy", "hispec", "--draft-layer", "2", "--verify-layer", "2"], "verify layer"),
    (["--strategy", "hispec", "--draft-layer", "3", "--verify-layer", "2"], "verify layer"),
    (["--strategy", "hispec", "--draft-layer", "0"], "draft layer"),
    (["--strategy", "selfspec", "--draft-layer", "6"], "draft layer"),
    (["--strategy", "hispec", "--window", "0"], "window"),
    (["--strategy", "hispec", "--window", "-2"], "window"),
    (["--strategy", "hispec", "--draft-layer", "1", "--verify-layer", "6"], "hispec needs a verify layer"),
])
def test_invalid_speculation_values(tiny, tmp_path, args, needle):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x"}\n')
    proc = run_cli("generate", "--model", tiny, "--prompts", str(f), *args)
    assert_clean_error(proc, needle)


def test_pickle_checkpoint_refused(tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    assert_clean_error(run_cli("generate", "hi", "--model", str(tmp_path)), "pickle", "--allow-pickle")


def test_no_prompt_given(tiny):
    assert_clean_error(run_cli("generate", "--model", tiny), "PROMPT")


def test_prompt_as_an_option_is_text_not_a_file(tiny):
    """``--prompt TEXT`` (and ``-p``) is the prompt itself, as the positional is: argparse used to
    take ``--prompt`` as short for ``--prompts`` and look for a file named by the text."""
    args = ("--model", tiny, "--max-new-tokens", "4", "--ignore-eos", "--json", "--strategy", "ar")
    positional = run_cli("generate", "hello there", *args)
    assert positional.returncode == 0, positional.stderr
    for flag in ("--prompt", "-p"):
        proc = run_cli("generate", flag, "hello there", *args)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["token_ids"] == json.loads(positional.stdout)["token_ids"]
    assert_clean_error(run_cli("generate", "hi", "--prompt", "hello", "--model", tiny), "once")
    assert_clean_error(run_cli("generate", "--prompt", "hi", "--prompts", "f.jsonl", "--model", tiny), "either")


def test_cuda_requested_without_gpu(tiny):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert_clean_error(run_cli("generate", "hi", "--model", tiny, "--device", "cuda"), "CUDA")
