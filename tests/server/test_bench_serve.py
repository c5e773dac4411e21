"""``hispec bench serve`` and ``hispec bench soak`` end to end on a tiny model: each starts its own
``hispec serve`` on loopback, measures it and stops it (a few requests, a few tokens: no timing is
asserted)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod)

from tests.conftest import write_char_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench-serve-model") / "tiny"
    shutil.copytree(tiny_model_dir("llama", eos_token_id=2, bos_token_id=1, max_position_embeddings=1024), folder)
    write_char_tokenizer(folder)
    return folder


def hispec(args: list[str], tmp_path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "HISPEC_PEERS": str(tmp_path / "no-peers")}  # no peer is installed there
    return subprocess.run([sys.executable, "-m", "hispec.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL, cwd=tmp_path)


def test_bench_serve_measures_its_own_server_and_skips_missing_peers(model_dir, tmp_path):
    run = hispec(["bench", "serve", "--model", str(model_dir), "--threads", "1", "--dataset", "random",
                  "--input-len", "16", "--output-len", "4", "--num-prompts", "4", "--max-concurrency", "2",
                  "--request-rate", "inf", "--warmup", "1", "--slo", "ttft:60000,tpot:60000",
                  "--peers", "vllm,llama.cpp", "--result-file", "out/serve.json", "--no-progress"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Serving Benchmark Result: hispec" in run.stdout and "P99 ITL (ms):" in run.stdout
    assert "skipping vllm: vllm is not installed" in run.stderr
    assert "skipping llama.cpp: llama.cpp is not installed" in run.stderr
    saved = json.loads((tmp_path / "out" / "serve.json").read_text())
    assert saved["servers"]["vllm"]["skipped"] and saved["servers"]["llama.cpp"]["skipped"]
    (r,) = saved["runs"]
    assert r["server"] == "hispec" and r["max_concurrency"] == 2 and r["request_rate"] == "inf"
    assert r["completed"] == 4 and r["failed"] == 0 and r["errors"] == []
    assert r["total_output_tokens"] == 16  # random prompts ignore EOS: 4 tokens each, from the server's usage
    assert r["total_input_tokens"] >= 4 * 16  # the server's count (the prompt ids, its BOS)
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # an SLO every request meets
    for key in ("p99_ttft_ms", "p90_tpot_ms", "mean_e2el_ms", "output_throughput"):
        assert r[key] > 0
    assert r["p99_itl_ms"] >= 0  # (per chunk: a greedy round may stream all 4 tokens in one chunk)
    assert r["server_cpu_cores"] > 0 and "Server CPU (cores busy):" in run.stdout  # its /metrics process series
    assert str(tmp_path) not in json.dumps(saved)  # no machine paths in the result
    if __import__("importlib").util.find_spec("matplotlib"):
        assert (tmp_path / "out" / "serve.png").stat().st_size > 0
    stray = subprocess.run(["pgrep", "-f", str(model_dir)], capture_output=True, text=True)
    assert stray.stdout.strip() == ""  # the server it started is gone


def test_soak_short_run_reports_no_loss(model_dir, tmp_path):
    run = hispec(["bench", "soak", "--model", str(model_dir), "--threads", "1", "--duration", "4",
                  "--concurrency", "4", "--max-batch-size", "4", "--max-tokens", "12", "--max-words", "40",
                  "--disconnect-fraction", "0.3", "--sample-interval", "1", "--result-file", "soak.json"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "soak: ok" in run.stdout
    report = json.loads((tmp_path / "soak.json").read_text())
    q = report["requests"]
    assert q["sent"] > 0 and q["errors"] == 0 and q["lost"] == 0
    assert q["completed"] + q["disconnected"] == q["sent"]
    assert report["server"]["unfinished"] == 0 and not report["server"]["finished"].get("error")
    assert report["kv_blocks"]["leaked"] == 0 and report["kv_blocks"]["unaccounted"] == 0
    assert report["kv_blocks"]["total"] > 0
    assert report["drain"]["completed"] == report["drain"]["requests"] == 4
    assert report["drain"]["server_exit_status"] == 0
    assert report["rss_mb"]["peak"] > 0 and report["samples"]


FAKE_SERVER = r'''#!PYTHON
"""A stand-in for llama-server: /v1/models and streamed /v1/completions of 4 chunks, without usage."""
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

argv = sys.argv[1:]
port = int(argv[argv.index("--port") + 1])
assert argv[argv.index("--host") + 1] == "127.0.0.1" and "-np" in argv and "--cont-batching" in argv


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def send(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.send(json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode(),
                  "application/json")

    def do_POST(self):
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        words = [" one", " two", " three", " four"]
        events = [{"choices": [{"index": 0, "text": w, "finish_reason": "length" if i == 3 else None}]}
                  for i, w in enumerate(words)]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send(body.encode(), "text/event-stream")


ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_bench_serve_runs_a_peer_server_and_counts_tokens_without_usage(tmp_path):
    from hispec.bench.peers import model_gguf

    if model_gguf("default") is None:
        pytest.skip("the default model's GGUF file is not installed")
    fake = tmp_path / "llama-server"
    fake.write_text(FAKE_SERVER.replace("PYTHON", sys.executable))
    fake.chmod(0o755)
    run = hispec(["bench", "serve", "--no-hispec", "--peers", "llama.cpp", "--llama-server", str(fake),
                  "--threads", "1", "--dataset", "random", "--input-len", "8", "--output-len", "4",
                  "--num-prompts", "3", "--max-concurrency", "1,3", "--result-file", "peer.json", "--no-plot",
                  "--no-progress"], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    saved = json.loads((tmp_path / "peer.json").read_text())
    assert [(r["server"], r["max_concurrency"]) for r in saved["runs"]] == [("llama.cpp", 1), ("llama.cpp", 3)]
    for r in saved["runs"]:
        assert r["completed"] == 3 and r["model_id"] == "fake"
        assert r["total_output_tokens"] == 3 * 4  # " one two three four": 4 tokens by the model's tokenizer
        assert r["total_input_tokens"] > 0  # the dataset's count (no usage)
    stray = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True)
    assert stray.stdout.strip() == ""
