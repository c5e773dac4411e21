"""The fused CPU path for the families beyond Llama (Qwen3's QK-norm; Gemma 3's QK-norm, GeGLU,
sandwich norms, scaled embeddings, its own attention scale and sliding-window layers with their own
RoPE base): the kernels agree with the eager computation, compute every row alone, and the model's
one-call paths (``decode_step``, ``decode_greedy``, ``run_layers`` on verification windows) give a
row the bits of a one-token step, so every strategy keeps ``ar``'s tokens."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import AttentionBatch, KVPool, SeqChunk
from hispec.kernels import fused, layer_op, plan
from hispec.model.decoder import apply_rope, attend

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler: the eager path runs instead")

G = torch.Generator().manual_seed(1)


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=G) * scale).to(dtype)


# ---- kernels ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul(dtype):
    gu = rand(7, 2 * 100, dtype=dtype, scale=4.0)
    gu[0, :6] = torch.tensor([-100.0, -20.0, 0.0, 1e-8, 20.0, 100.0]).to(dtype)  # tails of the tanh
    out = fused.gelu_tanh_mul(gu, torch.float32)
    parts = torch.cat([fused.gelu_tanh_mul(gu[i:i + 1], torch.float32) for i in range(7)])
    assert torch.equal(out, parts)
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(out, F.gelu(gate, approximate="tanh") * up, rtol=3e-6, atol=3e-6)
    assert torch.equal(fused.gelu_tanh_mul(gu, torch.bfloat16), out.bfloat16())


def test_sandwich_norm_kernels():
    h, d, dw, w = rand(6, 64), rand(6, 64, dtype=torch.bfloat16, scale=5.0), rand(64), rand(64)
    h_out, x = fused.norm_add_rms_norm(h, d, dw, w, 1e-6, torch.float32)
    normed = fused.rms_norm(d.float(), dw, 1e-6, torch.float32)  # the norm of the output, as the eager path's
    assert torch.equal(h_out, h + normed)
    assert torch.equal(x, fused.rms_norm(h + normed, w, 1e-6, torch.float32))
    torch.testing.assert_close(normed, torch.rms_norm(d.float(), (64,), dw, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.norm_add(h, d, dw, 1e-6), h + normed)
    for i in range(6):  # row by row: the same bits
        hi, xi = fused.norm_add_rms_norm(h[i:i + 1], d[i:i + 1], dw, w, 1e-6, torch.float32)
        assert torch.equal(hi, h_out[i:i + 1]) and torch.equal(xi, x[i:i + 1])
        assert torch.equal(fused.norm_add(h[i:i + 1], d[i:i + 1], dw, 1e-6), h_out[i:i + 1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_rope_write_with_qk_norm(kv_dtype):
    t, hq, hkv, d, s = 5, 4, 2, 32, 16
    qkv = rand(t, (hq + 2 * hkv) * d, scale=3.0)
    pos = torch.tensor([3, 9, 4, 0, 11])
    inv = 1.0 / (1000 ** (torch.arange(0, d, 2).float() / d))
    f = pos.float()[:, None] * inv
    cos, ssin = torch.cat((f.cos(), f.cos()), -1), torch.cat((-f.sin(), f.sin()), -1)
    qn, kn = rand(d), rand(d)
    slots = torch.tensor([7, 2, 11, 0, 5])
    kp, vp = torch.zeros(hkv, s, d, dtype=kv_dtype), torch.zeros(hkv, s, d, dtype=kv_dtype)
    q = fused.rope_write(qkv, cos, ssin, slots, hq, hkv, kp, vp, True, qn, kn, 1e-6)
    # the eager computation: each head normed as rows of the norm kernel, then rotated
    qh = fused.rms_norm(qkv[:, :hq * d].reshape(-1, d), qn, 1e-6, torch.float32).view(t, hq, d)
    kh = fused.rms_norm(qkv[:, hq * d:(hq + hkv) * d].reshape(-1, d), kn, 1e-6, torch.float32).view(t, hkv, d)
    rq, rk = apply_rope(qh, cos[:, None], ssin[:, None]), apply_rope(kh, cos[:, None], ssin[:, None])
    torch.testing.assert_close(q, rq, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(kp[:, slots].transpose(0, 1).float(), rk.to(kv_dtype).float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(vp[:, slots].transpose(0, 1), qkv[:, (hq + hkv) * d:].view(t, hkv, d).to(kv_dtype))
    for i in range(t):  # row by row
        k1, v1 = torch.zeros_like(kp), torch.zeros_like(vp)
        q1 = fused.rope_write(qkv[i:i + 1], cos[i:i + 1], ssin[i:i + 1], slots[i:i + 1], hq, hkv, k1, v1, True, qn,
                              kn, 1e-6)
        assert torch.equal(q1, q[i:i + 1]) and torch.equal(k1[:, slots[i]], kp[:, slots[i]])


def one_sequence(start, count, hq, hkv, d, bs=4, kv_dtype=torch.float32):
    blocks = BlockManager(64, bs, 1)
    blocks.add_sequence(0)
    blocks.add_sequence(1)  # a second sequence's blocks between this one's
    for upto in range(bs, start + count + bs, bs):
        blocks.ensure_capacity(0, min(upto, start + count))
        blocks.ensure_capacity(1, upto)
    pool = KVPool(1, 64, bs, hkv, d, kv_dtype, "cpu")
    pool.k[0].copy_(rand(*pool.k[0].shape))
    pool.v[0].copy_(rand(*pool.v[0].shape))
    return AttentionBatch([SeqChunk(0, start, count)], blocks, "cpu"), pool, rand(count, hq, d)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 256])  # 64: bfloat16 products over a bfloat16 pool (AVX512_BF16)
@pytest.mark.parametrize("window", [0, 1, 5, 16, 23])
def test_sliding_window_attention_is_per_query(kv_dtype, head_dim, window):
    """Query t at position p sees keys p - window < j <= p; alone (a one-token step) it gets the bits
    it gets among 40 others (two tiles), whatever the tile's other windows."""
    start, count, hq, hkv = 9, 40, 4, 2
    batch, pool, q = one_sequence(start, count, hq, hkv, head_dim, kv_dtype=kv_dtype)
    meta = batch.kernel()
    scale = 0.3
    out = fused.paged_attention(q, pool.k[0], pool.v[0], meta, torch.float32, window, scale).view_as(q)
    ck, cv = pool.context(0, batch, 0, torch.float32)
    for j in range(count):
        n = start + j + 1
        lo = max(0, n - window) if window else 0
        ref = attend(q[j:j + 1], ck[lo:n], cv[lo:n], None, scale)
        tol = 1e-5 if kv_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[j:j + 1], ref, rtol=tol, atol=tol)
        alone = SimpleNamespace(tables=meta.tables, seq=meta.seq[j:j + 1], lengths=meta.lengths[j:j + 1],
                                tail=None, tail_start=None, keys=n, block_size=meta.block_size)
        single = fused.paged_attention(q[j:j + 1], pool.k[0], pool.v[0], alone, torch.float32, window, scale)
        assert torch.equal(single.view(1, hq, head_dim), out[j:j + 1]), j
    if window == 0:  # no window: the plain kernel's bits
        assert torch.equal(out, fused.paged_attention(q, pool.k[0], pool.v[0], meta, torch.float32, 0, scale).view_as(q))


