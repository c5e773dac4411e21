"""hispec.kernels.matmul.linear: the CPU fast paths compute F.linear (up to float rounding)."""
import copy

import pytest
import torch
from torch.nn import functional as F

from hispec.kernels import fused, matmul
from hispec.kernels.matmul import SMALL_ROWS, Linear, linear


@pytest.mark.parametrize("route", matmul.ROUTES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, SMALL_ROWS, SMALL_ROWS + 1, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_f_linear(rows, bias, route, monkeypatch):
    monkeypatch.setattr(matmul, "small_route", lambda: route)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    out = linear(x, w, b)
    assert out.shape == (rows, 96) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_linear_leading_dims_and_strided_input():
    w = torch.randn(24, 16)
    x = torch.randn(3, 5, 32)[..., ::2]  # [3, 5, 16], not contiguous
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x[:1, :1], w), F.linear(x[:1, :1], w), rtol=1e-5, atol=1e-5)


def test_linear_module_keeps_nn_linear_state_and_autograd():
    m = Linear(8, 4)
    assert set(m.state_dict()) == {"weight", "bias"}
    x = torch.randn(2, 8, requires_grad=True)
    m(x).sum().backward()  # training goes through F.linear
    assert x.grad is not None and m.weight.grad is not None
    with torch.inference_mode():
        torch.testing.assert_close(m(x.detach()), F.linear(x.detach(), m.weight, m.bias))


