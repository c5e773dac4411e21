"""BENCHMARKS.md's current summary: the newest figures of each kind of comparison, made from result files.

A *comparison* is what one ``hispec bench`` run measured side by side: its engines (hispec's
strategies and the peers) at one batch size on one machine. Result files are a run's
``results.json`` (batch 1) or ``batch_results.json`` (``--batch-sizes``: one comparison per batch
size); a folder stands for the result files under it. Where several files hold the same
comparison (same machine, batch size and engines), the newest (``created``) counts.

The summary shows one table per *kind* of comparison: batch size, greedy or sampled, and whether
other engines (llama.cpp, vLLM, transformers: peers that are not hispec run with other options) ran
beside hispec's strategies. Each kind's table is its newest comparison, whatever the machine; every
other comparison gets one line under "Older comparisons" (its figures over ``ar``'s and its result
file), and the dated history (``docs/benchmarks/history.md`` beside the markdown file, linked where
it exists) says what each run was for.

The summary replaces the text between the markers ``<!-- summary:start -->`` and
``<!-- summary:end -->`` of a markdown file; everything outside them is kept byte for byte.
``hispec bench --summary FILE [--results PATH ...]`` (default: the files in
``docs/benchmarks/results/`` beside FILE).

A file may carry ``transcribed_from`` (figures copied from a dated entry whose run's own file was
not kept) and ``note`` (the machine's load, anything else that qualifies the figures): both are
shown with a comparison's table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..options import UsageError
from ..settings import STRATEGIES, StrategyName

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

START, END = "<!-- summary:start -->", "<!-- summary:end -->"
RESULT_NAMES = ("results.json", "batch_results.json")
HISTORY = "docs/benchmarks/history.md"  # the dated history, relative to the markdown file's folder


@dataclass
class Row:
    label: str
    own: bool  # one of hispec's strategies in the bench's own process (else a peer)
    weights: str | None
    tokens_per_second: float | None
    median: float | None  # per-prompt median (batch 1 runs)
    same_ids: str  # agreement with the run's ``ar``: "reference", "yes", "NO", "k/n" or "–"
    decode: float | None = None  # tokens/s with the prefill left out (hispec's strategies, batch 1 runs)


@dataclass
class Comparison:
    machine: str
    batch_size: int
    rows: list[Row]
    created: str | None = None
    command: str | None = None
    commit: str | None = None
    load: list | None = None  # 1-minute load average at start and end
    prompts: int | None = None
    max_new_tokens: int | None = None
    rounds: int | None = None
    source: str = ""
    transcribed_from: str | None = None
    note: str | None = None
    adaptive: bool | None = None  # speculation decoded adaptively (None: not recorded)
    sampling: str | None = None  # e.g. "temperature 0.7, top-p 0.9, seed 1"; None: greedy
    link: str | None = None  # the result file relative to the markdown file (set by ``make``)
    model: str | None = None  # the model's name as the run gave it; None, "default": the default model
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.machine, self.batch_size, tuple(sorted(r.label for r in self.rows)), bool(self.adaptive),
                    next((r.weights for r in self.rows if r.own), None),  # e.g. runs on another kernel
                    self.sampling, self.model_name)

    @property
    def model_name(self) -> str | None:
        """The model, None for the default one (whatever name the run gave it)."""
        if self.model in (None, "default", "smollm2", "smollm2-135m-instruct"):
            return None
        return Path(self.model).name or self.model  # a folder or file: its name

    @property
    def with_peers(self) -> bool:
        """Whether another engine ran beside hispec's strategies (a peer that is not a hispec
        strategy with other options, such as ``ar:kv_cache_dtype=bfloat16``)."""
        return any(not r.own and r.label.split(":")[0] not in STRATEGIES for r in self.rows)

    @property
    def kind(self) -> tuple:
        """What the summary shows one table of: (batch size, sampled, against other engines), and for
        a model other than the default one, the model and whether speculation ran (its plain
        throughput runs apart from its speculative ones)."""
        kind = (self.batch_size, self.sampling is not None, self.with_peers)
        speculative = any(r.own and r.label.split(":")[0] != AR for r in self.rows)
        return kind + ((self.model_name, speculative) if self.model_name else ())


# ---- reading result files ------------------------------------------------------------------
def result_files(paths: list[Path]) -> list[Path]:
    """``paths`` with each folder replaced by the result files under it (``results.json``,
    ``batch_results.json`` and, in a folder of kept results, any ``*.json``), sorted."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(f for f in p.rglob("*.json") if f.is_file())
            if not found:
                raise UsageError(f"--results {p}: no result files (*.json) in this folder")
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise UsageError(f"--results {p}: no such file or folder")
    return out