@pytest.mark.parametrize("head_dim, hq, hkv", [(64, 9, 3), (128, 8, 2), (64, 4, 4)])
@pytest.mark.parametrize("start, count, bs", [(0, 1, 16), (0, 40, 16), (37, 70, 16), (5, 21, 4)])
def test_prompt_attention_is_per_query(head_dim, hq, hkv, start, count, bs):
    """A prompt's queries (``prompt``: AMX tiles where the CPU has them): each gets the bits it gets
    alone, whatever its tile (16 rows, 32 queries) and where its keys' blocks lie, within bfloat16
    products of attention; where the tile path does not run, exactly the decoding path's bits."""
    batch, pool, q = one_sequence(start, count, hq, hkv, head_dim, bs=bs, kv_dtype=torch.bfloat16)
    meta = batch.kernel()
    out = fused.paged_attention(q, pool.k[0], pool.v[0], meta, torch.float32, prompt=True).view_as(q)
    decoded = fused.paged_attention(q, pool.k[0], pool.v[0], meta, torch.float32).view_as(q)
    if not fused.prompt_attention_on_tiles():
        assert torch.equal(out, decoded)
    torch.testing.assert_close(out, decoded, rtol=2e-3, atol=2e-3)
    ck, cv = pool.context(0, batch, 0, torch.float32)
    for j in range(count):
        n = start + j + 1
        torch.testing.assert_close(out[j:j + 1], attend(q[j:j + 1], ck[:n], cv[:n], None), rtol=2e-2, atol=2e-2)
        alone = SimpleNamespace(tables=meta.tables, seq=meta.seq[j:j + 1], lengths=meta.lengths[j:j + 1],
                                tail=None, tail_start=None, keys=n, block_size=meta.block_size)
        single = fused.paged_attention(q[j:j + 1], pool.k[0], pool.v[0], alone, torch.float32, prompt=True)
        assert torch.equal(single.view(1, hq, head_dim), out[j:j + 1]), j


