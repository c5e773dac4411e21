"""CUDA paths: run by ``scripts/gpu-check.sh`` on a GPU machine, skipped elsewhere.

Greedy selfspec/hispec equal ar on CUDA in float32 and bfloat16 (same precision, same kernels),
CUDA logits match CPU float32, the batched engine matches batch-of-one, and with two or more
GPUs tensor parallelism over NCCL matches one process.
"""
from __future__ import annotations

import pytest
import torch

from hispec.config import SamplingParams, SpecConfig
from hispec.generate import Generator
from hispec.model.load.checkpoint import load_model

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cuda_greedy_strategies_equal_ar(tiny_model_dir, family, dtype):
    gen = Generator(load_model(tiny_model_dir(family), device="cuda", dtype=dtype))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in ([1, 5, 9, 22, 7], list(range(3, 40))):
        want = gen.generate(prompt, params, "ar").token_ids
        for strategy, spec in (("selfspec", SpecConfig(draft_layer=2, verify_layer=6, num_layers=6)),
                               ("hispec", SpecConfig(draft_layer=1, verify_layer=3, num_layers=6))):
            assert gen.generate(prompt, params, strategy, spec=spec).token_ids == want, (strategy, dtype)


def test_cuda_logits_match_cpu(tiny_model_dir):
    from hispec.model.runner import LayerRunner
    from hispec.cache.block_manager import BlockManager
    from hispec.cache.kv_cache import KVPool

    folder = tiny_model_dir("llama")
    out = {}
    for device in ("cpu", "cuda"):
        m = load_model(folder, device=device)
        blocks = BlockManager(8, 16, m.num_layers)
        pool = KVPool(m.num_layers, 8, 16, m.cfg.num_kv_heads, m.cfg.head_dim, m.dtype, m.device)
        blocks.add_sequence(0)
        h = LayerRunner(m, blocks, pool).forward(0, 0, torch.arange(3, 40, device=device), 0, m.num_layers)
        out[device] = m.final_logits(h).float().cpu()
    assert (out["cpu"] - out["cuda"]).abs().max().item() < 1e-3


def test_cuda_batched_engine_equals_batch_of_one(tiny_model_dir):
    from hispec.llm import LLM

    gen = Generator(load_model(tiny_model_dir("llama"), device="cuda", dtype=torch.bfloat16))
    prompts = [[1, 5, 9], list(range(3, 30)), [7] * 12]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    single = [gen.generate(p, params, "ar").token_ids for p in prompts]
    llm = LLM(gen, "hispec", spec=SpecConfig(draft_layer=1, verify_layer=3, num_layers=6), adaptive=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == single


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
def test_tensor_parallel_nccl_equals_single_process(tiny_model_dir):
    from tests.distributed.test_tensor_parallel import assert_lossless, run_check

    rc, report, err, _ = run_check(tiny_model_dir("llama"), "--device", "cuda", "--exit-heads", "1,3")
    assert rc == 0, err
    assert_lossless(report)
