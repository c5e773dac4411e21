"""The kernels' one binding table: the header declares every function the C files export, the
ctypes types are those of its prototypes, and the build key follows every source and header."""
import ctypes
import re
import shutil

import pytest

from hispec.kernels import binding, build, layer_op


def _defined() -> set[str]:
    """The ``hs_`` functions the C files define with external linkage (not ``static``)."""
    found = set()
    for path in build.c_sources():
        found |= set(re.findall(r"^(?:void|int64_t|int)\s+(hs_\w+)\s*\(", path.read_text(), re.M))
    return found


def test_the_header_declares_every_exported_kernel():
    declared = set(binding.signatures())
    internal = set(re.findall(r"visibility\(\"hidden\"\)\)\)\s+\w+\s+(hs_\w+)", (build.CSRC / "simd.h").read_text()))
    assert _defined() - internal == declared


def test_signatures_are_read_from_the_prototypes():
    table = binding.signatures()
    p, i64, f, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    assert table["hs_rms_norm"] == ([p, p, i64, i64, f, p, i], None)
    assert table["hs_panel_width"] == ([], i64)
    assert table["hs_attention_bf16_products"] == ([], i)
    assert table["hs_paged_attention"][0] == [p, p, p, i, p, i64, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, f, p, i,
                                              i]


@pytest.mark.skipif(not binding.available(), reason="no C compiler for the kernels")
def test_the_library_is_bound_from_the_header():
    lib = binding.library()
    for name, (args, ret) in binding.signatures().items():
        assert getattr(lib, name).argtypes == args and getattr(lib, name).restype == ret, name


def test_matmul_kinds_come_from_the_header():
    kinds = binding.enum("hs_matmul_kind")
    assert len(kinds) == 15 and sorted(kinds.values()) == list(range(15))
    assert (layer_op.MM_Q4, layer_op.MM_PANEL, layer_op.MM_DENSE_BF16) == (
        kinds["HS_MM_Q4"], kinds["HS_MM_PANEL"], kinds["HS_MM_DENSE_BF16"])


def test_unsupported_parameter_types_are_refused():
    with pytest.raises(ValueError, match="unsupported type"):
        binding._ctype("double x")


def test_the_build_key_follows_every_source_and_header(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(build.CSRC, csrc)
    monkeypatch.setattr(build, "CSRC", csrc)
    keys = set()
    for name in ("hispec_kernels.h", "simd.h", "gguf.c"):
        build.library_key.cache_clear()
        keys.add(build.library_key())
        (csrc / name).write_text((csrc / name).read_text() + "\n/* changed */\n")
    (csrc / "extra.c").write_text("/* a new file */\n")
    build.library_key.cache_clear()
    keys.add(build.library_key())
    build.library_key.cache_clear()
    assert len(keys) == 4