def read(path: Path) -> list[Comparison]:
    """The comparisons in one result file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: not a readable JSON file ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("batch_sizes"), dict):
        return _from_batch(data, path.name)
    if isinstance(data, dict) and isinstance(data.get("strategies"), dict):
        return [_from_results(data, path.name)]
    raise UsageError(f"{path}: not a hispec bench result file (results.json or batch_results.json)")


def _machine(m: dict | None) -> str:
    m = m or {}
    cpu, threads, cpus = m.get("cpu") or "unknown machine", m.get("threads"), m.get("cpu_count")
    device = m.get("device") or "cpu"
    gpu = "" if device.startswith("cpu") else f"{device.split(' ', 1)[-1].strip('()')} on "  # "cuda:0 (NVIDIA H200)"
    if not threads:
        return gpu + cpu
    return f"{gpu}{cpu}, {threads} thread{'s' if threads != 1 else ''}" + (f" of {cpus} CPUs" if cpus else "")


def _load(m: dict | None) -> list | None:
    m = m or {}
    start, end = m.get("load_average_at_start"), m.get("load_average_at_end")
    return None if start is None and end is None else [(start or [None])[0], (end or [None])[0]]


def _same(e: dict, label: str, own: bool) -> str:
    """Agreement with the run's ``ar``: expected of hispec's strategies (yes/NO), counted for peers."""
    if label == AR:
        return "reference"
    a = e.get("agreement_with_ar")
    if not own and a:
        return f"{a['identical']}/{a['prompts']}"
    same = e.get("identical_to_ar")
    return "–" if same is None else ("yes" if same else "NO")


def _from_results(data: dict, source: str) -> Comparison:
    model, cfg = data.get("model") or {}, data.get("config") or {}
    rows = []
    for label, e in data["strategies"].items():
        if e.get("available") is False:
            continue
        own = e.get("kind") in STRATEGIES
        rows.append(Row(label, own, _own_weights(model) if own else e.get("weights"), e.get("tokens_per_second"),
                        e.get("tokens_per_second_median"), _same(e, label, own), _decode(e) if own else None))
    return Comparison(_machine(data.get("machine")), int(cfg.get("batch_size") or 1), rows,
                      prompts=cfg.get("num_prompts"), max_new_tokens=cfg.get("max_new_tokens"),
                      command=cfg.get("command"), adaptive=cfg.get("adaptive", False),
                      sampling=_sampling(cfg.get("sampling")), model=model.get("name"), **_provenance(data, source))


def _sampling(sp: dict | None) -> str | None:
    """A sampled run's settings in words (None: greedy, or not recorded)."""
    if not sp or not sp.get("temperature"):
        return None
    parts = [f"temperature {sp['temperature']:g}"]
    if sp.get("top_k"):
        parts.append(f"top-k {sp['top_k']}")
    if sp.get("top_p", 1.0) < 1.0:
        parts.append(f"top-p {sp['top_p']:g}")
    if sp.get("seed") is not None:
        parts.append(f"seed {sp['seed']}")
    return ", ".join(parts)


def _decode(e: dict) -> float | None:
    """A strategy's tokens/s with the prefill left out: the file's ``decode_tokens_per_second``, or
    for files written before that field, the same from its seconds and prefill phase."""
    if e.get("decode_tokens_per_second"):
        return e["decode_tokens_per_second"]
    prefill = (e.get("phase_seconds") or {}).get("prefill")
    seconds, tokens = e.get("seconds"), e.get("new_tokens")
    if prefill is None or not seconds or not tokens or seconds <= prefill:
        return None
    return tokens / (seconds - prefill)


def _provenance(data: dict, source: str) -> dict:
    """The fields of a run's date, commit, load and source, as every result file records them."""
    return {"created": data.get("created"), "commit": data.get("commit"), "load": _load(data.get("machine")),
            "source": source, "transcribed_from": data.get("transcribed_from"), "note": data.get("note")}


def _own_weights(model: dict) -> str | None:
    fmt = model.get("weight_format")
    return _with_kernels(fmt if fmt and fmt != "none" else model.get("dtype"), model.get("kernels"))


def _with_kernels(weights: str | None, kernels: list | None) -> str | None:
    """``native`` -> ``native on q4/q8``: which kernels ran (result files record it since they may differ)."""
    return f"{weights} on {'/'.join(kernels)}" if weights and kernels else weights