@pytest.mark.parametrize("kv_dtype, head_dim, window", [(torch.float32, 64, 0), (torch.bfloat16, 16, 0),
                                                        (torch.bfloat16, 64, 5)])
def test_prompt_attention_elsewhere_is_the_decoding_paths(kv_dtype, head_dim, window):
    """Off the tile path (a float32 pool, another head size, a sliding window) a prompt's queries get
    the decoding path's bits."""
    batch, pool, q = one_sequence(3, 37, 4, 2, head_dim, kv_dtype=kv_dtype)
    meta = batch.kernel()
    args = (q, pool.k[0], pool.v[0], meta, torch.float32, window)
    assert torch.equal(fused.paged_attention(*args, prompt=True), fused.paged_attention(*args))


# ---- the model --------------------------------------------------------------------------------

def _hf_config(kind: str):
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(vocab_size=181, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=256, tie_word_embeddings=False)
    if kind == "gemma3":  # window 5 (crossed), its own RoPE base on sliding layers, a scale not head_dim ** -0.5
        return transformers.Gemma3TextConfig(
            vocab_size=181, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=256, sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=20,
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}},
            tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    # head_dim 64 (bfloat16 products over a bfloat16 cache), window 8, tied embeddings as the real one
    return transformers.Gemma3TextConfig(
        vocab_size=181, hidden_size=128, intermediate_size=192, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=256, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=64,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)


_DIRS: dict[str, object] = {}


def model_dir(kind: str, tmp_path_factory):
    import transformers

    if kind not in _DIRS:
        cfg = _hf_config(kind)
        torch.manual_seed(3)
        hf = transformers.AutoModelForCausalLM.from_config(cfg)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # weights that make the layers matter (norms around their 1 + w)
            for name, p in hf.named_parameters():
                std = 0.4 if "embed" in name else 0.15 if p.dim() > 1 else 0.3
                p.copy_(torch.randn(p.shape, generator=g) * std)
        folder = tmp_path_factory.mktemp(f"fam-{kind}")
        hf.save_pretrained(folder)
        _DIRS[kind] = folder
    return _DIRS[kind]


KINDS = ["gemma3", "gemma3-d64", "qwen3"]


def load(kind, tmp_path_factory, quantize="none", kv_dtype=torch.float32):
    from hispec.model.load.checkpoint import apply_quantization, load_model

    model = load_model(model_dir(kind, tmp_path_factory))
    if quantize != "none":
        apply_quantization(model, quantize)
    model.kv_cache_dtype = kv_dtype
    return model


def runner(model, starts, extra, kv_dtype=torch.float32, bs=4, fused=True):
    from hispec.model.runner import LayerRunner

    cfg, n = model.cfg, model.num_layers
    blocks = BlockManager(64, bs, n)
    pool = KVPool(n, 64, bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu")
    for s, start in enumerate(starts):
        blocks.add_sequence(s)
    for upto in range(bs, max(starts) + extra + bs, bs):  # blocks handed out round-robin
        for s, start in enumerate(starts):
            blocks.ensure_capacity(s, min(upto, start + extra))
    return LayerRunner(model, blocks, pool, fused=fused)  # fused=False: the eager reference alone


def prompts(starts, vocab, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (s,), generator=g) for s in starts]


