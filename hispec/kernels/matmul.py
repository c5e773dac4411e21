"""Linear layers in the layout that is fastest on CPU for decode-sized inputs.

On the 2-core AMD EPYC test machine, with the MKL that ships in the torch CPU wheel, ``F.linear``
(``x @ W.T``) on a few rows runs at a fraction of memory bandwidth. Two other routes to the same
product are faster: ``(W @ x.T).T`` (MKL's other GEMM layout; a single row must be padded to two,
or it goes down MKL's slow matrix-vector path) and oneDNN's linear kernel on the same dense
weights. Measured over the 120 decoder matmuls of SmolLM2-135M (weights far larger than the
cache, float32, 2 threads, ms per pass, outputs made contiguous):

    rows             1     2     4     6     8    12    16    48    64   256  1024
    F.linear        35    59    46    39    41    46    49    84   104   323  1167
    (W @ x.T).T     15    15    22    31    34    55    43    79    98   420  1714   (1 row padded)
    oneDNN          21    23    26    28    29    33    37    71    86   275  1035

On a 2-core Intel Xeon (AVX512-BF16, AMX) the same MKL's matrix-vector path is fast and the
other layout is not (same 120 matmuls, ms per pass; oneDNN on the prepacked weight, see below):

    rows             1     2     4     8    16
    F.linear        17    19    30    35    42
    (W @ x.T).T     43    45    43    45    45   (1 row padded)
    oneDNN          22    23    24    28    33

So for up to ``SMALL_ROWS`` rows (decode steps, short verification windows) :func:`linear` takes
the faster of ``F.linear`` and ``(W @ x.T).T`` on this CPU (:func:`small_route`: timed once per
process on weights larger than the cache; a :class:`Linear` may also take the panel kernel below,
which streams the weight at memory bandwidth where MKL does not: on a 2-core AMD EPYC Zen 3, 120
decoder matmuls at 1 row, ``(W @ x.T).T`` 41.7 ms, ``F.linear`` 46.6, panel 25.2), and oneDNN above (batched steps, prefill), on CPU in
float32; ``F.linear`` otherwise (other devices and dtypes, autograd, or a torch without oneDNN).
The values agree with ``F.linear`` up to float rounding (different summation order, |diff| ~ 1e-5
on unit-scale inputs).

Above ``SMALL_ROWS`` a :class:`Linear` runs oneDNN on a copy of its weight reordered once into
oneDNN's blocked layout for 16 rows (``mkldnn._reorder_linear_weight``): the same values, the same
kernel family, but no per-call reorder. Over the same 120 matmuls (2 threads, ms per pass, medians):

    rows                  8    16    32    64   512
    oneDNN, dense W      44    49    74   115   626
    oneDNN, prepacked    25    29    48    93   599

That is batched decode steps ~1.7x faster and prefill ~5%. The copy costs the weight's memory once
more, so it is made on first use only while all copies together stay under ``PREPACK_FRACTION`` of
the machine's memory (float32 SmolLM2-135M: ~540 MB), and follows the weight (remade when the
weight is replaced or changed in place). ``HISPEC_PREPACK=0`` turns it off.

Above ``SMALL_ROWS`` rows a third kernel may serve instead: ``fused.panel_matmul``, hispec's own,
on a copy of the weight in panels of 48 output columns (same budget as above). Every output is one
fused multiply-add chain over K, so a row's values do not depend on how many rows share the call.
On the 2-core AMD EPYC (Zen 4) test machine, over the decoder matmuls' shapes (GFLOP/s, medians,
2 threads, interleaved):

    rows                  8    16    64   128   256  1024
    oneDNN, prepacked    67   100   161   169   198   208
    panel kernel        103   126   185   194   211   211

How far it serves is decided once per process by timing both on 16 and on 256 rows
(:func:`panel_rows`: up to ``PANEL_ROWS`` rows if it wins both, up to ``PANEL_DECODE_ROWS`` if it
wins on 16 only, else never; ``HISPEC_BATCH_MATMUL=panel|onednn`` forces it), since CPUs differ
(the kernel has an AVX-512 tile of 8 rows x 48 columns, an AVX2 one of 6 x 16 on panels 16 wide,
and a plain loop elsewhere). On a 2-core AMD EPYC Zen 3 (AVX2, no AVX-512), same shapes:

    rows                 16   256
    oneDNN, prepacked    37   109
    panel kernel         58   105
"""
from __future__ import annotations