def _from_batch(data: dict, source: str) -> list[Comparison]:
    out = []
    peers = data.get("peers") or {}
    for b, row in data["batch_sizes"].items():
        rows = []
        for label, r in row.items():
            own = label not in peers
            weights = _with_kernels(data.get("weights"), data.get("kernels")) if own \
                else (peers[label] or {}).get("weights")
            rows.append(Row(label, own, weights, r.get("tokens_per_second"), None, _same(r, label, own)))
        out.append(Comparison(_machine(data.get("machine")), int(b), rows, prompts=data.get("num_prompts"),
                              max_new_tokens=data.get("max_new_tokens"), rounds=data.get("rounds"),
                              command=data.get("command"), adaptive=data.get("adaptive"),
                              sampling=_sampling(data.get("sampling")), model=data.get("model"),
                              **_provenance(data, source)))
    return out


def latest(comparisons: list[Comparison]) -> list[Comparison]:
    """The newest of each comparison (by ``created``; a file without a date counts as oldest),
    ordered by batch size, then newest first."""
    best: dict[tuple, Comparison] = {}
    for c in comparisons:
        kept = best.get(c.key)
        if kept is None or (c.created or "") > (kept.created or ""):
            best[c.key] = c
    newest_first = sorted(best.values(), key=lambda c: c.created or "", reverse=True)
    return sorted(newest_first, key=lambda c: c.batch_size)


def current(comparisons: list[Comparison]) -> tuple[list[Comparison], list[Comparison]]:
    """``comparisons`` (as ``latest`` gives them) split into the newest of each kind (batch size,
    sampled, against other engines), ordered by batch size, greedy first, against other engines
    first; and the others, ordered by batch size, then newest first."""
    shown: dict[tuple, Comparison] = {}
    for c in comparisons:
        kept = shown.get(c.kind)
        if kept is None or (c.created or "") > (kept.created or ""):
            shown[c.kind] = c
    kinds = sorted(shown, key=lambda k: (k[0], k[1], not k[2]))
    chosen = {id(c) for c in shown.values()}
    return [shown[k] for k in kinds], [c for c in comparisons if id(c) not in chosen]


# ---- rendering ------------------------------------------------------------------------------
def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "–" if x is None else fmt.format(x)


def _name(r: Row) -> str:
    return (f"hispec `{r.label}`" if r.own else f"`{r.label}`") + (f" ({r.weights})" if r.weights else "")


def table(c: Comparison) -> list[str]:
    ar = next((r for r in c.rows if r.label == AR), None)
    batch1 = c.batch_size == 1
    decode = batch1 and ar is not None and ar.decode is not None and any(r.decode for r in c.rows if r is not ar)
    header = (["engine / weights", "tokens/s"] + (["per-prompt median"] if batch1 else []) + ["vs `ar`"]
              + (["decode vs `ar`"] if decode else []) + ["same ids as `ar`"])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for r in c.rows:
        ratio = r.tokens_per_second / ar.tokens_per_second \
            if ar and ar.tokens_per_second and r.tokens_per_second is not None else None
        cells = [_name(r), _num(r.tokens_per_second)] + ([_num(r.median)] if batch1 else []) + [_num(ratio, "{:.2f}x")]
        if decode:
            cells.append(_num(r.decode / ar.decode if r.decode is not None else None, "{:.2f}x"))
        lines.append("| " + " | ".join(cells + [r.same_ids]) + " |")
    return lines


def _setup(c: Comparison) -> str:
    parts = []
    if c.prompts is not None:
        parts.append(f"{c.prompts} prompts")
    if c.max_new_tokens is not None:
        parts.append(f"{c.max_new_tokens} new tokens")
    if c.rounds is not None:
        parts.append(f"median of {c.rounds} interleaved rounds")
    if c.adaptive is not None and any(r.own and r.label != AR for r in c.rows):
        parts.append("adaptive" if c.adaptive else "always speculating")
    if c.sampling:
        parts.append("sampled: " + c.sampling)
    if c.load is not None:
        parts.append("load average " + " -> ".join("?" if x is None else f"{x:.2f}" for x in c.load))
    else:
        parts.append("load not recorded")
    parts.append(f"commit `{c.commit}`" if c.commit else "commit not recorded")
    return "; ".join(parts) + "."


def _title(c: Comparison) -> str:
    date = (c.created or "date not recorded")[:10]
    sampled = ", sampled" if c.sampling else ""
    model = f" ({c.model_name})" if c.model_name else ""
    return f"Batch {c.batch_size}{sampled}{model}: {', '.join(r.label for r in c.rows)} ({c.machine}, {date})"


