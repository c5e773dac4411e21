"""kernels/threads.py: a function run in a thread that ends, and a thread's own parallel-region size."""
from __future__ import annotations

import threading

import pytest
import torch

from hispec.kernels.threads import in_own_thread, set_threads


def test_in_own_thread_returns_from_another_thread_that_ends():
    seen = []

    def work(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert in_own_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()


def test_in_own_thread_raises_its_exception_here():
    def fail():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        in_own_thread(fail)


def test_set_threads_is_the_calling_threads_own():
    before = torch.get_num_threads()
    inside = in_own_thread(lambda: (set_threads(1), torch.get_num_threads())[1])
    assert inside == 1
    assert torch.get_num_threads() == before  # this thread's setting is untouched
    set_threads(None)  # None leaves it
    assert torch.get_num_threads() == before


@pytest.fixture
def fresh_warning(monkeypatch):
    import hispec.kernels.threads as threads

    monkeypatch.setattr(threads, "_warned", False)


def _generate_in(thread_target) -> None:
    t = threading.Thread(target=thread_target)
    t.start()
    t.join()


def test_a_model_used_from_another_thread_than_its_living_loader_is_warned_of(tiny_model_dir, caplog,
                                                                               fresh_warning):
    from hispec.config import SamplingParams
    from hispec.generate import Generator

    gen = Generator.from_pretrained(str(tiny_model_dir("llama")), progress=False)
    params = SamplingParams(max_new_tokens=2)
    with caplog.at_level("WARNING", logger="hispec.kernels.threads"):
        gen.generate([3, 4, 5], params)  # the loading thread itself: nothing to say
        assert not caplog.records

        def other():
            set_threads(2)
            gen.generate([3, 4, 5], params)
            gen.generate([3, 4, 5], params)

        _generate_in(other)
    assert len(caplog.records) == 1  # once
    assert "loaded in thread" in caplog.text and "in_own_thread" in caplog.text


def test_a_model_loaded_in_a_thread_that_ended_is_not_warned_of(tiny_model_dir, caplog, fresh_warning):
    from hispec.config import SamplingParams
    from hispec.generate import Generator

    gen = in_own_thread(Generator.from_pretrained, str(tiny_model_dir("llama")), progress=False)

    def other():
        set_threads(2)
        gen.generate([3, 4, 5], SamplingParams(max_new_tokens=2))

    with caplog.at_level("WARNING", logger="hispec.kernels.threads"):
        _generate_in(other)
    assert not caplog.records
