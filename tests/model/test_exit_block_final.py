"""Design ``block-final``: an exit block that also reads the previous position's final state
(EAGLE's feature input), on tiny random models (no network)."""
from __future__ import annotations

import pytest
import torch

from hispec.model.exits.block import ExitBlock
from hispec.model.load.checkpoint import load_model
from hispec.train import collect as C
from hispec.train import distill as S
from hispec.train import teacher as T
from hispec.train.config import TrainConfig

from tests.model.test_exit_blocks import encoded, tiny, train_and_measure  # noqa: F401 (tiny: a fixture)


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher-final")
    n = tiny.num_layers
    cfg = TrainConfig((0, 2, n), topk=8, token_cap=48, teacher_batch_tokens=256, shard_positions=300)
    C.collect(tiny, encoded(40), folder, cfg, {"model": "tiny"})
    return folder


def test_teacher_keeps_the_embeddings_and_the_final_states(tiny, shards):
    n = tiny.num_layers
    data = S.load_sequences(shards, 2, final_layer=n)
    _, ids, _ = encoded(40)[0]
    ids = torch.tensor(ids[:48])
    with torch.inference_mode():
        capture, final, _ = T.layer_pass(tiny, [ids.tolist()], (0, 2, n))
    assert torch.allclose(capture[0], tiny.embed(ids, torch.arange(len(ids))), atol=1e-6)
    assert torch.equal(capture[n], final)
    assert torch.allclose(data.final[:len(ids)].float(), final.float(), atol=2e-3)
    # the final state gives the teacher's own argmax
    assert torch.equal(tiny.final_logits(final).argmax(-1), data.top_ids[:len(ids), 0])
    with pytest.raises(ValueError, match="final states"):
        S.load_sequences(shards, 2, final_layer=n + 1)


def test_untrained_block_final_is_the_block_and_the_fed_back_pass_is_exact(tiny):
    torch.manual_seed(0)
    plain, final = ExitBlock(tiny, init="copy").eval(), ExitBlock(tiny, init="copy", reads_final=True).eval()
    final.load_state_dict(plain.state_dict(), strict=False)
    h, d = torch.randn(2, 11, tiny.cfg.hidden_size), torch.randn(2, 11, tiny.cfg.hidden_size)
    rope = S.dense_rope(tiny, 11, tiny.device)
    assert final.kind == "block-final" and plain.kind == "block"
    assert torch.allclose(final.forward_dense(h, rope, d), plain.forward_dense(h, rope), atol=1e-5)
    torch.nn.init.normal_(final.final_in.weight, std=0.1)
    z = final.forward_dense(h, rope, d)
    assert not torch.allclose(z, plain.forward_dense(h, rope), atol=1e-3)
    x = final.block_input(h, d)
    assert torch.allclose(S.fed_back_layer(final.layer, x, x, rope), z, atol=1e-5)
    # position t of the fed-back pass depends on its own input, and on the others' only through their exact K/V
    x2 = x.clone()
    x2[:, 5] += 1.0
    z2 = S.fed_back_layer(final.layer, x, x2, rope)
    assert torch.allclose(z2[:, :5], z[:, :5], atol=1e-5) and torch.allclose(z2[:, 6:], z[:, 6:], atol=1e-5)
    assert not torch.allclose(z2[:, 5], z[:, 5], atol=1e-3)


def test_training_block_final_lowers_the_loss_and_raises_agreement(tiny, shards):
    data = S.load_sequences(shards, 2, final_layer=tiny.num_layers)
    block = ExitBlock(tiny, init="zero", reads_final=True)
    before, after = train_and_measure(block, data)
    assert after[0] < before[0] - 0.1 and after[1] > before[1], (before, after)
    assert block.final_in.weight.abs().sum() > 0  # it learnt to read the final state
    fed = S.feedback_agreement(block, data)
    assert 0.0 <= fed["top1_fed_back"] <= 1.0 and 0.0 <= fed["top1_fed_back_given_previous"] <= 1.0
    with pytest.raises(ValueError, match="final states"):
        S.agreement(block, S.load_sequences(shards, 2))


def test_block_final_exits_save_and_load(tiny, tmp_path):
    from hispec.model.exits import Manifest, load_heads, model_identity, new_heads, save_heads

    exits = new_heads(tiny, [2], design="block-final", init="zero")
    torch.nn.init.normal_(exits[2].final_in.weight, std=0.05)
    save_heads(tmp_path, exits, Manifest(model_identity(tiny), [2], {}))
    loaded, manifest = load_heads(tmp_path, tiny)
    assert manifest.design["kind"] == "block-final" and loaded[2].reads_final
    assert torch.allclose(loaded[2].final_in.weight.float(), exits[2].final_in.weight.float(), atol=1e-3)


def test_the_engine_refuses_block_final_exits(tiny_model_dir, tmp_path):
    from hispec.generate import Generator
    from hispec.model.exits import ExitHeadError, Manifest, attach_exits, model_identity, new_heads, save_heads

    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, progress=False)
    save_heads(tmp_path, new_heads(gen.model, [2], design="block-final", init="zero"),
               Manifest(model_identity(gen.model), [2], {}))
    with pytest.raises(ExitHeadError, match="block-final"):
        attach_exits(gen, tmp_path)


def test_collect_and_distill_block_final_from_two_folders_cli(tiny_model_dir, tmp_path):
    """collect-exits keeps the final states (--layers ...,N), distill-exits --design block-final trains
    on two folders together (e.g. teacher-forced replies + the model's own continuations) and records
    the fed-back agreement; a folder without the final states is a clear usage error."""
    import json

    from hispec.cli import main

    model = str(tiny_model_dir("llama"))
    n = load_model(tiny_model_dir("llama")).num_layers
    folders = []
    for seed in (2, 3):
        data = tmp_path / f"data-{seed}.jsonl"
        with data.open("w") as f:
            for _, ids, first in encoded(30, seed=seed):
                f.write(json.dumps({"prompt_ids": ids[:first + 1], "response_ids": ids[first + 1:]}) + "\n")
        folders.append(tmp_path / f"teacher-{seed}")
        assert main(["collect-exits", "--model", model, "--threads", "1", "--layers", f"2,{n}", "--data", str(data),
                     "--out", str(folders[-1]), "--topk", "8", "--max-tokens", "48", "--batch-tokens", "256"]) == 0
    base = ["distill-exits", "--model", model, "--threads", "1", "--layers", "2", "--design", "block-final",
            "--init", "zero", "--vocab", "64", "--epochs", "1", "--batch-tokens", "256", "--heldout-every", "10"]
    assert main(base + ["--data", *map(str, folders), "--out", str(tmp_path / "both")]) == 0
    assert main(base + ["--data", str(folders[0]), "--out", str(tmp_path / "one")]) == 0
    both = json.loads((tmp_path / "both" / "manifest.json").read_text())
    one = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert both["design"]["kind"] == "block-final" and both["data"]["folder"] == ["teacher-2", "teacher-3"]
    assert both["data"]["positions"]["2"] > one["data"]["positions"]["2"]
    assert 0 <= both["agreement"]["2"]["top1_fed_back"] <= 1
    assert main(["collect-exits", "--model", model, "--layers", f"2,{n + 1}", "--data", str(tmp_path / "data-2.jsonl"),
                 "--out", str(tmp_path / "bad")]) != 0
