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