def _source(c: Comparison) -> str:
    return f"[`{c.source}`]({c.link})" if c.link else f"`{c.source}`"


def line(c: Comparison) -> str:
    """An older comparison in one line: ``ar``'s tokens/s, the other engines' over it, its file."""
    ar = next((r for r in c.rows if r.label == AR), None)
    figures = []
    for r in c.rows:
        if r is ar:
            continue
        if ar and ar.tokens_per_second and r.tokens_per_second is not None:
            figures.append(f"{r.label} {r.tokens_per_second / ar.tokens_per_second:.2f}x"
                           + (" (not `ar`'s ids)" if r.same_ids == "NO" else ""))
        else:
            figures.append(f"{r.label} {_num(r.tokens_per_second)} tokens/s")
    head = f"ar {_num(ar.tokens_per_second)} tokens/s" if ar else ""
    return f"- {_title(c)}: {'; '.join(x for x in (head, ', '.join(figures)) if x)}. {_source(c)}"


def render(comparisons: list[Comparison], sources: list[str], target: str = "BENCHMARKS.md",
           older: list[Comparison] | None = None, history: str | None = None) -> str:
    """The summary section of the markdown file ``target`` (without the markers): a table for each
    of ``comparisons``, a line for each of ``older``; ``history``: the dated history's link."""
    lines = ["## Current summary", "",
             "The newest run of each kind of comparison (batch size; greedy or sampled; hispec's strategies "
             "alone or against other engines) among the result files "
             f"({', '.join(f'`{s}`' for s in sources) or 'none given'}). tokens/s include prefill; `vs ar` is "
             "tokens/s over hispec `ar`'s in the same run; `decode vs ar` (batch 1, hispec's strategies) is the "
             "same with each prompt's prefill left out, the part speculation changes; greedy unless a "
             "comparison says sampled. Made by "
             f"`hispec bench --summary {target}`: it rewrites "
             "only this section, the rest of the file stays as it is.", ""]
    if not comparisons:
        lines += ["(no result files)", ""]
    for c in comparisons:
        lines += [f"### {_title(c)}", ""]
        if c.command:
            lines += [f"`{c.command}`", ""]
        lines += table(c) + ["", _setup(c)]
        if c.note:
            lines.append(c.note)
        lines.append(f"Source: {_source(c)}" + (f", transcribed from {c.transcribed_from}." if c.transcribed_from
                                               else "."))
        lines.append("")
    if older:
        where = f"[the dated history]({history})" if history else "the dated history"
        lines += ["### Older comparisons", "",
                  "The newest run of every other comparison (machine, batch size, engines), one line each: `ar`'s "
                  "tokens/s and each other engine's over it, then the result file; what each run was for and "
                  f"what changed between them: {where}.", ""]
        lines += [line(c) for c in older] + [""]
    return "\n".join(lines).rstrip("\n")


# ---- writing into the markdown file --------------------------------------------------------
def replace_section(text: str, section: str) -> str:
    """``text`` with the part between the markers replaced by ``section``; the rest unchanged."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise UsageError(f"the file needs exactly one {START} followed by one {END} around its summary")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{section}\n{END}{tail}"


def make(target: Path, paths: list[Path]) -> tuple[str, list[Comparison], list[Comparison]]:
    """The summary section for ``target`` from the result files at ``paths``: its text, the
    comparisons shown as tables and the older ones shown as lines."""
    found = []
    for f in result_files(paths):
        for c in read(f):
            c.link = _shown(f, target, link=True)
            found.append(c)
    shown, older = current(latest(found))
    sources = sorted({_shown(p, target) for p in paths})
    history = HISTORY if (target.resolve().parent / HISTORY).is_file() else None
    return render(shown, sources, target.name, older, history), shown, older


def write_summary(target: Path, paths: list[Path]) -> list[Comparison]:
    """Rewrite ``target``'s summary from the result files at ``paths``; the comparisons shown
    (tables first, then the older ones' lines)."""
    if not target.is_file():
        raise UsageError(f"--summary {target}: no such file")
    section, shown, older = make(target, paths)
    text = target.read_text(encoding="utf-8")
    target.write_text(replace_section(text, section), encoding="utf-8")
    return shown + older


def _shown(path: Path, target: Path, link: bool = False) -> str | None:
    """A source as the summary names it: relative to the markdown file's folder where it is inside
    (else its name, or with ``link`` None: no link to a file outside the markdown file's folder)."""
    try:
        return path.resolve().relative_to(target.resolve().parent).as_posix()
    except ValueError:
        return None if link else path.name