def test_other_dtypes_fall_back():
    w = torch.randn(8, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.equal(linear(x, w), F.linear(x, w))


@pytest.mark.skipif(not matmul.PREPACK, reason="no oneDNN weight reordering in this torch")
@pytest.mark.parametrize("rows", [SMALL_ROWS + 1, 16, 33, 300])
def test_prepacked_linear_matches_and_follows_its_weight(rows, monkeypatch):
    monkeypatch.setattr(matmul, "panel_rows", lambda: 0)
    m = Linear(40, 96)
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        assert m in matmul._packs  # the blocked copy was made ...
        assert set(m.state_dict()) == {"weight", "bias"}  # ... outside the module's state
        m.weight.mul_(2)  # changed in place: the copy is remade
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    m.weight = torch.nn.Parameter(torch.randn(96, 40))  # replaced
    twin = copy.deepcopy(m)
    with torch.inference_mode():
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(twin(x), m(x))


@pytest.mark.skipif(not matmul.PREPACK, reason="no oneDNN weight reordering in this torch")
@pytest.mark.parametrize("route", ["onednn", "panel"])
def test_prepacking_respects_its_memory_budget(route, monkeypatch):
    monkeypatch.setattr(matmul, "PREPACK_FRACTION", 0.0)
    monkeypatch.setattr(matmul, "panel_rows", lambda: matmul.PANEL_ROWS if route == "panel" else 0)
    m = Linear(40, 96)
    with torch.inference_mode():
        x = torch.randn(20, 40)
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
    assert m not in matmul._packs and m not in matmul._panels


needs_kernels = pytest.mark.skipif(not fused.available(), reason="no C compiler for the fused kernels")


@needs_kernels
@pytest.mark.parametrize("rows", [SMALL_ROWS + 1, 16, 33, matmul.PANEL_DECODE_ROWS])
def test_panel_linear_matches_and_follows_its_weight(rows, monkeypatch):
    monkeypatch.setattr(matmul, "panel_rows", lambda: matmul.PANEL_DECODE_ROWS)
    m = Linear(40, 100)  # 100 outputs: full panels (of 48, or 16 on AVX2) and a padded one
    x = torch.randn(rows, 40)
    with torch.inference_mode():
        y = m(x)
        torch.testing.assert_close(y, F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        assert m in matmul._panels and m not in matmul._packs
        assert torch.equal(m(torch.cat([x[1:], x[:1]]))[:-1], y[1:])  # a row's values: not where it sits in the call
        if rows > 2 * SMALL_ROWS:
            assert torch.equal(m(x[:SMALL_ROWS + 1]), y[:SMALL_ROWS + 1])  # nor the call's row count
        m.weight.mul_(2)  # changed in place: the copy is remade
        torch.testing.assert_close(m(x), F.linear(x, m.weight, m.bias), rtol=1e-5, atol=1e-5)
        big = torch.randn(matmul.PANEL_DECODE_ROWS + 1, 40)  # above the panel range: oneDNN (where prepacking is)
        torch.testing.assert_close(m(big), F.linear(big, m.weight, m.bias), rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("n,k", [(48, 16), (100, 40), (7, 33)])
def test_panel_matmul_rows_are_independent_of_the_call(n, k):
    """Each output is one multiply-add chain over K: the same bits for any number of rows."""
    g = torch.Generator().manual_seed(n)
    w, x = torch.randn(n, k, generator=g), torch.randn(19, k, generator=g)
    packed = fused.panel_pack(w)
    p = fused.panel_width()
    assert p in (16, 48) and packed.shape == (-(-n // p), k, p)
    y = fused.panel_matmul(x, packed, n)
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-5)
    for t in (1, 3, 5, 6, 7, 8, 9, 13):
        assert torch.equal(fused.panel_matmul(x[-t:].clone(), packed, n), y[-t:])


def test_panel_rows_are_measured_or_forced(monkeypatch):
    matmul.panel_rows.cache_clear()
    try:
        monkeypatch.setenv("HISPEC_BATCH_MATMUL", "onednn")
        assert matmul.panel_rows() == 0
        matmul.panel_rows.cache_clear()
        monkeypatch.setenv("HISPEC_BATCH_MATMUL", "panel")
        assert matmul.panel_rows() == matmul.PANEL_ROWS
        matmul.panel_rows.cache_clear()
        monkeypatch.delenv("HISPEC_BATCH_MATMUL")
        assert matmul.panel_rows() in (0, matmul.PANEL_DECODE_ROWS, matmul.PANEL_ROWS)
    finally:
        matmul.panel_rows.cache_clear()


def test_small_route_is_measured_or_forced(monkeypatch):
    """Decode-sized products take whichever route this CPU runs faster (MKL's matrix-vector path is
    slow on one AMD EPYC and fast on one Intel Xeon), unless HISPEC_SMALL_MATMUL names one."""
    matmul.small_route.cache_clear()
    try:
        monkeypatch.setenv("HISPEC_SMALL_MATMUL", "wxt")
        assert matmul.small_route() == "wxt"
        matmul.small_route.cache_clear()
        monkeypatch.delenv("HISPEC_SMALL_MATMUL")
        assert matmul.small_route() in matmul.ROUTES
    finally:
        matmul.small_route.cache_clear()


def test_timed_routes_are_kept_per_machine(monkeypatch, tmp_path):
    """A route timed once is kept on disk and reused by later processes (no timing at a fresh
    process's first use); a kept value that is not a valid route is timed again."""
    monkeypatch.setattr(matmul.build, "build_dir", lambda: tmp_path)
    assert matmul._kept("route", ("a", "b"), lambda: "b") == "b"
    assert matmul._kept("route", ("a", "b"), lambda: pytest.fail("timed again")) == "b"
    assert matmul._kept("rows", (0, 64), lambda: 64) == 64  # another name beside it
    assert matmul._kept("route", ("a", "b"), lambda: "x") == "b"
    matmul._routes_file().write_text('{"route": "gone"}')
    assert matmul._kept("route", ("a", "b"), lambda: "a") == "a"
    matmul._routes_file().write_text("not json")
    assert matmul._kept("route", ("a", "b"), lambda: "b") == "b"


def test_choose_routes_times_only_for_float32_linears(monkeypatch):
    calls = []
    monkeypatch.setattr(matmul, "small_route", lambda: calls.append("small"))
    monkeypatch.setattr(matmul, "panel_rows", lambda: calls.append("panel"))
    matmul.choose_routes(torch.nn.Sequential(torch.nn.Linear(4, 4)))  # not hispec's Linear: nothing to choose
    assert calls == []
    matmul.choose_routes(torch.nn.Sequential(Linear(4, 4)))
    assert calls == ["small", "panel"]