@pytest.mark.parametrize("kind", KINDS)
def test_family_layers_plan_on_the_op(kind, tmp_path_factory):
    model = load(kind, tmp_path_factory)
    assert all(plan.fusable(layer) for layer in model.layers)
    plans = [plan.layer_plan(layer) for layer in model.layers]
    assert all(p is not None for p in plans)
    for layer, p in zip(model.layers, plans):
        norms, flags = p[0], p[4]
        assert len(norms) == len(layer_op.NORMS) and len(flags) == len(layer_op.FLAGS)
        assert (norms[2].numel() > 0) == (layer.q_norm is not None)
        assert (norms[4].numel() > 0) == (layer.attn_out_norm is not None)
        assert flags[0] == (model.cfg.sliding_window if layer.sliding else 0)
        assert flags[2] == layer_op.ACTS[model.cfg.hidden_act]


@pytest.mark.parametrize("kind", KINDS)
def test_fused_logits_equal_the_eager_path(kind, tmp_path_factory):
    """Prompt, then one-token steps past the window: the fused path's logits are the eager path's
    within float rounding."""
    fast, slow = load(kind, tmp_path_factory), load(kind, tmp_path_factory)
    (ids,) = prompts([11], fast.cfg.vocab_size)
    outs = []
    for model in (fast, slow):
        r = runner(model, [11], 11 + 8, fused=model is fast)
        with torch.no_grad():
            logits = [model.exit_logits(r.forward(0, 0, ids, 0, model.num_layers), model.num_layers)]
            token = int(logits[-1][-1].argmax())
            for j in range(8):
                h = r.forward(0, 11 + j, torch.tensor([token]), 0, model.num_layers)
                logits.append(model.exit_logits(h, model.num_layers))
                token = int(logits[-1][-1].argmax())
        outs.append(torch.cat(logits))
    assert plan.fast_path(fast).plans_for(0, fast.num_layers, False, False)[0] is not None
    assert not plan.fast_path(slow)._range_plans  # the eager runner never asked the planner
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-4, atol=2e-4)


CASES = [("gemma3", "none", torch.float32), ("gemma3", "int4", torch.float32), ("gemma3-d64", "none", torch.bfloat16),
         ("gemma3-d64", "q4", torch.bfloat16), ("qwen3", "none", torch.bfloat16)]


@pytest.fixture
def panel_everywhere(monkeypatch):
    """float32 products on the panel kernel at every row count (its rows are computed alone: a
    one-token step's row has a verification window's bits; oneDNN's and MKL's need not)."""
    from hispec.kernels import matmul

    monkeypatch.setenv("HISPEC_SMALL_MATMUL", "panel")
    monkeypatch.setenv("HISPEC_BATCH_MATMUL", "panel")
    for f in (matmul.small_route, matmul.panel_rows):
        getattr(f, "cache_clear", lambda: None)()
    yield
    for f in (matmul.small_route, matmul.panel_rows):
        getattr(f, "cache_clear", lambda: None)()


def _quantized(model_kind, quantize, four_bit_kernel):
    if quantize == "q4":
        four_bit_kernel("q4")
        return "int4"
    if quantize == "int4":
        four_bit_kernel("int4")
    return quantize


