"""scripts/gpu-distill.sh end to end on the CPU with a tiny random model: teacher passes over the
records' replies, on-policy generation by the engine, distillation of an exit block from both, the
shipped exit format, and lossless decoding with the written exits. On a GPU machine only the device
and sizes change."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hispec.config import SamplingParams, SpecConfig
from hispec.generate import Generator
from hispec.model.exits import load_heads, read_manifest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-distill.sh"
WORDS = "the cat sat on a mat and then it ran to see why every dog barks at night".split()


def prompts_file(path: Path, n: int) -> Path:
    r = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            words = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randrange(lo, hi)))
            f.write(json.dumps({"id": f"p{i}", "prompt": words(4, 9), "response": words(8, 20)}) + "\n")
    return path


def run_script(env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **env}
    return subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=timeout)


def test_gpu_distill_script_writes_lossless_exits_on_cpu(tiny_text_model_dir, tmp_path):
    out = tmp_path / "out"
    env = {"GPU_DISTILL_OUT": str(out), "MODEL": str(tiny_text_model_dir), "DEVICE": "cpu", "LAYERS": "2",
           "DATA": str(prompts_file(tmp_path / "prompts.jsonl", 40)), "KEEP": "", "TEACHER_SECONDS": "60",
           "SELF_SECONDS": "60",
           "MAX_NEW_TOKENS": "24", "BATCH_SIZE": "8", "TEACHER_BATCH_TOKENS": "512", "VOCAB": "64", "EPOCHS": "2",
           "BATCH_TOKENS": "256", "CHECK_TOKENS": "12", "DISTILL_SECONDS": "300", "CHECK_SECONDS": "300"}
    done = run_script(env)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    steps = ["collect-teacher", "collect-self", "distill", "check"]
    assert [line.split()[1] for line in summary.splitlines() if line.split()[:1] in [[s] for s in steps]] == ["PASS"] * 4
    # the data: the replies and the model's own continuations, with the exit layer's and the final states
    for folder, source in (("teacher", None), ("own", "continuations")):
        meta = json.loads((out / folder / "meta.json").read_text())
        assert meta["reply_positions"] > 0 and meta["config"]["layers"] == [2, 6]
        assert source is None or source in meta["source"]
    # the shipped format: heads.safetensors + a manifest naming the recipe and the measured agreement
    manifest = read_manifest(out / "exits")
    assert manifest.layers == [2] and manifest.design["kind"] == "block" and manifest.design["init"] == "zero"
    assert manifest.data["folder"] == ["teacher", "own"] and "distill-exits" in manifest.training["command"]
    assert manifest.training["per_layer"]["2"]["steps"] > 0 and manifest.agreement["2"]["heldout_positions"] > 0
    assert str(tmp_path) not in (out / "exits" / "manifest.json").read_text()
    # the exits load with the model and decode losslessly
    gen = Generator.from_pretrained(str(tiny_text_model_dir), exits=out / "exits", progress=False)
    assert gen.model.exits[2].kind == "block" and gen.model.exits[2].vocab_ids.numel() == 64
    _, loaded = load_heads(out / "exits", gen.model)
    assert loaded.layers == [2]
    n = gen.model.num_layers
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for prompt in ("the cat sat", "why every dog barks at night"):
        want = gen.generate(prompt, params, "ar").token_ids
        for strategy, spec in (("selfspec", SpecConfig(draft_layer=2, verify_layer=n, num_draft=3, num_layers=n)),
                               ("hispec", SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=3,
                                                     num_layers=n))):
            assert gen.generate(prompt, params, strategy, spec=spec).token_ids == want, (strategy, prompt)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is visible")
def test_gpu_distill_script_refuses_without_cuda(tmp_path):
    done = run_script({"GPU_DISTILL_OUT": str(tmp_path / "out")}, timeout=120)
    assert done.returncode == 2 and "no CUDA device" in done.stderr