import functools
import json
import os
import weakref

import torch
from torch import nn
from torch.nn import functional as F

from .. import envs
from . import build, fused
from .timing import interleaved_medians


SMALL_ROWS = 4
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
PREPACK = (_ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
           and envs.HISPEC_PREPACK)
PREPACK_FRACTION = 0.25
PACK_ROWS = 16  # the row count oneDNN's blocked layout is chosen for; it serves 5-512 rows well (table above)
PANEL_DECODE_ROWS = 64  # batched decode steps and verification windows
PANEL_ROWS = 512  # and prefill chunks (the engine's default chunk: 256): see panel_rows
_packs: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()
_panels: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor]]" = weakref.WeakKeyDictionary()


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _packed(module: nn.Module, weight: torch.Tensor, copies=_packs) -> torch.Tensor | None:
    """The oneDNN-blocked copy of ``weight [N, K]`` kept for ``module`` (or, with ``copies=_panels``,
    its panel-kernel copy), made now if the budget allows; None when it does not. Kept outside the
    module (no state-dict key, not deep-copied)."""
    key = (weight.data_ptr(), weight._version, tuple(weight.shape))
    entry = copies.get(module)
    if entry is not None and entry[0] == key:
        return entry[1]
    copies.pop(module, None)
    held = sum(p.numel() * p.element_size() for d in (_packs, _panels) for _, p in d.values())
    if held + weight.numel() * weight.element_size() > PREPACK_FRACTION * _memory_bytes():
        return None
    with torch.no_grad():
        if copies is _panels:
            packed = fused.panel_pack(weight.detach())
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
    copies[module] = (key, packed)
    return packed


BATCHED_ROUTES = ("panel", "onednn")


def _routes_file():
    """Where the timed routes are kept on this machine, per build of the C kernels (sources, flags,
    CPU) and torch version, as the 4-bit kernel's choice is (``quant._four_bit_choice_file``)."""
    return build.build_dir() / f"matmul-routes-{build.library_key()}-torch{torch.__version__}.json"


def _kept(name: str, allowed: tuple, timed):
    """The route ``name`` as kept on this machine (one of ``allowed``), else ``timed()`` now, kept
    for later processes: timing at the first use cost a fresh process ~0.15 s (a CLI run's first
    exit round), and a route kept makes the same command give the same bits from one run to the
    next (routes round differently)."""
    path = _routes_file()
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    if kept.get(name) in allowed:
        return kept[name]
    kept[name] = value = timed()
    build.keep_json(path, kept)
    return value


@functools.lru_cache(maxsize=1)
def panel_rows() -> int:
    """Up to how many rows float32 products above ``SMALL_ROWS`` take the panel kernel on this CPU
    (0: never), decided once per process: ``HISPEC_BATCH_MATMUL=panel|onednn`` if set; 0 when the
    kernel cannot run (no compiled kernels) or weight copies are off (``HISPEC_PREPACK=0``: the panel
    layout is a copy too); else both kernels timed (interleaved, medians of 5) on 16 and on 256 rows
    against 8 weights of a SmolLM2 MLP's size, once per machine (kept: ``_kept``)."""
    forced = envs.HISPEC_BATCH_MATMUL
    if forced in BATCHED_ROUTES:
        return PANEL_ROWS if forced == "panel" else 0
    if not (PREPACK and fused.available()):
        return 0
    return _kept("panel_rows", (0, PANEL_DECODE_ROWS, PANEL_ROWS), _time_panel_rows)


def _time_panel_rows() -> int:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=g) for _ in range(8)]
    with torch.no_grad():
        dnn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights]
        panels = [fused.panel_pack(w) for w in weights]
        wins = []
        for rows in (16, 256):
            x = torch.randn(rows, 576, generator=g)
            med = interleaved_medians({
                "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [None], "") for w in dnn],
                "panel": lambda: [fused.panel_matmul(x, p, 3072) for p in panels]}, reps=5, warmup=1)
            wins.append(med["panel"] < med["onednn"])
    return PANEL_ROWS if all(wins) else PANEL_DECODE_ROWS if wins[0] else 0


ROUTES = ("wxt", "linear", "panel")  # decode-sized float32 products: (W @ x.T).T (one row padded to two),
#                                     F.linear, or the panel kernel on the weight's panel copy (Linear only)


@functools.lru_cache(maxsize=1)
def small_route() -> str:
    """The faster route for decode-sized float32 products on this CPU, decided once per process:
    ``HISPEC_SMALL_MATMUL=wxt|linear|panel`` if set, else the routes timed (interleaved, medians of
    5) on one row against 8 weights of a SmolLM2 MLP's size (56 MB, more than a cache holds), once
    per machine (kept: ``_kept``); ``panel`` only where the kernels are built and weight copies
    allowed. Where a ``Linear`` gets no panel copy (over the memory budget) and for :func:`linear`,
    ``panel`` computes as ``wxt``."""
    forced = envs.HISPEC_SMALL_MATMUL
    if forced in ROUTES:
        return forced
    can_panel = PREPACK and fused.available()
    return _kept("small_route" if can_panel else "small_route_no_panel", ROUTES if can_panel else ROUTES[:2],
                 _time_small_route)


def _time_small_route() -> str:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(3072, 576, generator=g) for _ in range(8)]
    x = torch.randn(1, 576, generator=g)
    with torch.no_grad():
        routes = {"wxt": lambda: [(w @ torch.cat([x, x]).T).T[:1].contiguous() for w in weights],
                  "linear": lambda: [F.linear(x, w) for w in weights]}
        if PREPACK and fused.available():
            panels = [fused.panel_pack(w) for w in weights]
            routes["panel"] = lambda: [fused.panel_matmul(x, p, 3072) for p in panels]
        med = interleaved_medians(routes, reps=5, warmup=1)
    return min(med, key=med.get)


def choose_routes(model: nn.Module) -> None:
    """Time this CPU's kernel choices now (~1 s, once per process) if ``model`` has float32
    ``Linear`` layers on the CPU, so the first prefill or batched step does not pay for it."""
    if any(type(m) is Linear and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"
           for m in model.modules()):
        small_route()
        panel_rows()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias[N])`` -> ``[..., N]``, contiguous."""
    if (x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous()
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [T, K]
    t = rows.shape[0]
    if t == 0:
        return F.linear(x, weight, bias)
    if t > SMALL_ROWS:
        if not _ONEDNN:
            return F.linear(x, weight, bias)
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [None], "")
        return out.reshape(*lead, weight.shape[0])
    if small_route() == "linear":
        return F.linear(rows, weight, bias).reshape(*lead, weight.shape[0])
    # wxt (also for "panel", which needs a Linear's panel copy)
    if t == 1:
        rows = torch.cat([rows, rows])  # [2, K]: keeps MKL off its slow matrix-vector path
    out = (weight @ rows.T).T[:t]  # [T, N], a column-major view
    out = (out + bias if bias is not None else out).contiguous()
    return out.reshape(*lead, weight.shape[0])


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state-dict keys) computed by :func:`linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (PREPACK and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32 and w.is_contiguous()
                and x.numel() > 0 and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            rows = x.reshape(-1, x.shape[-1]).contiguous()  # [T, K]
            t = rows.shape[0]
            if fused.available() and (t <= panel_rows() if t > SMALL_ROWS else small_route() == "panel"):
                panel = self.panel()
                if panel is not None:
                    out = fused.panel_matmul(rows, panel, w.shape[0])
                    out = out if self.bias is None else out + self.bias
                    return out.reshape(*x.shape[:-1], w.shape[0])
            if t > SMALL_ROWS:
                packed = _packed(self, w)
                if packed is not None:
                    out = torch.ops.mkldnn._linear_pointwise(rows, packed, self.bias, "none", [None], "")
                    return out.reshape(*x.shape[:-1], w.shape[0])
        return linear(x, w, self.bias)

    def panel(self) -> torch.Tensor | None:
        """The weight's panel copy for ``fused.panel_matmul`` (made now if the budget allows), or None."""
        return _packed(self, self.weight, _panels)
