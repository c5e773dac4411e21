"""Compiling the kernels for this CPU: one build step for the C library and the torch op.

Both are built on first use by the machine's compilers and cached under ``$HISPEC_HOME/kernels``
by a hash of everything that makes them (every source and header under ``csrc/``, the command's
flags, this CPU's instruction set; the op adds the torch version and the library it links), so a
changed source, flag or CPU builds anew and an unchanged one is loaded as it is.

- the C library (``csrc/*.c``, ``-O3 -march=native``: the instructions this CPU has, AVX2 or
  AVX-512, chosen by the compiler), loaded with ctypes (``binding.py``);
- the torch op (``csrc/decode_op.cpp``), compiled against the installed torch's headers and
  linked to that same library, loaded with ``torch.ops.load_library`` (``layer_op.py``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from .. import envs

CSRC = Path(__file__).with_name("csrc")
HEADER = CSRC / "hispec_kernels.h"
OP_SOURCE = CSRC / "decode_op.cpp"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
CXX_FLAGS = ["-O2", "-std=c++20", "-fPIC", "-shared", "-w"]


def c_sources() -> list[Path]:
    """The C library's translation units, in a fixed order."""
    return sorted(CSRC.glob("*.c"))


def _library_files() -> list[Path]:
    """What the C library is made of: its translation units and every header they may include."""
    return sorted([*c_sources(), *CSRC.glob("*.h")])


def cpu_key() -> str:
    """What identifies this CPU's instruction set (a library built for another CPU is not reused)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_dir() -> Path:
    return envs.HISPEC_HOME / "kernels"


def keep_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` (a choice kept per machine beside the kernels), whole or not
    at all: concurrent loads never read half a file; a path that cannot be written is left alone."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, path)
    except OSError:
        pass


def _key(files: list[Path], *parts: str) -> str:
    """The sha256 of ``files`` (names and bytes), ``parts`` and this CPU, 16 hex digits."""
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (*parts, cpu_key()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def library_key() -> str:
    """What identifies a build of the C kernels: their sources, the compiler flags and this CPU."""
    return _key(_library_files(), " ".join(FLAGS))


def library_path() -> Path:
    return build_dir() / f"libhispec_kernels-{library_key()}.so"


def _compiler(env: str, *names: str) -> str:
    found = os.environ.get(env) or next((p for p in map(shutil.which, names) if p), None)
    if found is None:
        raise RuntimeError(f"no compiler ({'/'.join(names)}) on PATH")
    return found


def build(out: Path, command) -> Path:
    """``out`` built unless it exists: ``command(tmp_out)`` (the argument list that writes the file
    ``tmp_out``) run in a folder beside it, its result moved in place whole (concurrent builders
    leave one complete file). Raises RuntimeError with the compiler's message when it fails."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        args = command(tmp_out)
        proc = subprocess.run(args, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)
    return out


def build_library() -> Path:
    """The C library for this CPU (built now if missing). Its soname is its file name, so the torch
    op that links it shares the copy ctypes loaded."""
    path = library_path()
    cc = _compiler("CC", "gcc", "cc")
    # absolute paths: q8act.c includes itself once per instruction set (#include __FILE__)
    sources = [str(p.resolve()) for p in c_sources()]
    return build(path, lambda tmp: [cc, *FLAGS, *sources, "-o", str(tmp), f"-Wl,-soname,{path.name}", "-lm"])


def op_path() -> Path:
    """Where the torch op for these sources, this torch version, this CPU and library is built."""
    import torch

    key = _key([OP_SOURCE, *_library_files()], " ".join(CXX_FLAGS), torch.__version__, library_key())
    return build_dir() / f"hispec_op-{key}.so"


def build_op() -> Path:
    """The torch op (built now if missing), linked to :func:`build_library`'s library."""
    import torch
    from torch.utils import cpp_extension

    lib = build_library()
    cxx = _compiler("CXX", "g++", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return build(op_path(), lambda tmp: [
        cxx, *CXX_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{CSRC}",
        *(f"-I{p}" for p in cpp_extension.include_paths()), str(OP_SOURCE), "-o", str(tmp),
        f"-L{lib.parent}", f"-l:{lib.name}", "-Wl,-rpath,$ORIGIN",
        *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu"])
