"""The C library loaded with ctypes, each function bound as ``csrc/hispec_kernels.h`` declares it.

The header is the one place a kernel's signature is written: :func:`signatures` reads its
prototypes (argument types and return type by name), :func:`enum` its enums, and :func:`library`
sets every exported function's ``argtypes``/``restype`` from them, so a kernel added to the
header is bound without another list to keep in step.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import re

from .. import envs
from . import build

log = logging.getLogger(__name__)

# C parameter / return types the header may use -> ctypes (every pointer is a c_void_p)
_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^(void|int64_t|int)\s+(hs_\w+)\s*\(([^)]*)\)\s*;", re.M | re.S)
_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def _header() -> str:
    return _COMMENT.sub(" ", build.HEADER.read_text())


def _ctype(param: str):
    """``const float *x`` -> c_void_p, ``int64_t T`` -> c_int64, ``void`` (no parameters) -> None."""
    if "*" in param:
        return ctypes.c_void_p
    words = param.replace("const ", " ").split()
    if words == ["void"]:
        return None
    if len(words) != 2 or words[0] not in _SCALARS:
        raise ValueError(f"hispec_kernels.h: parameter {param.strip()!r} of an unsupported type")
    return _SCALARS[words[0]]


@functools.lru_cache(maxsize=1)
def signatures() -> dict[str, tuple[list, object]]:
    """Every function the header declares: name -> (argtypes, restype), from its prototypes."""
    table = {}
    for ret, name, params in _PROTOTYPE.findall(_header()):
        args = [_ctype(p) for p in params.split(",")]
        table[name] = ([a for a in args if a is not None], None if ret == "void" else _SCALARS[ret])
    if not table:
        raise ValueError("hispec_kernels.h: no prototypes found")
    return table


def enum(name: str) -> dict[str, int]:
    """The members of ``enum name { A = 0, B = 1, ... }`` in the header (explicit values only)."""
    body = re.search(rf"enum\s+{name}\s*\{{([^}}]*)\}}", _header())
    if body is None:
        raise ValueError(f"hispec_kernels.h: no enum {name}")
    return {k: int(v) for k, v in re.findall(r"(\w+)\s*=\s*(\d+)", body.group(1))}


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernels with every function of the header bound, or None (no compiler, a failed
    build, ``HISPEC_FUSED=0``)."""
    if not envs.HISPEC_FUSED:
        return None
    try:
        lib = ctypes.CDLL(str(build.build_library()))
    except (OSError, RuntimeError) as e:
        log.warning("fused CPU kernels unavailable, using the eager PyTorch path: %s", e)
        return None
    for name, (args, ret) in signatures().items():
        fn = getattr(lib, name)  # AttributeError: declared in the header, not defined in csrc/
        fn.argtypes, fn.restype = args, ret
    return lib


def available() -> bool:
    return library() is not None
