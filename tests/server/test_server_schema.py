"""``/openapi.json`` describes the API with typed request bodies, and a bounded schemathesis
run over it (valid and invalid bodies for every operation) gets no 5xx, with OpenAI-shaped
errors. The server's model has a 96-token context and a short queue, so every generated
request ends quickly (long prompts and large fan-outs are refused with 400/429)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "schemathesis"):
    pytest.importorskip(_mod)

import httpx  # noqa: E402

from tests.conftest import write_char_tokenizer  # noqa: E402
from tests.server.test_server import MODEL, ServerProcess  # noqa: E402

MAX_EXAMPLES = 40  # per operation and phase: ~1-2 minutes on the 2-core CI machine


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("schema-model") / MODEL
    shutil.copytree(tiny_model_dir("llama", eos_token_id=2, bos_token_id=1, max_position_embeddings=96), folder)
    write_char_tokenizer(folder)
    log = tmp_path_factory.mktemp("schema-server") / "server.log"
    proc = ServerProcess(["--model", str(folder), "--threads", "1", "--max-batch-size", "8", "--max-queue", "8",
                          "--kv-blocks", "64"], log)
    yield proc.wait_ready()
    proc.stop()


def test_openapi_schema_has_typed_request_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json", trust_env=False).json()
    assert schema["openapi"].startswith("3.")
    components = schema["components"]["schemas"]
    for path, name in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest")):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"}
        assert "model" in components[name]["required"]
        assert schema["paths"][path]["post"]["responses"]["400"]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ErrorResponse"}
    assert {"logprobs", "echo", "best_of", "n", "logit_bias"} <= set(components["CompletionRequest"]["properties"])


def test_schemathesis_finds_no_server_error(server, tmp_path):
    report = tmp_path / "junit.xml"
    cmd = [sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()", "run",
           f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", str(MAX_EXAMPLES),
           "--seed", "1", "--generation-deterministic", "--request-timeout", "60", "--workers", "1",
           "--report", "junit", "--report-junit-path", str(report), "--no-color"]
    # run in tmp_path: schemathesis keeps a cache of crashes in the working directory
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "not_a_server_error" in run.stdout or report.exists()
    # the server is still healthy and answers a normal request
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                   trust_env=False, timeout=60)
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": 3}, trust_env=False, timeout=60)
    assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
    json.dumps(bad.json())
