"""Which threads compute in a server: the model is loaded in a thread that ends and the engine thread
computes on the configured threads, so that it holds the process's only OpenMP pool
(hispec/kernels/threads.py; two pools made every parallel region a futex sleep and wake-up)."""
from __future__ import annotations

import asyncio
import threading

import pytest

for _mod in ("fastapi", "uvicorn"):
    pytest.importorskip(_mod)

import torch  # noqa: E402

from hispec.config import SamplingParams  # noqa: E402


def test_the_engine_thread_computes_on_the_bridges_threads(tiny_model_dir):
    """...also after the thread that started it turns PyTorch's default down to one thread, as
    hispec serve does (PyTorch sets a thread up from that default when it first computes)."""
    from hispec.engine import Engine
    from hispec.generate import make_strategy
    from hispec.model.load.checkpoint import load_model
    from hispec.server.async_engine import AsyncEngine

    engine = Engine(load_model(tiny_model_dir("llama")), make_strategy("ar"), kv_blocks=64, block_size=4)
    main_threads = torch.get_num_threads()
    bridge = AsyncEngine(engine, threads=2)
    seen = []
    prefill = engine._prefill

    def recording_prefill(*args, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return prefill(*args, **kwargs)

    engine._prefill = recording_prefill

    async def run():
        stream = bridge.submit(list(range(3, 20)), SamplingParams(max_new_tokens=2))
        while not (await stream.get()).finished:
            pass
        await asyncio.to_thread(bridge.stop)

    bridge.start()
    torch.set_num_threads(1)
    try:
        asyncio.run(run())
    finally:
        torch.set_num_threads(main_threads)
    assert seen and seen[0] == ("hispec-engine", 2), seen


def test_hispec_serve_loads_its_model_in_a_thread_that_ends(monkeypatch):
    import hispec.distributed as distributed
    from hispec.cli import build_parser
    from hispec.server.commands import cmd_serve

    loaded_in = []

    class Loaded(Exception):
        pass

    def fake_generator_from_args(args, *a, **k):
        loaded_in.append(threading.current_thread())
        raise Loaded

    monkeypatch.setattr(distributed, "generator_from_args", fake_generator_from_args)
    args = build_parser().parse_args(["serve", "--model", "default", "--port", "0"])
    with pytest.raises(Loaded):
        cmd_serve(args)
    assert loaded_in and loaded_in[0] is not threading.main_thread()
    assert not loaded_in[0].is_alive()