@pytest.mark.parametrize("kind,quantize,kv_dtype", CASES)
def test_windows_and_steps_give_each_row_the_same_bits(kind, quantize, kv_dtype, tmp_path_factory, four_bit_kernel,
                                                       panel_everywhere):
    """The core of lossless decoding: a verification window of k tokens (``run_layers`` in one op
    call), the same tokens one by one (``decode_step``), ``decode_greedy`` and the per-layer fused path
    in Python give each row the same logits and K/V bit for bit, across the sliding windows."""
    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers")
    model = load(kind, tmp_path_factory, _quantized(kind, quantize, four_bit_kernel), kv_dtype)
    n, V = model.num_layers, model.cfg.vocab_size
    starts = [13, 6]
    steps = 7
    ps = prompts(starts, V)
    g = torch.Generator().manual_seed(11)
    nxt = [torch.randint(V, (steps,), generator=g).tolist() for _ in starts]

    def prefilled():
        r = runner(model, starts, max(starts) + steps + 1, kv_dtype)
        with torch.no_grad():
            r.forward_many([(s, 0, p) for s, p in enumerate(ps)], 0, n, prefill=True)
        return r

    with torch.no_grad():
        # (1) a window of `steps` tokens per sequence in one run_layers call of the op
        win = prefilled()
        h = win.forward_many([(s, start, torch.tensor(nxt[s])) for s, start in enumerate(starts)], 0, n)
        window_logits = [model.exit_logits(x, n) for x in h]
        # (2) one token at a time, both sequences in one decode_step call each
        step = prefilled()
        step_logits = [[] for _ in starts]
        for j in range(steps):
            lg = step.decode_logits([(s, start + j, nxt[s][j]) for s, start in enumerate(starts)])
            assert lg is not None, "decode_step was not chosen"
            for s in range(len(starts)):
                step_logits[s].append(lg[s])
        # (3) the per-layer fused path in Python (the op's range call refused), one sequence at a time
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan.FastPath, "run_layers", lambda *a, **k: None)
            mp.setattr(plan.FastPath, "step_op", lambda *a, **k: None)
            py = prefilled()
            py_logits = [model.exit_logits(py.forward(s, start, torch.tensor(nxt[s]), 0, n), n)
                         for s, start in enumerate(starts)]
    for s in range(len(starts)):
        assert torch.equal(window_logits[s], torch.stack(step_logits[s])), s
    # the Python path's prompt went the same way (its own, the per-layer calls): compare its rows too
    for s in range(len(starts)):
        assert torch.equal(py_logits[s], window_logits[s]), s
    for i in range(n):
        for a, b in ((win, step), (win, py)):
            assert torch.equal(a.pool.k[i], b.pool.k[i]) and torch.equal(a.pool.v[i], b.pool.v[i]), i

    # (4) decode_greedy: several steps in one call = decode_step + argmax step by step
    with torch.no_grad():
        one, by = prefilled(), prefilled()
        first = [int(nxt[s][0]) for s in range(len(starts))]
        chosen = one.decode_greedy([(s, start, first[s]) for s, start in enumerate(starts)], steps, [])
        assert chosen is not None, "decode_greedy was not chosen"
        ref, last = [[] for _ in starts], first
        for j in range(steps):
            lg = by.decode_logits([(s, start + j, t) for s, (start, t) in enumerate(zip(starts, last))])
            last = [int(x) for x in lg.argmax(-1)]
            for s, t in enumerate(last):
                ref[s].append(t)
    assert chosen == ref
    for i in range(n):
        assert torch.equal(one.pool.k[i], by.pool.k[i]) and torch.equal(one.pool.v[i], by.pool.v[i])


@pytest.mark.parametrize("kind,quantize,kv_dtype", [("gemma3", "none", torch.float32),
                                                    ("gemma3", "int4", torch.float32),
                                                    ("gemma3-d64", "q4", torch.bfloat16),
                                                    ("qwen3", "none", torch.float32)])
def test_strategies_keep_ar_tokens(kind, quantize, kv_dtype, tmp_path_factory, four_bit_kernel, panel_everywhere):
    """Greedy ``lookup``, ``selfspec`` and ``hispec`` give ``ar``'s token ids on the fused path, past
    the sliding windows (prompts that repeat, so lookup drafts)."""
    from hispec.config import SamplingParams, SpecConfig
    from hispec.generate import Generator

    model = load(kind, tmp_path_factory, _quantized(kind, quantize, four_bit_kernel), kv_dtype)
    gen = Generator(model)
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    spec = SpecConfig(draft_layer=1, verify_layer=2, num_draft=4, window=4)
    base = prompts([9], model.cfg.vocab_size, seed=13)[0].tolist()
    for prompt in (base + base + base[:4], [5, 17, 99, 3], base[:3] * 5):
        want = gen.generate(prompt, params, "ar").token_ids
        assert len(want) == 30
        for strategy in ("lookup", "selfspec", "hispec"):
            out = gen.generate(prompt, params, strategy, spec=spec)
            assert out.token_ids == want, (strategy, prompt)


