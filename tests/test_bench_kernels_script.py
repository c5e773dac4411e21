"""scripts/bench-kernels-step.c, the C driver of scripts/bench-kernels.py: it builds against the
kernel library and times every kernel and row count asked for (tiny shapes here: no figures)."""
import shutil
import subprocess
from pathlib import Path

import pytest

from hispec.kernels import build, fused

SOURCE = Path(__file__).resolve().parents[1] / "scripts" / "bench-kernels-step.c"


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_c_driver_times_each_kernel_and_row_count(tmp_path):
    if not fused.available():
        pytest.skip("hispec's kernels are not built here")
    lib = build.build_library()
    exe = tmp_path / "step"
    subprocess.run(["cc", "-O2", "-I", str(build.CSRC), str(SOURCE), str(lib), f"-Wl,-rpath,{lib.parent}", "-o",
                    str(exe)], check=True)
    out = subprocess.run([str(exe), "2", "64", "96", "64", "64", "64", "160", "96", "64", "64", "320", "1,3,4", "3",
                          "q4", "q8a:0", "q8a:1"], check=True, capture_output=True, text=True).stdout.split("\n")
    lines = [line.split() for line in out if line.strip()]
    assert [(k, int(t)) for k, t, _, _ in lines] == [(k, t) for k in ("q4", "q8a:0", "q8a:1") for t in (1, 3, 4)]
    assert all(float(step) >= float(head) > 0 for _, _, step, head in lines)
    bad = subprocess.run([str(exe), "2"], capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr
