"""Choose L_d, L_i, N_d, N_i and the draft policy by measurement (``hispec tune``).

Two measurements, then an exact-enough simulation:

1. *Costs*: wall time of one forward call through ``l`` decoder layers for ``n`` new tokens
   (``overhead(n) + l * per_layer(n)``), of each exit head and of the final head for ``n``
   tokens, on this machine, at a typical context length.
2. *Traces*: the model's own greedy continuations of calibration prompts, teacher-forced
   once; at every position the argmax and the entropy of every candidate exit.

With greedy decoding a draft is accepted iff it equals the verifier's argmax at that
position, and every accepted prefix lies on the final trajectory, so replaying the traces
gives the acceptance pattern of every configuration exactly (after the first rejection
within a round only the count of wasted work matters, which is approximated from the
same positions). Each configuration's time is its phases' counts times the measured costs.
The best few can then be checked end to end, interleaved with ``ar`` (``--validate``).

Token trees (``tree_width``, ``tree_min_prob``) are simulated from the same traces: each exit's
top candidates and their probabilities at every position give the runners-up a round would add
(those whose branch the exit rates at least ``tree_min_prob``, or, where that is None, at least
a row's measured cost relative to a plain step); a round whose chain breaks at a
position where the reference token is among them accepts that runner-up too. Their cost is one
more pass of those rows through the draft layers and that many more verification rows, at the
measured per-row costs: the tree budget that pays on this machine is chosen by the same search.
"""
from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import KVPool
from ..config import DraftPolicyName, SpecConfig
from ..model.runner import LayerRunner
from ..spec.proposers.exit_policies import DraftConfidence, DraftPolicy, make_policy
from ..settings import StrategyName
from ..spec.proposers.exit import branch_threshold
from ..engine.engine import EngineConfig
from .collect import greedy_continuations
from .teacher import exit_logits_along