@pytest.mark.parametrize("head_dim", [16, 64, 256])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_windowed_attention_has_the_same_bits_on_avx2_and_avx512(tmp_path, head_dim, pool_dtype):
    """Over sliding windows too, attention.c built for AVX2 + FMA only gives the AVX-512 builds' bits
    (a bfloat16 pool on an AVX512_BF16 build, head sizes 64 / 128: bfloat16 products, its own)."""
    import ctypes
    import platform
    import shutil
    import subprocess

    from hispec.kernels import binding, build

    if shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs a C compiler on x86-64")
    cpu = open("/proc/cpuinfo").read().split()
    if not {"avx2", "fma", "avx512f"} <= set(cpu):
        pytest.skip("needs a CPU with both AVX2 + FMA and AVX-512 to run both builds")
    flags = [f for f in build.FLAGS if not f.startswith("-march")]
    fns = []
    for isa in ("-march=haswell", "-march=skylake-avx512", "-march=native"):
        lib = tmp_path / f"attention{len(fns)}.so"
        subprocess.run(["cc", *flags, isa, "-I", str(build.CSRC), str(build.CSRC / "attention.c"), "-o", str(lib),
                        "-lm"], check=True, capture_output=True)
        f = ctypes.CDLL(str(lib)).hs_paged_attention_window
        f.argtypes, f.restype = binding.signatures()["hs_paged_attention_window"]
        if pool_dtype == torch.float32 or not (ctypes.CDLL(str(lib)).hs_attention_bf16_products()
                                                and head_dim in (64, 128)):
            fns.append(f)
    batch, pool, q = one_sequence(3, 40, 4, 2, head_dim)
    k, v = pool.k[0].to(pool_dtype), pool.v[0].to(pool_dtype)
    real = fused.library
    for window in (5, 17):
        results = []
        for f in fns:
            fused.library = lambda f=f: type("Lib", (), {"hs_paged_attention_window": staticmethod(f)})
            try:
                results.append(fused.paged_attention(q, k, v, batch.kernel(), torch.float32, window, 0.2))
            finally:
                fused.library = real
        assert all(torch.equal(results[0], r) for r in results[1:]), window


def test_argmax_picks_as_torch_does():
    """``hs_argmax`` (the op's greedy choice) is ``torch.argmax``: the first of equal maxima (-0 = +0),
    the first NaN, infinities, rows of any length (vector bodies and tails)."""
    lib = fused.library()
    g = torch.Generator().manual_seed(2)
    rows = []
    for n in (1, 5, 16, 17, 33, 1000, 262144):
        x = torch.randn(n, generator=g)
        rows.append(x)
        tie = x.clone()
        tie[n // 3:] = tie.max()  # ties: the first
        rows.append(tie)
        if n > 2:
            z = torch.full((n,), -1.0)
            z[n - 2], z[1] = 0.0, -0.0  # -0 before +0: equal, the first
            rows.append(z)
            nan = x.clone()
            nan[n - 1] = float("nan")
            nan[n // 2] = float("inf")
            rows.append(nan)
            both = x.clone()
            both[n // 2:] = float("nan")
            rows.append(both)
        rows.append(torch.full((n,), float("-inf")))
        rows.append(torch.full((n,), float("inf")))
    fns = [lib.hs_argmax]
    import ctypes
    import platform
    import shutil
    import subprocess
    import tempfile

    from hispec.kernels import build

    if shutil.which("cc") is not None and platform.machine() in ("x86_64", "AMD64"):  # the AVX2 and plain C bodies
        flags = [f for f in build.FLAGS if not f.startswith("-march")]
        with tempfile.TemporaryDirectory() as tmp:
            for isa in ("-march=haswell", "-march=x86-64"):
                so = f"{tmp}/sample{len(fns)}.so"
                subprocess.run(["cc", *flags, isa, "-I", str(build.CSRC), str(build.CSRC / "sample.c"), "-o", so,
                                "-lm"], check=True, capture_output=True)
                f = ctypes.CDLL(so).hs_argmax
                f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
                fns.append(f)
            for x in rows:
                for f in fns:
                    assert f(x.data_ptr(), x.numel()) == int(torch.argmax(x)), (f, x.numel(), x[:4])
            return
    for x in rows:
        assert lib.hs_argmax(x.data_ptr(), x.numel()) == int(torch.argmax(x)), (x.numel(), x[:4])
