"""The fused CPU kernels (hispec/kernels/: fused.py, layer_op.py, plan.py): each agrees with the eager PyTorch computation
it replaces, computes every row independently of the others in its call (what keeps batched
verification bit-identical to one-token decoding), rounds to bfloat16 exactly as PyTorch does,
and the model really runs on them."""
import gc
import platform
import shutil

import pytest
import torch

from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import AttentionBatch, KVPool, SeqChunk
from hispec.kernels import build, fused, layer_op, plan, quant
from hispec.model.decoder import DecoderLayer, RMSNorm, apply_rope
from hispec.model.fast_path import FUSED, layer_forward

pytestmark = pytest.mark.skipif(not fused.available(), reason="no C compiler: the eager path runs instead")

G = torch.Generator().manual_seed(0)


def rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=G) * scale).to(dtype)


def rows_independent(f, x: torch.Tensor):
    """``f`` on all rows at once equals ``f`` row by row, bit for bit."""
    whole = f(x)
    parts = torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(whole, parts)
    return whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x, w = rand(7, 576, scale=3.0), rand(576)
    out = rows_independent(lambda r: fused.rms_norm(r, w, 1e-5, dtype), x)
    ref = RMSNorm(576, 1e-5)
    ref.weight.data = w
    torch.testing.assert_close(out.float(), ref(x).float(), rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    # the bfloat16 output is the float32 output rounded by PyTorch's own rule (nearest even)
    assert torch.equal(fused.rms_norm(x, w, 1e-5, torch.bfloat16), fused.rms_norm(x, w, 1e-5, torch.float32).bfloat16())


def test_add_rms_norm():
    h, d, w = rand(5, 64), rand(5, 64, dtype=torch.bfloat16), rand(64)
    h_out, out = fused.add_rms_norm(h, d, w, 1e-6, torch.float32)
    assert torch.equal(h_out, h + d)  # the residual add is exact float32 addition
    torch.testing.assert_close(out, torch.rms_norm(h + d, (64,), w, 1e-6), rtol=1e-5, atol=1e-5)
    parts = [fused.add_rms_norm(h[i:i + 1], d[i:i + 1], w, 1e-6, torch.float32)[1] for i in range(5)]
    assert torch.equal(torch.cat(parts), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    gu = rand(6, 2 * 96, dtype=dtype, scale=4.0)
    out = rows_independent(lambda r: fused.silu_mul(r, torch.float32), gu)
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=2e-6, atol=2e-6)


def rope_tables(positions, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = positions.float()[:, None] * inv[None, :]
    return torch.cat([f.cos(), f.cos()], -1), torch.cat([-f.sin(), f.sin()], -1)  # [T, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_matches_eager_exactly(dtype):
    t, hq, hkv, d = 4, 6, 2, 16
    qkv = rand(t, (hq + 2 * hkv) * d, dtype=dtype)
    cos, ssin = rope_tables(torch.tensor([3, 4, 9, 20]), d)
    pool = KVPool(1, 8, 8, hkv, d, torch.float32, "cpu")  # 64 slots
    slots = torch.tensor([5, 6, 40, 41])
    q = fused.rope_write(qkv, cos, ssin, slots, hq, hkv, pool.k[0], pool.v[0])
    x = qkv.view(t, hq + 2 * hkv, d)
    qk = apply_rope(x[:, :hq + hkv], cos[:, None], ssin[:, None])  # the eager path: same float ops
    k, v = pool.read(0, slots)
    assert torch.equal(q, qk[:, :hq]) and torch.equal(k, qk[:, hq:]) and torch.equal(v, x[:, hq + hkv:].float())
    pool.write(0, slots, torch.zeros_like(k), torch.zeros_like(v))
    assert pool.k[0].abs().sum() == 0 and pool.v[0].abs().sum() == 0  # nothing else written


def paged_case(starts, counts, hq=6, hkv=2, d=16, bs=4):
    """A pool whose sequences' blocks interleave (blocks handed out round-robin), one chunk per
    sequence: ``counts[i]`` new tokens after ``starts[i]`` cached ones."""
    blocks = BlockManager(64, bs, 1)
    chunks = [SeqChunk(i, s, n) for i, (s, n) in enumerate(zip(starts, counts))]
    for c in chunks:
        blocks.add_sequence(c.seq_id)
    for upto in range(bs, max(starts) + max(counts) + bs, bs):
        for c in chunks:
            blocks.ensure_capacity(c.seq_id, min(upto, c.start + c.num_tokens))
    pool = KVPool(1, 64, bs, hkv, d, torch.float32, "cpu")
    pool.k[0].copy_(rand(*pool.k[0].shape))
    pool.v[0].copy_(rand(*pool.v[0].shape))
    return AttentionBatch(chunks, blocks, "cpu"), pool, rand(sum(counts), hq, d)


@pytest.mark.parametrize("head_dim", [16, 64, 128])  # 64 and 128: the register-resident path
def test_paged_attention_matches_eager_and_is_per_query(head_dim):
    from hispec.model.decoder import attend

    batch, pool, q = paged_case([0, 13, 30], [5, 1, 3], d=head_dim)
    out = fused.paged_attention(q, pool.k[0], pool.v[0], batch.kernel(), torch.float32).view_as(q)
    for i, c in enumerate(batch.chunks):
        ck, cv = pool.context(0, batch, i)
        for j in range(c.num_tokens):
            row = batch.offsets[i] + j
            n = c.start + j + 1  # each query sees exactly its own prefix
            ref = attend(q[row:row + 1], ck[:n], cv[:n], None)
            torch.testing.assert_close(out[row:row + 1], ref, rtol=1e-5, atol=1e-5)
            # alone, the same query gives the same bits
            alone, alone_pool, _ = paged_case([c.start + j], [1], d=head_dim)
            alone_pool.k[0].copy_(pool.k[0]), alone_pool.v[0].copy_(pool.v[0])
            alone.kernel().tables.copy_(batch.kernel(i).tables[:, :alone.kernel().tables.shape[1]])
            single = fused.paged_attention(q[row:row + 1], pool.k[0], pool.v[0], alone.kernel(), torch.float32)
            assert torch.equal(single.view(1, *q.shape[1:]), out[row:row + 1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [dict(starts=[40, 50, 60, 70], counts=[8, 8, 8, 8], bs=16),
                                  # fewer KV heads than threads: split by query head
                                  dict(starts=[70], counts=[1], hkv=1),
                                  # a window of 2, 5 or 7 over 3 KV heads on 2 threads: its tile halved (float32
                                  # products) or whole (bfloat16 products)
                                  dict(starts=[37], counts=[5], hq=6, hkv=3, d=64),
                                  dict(starts=[20], counts=[2], hq=6, hkv=3, d=64),
                                  dict(starts=[100], counts=[7], hq=6, hkv=3, d=64),
                                  # a prompt chunk of three query tiles
                                  dict(starts=[5], counts=[70], hq=6, hkv=3, d=64)])
def test_parallel_attention_equals_serial(monkeypatch, case, kv_dtype):
    batch, pool, q = paged_case(**case)
    k, v = pool.k[0].to(kv_dtype), pool.v[0].to(kv_dtype)
    serial = fused.paged_attention(q, k, v, batch.kernel(), torch.float32)
    monkeypatch.setattr(fused, "PARALLEL_MIN_WORK", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernel splits the work by the threads it has (the suite runs on one)
    try:
        with_threads = fused.paged_attention(q, k, v, batch.kernel(), torch.float32)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(serial, with_threads)


def test_rope_write_into_a_bfloat16_pool_rounds_as_torch_does():
    t, hq, hkv, d = 4, 6, 2, 16
    qkv = rand(t, (hq + 2 * hkv) * d)
    cos, ssin = rope_tables(torch.tensor([3, 4, 9, 20]), d)
    slots = torch.tensor([5, 6, 40, 41])
    kf, vf = torch.zeros(hkv, 64, d), torch.zeros(hkv, 64, d)  # [Hkv, S, D]
    kb, vb = torch.zeros(hkv, 64, d, dtype=torch.bfloat16), torch.zeros(hkv, 64, d, dtype=torch.bfloat16)
    qf = fused.rope_write(qkv, cos, ssin, slots, hq, hkv, kf, vf)
    qb = fused.rope_write(qkv, cos, ssin, slots, hq, hkv, kb, vb)
    assert torch.equal(qf, qb)  # the queries stay float32
    assert torch.equal(kb, kf.to(torch.bfloat16)) and torch.equal(vb, vf.to(torch.bfloat16))
    assert fused.rope_write(qkv, cos, ssin, slots, hq, hkv, kb, vb, queries=False) is None


def bf16_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of ``q [T, Hq, D]`` over every key of ``k, v [C, Hkv, D]`` (bfloat16 values) as a
    bfloat16 pool's kernel defines it, in float64: softmax weights rounded to bfloat16, the weights'
    sum that of the rounded weights (the queries as two bfloat16 each: float32's to ~2^-17)."""
    T, hq, d = q.shape
    g = hq // k.shape[1]
    qb = q.double().view(T, k.shape[1], g, d)
    s = torch.einsum("thgd,chd->thgc", qb, k.double()) * d ** -0.5
    p = (s - s.amax(-1, keepdim=True)).exp().float().bfloat16().double()
    out = torch.einsum("thgc,chd->thgd", p, v.double()) / p.sum(-1, keepdim=True)
    return out.reshape(T, hq, d).float()


@pytest.mark.parametrize("head_dim,bs", [(16, 4), (64, 4), (64, 16), (128, 32)])
def test_paged_attention_over_a_bfloat16_pool(head_dim, bs):
    """Where the build multiplies bfloat16 pairs (AVX512_BF16; head sizes 64, 128), the softmax
    weights are rounded to bfloat16 and each query split into two bfloat16: the reference's result
    to rounding. Elsewhere a bfloat16 pool is read as the float32 values it holds: the bits of a
    float32 pool holding them. Either way a query's bits do not depend on the queries beside it in
    the call (rows of 1-43 keys: whole chunks of 16 and odd tails)."""
    batch, pool, q = paged_case([0, 13, 40], [21, 1, 3], d=head_dim, bs=bs)
    kb, vb = pool.k[0].to(torch.bfloat16), pool.v[0].to(torch.bfloat16)
    out = fused.paged_attention(q, kb, vb, batch.kernel(), torch.float32).view_as(q)
    if not fused.bf16_attention_products(head_dim):
        as_float = fused.paged_attention(q, kb.float(), vb.float(), batch.kernel(), torch.float32)
        assert torch.equal(out, as_float.view_as(q))
    for i, c in enumerate(batch.chunks):
        ck, cv = pool.context(0, batch, i)
        for j in range(c.num_tokens):
            row, n = batch.offsets[i] + j, c.start + j + 1
            ref = bf16_attention_reference(q[row:row + 1], ck[:n].bfloat16(), cv[:n].bfloat16())
            torch.testing.assert_close(out[row:row + 1], ref, rtol=5e-3, atol=5e-3)
            alone, _, _ = paged_case([c.start + j], [1], d=head_dim, bs=bs)
            alone.kernel().tables.copy_(batch.kernel(i).tables[:, :alone.kernel().tables.shape[1]])
            single = fused.paged_attention(q[row:row + 1], kb, vb, alone.kernel(), torch.float32)
            assert torch.equal(single.view(1, *q.shape[1:]), out[row:row + 1])
    with pytest.raises(TypeError):  # one dtype for K and V
        fused.paged_attention(q, kb, vb.float(), batch.kernel(), torch.float32)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_of_several_query_tiles_gives_each_query_its_own_bits(kv_dtype):
    """A prompt chunk of 70 queries spans several query tiles (the kernel takes up to 32 a tile):
    the queries on either side of each tile's edge give the bits they give alone."""
    batch, pool, q = paged_case([5], [70], d=64)
    k, v = pool.k[0].to(kv_dtype), pool.v[0].to(kv_dtype)
    out = fused.paged_attention(q, k, v, batch.kernel(), torch.float32).view_as(q)
    for j in (0, 1, 30, 31, 32, 33, 63, 64, 69):
        alone, _, _ = paged_case([5 + j], [1], d=64)
        alone.kernel().tables.copy_(batch.kernel(0).tables[:, :alone.kernel().tables.shape[1]])
        single = fused.paged_attention(q[j:j + 1], k, v, alone.kernel(), torch.float32)
        assert torch.equal(single.view(1, *q.shape[1:]), out[j:j + 1]), j


@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_bfloat16_pool_weights_every_value_once(head_dim):
    """Zero queries give every key the weight 1: each output is then exactly the mean of its
    values (small integers, so every sum is exact), which a key taken twice, skipped, or put in
    the wrong column would change (pairs of keys across chunks of 16 and odd last keys)."""
    batch, pool, q = paged_case([0, 13, 40], [21, 1, 3], d=head_dim)
    vals = torch.randint(-8, 9, pool.v[0].shape, generator=G).float()
    kb, vb = pool.k[0].to(torch.bfloat16), vals.to(torch.bfloat16)
    out = fused.paged_attention(torch.zeros_like(q), kb, vb, batch.kernel(), torch.float32).view_as(q)
    for i, c in enumerate(batch.chunks):
        for j in range(c.num_tokens):
            row, n = batch.offsets[i] + j, c.start + j + 1
            slots = batch.context_slots[i][:n]
            v = vals[:, slots].transpose(0, 1)  # [n, Hkv, D]
            want = (v.sum(0) / n).repeat_interleave(q.shape[1] // v.shape[1], dim=0)  # [Hq, D]
            assert torch.equal(out[row], want)


@pytest.mark.parametrize("head_dim,bs", [(64, 4), (64, 16), (128, 16)])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_slots_no_query_sees_never_reach_its_output(head_dim, bs, kv_dtype):
    """The slots past every sequence's last position (a block's unwritten rest, a freed sequence's
    leftovers) hold NaN: every output stays the one with zeros there. A verification window's rows
    shorter than its longest (weights past a row's keys), keys read in whole blocks or chunks of 16
    and 32 (on AMX tiles where the CPU has them) must not take a value they do not weigh."""
    batch, pool, q = paged_case([0, 13, 40], [21, 1, 6], d=head_dim, bs=bs)
    seen = torch.zeros(pool.k[0].shape[1], dtype=torch.bool)
    for i, c in enumerate(batch.chunks):
        seen[batch.context_slots[i][:c.start + c.num_tokens]] = True
    outs = []
    for fill in (0.0, float("nan")):
        k, v = pool.k[0].clone(), pool.v[0].clone()
        k[:, ~seen], v[:, ~seen] = fill, fill
        outs.append(fused.paged_attention(q, k.to(kv_dtype), v.to(kv_dtype), batch.kernel(), torch.float32))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


def test_wrong_tensors_raise_instead_of_reading_memory():
    with pytest.raises(TypeError):
        fused.rms_norm(rand(2, 8, dtype=torch.float16), rand(8), 1e-5, torch.float32)


def test_model_runs_on_the_fused_kernels(tiny_model_dir, monkeypatch):
    """A Llama model's decode goes through the kernels and agrees with the eager path."""
    from hispec.config import SamplingParams
    from hispec.generate import Generator

    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, progress=False)
    calls = []
    for module, name in ((fused, "paged_attention"), (layer_op, "decode_layers")):  # a layer at a time, or a range
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = list(range(3, 20))
    with_kernels = gen.generate(prompt, params, "ar")
    assert calls, "the fused kernels were not used"
    assert isinstance(gen.model.layers[0], DecoderLayer)
    monkeypatch.setenv("HISPEC_FUSED", "0")
    fused.library.cache_clear()
    try:
        eager = gen.generate(prompt, params, "ar")
    finally:
        fused.library.cache_clear()
    assert with_kernels.token_ids == eager.token_ids  # a random tiny model has no near-ties in 12 tokens


@pytest.fixture
def small_route(monkeypatch):
    """``small_route(name)``: float32 products of up to SMALL_ROWS rows take route ``name``."""
    from hispec.kernels import matmul

    def use(name: str) -> None:
        monkeypatch.setenv("HISPEC_SMALL_MATMUL", name)
        matmul.small_route.cache_clear()

    yield use
    matmul.small_route.cache_clear()


def tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, quantize: str):
    """The tiny llama's Generator on ``quantize``: ``none:ROUTE`` (float32 weights, decode-sized
    products on ROUTE), ``int4`` / ``q4`` / ``q8a`` (4-bit weights on that kernel) or ``int8``; skips
    where the layer op cannot be built."""
    from hispec.generate import Generator

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers: the layers run one by one")
    if quantize in ("int4", "q4", "q8a"):
        four_bit_kernel(quantize)
        quantize = "int4"
    if quantize.startswith("none:"):
        small_route(quantize[5:])
        quantize = "none"
    return Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize=quantize, progress=False)


@pytest.mark.parametrize("quantize", ["none:wxt", "none:linear", "none:panel", "int4", "q4", "q8a", "int8"])
def test_layer_op_equals_the_per_layer_path(tiny_model_dir, four_bit_kernel, small_route, quantize):
    """``decode_layers`` (a range of layers in one C++ call) gives the per-layer fused path's hidden
    states and K/V bit for bit, for float32 (on each decode-sized route), int4 (on PyTorch's int4
    kernel, hispec's q4 or q8a) and int8 weights, on a ragged batch (above SMALL_ROWS rows, float32 weights
    take the panel kernel where this CPU serves them with it)."""
    from hispec.kernels.matmul import panel_rows

    gen = tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, quantize)
    quantize = quantize.split(":")[0]
    model, cfg = gen.model, gen.model.cfg
    n = model.num_layers
    for starts, counts in (([0, 13, 30], [1, 1, 1]), ([0, 13, 30], [4, 1, 3]), ([7], [2])):
        batch, base_pool, _ = paged_case(starts, counts, hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim)
        pool = KVPool(n, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        for i in range(n):
            pool.k[i].copy_(rand(*pool.k[i].shape)), pool.v[i].copy_(rand(*pool.v[i].shape))
        h = rand(sum(counts), cfg.hidden_size)
        plans = plan.fast_path(model).layer_plans(h, 0, n, model.rope(batch.positions), batch, pool)
        if quantize == "none" and sum(counts) > 4 and panel_rows() == 0:
            assert plans is None  # more rows than SMALL_ROWS take oneDNN (this CPU), in Python
            continue
        assert plans is not None, "the layer op was not chosen"
        if quantize == "q8a":
            assert set(plans.kinds) == {layer_op.MM_Q8A4}
        per_layer = KVPool(n, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        for i in range(n):
            per_layer.k[i].copy_(pool.k[i]), per_layer.v[i].copy_(pool.v[i])
        with torch.no_grad():
            one_call = model.run_layers(h, 1, n, batch, pool, FUSED)
            rope = model.rope(batch.positions)
            ref = h
            for i in range(1, n):
                ref = layer_forward(model.layers[i], ref, i, rope, batch, per_layer)
        assert torch.equal(one_call, ref)
        for i in range(n):
            assert torch.equal(pool.k[i], per_layer.k[i]) and torch.equal(pool.v[i], per_layer.v[i])


@pytest.mark.parametrize("quantize", ["int4", "q4", "q8a"])
def test_layer_op_prefill_on_dense_weights_equals_the_per_layer_path(tiny_model_dir, four_bit_kernel, small_route,
                                                                    quantize):
    """Prompt chunks on the dense bfloat16 prefill weights: the op's matmul (for q4, float32 rows cast
    to bfloat16) gives the per-layer path's hidden states and K/V bit for bit."""
    gen = tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, quantize)
    model, cfg = gen.model, gen.model.cfg
    n = model.num_layers
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            m = getattr(layer, name)
            m.dense = m.dequantize().to(torch.bfloat16)
            setattr(layer, name, m)  # planned anew
    chunks = [SeqChunk(0, 3, 9), SeqChunk(1, 0, 5)]
    blocks = BlockManager(64, 4, 1)
    for c in chunks:
        blocks.add_sequence(c.seq_id)
        blocks.ensure_capacity(c.seq_id, c.start + c.num_tokens)
    batch = AttentionBatch(chunks, blocks, "cpu", prefill=True)
    pools = [KVPool(n, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu") for _ in range(2)]
    for i in range(n):
        k, v = rand(*pools[0].k[i].shape), rand(*pools[0].v[i].shape)
        for p in pools:
            p.k[i].copy_(k), p.v[i].copy_(v)
    h = rand(14, cfg.hidden_size)
    assert plan.fast_path(model).layer_plans(h, 0, n, model.rope(batch.positions), batch, pools[0]) is not None
    assert layer_op.MM_DENSE_BF16 in plan.fast_path(model).plans_for(0, n, True, True)[0].kinds or quantize == "int4"
    with torch.no_grad():
        one_call = model.run_layers(h, 0, n, batch, pools[0], FUSED)
        rope, ref = model.rope(batch.positions), h
        for i in range(n):
            ref = layer_forward(model.layers[i], ref, i, rope, batch, pools[1])
    assert torch.equal(one_call, ref)
    for i in range(n):
        assert torch.equal(pools[0].k[i], pools[1].k[i]) and torch.equal(pools[0].v[i], pools[1].v[i])


def test_layer_plan_follows_replaced_projections(tiny_model_dir):
    """A projection replaced after the plan was made (e.g. quantization) is planned anew."""
    from hispec.generate import Generator
    from hispec.kernels.quant import QuantLinear

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers")
    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="none", progress=False)
    layer = gen.model.layers[0]
    from hispec.kernels.matmul import small_route

    kind = {"wxt": layer_op.MM_FLOAT, "linear": layer_op.MM_FLOAT_LINEAR, "panel": layer_op.MM_PANEL}[small_route()]
    assert plan.layer_plan(layer)[2] == [kind] * 4
    weight = layer.o_proj.weight
    if small_route() == "panel":  # a float32 weight changed in place: the plan's panel copy is remade
        before = plan.layer_plan(layer)[1][2].clone()
        with torch.no_grad():
            weight.mul_(2)
        assert torch.equal(plan.layer_plan(layer)[1][2], 2 * before)
    layer.o_proj = QuantLinear.from_float(weight, "int4", kernel="int4")
    assert plan.layer_plan(layer) is None  # int4 wants bfloat16 activations, this layer runs float32 ones
    layer.o_proj = QuantLinear.from_float(weight, "int4", kernel="q4")  # q4 reads float32 ones
    assert plan.layer_plan(layer)[2][1] == layer_op.MM_Q4


def test_range_plans_follow_the_layers(tiny_model_dir, small_route):
    """The model keeps each layer range's flattened plans between steps; a weight changed in place,
    a replaced projection or a replaced layer is seen at the next step."""
    from hispec.generate import Generator
    from hispec.kernels.quant import QuantLinear

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers")
    small_route("panel")
    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="none", progress=False)
    model, n = gen.model, gen.model.num_layers
    plans, has_float = plan.fast_path(model).plans_for(0, n, False, False)
    assert has_float and plans.kinds[:4] == [layer_op.MM_PANEL] * 4
    assert plan.fast_path(model).plans_for(0, n, False, False)[0] is plans  # kept
    before = plans.weights[2].clone()  # layer 0's o_proj, in panels
    with torch.no_grad():
        model.layers[0].o_proj.weight.mul_(2)
    again = plan.fast_path(model).plans_for(0, n, False, False)[0]
    assert again is not plans and torch.equal(again.weights[2], 2 * before)
    model.layers[1].o_proj = QuantLinear.from_float(model.layers[1].o_proj.weight, "int4", kernel="q4")
    assert plan.fast_path(model).plans_for(0, n, False, False)[0].kinds[4 + 1] == layer_op.MM_Q4
    model.layers[1].o_proj = QuantLinear.from_float(model.layers[1].o_proj.weight, "int4", kernel="int4")
    assert plan.fast_path(model).plans_for(0, n, False, False)[0] is None  # int4 wants bfloat16 activations
    model.layers[1] = type(model.layers[0])(model.cfg)  # a fresh float32 layer
    assert plan.fast_path(model).plans_for(0, n, False, False)[0] is not None


def test_op_ranges_go_with_the_pool_and_the_plans(tiny_model_dir):
    """The op's handle on a layer range (plans and cache layers) is made once per pool and plans:
    kept between steps, another for another pool or range, anew for new plans; and it writes the
    pool it was made for."""
    from hispec.generate import Generator

    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers")
    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="none", progress=False)
    model, cfg, n = gen.model, gen.model.cfg, gen.model.num_layers
    plans = plan.fast_path(model).plans_for(0, n, False, False)[0]
    pools = [KVPool(n, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu") for _ in range(2)]
    ranges = plan.fast_path(model).ranges
    first = ranges.get(plans, pools[0], 0, n, cfg, False)
    assert ranges.get(plans, pools[0], 0, n, cfg, False) is first
    assert ranges.get(plans, pools[1], 0, n, cfg, False) is not first
    tail = plan.fast_path(model).plans_for(1, n, False, False)[0]
    assert ranges.get(tail, pools[0], 1, n, cfg, False) is not first
    remade = layer_op.LayerPlans.of([plan.layer_plan(layer) for layer in model.layers])
    assert ranges.get(remade, pools[0], 0, n, cfg, False) is not first
    batch, _, _ = paged_case([0], [1], hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim)
    h = rand(1, cfg.hidden_size)
    with torch.no_grad():
        layer_op.decode_layers(h, ranges.get(plans, pools[1], 0, n, cfg, False), model.rope(batch.positions), batch, cfg)
    assert pools[1].k[0].abs().sum() > 0 and pools[0].k[0].abs().sum() == 0  # the pool it was given
    del pools[1]  # the handles go with their pool
    gc.collect()
    assert len(ranges._by_pool) == 1


@pytest.mark.parametrize("kernel", ["int4", "q4"])
def test_prefill_on_dense_weights_is_independent_of_chunking(tiny_model_dir, four_bit_kernel, kernel):
    """Prompt tokens run on the dense bfloat16 prefill weights (``QuantLinear.dense``: the int4
    kernel's bfloat16 activations, or q4's float32 ones cast), and a prompt's hidden states and K/V
    are the same bits whether it is prefilled whole or in chunks (what keeps batches, whose chunked
    prefill splits prompts differently, identical to batch 1)."""
    from hispec.model.runner import LayerRunner
    from hispec.generate import Generator

    four_bit_kernel(kernel)
    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="int4", progress=False)
    assert gen.model.layers[0].qkv_proj.kernel == kernel
    model = gen.model
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            m = getattr(layer, name)
            m.dense = m.dequantize().to(torch.bfloat16)
            setattr(layer, name, m)  # a projection set again: its layer plans anew
    cfg, n = model.cfg, model.num_layers
    prompt = torch.tensor([(7 * i) % cfg.vocab_size for i in range(40)])

    def prefill(chunks: list[int], dense: bool = True):
        blocks = BlockManager(64, 4, n)
        pool = KVPool(n, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        runner = LayerRunner(model, blocks, pool)
        blocks.add_sequence(0)
        out, start = [], 0
        with torch.no_grad():
            for c in chunks:
                out += runner.forward_many([(0, start, prompt[start:start + c])], 0, n, prefill=dense)
                start += c
        return torch.cat(out), pool, blocks

    whole, pool, blocks = prefill([40])
    slots = torch.tensor([blocks.block_table(0)[p // 4] * 4 + p % 4 for p in range(40)])
    for chunks in ([7] * 5 + [5], [1] * 3 + [37], [3, 30, 7]):
        parts, pool2, blocks2 = prefill(chunks)
        slots2 = torch.tensor([blocks2.block_table(0)[p // 4] * 4 + p % 4 for p in range(40)])
        assert torch.equal(parts, whole)
        for i in range(n):
            assert all(torch.equal(a, b) for a, b in zip(pool.read(i, slots), pool2.read(i, slots2)))
    int4_prefill, _, _ = prefill([40], dense=False)
    assert not torch.equal(int4_prefill, whole)  # the prompt really ran on the dense weights


def test_q8a_prefill_on_its_own_rows_is_independent_of_chunking(tiny_model_dir, four_bit_kernel):
    """Where the CPU has integer dot products, q8a layers run prompt chunks on their own kernel
    (``quant.q8a_prefills_on_rows``; the native loader keeps no dense copy for them): a prompt's
    hidden states and K/V are the same bits whole and in chunks, and through the decode path where
    prompts do not take bfloat16 tiles (``q8act.bf16_tiles``: another arithmetic, prompts only)."""
    from hispec.kernels import q8act
    from hispec.model.runner import LayerRunner
    from hispec.generate import Generator

    four_bit_kernel("q8a")
    if not quant.q8a_prefills_on_rows():
        pytest.skip("q8a prefills on its rows only where the CPU has integer dot products")
    model = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="int4", progress=False).model
    assert model.layers[0].qkv_proj.kernel == "q8a" and model.layers[0].qkv_proj.dense is None
    cfg, n = model.cfg, model.num_layers
    prompt = torch.tensor([(5 * i + 3) % cfg.vocab_size for i in range(37)])

    def run(chunks: list[int], prefill: bool):
        blocks = BlockManager(64, 4, n)
        pool = KVPool(n, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        blocks.add_sequence(0)
        out, start = [], 0
        with torch.no_grad():
            for c in chunks:
                out += LayerRunner(model, blocks, pool).forward_many([(0, start, prompt[start:start + c])], 0, n,
                                                                     prefill=prefill)
                start += c
        slots = torch.tensor([blocks.block_table(0)[p // 4] * 4 + p % 4 for p in range(37)])
        return torch.cat(out), [pool.read(i, slots) for i in range(n)]

    whole, kv = run([37], True)
    cases = [([5] * 7 + [2], True), ([1, 30, 6], True)] + ([] if q8act.bf16_tiles() else [([37], False)])
    for chunks, prefill in cases:
        h, kv2 = run(chunks, prefill)
        assert torch.equal(h, whole)
        assert all(torch.equal(a, b) for pair in zip(kv, kv2) for a, b in zip(*pair))


def test_kernels_are_built_at_load_not_in_the_first_decode_step(tiny_model_dir, monkeypatch, tmp_path, capsys):
    """A first run builds the C++ layer op while the model loads (and says so), so the first
    generation's prefill time is not a compiler's; a later load finds it built and says nothing."""
    from hispec.generate import Generator

    built = []
    monkeypatch.setattr(layer_op, "layers_op", lambda: built.append(1))
    monkeypatch.setattr(build, "build_dir", lambda: tmp_path)
    Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, progress=True)
    assert built and "building hispec's CPU kernels" in capsys.readouterr().err
    build.op_path().touch()
    Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, progress=True)
    assert len(built) == 2 and "building" not in capsys.readouterr().err


@pytest.mark.skipif(not fused.available(), reason="needs the fused CPU kernels (a C compiler)")
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="builds an x86-64 baseline library")
def test_plain_c_fallback_gives_the_same_bits(tmp_path):
    """The row-independent matmul kernels' plain-C code (CPUs without AVX2 and FMA: q4 in both
    forms, q8, the panel kernel with its own panel width) computes the same bits as the vector
    code this machine runs: a model's tokens do not depend on which of these CPUs runs it."""
    import ctypes
    import subprocess

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    lib_path = tmp_path / "baseline.so"
    flags = [f if f != "-march=native" else "-march=x86-64" for f in build.FLAGS]
    subprocess.run([cc, *flags, *map(str, build.c_sources()), "-o", str(lib_path), "-lm"], check=True,
                   capture_output=True)
    base = ctypes.CDLL(str(lib_path))
    from hispec.model.load.gguf_weights import _blocks, _q8_blocks
    from hispec.kernels.quant import QuantLinear
    from tests.kernels.test_quant import _gguf_blocks

    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 96, generator=g)
    x[1, 32:64] = 0
    p = ctypes.c_void_p
    for t in (1, 6):
        q4 = QuantLinear.from_blocks(*_blocks(_gguf_blocks("Q4_1", n=20, k=96)[0]), "Q4_1", kernel="q4")
        y = torch.empty(t, 20)
        base.hs_q4_matmul(ctypes.c_void_p(q4.qweight.data_ptr()), ctypes.c_void_p(q4.qparams[0].data_ptr()),
                          ctypes.c_void_p(q4.qparams[1].data_ptr()), ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(t),
                          ctypes.c_int64(20), ctypes.c_int64(96), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(0))
        assert torch.equal(y, q4(x[:t])), t
        q8 = QuantLinear.from_q8_blocks(*_q8_blocks(_gguf_blocks("Q8_0", n=20, k=96)[0]), kernel="q8")
        base.hs_q8_matmul(ctypes.c_void_p(q8.qweight.data_ptr()), ctypes.c_void_p(q8.qparams.data_ptr()),
                          ctypes.c_void_p(x.data_ptr()), ctypes.c_int(0), ctypes.c_int64(t), ctypes.c_int64(20),
                          ctypes.c_int64(96), ctypes.c_void_p(y.data_ptr()), ctypes.c_int(0))
        assert torch.equal(y, q8(x[:t])), t
        for panels in (0, 1):  # prompt chunks: float32 panels of the same weights
            fn = base.hs_q4_panel_matmul if panels else base.hs_q4_matmul
            fn(p(q4.qweight.data_ptr()), p(q4.qparams[0].data_ptr()), p(q4.qparams[1].data_ptr()), p(x.data_ptr()),
               ctypes.c_int64(t), ctypes.c_int64(20), ctypes.c_int64(96), p(y.data_ptr()), ctypes.c_int(0))
            assert torch.equal(y, fused.q4_matmul(x[:t], q4.qweight, q4.qparams, panels=bool(panels))), (t, panels)
        w = torch.randn(20, 96, generator=g)
        base.hs_panel_width.restype = ctypes.c_int64
        packed = torch.empty(-(-20 // base.hs_panel_width()), 96, base.hs_panel_width())
        base.hs_panel_pack(p(w.data_ptr()), ctypes.c_int64(20), ctypes.c_int64(96), p(packed.data_ptr()))
        base.hs_panel_matmul(p(x.data_ptr()), ctypes.c_int64(t), ctypes.c_int64(96), p(packed.data_ptr()),
                             ctypes.c_int64(20), p(y.data_ptr()), ctypes.c_int(0))
        assert torch.equal(y, fused.panel_matmul(x[:t], fused.panel_pack(w), 20)), t


def test_layer_op_on_an_empty_range_returns_its_input():
    """An empty range (no layers, no cache layers) hands ``h`` back instead of reading a first layer."""
    if layer_op.layers_op() is None:
        pytest.skip("no C++ compiler or torch headers")
    empty = torch.classes.hispec_fused.Range([], [], [], [], [], [], [], 2, 1, 1e-5, 0.0, False)
    h, rows = rand(1, 8), rand(1, 4)
    one = torch.ones(1, dtype=torch.int32)
    out = layer_op.layers_op()(h, rows, rows, rows, rows, torch.zeros(1, dtype=torch.long), one[None], one - 1, one, None,
                               None, 4, False, empty)
    assert torch.equal(out, h)


def test_rope_table_rows_equal_the_rows_computed_alone(tiny_model_dir):
    """The CPU's RoPE table (grown by doubling) gives each position the values computing that
    position alone gives, bit for bit, in the model's dtype."""
    from hispec.generate import Generator

    model = Generator.from_pretrained(str(tiny_model_dir("llama")), exits=False, quantize="none", progress=False).model
    for positions in (torch.tensor([0]), torch.tensor([5, 1023, 1024, 3000, 2]), torch.arange(40, 47)):
        cos, ssin = model.rope(positions)
        for i, p in enumerate(positions.tolist()):
            alone = model._rope_rows(torch.tensor([p]))
            assert torch.equal(cos[i, 0], alone[0][0]) and torch.equal(ssin[i, 0], alone[1][0])
    assert model._rope_table[0].shape[0] == 4096
    model.to(torch.bfloat16)
    assert model.rope(torch.tensor([7]))[0].dtype == torch.bfloat16


@pytest.mark.parametrize("quantize", ["none:wxt", "none:linear", "none:panel", "int4", "q4", "q8a", "int8", "q8 head",
                                      "q8a head"])
@pytest.mark.parametrize("batch_size", [1, 3, 6])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_step_equals_the_general_path(tiny_model_dir, four_bit_kernel, small_route, quantize, batch_size,
                                             kv_dtype):
    """``fast_path.decode_step`` (embedding, every layer, final norm and head in one C++ call) gives
    the logits and K/V of ``forward_many`` + ``exit_logits`` bit for bit, for sequences of different
    lengths whose blocks interleave, on float32 (each decode-sized route; 6 rows: the batched route),
    int4 / q4 / q8a / int8 weights and a Q8_0 output head (q8, or q8a8 beside q8a layers), over a
    float32 or a bfloat16 KV cache."""
    from hispec.model.runner import LayerRunner
    from hispec.kernels.matmul import panel_rows
    from hispec.kernels.quant import QuantLinear

    q8_head = quantize.endswith(" head")
    quantize = {"q8 head": "none:wxt", "q8a head": "q8a"}.get(quantize, quantize)
    gen = tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, quantize)
    quantize = quantize.split(":")[0]
    model, cfg = gen.model, gen.model.cfg
    if q8_head:  # the default model's kind of head: GGUF Q8_0 blocks, on q8 (q8a8 beside q8a layers)
        w = model.lm_head.weight.detach().float()
        d = w.view(w.shape[0], -1, 32).abs().amax(-1) / 127  # [N, K / 32]
        q = (w.view(w.shape[0], -1, 32) / d[..., None]).round().to(torch.int8).view_as(w)
        model.lm_head = QuantLinear.from_q8_blocks(q, d.half(), kernel="q8a8" if quantize == "q8a" else "q8")
    n, bs = model.num_layers, 4
    starts = [0, 13, 30, 5, 21, 2][:batch_size]
    runs = []
    for _ in range(2):
        blocks = BlockManager(64, bs, n)
        pool = KVPool(n, 64, bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype, "cpu")
        for i in range(n):
            pool.k[i].copy_(rand(*pool.k[i].shape) if not runs else runs[0][1].k[i])
            pool.v[i].copy_(rand(*pool.v[i].shape) if not runs else runs[0][1].v[i])
        for s in range(batch_size):
            blocks.add_sequence(s)
        for upto in range(bs, max(starts) + 1 + bs, bs):  # blocks handed out round-robin
            for s, start in enumerate(starts):
                blocks.ensure_capacity(s, min(upto, start + 1))
        for s, start in enumerate(starts):
            blocks.set_filled(s, 0, n, start)
        runs.append((LayerRunner(model, blocks, pool), pool))
    tokens = torch.randint(cfg.vocab_size, (batch_size,), generator=G).tolist()
    with torch.no_grad():
        one_call = runs[0][0].decode_logits(list(zip(range(batch_size), starts, tokens)))
        if quantize == "none" and batch_size > 4 and panel_rows() == 0:
            assert one_call is None  # more rows than SMALL_ROWS take oneDNN (this CPU), in Python
            return
        assert one_call is not None, "decode_step was not chosen"
        items = [(s, start, torch.tensor([t])) for s, start, t in zip(range(batch_size), starts, tokens)]
        ref = model.exit_logits(torch.cat(runs[1][0].forward_many(items, 0, n)), n)
    assert torch.equal(one_call, ref)
    for i in range(n):
        assert torch.equal(runs[0][1].k[i], runs[1][1].k[i]) and torch.equal(runs[0][1].v[i], runs[1][1].v[i])
    for s, start in enumerate(starts):
        assert runs[0][0].blocks.length(s, n - 1) == start + 1


@pytest.mark.parametrize("quantize", ["none:panel", "q4", "q8a", "int8"])
@pytest.mark.parametrize("batch_size", [1, 3, 6])
def test_decode_greedy_equals_steps_of_decode_step_and_argmax(tiny_model_dir, four_bit_kernel, small_route, quantize,
                                                               batch_size, monkeypatch):
    """``LayerRunner.decode_greedy`` (several greedy steps in one op call) chooses the tokens and
    writes the K/V that ``decode_logits`` + ``sampler.argmax`` step by step do, bit for bit, with the
    attention threads switching on mid-run in both (as each step's key count decides); with an EOS
    list it stops after the step where every sequence has chosen one."""
    from hispec.model.runner import LayerRunner
    from hispec.spec.proposers.ngram import NgramIndex
    from hispec.sampling.sampler import argmax

    gen = tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, quantize)
    model, cfg = gen.model, gen.model.cfg
    n, bs, steps = model.num_layers, 4, 5
    starts = [0, 13, 30, 5, 21, 2][:batch_size]
    keys = sum(starts) + batch_size  # the first step's; each step adds batch_size
    monkeypatch.setattr(fused, "PARALLEL_MIN_WORK", (keys + 2 * batch_size) * cfg.num_heads * cfg.head_dim)

    def runner() -> LayerRunner:
        blocks = BlockManager(64, bs, n)
        pool = KVPool(n, 64, bs, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        for i in range(n):
            pool.k[i].copy_(torch.arange(pool.k[i].numel()).view_as(pool.k[i]).sin())
            pool.v[i].copy_(torch.arange(pool.v[i].numel()).view_as(pool.v[i]).cos())
        for s, start in enumerate(starts):
            blocks.add_sequence(s)
            blocks.ensure_capacity(s, start + steps)
            blocks.set_filled(s, 0, n, start)
        return LayerRunner(model, blocks, pool)

    tokens = torch.randint(cfg.vocab_size, (batch_size,), generator=G).tolist()
    one_call, by_step = runner(), runner()
    with torch.no_grad():
        chosen = one_call.decode_greedy(list(zip(range(batch_size), starts, tokens)), steps, [])
        assert chosen is not None, "decode_greedy was not chosen"
        ref, last = [[] for _ in starts], tokens
        for j in range(steps):
            logits = by_step.decode_logits([(s, start + j, t) for s, (start, t) in enumerate(zip(starts, last))])
            last = argmax(logits).tolist()
            for s, t in enumerate(last):
                ref[s].append(t)
    assert chosen == ref
    for i in range(n):
        assert torch.equal(one_call.pool.k[i], by_step.pool.k[i]) and torch.equal(one_call.pool.v[i], by_step.pool.v[i])
    for s, start in enumerate(starts):
        assert one_call.blocks.length(s, n - 1) == start + steps

    # stop once every sequence has chosen an EOS: at step 2 here (each one's second token is an EOS)
    eos = sorted({r[1] for r in ref})
    with torch.no_grad():
        early = runner().decode_greedy(list(zip(range(batch_size), starts, tokens)), steps, eos)
    stop = next(j for j in range(steps) if all(any(t in eos for t in r[:j + 1]) for r in ref)) + 1
    assert early == [r[:stop] for r in ref] and stop <= 2

    # stop where a row's text comes to end on an n-gram seen before (prompt lookup has drafts there):
    # row 0 after its 3rd token (its 2nd and 3rd tokens are in its history, as a 2-gram with a token
    # after it), the others never (n = 0) or on any repeated token (n = 1); where, as NgramIndex finds
    filler = [t for t in range(cfg.vocab_size) if all(t not in r for r in ref) and t not in tokens][:12]
    texts = [filler[:6] + [ref[0][1], ref[0][2], filler[6], tokens[0]]] + [filler[6:] + [t] for t in tokens[1:]]
    ngram = [2] + [b % 2 for b in range(1, batch_size)]

    def ends_on_seen(text: list[int], n: int) -> bool:
        return n > 0 and NgramIndex(3).match(text)[0] >= n

    expected = next((j + 1 for j in range(steps) if any(ends_on_seen(texts[b] + ref[b][:j + 1], ngram[b])
                                                        for b in range(batch_size))), steps)
    with torch.no_grad():
        stopped = runner().decode_greedy(list(zip(range(batch_size), starts, tokens)), steps, [],
                                         list(zip(texts, ngram)))
    assert stopped == [r[:expected] for r in ref] and expected <= 3


def test_profiling_counts_the_op_calls(tiny_model_dir, four_bit_kernel, small_route):
    """``fused.profile``: while on, the op times each of its calls per part (a plain decode step:
    four matmuls, one attention, one RoPE, two norms, one gated activation and one residual add per
    layer, the final norm, the head, one setup); off, it counts nothing; each call returns and
    restarts the sums."""
    from hispec.config import SamplingParams

    gen = tiny_on_kernels(tiny_model_dir, four_bit_kernel, small_route, "int4")
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    gen.generate([1, 2, 3], params)  # warm-up
    layer_op.profile(True)
    gen.generate([1, 2, 3], params)
    parts = layer_op.profile(False)
    assert list(parts) == list(layer_op.PROFILE_PARTS)
    steps, n = 3, gen.model.num_layers  # the first token comes from the prompt's pass
    per_step = {"matmul": 4 * n + 1, "attention": n, "rope_cache": n, "norm": 2 * n + 1, "silu_mul": n,
                "residual": n, "setup": 1}
    for part, (seconds, calls) in parts.items():
        assert calls >= steps * per_step[part] and seconds > 0, part
    gen.generate([1, 2, 3], params)
    assert all(v == (0.0, 0) for v in layer_op.profile(False).values())


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    line = next((l for l in text.splitlines() if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.skipif(shutil.which("cc") is None or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs a C compiler on x86-64")
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_attention_has_the_same_bits_on_avx2_and_avx512(tmp_path, head_dim, pool_dtype):
    """The kernel's arithmetic (16-lane fused sums, softmax, weighted values) does not depend on
    the vector width: attention.c built for AVX2 + FMA only gives the bits of the AVX-512 builds.
    (A bfloat16 pool on a build with AVX512_BF16 takes bfloat16 products instead, its own bits.)"""
    import ctypes
    import subprocess

    from hispec.kernels import binding

    if not {"avx2", "fma", "avx512f"} <= _cpu_flags():
        pytest.skip("needs a CPU with both AVX2 + FMA and AVX-512 to run both builds")
    flags = [f for f in build.FLAGS if not f.startswith("-march")]
    out = {}
    for isa in ("-march=haswell", "-march=skylake-avx512", "-march=native"):
        lib = tmp_path / f"attention{len(out)}.so"
        subprocess.run(["cc", *flags, isa, "-I", str(build.CSRC), str(build.CSRC / "attention.c"), "-o", str(lib),
                        "-lm"], check=True, capture_output=True)
        f = ctypes.CDLL(str(lib)).hs_paged_attention
        f.argtypes, f.restype = binding.signatures()["hs_paged_attention"]
        bf16_products = ctypes.CDLL(str(lib)).hs_attention_bf16_products() and head_dim in (64, 128)
        if pool_dtype == torch.float32 or not bf16_products:
            out[isa] = f
    batch, pool, q = paged_case([0, 13, 40], [21, 1, 3], d=head_dim)  # rows of 1-43 keys: whole 16s and tails
    results = []
    real = fused.library
    for f in out.values():
        fused.library = lambda f=f: type("Lib", (), {"hs_paged_attention": staticmethod(f)})
        try:
            results.append(fused.paged_attention(q, pool.k[0].to(pool_dtype), pool.v[0].to(pool_dtype),
                                                 batch.kernel(), torch.float32))
        finally:
            fused.library = real
    assert all(torch.equal(results[0], r) for r in results[1:])