# ---- costs ---------------------------------------------------------------------------------
@dataclass
class CostModel:
    """Seconds per call: ``overhead[n] + layers * per_layer[n]``, heads per layer and ``n``."""

    per_layer: dict[int, float]  # n tokens -> seconds per decoder layer
    overhead: dict[int, float]  # n tokens -> seconds per forward call (embedding, metadata, ...)
    head: dict[int, dict[int, float]]  # exit layer -> n -> seconds (final head under num_layers)
    num_layers: int
    sampling: float = 0.0  # per verification (argmax, accept, truncate)

    def forward(self, layers: int, n: int) -> float:
        n = self._n(n)
        return self.overhead[n] + layers * self.per_layer[n] if layers > 0 else 0.0

    def exit(self, layer: int, n: int) -> float:
        return self.head[layer][self._n(n)]

    def _n(self, n: int) -> int:
        n = max(1, n)
        if n in self.per_layer:
            return n
        return min(self.per_layer, key=lambda m: (abs(m - n), -m))

    def row_share(self) -> float:
        """One more row of a full-model pass as a share of a one-row pass (``RowCost.relative``'s
        figure at batch 1): what ``tree_min_prob=None`` weighs runners-up against."""
        one = self.forward(self.num_layers, 1) + self.exit(self.num_layers, 1)
        two = self.forward(self.num_layers, 2) + self.exit(self.num_layers, 2)
        return max(0.0, two - one) / one if one > 0 else 0.0

    def ar_token(self) -> float:
        return self.forward(self.num_layers, 1) + self.exit(self.num_layers, 1)

    def to_dict(self) -> dict:
        ms = lambda d: {str(k): round(v * 1e3, 3) for k, v in d.items()}  # noqa: E731
        return {"per_layer_ms": ms(self.per_layer), "overhead_ms": ms(self.overhead),
                "head_ms": {str(L): ms(v) for L, v in self.head.items()}, "sampling_ms": round(self.sampling * 1e3, 3)}


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@torch.inference_mode()
def measure_costs(model, token_counts=tuple(range(1, 11)), context: int = 256, repeat: int = 9,
                  block_size: int | None = None) -> CostModel:
    """Time forward calls and exit heads for each token count ``n`` at ``context`` cached positions
    (in the engine's KV layout: ``block_size`` as the engine's by default). An exit block costs
    one decoder layer plus its output head."""
    n_layers = model.num_layers
    max_n = max(token_counts)
    bs = block_size or EngineConfig().block_size
    blocks = BlockManager(-(-(context + max_n) // bs) + 1, bs, n_layers, model.kv_layers - n_layers)
    pool = KVPool(model.kv_layers, blocks.num_blocks, bs, model.cfg.num_kv_heads, model.cfg.head_dim, model.kv_dtype,
                  model.device)
    runner = LayerRunner(model, blocks, pool)
    blocks.add_sequence(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (context + max_n,), generator=g).to(model.device)
    runner.forward(0, 0, ids[:context], 0, n_layers)
    a, b = 1, n_layers  # forward calls through 1 and through all layers: overhead + l * per_layer
    H = model.cfg.hidden_size
    exits = dict(model.exits)
    heads = {L: exits[L] for L in sorted(exits)}
    hidden = {n: torch.randn(n, H, generator=g).to(model.device, model.dtype) for n in token_counts}

    def run(layers: int, n: int) -> None:
        runner.forward(0, context, ids[context:context + n], 0, layers)
        blocks.truncate(0, context)

    def head_fn(L: int, n: int):
        if L == n_layers:
            return lambda: model.final_logits(hidden[n]).argmax(-1)
        if getattr(heads[L], "has_kv", False):
            return lambda: heads[L].logits(hidden[n]).argmax(-1)  # + one layer, added below
        return lambda: heads[L](hidden[n]).argmax(-1)

    run(b, max_n)  # warm-up
    samples: dict[tuple, list[float]] = {}
    for _ in range(repeat):  # interleaved, so a busy spell on the machine hits every measurement alike
        for n in token_counts:
            for key, fn in ((("fwd", a, n), lambda n=n: run(a, n)), (("fwd", b, n), lambda n=n: run(b, n))):
                samples.setdefault(key, []).append(_median_time(fn, 1))
            for L in list(heads) + [n_layers]:
                samples.setdefault(("head", L, n), []).append(_median_time(head_fn(L, n), 1))
    # Medians per token count, not a fitted line: on CPU the cost is not monotonic in n (MKL
    # runs 2- and 3-row GEMMs slower than 4-row ones), and the search should see that.
    med = {k: statistics.median(v) for k, v in samples.items()}
    per_layer = {n: max(1e-7, (med[("fwd", b, n)] - med[("fwd", a, n)]) / (b - a)) for n in token_counts}
    overhead = {n: max(0.0, med[("fwd", a, n)] - a * per_layer[n]) for n in token_counts}
    head = {L: {n: med[("head", L, n)] + (per_layer[n] if getattr(heads.get(L), "has_kv", False) else 0.0)
                for n in token_counts} for L in list(heads) + [n_layers]}
    logits = torch.randn(5, model.cfg.vocab_size, generator=g).to(model.device)
    from ..sampling.speculative import accept_chosen
    drafts = logits[:4].argmax(-1)
    sampling = _median_time(lambda: accept_chosen(drafts, logits.argmax(-1)), repeat)
    blocks.free(0)
    return CostModel(per_layer, overhead, head, n_layers, sampling)


# ---- traces ---------------------------------------------------------------------------------
TREE_TOP = 4  # each exit's candidates kept per position: tree widths up to this are simulated


@dataclass
class Trace:
    """One greedy continuation: ``y[t]`` is the final layer's token at step t; per exit layer
    ``argmax[L][t]``, ``entropy[L][t]`` and ``top1[L][t]`` are that exit's view of the same position,
    ``top_ids[L][t]`` / ``top_probs[L][t]`` its ``TREE_TOP`` best tokens and their probabilities."""

    y: list[int]
    argmax: dict[int, list[int]]
    entropy: dict[int, list[float]]
    top1: dict[int, list[float]] = field(default_factory=dict)
    top_ids: dict[int, list[list[int]]] = field(default_factory=dict)
    top_probs: dict[int, list[list[float]]] = field(default_factory=dict)

    def confidence(self, layer: int, t: int) -> DraftConfidence:
        if t >= len(self.y):
            return DraftConfidence(0.0, 1.0)
        return DraftConfidence(self.entropy[layer][t], self.top1[layer][t] if self.top1 else 1.0)


@torch.inference_mode()
def collect_traces(model, prompts: list[list[int]], layers: list[int], max_new_tokens: int, eos_ids,
                   batch_size: int = 8) -> list[Trace]:
    """Greedy continuations of ``prompts`` and every exit's argmax/entropy/top-1 probability along
    them, computed as decoding computes them (exit blocks attend over their own K/V)."""
    traces = []
    for p, y in zip(prompts, greedy_continuations(model, prompts, max_new_tokens, eos_ids, batch_size)):
        views = exit_logits_along(model, p + y[:-1], len(p) - 1, layers)
        am, ent, top1, top_ids, top_probs = {}, {}, {}, {}, {}
        for L in layers:
            logits = views[L].float()
            am[L] = logits.argmax(-1).tolist()
            q = torch.softmax(logits, -1)
            ent[L] = (-(q * q.clamp_min(1e-30).log()).sum(-1)).tolist()
            top1[L] = q.max(-1).values.tolist()
            probs, ids = q.topk(min(TREE_TOP, q.shape[-1]), dim=-1)  # [T, TREE_TOP]
            top_ids[L], top_probs[L] = ids.tolist(), probs.tolist()
        traces.append(Trace(y, am, ent, top1, top_ids, top_probs))
    return traces


def trace_agreement(traces: list[Trace], layer: int, against: int | None = None) -> float:
    """Top-1 agreement of exit ``layer`` with the final layer (or with exit ``against``)."""
    hit = tot = 0
    for tr in traces:
        ref = tr.y if against is None else tr.argmax[against]
        hit += sum(a == b for a, b in zip(tr.argmax[layer], ref))
        tot += len(tr.y)
    return hit / max(1, tot)


# ---- simulation -------------------------------------------------------------------------------
@dataclass
class SimResult:
    tokens: int = 0
    seconds: float = 0.0
    full_passes: int = 0
    drafted: int = 0
    accepted_inter: int = 0
    verified_inter: int = 0
    accepted_full: int = 0
    verified_full: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def _drafts(policy: DraftPolicy, trace: Trace, layer: int, t: int, limit: int) -> tuple[int, int]:
    """(tokens drafted, exit evaluations) of one round starting at trace position ``t``, asking
    the real draft policy as ``speculative.draft`` does (the exit's view at ``t + n`` stands in
    for its view after ``n`` drafts)."""
    k = max(1, min(policy.max_drafts(), limit))
    if not policy.wants_confidence():
        return k, k
    for n in range(1, k):
        if policy.stop_before(trace.confidence(layer, t + n)):
            return n, n + 1
    return k, k


def _runs(a: list[int], b: list[int]) -> list[int]:
    """``r[t]``: how many consecutive positions from ``t`` on have ``a == b`` (one extra 0 at the end)."""
    r = [0] * (len(a) + 1)
    for t in range(len(a) - 1, -1, -1):
        r[t] = r[t + 1] + 1 if a[t] == b[t] else 0
    return r


class _TraceRuns:
    """Run lengths per (exit, reference) pair of one trace, computed once and shared by all configs."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace
        self._cache: dict[tuple, list[int]] = {}

    def runs(self, layer: int, against: int | None) -> list[int]:
        key = (layer, against)
        if key not in self._cache:
            ref = self.trace.y if against is None else self.trace.argmax[against]
            self._cache[key] = _runs(self.trace.argmax[layer], ref)
        return self._cache[key]


def _prepared(traces) -> list[_TraceRuns]:
    return [t if isinstance(t, _TraceRuns) else _TraceRuns(t) for t in traces]


def _draft_and_verify_seconds(costs: CostModel, d: int, to_layer: int, k: int, evals: int, extra: int = 0) -> float:
    """One round: ``k + 1`` single-token passes through layers ``[0, d)``, ``evals`` draft-exit
    heads, then one ``(k + 1)``-token pass through ``[d, to_layer)`` and that exit's head; a tree's
    ``extra`` runners-up add one pass of theirs through ``[0, d)`` and as many verification rows."""
    rows = k + 1 + extra
    return ((k + 1) * costs.forward(d, 1) + evals * costs.exit(d, 1) + (costs.forward(d, extra) if extra else 0.0)
            + costs.forward(to_layer - d, rows) + costs.exit(to_layer, rows) + costs.sampling)


def _least(spec: SpecConfig, costs: CostModel, to_layer: int) -> float:
    """``speculative.tree_min_probs`` of a greedy sequence, the row cost taken from ``costs``."""
    if spec.tree_min_prob is not None:
        return spec.tree_min_prob
    return branch_threshold(costs.row_share(), to_layer, costs.num_layers)


def _round(trace: Trace, spec: SpecConfig, layer: int, t: int, k: int, run: int, ref: list[int],
           least: float = 0.0) -> tuple[int, int]:
    """(drafts accepted, runners-up verified) of a round of ``k`` drafts at exit ``layer`` from trace
    position ``t`` against the reference tokens ``ref`` (``run``: how many drafts agree with them
    from ``t`` on). With ``spec.tree_width > 1`` the exit's runners-up at each draft position join
    the tree where their branch is at least ``least`` likely (``speculative._runners_up``'s rule);
    where the chain breaks, a runner-up equal to the reference token is accepted as well."""
    acc = min(run, k)
    if spec.tree_width <= 1 or layer not in trace.top_ids:
        return acc, 0
    ids, probs = trace.top_ids[layer], trace.top_probs[layer]
    reach, extra, hit = 1.0, 0, 0
    for n in range(min(k, len(ids) - t)):
        alts = [x for x, p in zip(ids[t + n][1:spec.tree_width], probs[t + n][1:spec.tree_width])
                if p > 0 and reach * p >= least]
        extra += len(alts)
        if n == acc and acc < k and ref[t + n] in alts:
            hit = 1
        reach *= probs[t + n][0]
    return acc + hit, extra


def simulate_selfspec(traces: list[Trace], spec: SpecConfig, costs: CostModel) -> SimResult:
    d, N = spec.draft_layer, costs.num_layers
    r, least = SimResult(), _least(spec, costs, N)
    for tr in _prepared(traces):
        T, t, pol = len(tr.trace.y), 0, make_policy(spec)
        run_dy = tr.runs(d, None)
        while t < T:
            k, evals = _drafts(pol, tr.trace, d, t, T - t)
            acc, extra = _round(tr.trace, spec, d, t, k, run_dy[t], tr.trace.y, least)
            r.seconds += _draft_and_verify_seconds(costs, d, N, k, evals, extra)
            pol.update(k, min(acc, k))
            r.drafted += k + extra
            r.accepted_full += acc
            r.verified_full += k + extra
            r.full_passes += 1
            t += acc + 1
        r.tokens += T
    return r


def simulate_hispec(traces: list[Trace], spec: SpecConfig, costs: CostModel) -> SimResult:
    """Window tokens are the intermediate exit's argmax at their positions; the leading ones
    that equal the final trajectory are committed (plus one correction/bonus token)."""
    d, i, N = spec.draft_layer, spec.verify_layer, costs.num_layers
    r, least = SimResult(), _least(spec, costs, i)
    for tr in _prepared(traces):
        T, t, pol = len(tr.trace.y), 0, make_policy(spec)
        run_di, run_iy = tr.runs(d, i), tr.runs(i, None)
        while t < T:
            m = 0  # window length
            while m < spec.window and t + m < T:
                k, evals = _drafts(pol, tr.trace, d, t + m, T - t - m)
                acc, extra = _round(tr.trace, spec, d, t + m, k, run_di[t + m], tr.trace.argmax[i], least)
                r.seconds += _draft_and_verify_seconds(costs, d, i, k, evals, extra)
                pol.update(k, min(acc, k))
                r.drafted += k + extra
                r.accepted_inter += acc
                r.verified_inter += k + extra
                m += acc + 1
            m = min(m, T - t)
            good = min(run_iy[t], m)
            r.seconds += costs.forward(i, 1) + costs.forward(N - i, m + 1) + costs.exit(N, m + 1) + costs.sampling
            r.accepted_full += good
            r.verified_full += m
            r.full_passes += 1
            t += min(good + 1, T - t)
        r.tokens += T
    return r


def simulate_ar(traces: list[Trace], costs: CostModel) -> SimResult:
    tokens = sum(len(tr.trace.y) for tr in _prepared(traces))
    return SimResult(tokens=tokens, seconds=tokens * costs.ar_token(), full_passes=tokens)


@dataclass
class Candidate:
    strategy: str
    spec: SpecConfig
    predicted: SimResult
    measured_speedup: float | None = None

    def row(self, ar_tps: float) -> dict:
        s, p = self.spec, self.predicted
        return {"strategy": self.strategy, "draft_layer": s.draft_layer, "verify_layer": s.verify_layer,
                "num_draft": s.num_draft, "window": s.window, "draft_policy": s.draft_policy,
                "svip_threshold": s.svip_threshold, "confidence_threshold": s.confidence_threshold,
                "tree_width": s.tree_width, "tree_min_prob": s.tree_min_prob,
                "predicted_tokens_per_s": round(p.tokens_per_second, 2),
                "predicted_speedup": round(p.tokens_per_second / ar_tps, 3) if ar_tps else None,
                "tokens_per_full_pass": round(p.tokens / max(1, p.full_passes), 3),
                "accept_inter": round(p.accepted_inter / p.verified_inter, 3) if p.verified_inter else None,
                "accept_full": round(p.accepted_full / p.verified_full, 3) if p.verified_full else None,
                "measured_speedup": None if self.measured_speedup is None else round(self.measured_speedup, 3)}


# the draft policies that take a threshold, and the SpecConfig field that holds it
THRESHOLD_OF = {DraftPolicyName.SVIP: "svip_threshold", DraftPolicyName.CONFIDENCE: "confidence_threshold"}


@dataclass
class SearchSpace:
    num_draft: tuple[int, ...] = (1, 2, 3, 4, 6)
    window: tuple[int, ...] = (2, 3, 4, 6, 8)
    # (policy, threshold): nats for svip, a top-1 probability for confidence
    policies: tuple[tuple[str, float], ...] = (
        (DraftPolicyName.FIXED, 0.0), (DraftPolicyName.HEURISTIC, 0.0), (DraftPolicyName.SVIP, 1.0),
        (DraftPolicyName.SVIP, 2.0), (DraftPolicyName.SVIP, 3.0), (DraftPolicyName.CONFIDENCE, 0.3),
        (DraftPolicyName.CONFIDENCE, 0.5), (DraftPolicyName.CONFIDENCE, 0.7))
    draft_layers: tuple[int, ...] | None = None
    verify_layers: tuple[int, ...] | None = None
    # token trees, tried on the best chains of each strategy: widths and runner-up probabilities
    tree_widths: tuple[int, ...] = (2, 3, 4)
    tree_min_probs: tuple[float | None, ...] = (None, 0.0, 0.05, 0.1, 0.2, 0.3)  # None: the measured row cost
    trees_on_best: int = 6


def _policy_fields(policy: str, threshold: float) -> dict:
    """SpecConfig fields of a ``(policy, threshold)`` pair of the search space."""
    name = THRESHOLD_OF.get(policy)
    return {"draft_policy": policy, **({name: threshold} if name else {})}


def search(traces: list[Trace], costs: CostModel, layers: list[int], space: SearchSpace = SearchSpace()
           ) -> tuple[list[Candidate], SimResult]:
    """Predicted tokens/s of every configuration, best first (hispec and selfspec)."""
    n = costs.num_layers
    traces = _prepared(traces)
    d_layers = [L for L in layers if space.draft_layers is None or L in space.draft_layers]
    i_layers = [L for L in layers if space.verify_layers is None or L in space.verify_layers]
    out = []
    for d, (pol, thr), k in itertools.product(d_layers, space.policies, space.num_draft):
        spec = SpecConfig(d, n, num_draft=k, window=1, **_policy_fields(pol, thr), num_layers=n)
        out.append(Candidate(StrategyName.SELFSPEC, spec, simulate_selfspec(traces, spec, costs)))
        for i in i_layers:
            if i <= d:
                continue
            for w in space.window:
                spec = SpecConfig(d, i, num_draft=k, window=w, **_policy_fields(pol, thr), num_layers=n)
                out.append(Candidate(StrategyName.HISPEC, spec, simulate_hispec(traces, spec, costs)))
    out.sort(key=lambda c: -c.predicted.tokens_per_second)
    sims = {StrategyName.SELFSPEC: simulate_selfspec, StrategyName.HISPEC: simulate_hispec}
    for name, simulate in sims.items():
        for c in [c for c in out if c.strategy == name][:space.trees_on_best]:
            for m, p in itertools.product(space.tree_widths, space.tree_min_probs):
                spec = dataclasses.replace(c.spec, tree_width=m, tree_min_prob=p)
                out.append(Candidate(name, spec, simulate(traces, spec, costs)))
    out.sort(key=lambda c: -c.predicted.tokens_per_second)
    return out, simulate_ar(traces, costs)


# ---- validation ----------------------------------------------------------------------------
def measure_end_to_end(gen, prompts: list[list[int]], candidates: list[Candidate], max_new_tokens: int,
                       rounds: int = 1) -> tuple[float, list[float]]:
    """Tokens/s of ``ar`` and of each candidate on ``prompts``, interleaved per prompt
    (ar, c1, c2, ..., then the next prompt), so a busy machine slows all alike."""
    from ..config import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    ar_t = ar_n = 0.0
    tot = [[0.0, 0] for _ in candidates]
    for _ in range(rounds):
        for p in prompts:
            ref = gen.generate(p, params, StrategyName.AR)
            ar_t, ar_n = ar_t + ref.seconds, ar_n + ref.new_tokens
            for c, acc in zip(candidates, tot):
                out = gen.generate(p, params, c.strategy, spec=c.spec)
                if out.token_ids != ref.token_ids:
                    raise AssertionError(f"{c.strategy} {c.spec} changed the output: a bug, please report it")
                acc[0] += out.seconds
                acc[1] += out.new_tokens
    ar_tps = ar_n / ar_t
    return ar_tps, [(n / s) / ar_tps if s else 0.0 for s, n in tot]


def format_table(rows: list[dict], limit: int = 25) -> str:
    cols = ["strategy", "draft_layer", "verify_layer", "num_draft", "window", "draft_policy", "svip_threshold",
            "tree_width", "tree_min_prob", "predicted_speedup", "tokens_per_full_pass", "accept_inter", "accept_full",
            "measured_speedup"]
    short = {"strategy": "strategy", "draft_layer": "L_d", "verify_layer": "L_i", "num_draft": "N_d",
             "window": "N_i", "draft_policy": "policy", "svip_threshold": "thr", "tree_width": "tree m",
             "tree_min_prob": "tree p", "predicted_speedup": "pred x",
             "tokens_per_full_pass": "tok/full", "accept_inter": "acc d->i", "accept_full": "acc ->f",
             "measured_speedup": "meas x"}
    lines = ["  ".join(f"{short[c]:>8}" for c in cols)]
    for r in rows[:limit]:
        cells = []
        for c in cols:
            v = r.get(c)
            if r["strategy"] == StrategyName.SELFSPEC and c in ("verify_layer", "window"):
                v = "-"
            if c == "tree_min_prob" and v is None:
                v = "auto"  # the measured cost of a row
            if c == "svip_threshold":
                v = r.get(THRESHOLD_OF[r["draft_policy"]]) if r["draft_policy"] in THRESHOLD_OF else "-"
            cells.append(f"{'-' if v is None else v:>8}")
        lines.append("  ".join(cells))
    return "\n".join(lines)
