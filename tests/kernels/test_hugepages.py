"""Weights and the KV cache in huge-page arenas (kernels/hugepages.py): same values, same results."""
from __future__ import annotations

import mmap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hispec.cache.kv_cache import KVPool
from hispec.config import SamplingParams
from hispec.kernels import hugepages

needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this OS")


@pytest.fixture
def arenas_on(monkeypatch):
    """Arenas made whatever this machine's THP setting (madvise is only advice: values never depend on it)."""
    monkeypatch.setattr(hugepages, "available", lambda: True)


def _in_arena(t: torch.Tensor) -> bool:
    return any(start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= end
               for _, start, end in hugepages._arenas)


def test_thp_mode_reads_the_bracketed_setting(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(hugepages, "THP_SETTING", setting)
    assert hugepages.thp_mode() == "madvise"
    monkeypatch.setattr(hugepages, "THP_SETTING", tmp_path / "missing")
    assert hugepages.thp_mode() == ""
    assert not hugepages.available()


def test_off_by_variable(monkeypatch):
    monkeypatch.setenv("HISPEC_HUGE_PAGES", "0")
    assert not hugepages.available()
    a, b = hugepages.zeros([(3, 5), (7,)], torch.float32)
    assert a.shape == (3, 5) and b.shape == (7,) and not a.any() and not b.any()
    assert not _in_arena(a)
    assert hugepages.gather(nn.Linear(256, 256)) == 0
    assert "HISPEC_HUGE_PAGES=0" in hugepages.describe()


@needs_madvise
def test_zeros_one_aligned_arena(arenas_on):
    shapes = [(3, 1000, 64), (3, 1000, 64), (17,), (2, 33)]
    ts = hugepages.zeros(shapes, torch.bfloat16)
    assert [tuple(t.shape) for t in ts] == shapes
    assert all(t.dtype == torch.bfloat16 and t.is_contiguous() and not t.any() for t in ts)
    assert all(t.data_ptr() % hugepages.ALIGN == 0 and _in_arena(t) for t in ts)
    assert ts[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the arena starts on a huge page
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in ts)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no overlap
    for i, t in enumerate(ts):
        t.fill_(i + 1)
    assert [t.float().mean().item() for t in ts] == [1, 2, 3, 4]
    resident, huge = hugepages.residency()
    assert resident >= sum(t.numel() * 2 for t in ts) and 0 <= huge <= resident
    mapping = hugepages._arenas[-1][0]
    del ts, t
    assert mapping() is None  # the last tensor gone, the mapping goes (and residency() skips it)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # tied: one tensor, two names
        self.only_embed = nn.Embedding(500, 64)
        self.register_buffer("table", torch.arange(4096, dtype=torch.int32))


@needs_madvise
def test_gather_moves_keeps_values_and_ties(arenas_on, tmp_path):
    torch.manual_seed(0)
    m = _Tied()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randint(0, 300, (5,))
    want = m.head(m.proj(m.embed(x)))
    moved = hugepages.gather(m, min_bytes=4096)
    assert moved >= (300 * 64 + 64 * 64) * 4 + 4096 * 4
    assert m.head.weight is m.embed.weight and isinstance(m.head.weight, nn.Parameter)
    assert _in_arena(m.embed.weight) and _in_arena(m.proj.weight) and _in_arena(m.table)
    assert not _in_arena(m.proj.bias)  # below min_bytes
    assert not _in_arena(m.only_embed.weight)  # a lookup table alone stays where it is
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    assert torch.equal(m.head(m.proj(m.embed(x))), want)
    # each tensor has a storage of its own: saved alone, not the arena
    state = {k: v for k, v in m.state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "m.safetensors"))
    assert all(torch.equal(v, state[k]) for k, v in load_file(str(tmp_path / "m.safetensors")).items())
    assert m.proj.weight.untyped_storage().nbytes() == 64 * 64 * 4


@needs_madvise
def test_kv_pool_in_an_arena(arenas_on):
    pool = KVPool(num_layers=3, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                  device="cpu")
    assert len(pool.k) == len(pool.v) == 3
    assert all(t.shape == (2, 128, 8) and not t.any() and _in_arena(t) for t in pool.k + pool.v)
    assert len({t.data_ptr() for t in pool.k + pool.v}) == 6
    slots = torch.tensor([0, 17, 127])
    k = torch.randn(3, 2, 8)
    pool.write(1, slots, k, -k)
    got_k, got_v = pool.read(1, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert not pool.k[0].any() and not pool.k[2].any()  # the other layers untouched


@needs_madvise
def test_loaded_model_decodes_the_same_ids(tiny_model_dir, monkeypatch):
    """The model in arenas (the loader gathers it) decodes token for token as in ordinary pages."""
    from hispec.generate import Generator
    from hispec.llm import LLM

    folder = str(tiny_model_dir("llama"))
    prompts = [[1, 5, 9, 2, 7], [3, 3, 8]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = {}
    for on in (False, True):
        monkeypatch.setattr(hugepages, "available", lambda on=on: on)
        monkeypatch.setattr(hugepages, "MIN_BYTES", 4096)  # the tiny model's matrices are 32 KiB
        gen = Generator.from_pretrained(folder, exits=False, progress=False)
        assert _in_arena(gen.model.layers[0].qkv_proj.weight) == on
        ids[on] = [o.token_ids for o in LLM(gen, "ar").generate(prompts, params)]
    assert ids[True] == ids[False]
