"""Tensor parallelism over ``torch.distributed`` (NCCL on CUDA, gloo on CPU).

- ``comm.py``: the process group, collectives with timeouts, counters
- ``layers.py``: row-parallel linear, vocabulary-parallel embedding and output head
- ``shard.py``: which slice each rank holds; a rank's model from safetensors slices or a built model
- ``runtime.py``: rank 0 leads (runs hispec as in one process), the other ranks follow its model calls
- ``generator.py``: a ``Generator`` on a group (``--tensor-parallel-size N``), and the one the command
  line's options describe (``generator_from_args``)
"""
from .comm import Comm, CommCounter, TensorParallelError, split_range
from .generator import generator_from_args, tp_generator
from .runtime import start_group

__all__ = ["Comm", "CommCounter", "TensorParallelError", "split_range", "generator_from_args", "start_group",
           "tp_generator"]
