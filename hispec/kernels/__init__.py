"""hispec's CPU kernels and what chooses, builds, binds and plans them.

Layout (this package sits just above ``envs``/``config``: it imports nothing from ``cache``,
``model`` or higher; the model imports it):

- ``csrc/hispec_kernels.h``: every exported kernel's prototype and the shared enums (the matmul
  kinds of a layer plan). The one place a signature is written.
- ``csrc/*.c``: the kernels by job, compiled together into one library: ``norm_rope.c`` (RMSNorms,
  the SiLU gate, RoPE with the KV cache write), ``attention.c`` (paged attention),
  ``panel.c`` (dense float32 panel matmul), ``gguf.c`` (GGUF Q4/Q8 block matmuls); ``simd.h``
  holds what they share (internal, not exported).
- ``csrc/decode_op.cpp``: the torch op (a range of layers, a decode step, greedy steps in one
  call); it includes the header and links the same library.
- ``build.py``: the one build step (C library and torch op), cached by a hash of every source and
  header, the flags, the CPU (and the torch version for the op).
- ``binding.py``: the ctypes table, generated from the header's prototypes and enums.
- ``fused.py``: the kernels called one at a time from Python (checked tensors in, tensors out).
- ``layer_op.py``: the torch op's Python side (plans flattened, op ranges, decode steps, profile).
- ``plan.py``: the CPU fast path of a model: which layers and heads the op runs, and how (its
  calls are the model runner's: ``model/fast_path.py``).
- ``matmul.py``, ``quant.py``, ``norm.py``: the layers over these kernels (float32 routes;
  quantized weights and the 4-bit kernel choice; RMSNorm), which the model is built from.
  ``select.py``: the weight-format choice per CPU and the ``--stats`` description. ``timing.py``:
  interleaved medians. ``threads.py``: which thread computes (one OpenMP pool per process: a model
  loaded in a thread that ends, the computing thread's own thread count).

To add a kernel: declare it in ``csrc/hispec_kernels.h``, implement it in a ``csrc/*.c`` file (a
new file is compiled and hashed automatically), and call it from Python through
``binding.library().hs_NAME`` (its ctypes types come from the header; wrap it in ``fused.py`` or
a module of its own with tensor checks); the torch op calls it directly. Keep every row's result
independent of the other rows in the call (the lossless guarantee rests on it) and add a test
that checks it.
"""
