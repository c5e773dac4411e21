"""Tensor parallelism on CPU (gloo over loopback): two processes hold one tiny model.

Each test runs ``python -m hispec.distributed.check`` (rank 0 compares the group with the same
model in one process) in a subprocess with a time limit, so a hang fails instead of blocking.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hispec.config import ConfigError, ModelConfig
from hispec.distributed.comm import split_range
from hispec.distributed.shard import Layout, shard_slice

ROOT = Path(__file__).resolve().parents[2]


def run_check(model_dir: Path, *args: str, limit: float = 240) -> tuple[int, dict, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hispec.distributed.check", str(model_dir), "--tp", "2",
                           "--max-new-tokens", "12", *args], capture_output=True, text=True, timeout=limit, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no report (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, json.loads(lines[-1]), proc.stderr, time.perf_counter() - t0


ALL_EQUAL = {"ar": True, "selfspec": True, "hispec": True, "lookup": True, "selfspec-tree": True, "hispec-tree": True,
             "lookup-tree": True}


def assert_lossless(report: dict) -> None:
    assert report["ok"], report.get("error")
    for name, diff in report["logits_max_abs_diff"].items():
        assert diff < 1e-4, (name, diff)
    assert report["greedy_equal_to_single_process_ar"] == ALL_EQUAL
    assert report["greedy_equal_to_tp_ar"] == ALL_EQUAL
    assert report["lookup_rounds"] > 0  # lookup verified free drafts under TP
    kv = report["kv_after_rejections"]
    assert kv["rejected"] > 0 and kv["max_abs_diff"] < 1e-5 and kv["layer_lengths"] == [kv["positions"]]
    assert report["follower_exit_codes"] == [0], report["follower_exit_codes"]  # not aborted at exit (-6)
    assert report["prefix_cache"] == {"equal": True, "cached_tokens": 32}  # the second request hit 2 blocks


def test_layout_splits_whole_kv_groups_unevenly():
    cfg = ModelConfig(family="llama", vocab_size=101, hidden_size=576, intermediate_size=1536, num_layers=2,
                      num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=64)
    a, b = Layout.of(cfg, 0, 2), Layout.of(cfg, 1, 2)
    assert (a.kv_heads, b.kv_heads) == ((0, 2), (2, 3)) and (a.q_heads, b.q_heads) == ((0, 6), (6, 9))
    assert (a.vocab, b.vocab) == ((0, 51), (51, 101))
    assert shard_slice(cfg, b, "layers.0.qkv_proj.weight", "k") == (0, 128, 192)
    assert shard_slice(cfg, b, "layers.0.o_proj.weight", None) == (1, 384, 576)
    assert shard_slice(cfg, a, "layers.0.down_proj.weight", None) == (1, 0, 768)
    assert shard_slice(cfg, a, "layers.0.input_norm.weight", None) is None
    assert [split_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ConfigError, match="KV heads"):
        Layout.of(cfg, 0, 4)


def test_tp2_llama_equals_single_process(tiny_model_dir):
    """Logits (final and two exit heads, one vocabulary-restricted), greedy ar/selfspec/hispec/lookup, KV shards."""
    rc, report, err, _ = run_check(tiny_model_dir("llama"), "--exit-heads", "1,3")
    assert rc == 0, err
    assert_lossless(report)


def test_tp2_qwen_uneven_heads_equals_single_process(tiny_model_dir):
    """Qwen2 (q/k/v biases) with 3 KV heads on 2 ranks (2 + 1, as SmolLM2-135M would split)."""
    rc, report, err, _ = run_check(tiny_model_dir("qwen2", hidden_size=96, num_attention_heads=6,
                                                  num_key_value_heads=3))
    assert rc == 0, err
    assert_lossless(report)


def test_tp2_default_model_with_its_shipped_exits():
    """SmolLM2-135M on 2 ranks with the exit heads it ships (vocabulary-restricted ones among them,
    whose rows each rank takes from its own part of the output head): the same greedy ids as one
    process for ar, selfspec, hispec and lookup. Logits differ only by the order of the reductions."""
    rc, report, err, _ = run_check(Path("default"), "--shipped-exits", limit=400)
    assert rc == 0, err
    assert report["ok"], report.get("error")
    assert set(report["logits_max_abs_diff"]) > {"final"}, "no exit heads were compared"
    assert max(report["logits_max_abs_diff"].values()) < 1e-3
    assert report["greedy_equal_to_single_process_ar"] == ALL_EQUAL
    assert report["greedy_equal_to_tp_ar"] == ALL_EQUAL
    assert report["lookup_rounds"] > 0
    assert report["follower_exit_codes"] == [0], report["follower_exit_codes"]


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_failing_rank_ends_the_group_with_a_clear_error(tiny_model_dir, mode):
    rc, report, err, seconds = run_check(tiny_model_dir("llama"), "--fail-rank", "1", "--fail-after", "12",
                                         "--fail-mode", mode, "--timeout", "8", limit=120)
    assert rc == 1 and not report["ok"]
    assert "TensorParallelError" in report["error"]
    assert ("timed out" in report["error"]) if mode == "hang" else ("another rank exited or failed" in report["error"])
    if mode == "raise":
        assert "rank 1: injected failure" in err
    assert seconds < 90
