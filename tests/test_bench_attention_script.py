"""scripts/bench-attention.py: it times every case asked for, and against another build of the
kernel library reports the ratio and the outputs' difference (tiny shapes here: no figures)."""
import subprocess
import sys
from pathlib import Path

import pytest

from hispec.kernels import build, fused

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench-attention.py"
SMALL = ["--heads", "4", "--kv-heads", "2", "--head-dim", "64", "--layers", "2", "--repeats", "2", "--calls", "1",
         "--threads", "1"]


def run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, *extra], capture_output=True, text=True)


def test_each_case_gets_a_line_and_against_itself_the_same_bits():
    if not fused.available():
        pytest.skip("hispec's kernels are not built here")
    out = run("--cases", "decode:2x40,verify:3x20,prefill:24", "--against", str(build.build_library()))
    assert out.returncode == 0, out.stderr
    lines = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [line[0] for line in lines] == ["decode:2x40", "verify:3x20", "prefill:24"]
    assert all(float(line[1]) > 0 and line[-1] == "0.0e+00" for line in lines)  # the same library: the same bits


def test_a_malformed_case_is_refused_by_name():
    out = run("--cases", "decode:2by40")
    assert out.returncode != 0 and "decode:2by40" in out.stderr
