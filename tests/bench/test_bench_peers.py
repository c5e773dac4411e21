"""``hispec bench --peers``: the peer protocol and runner against fake engines (CI has no peers),
hispec ``ar`` as a peer in a second process, and, when their venvs exist, the real llama.cpp / vLLM."""
from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from hispec.bench import peer_worker
from hispec.bench.peers import PeerProcess, find_python, parse_peer_python, parse_peers, peers_home
from hispec.cli import main
from hispec.config import ConfigError

FAKE_VLLM = '''
"""A stand-in for vLLM: each continuation is the prompt's ids reversed; calls are logged."""
import json, os

__version__ = "0.0-fake"


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class _Out:
    def __init__(self, ids):
        self.token_ids = ids


class _Result:
    def __init__(self, ids):
        self.outputs = [_Out(ids)]


class LLM:
    def __init__(self, **kw):
        self.kw = kw

    def generate(self, prompts, params, use_tqdm=True):
        with open(os.environ["FAKE_PEER_LOG"], "a") as f:
            f.write(json.dumps({"init": self.kw, "sampling": params.kw, "batch": len(prompts)}) + "\\n")
        n = params.kw["max_tokens"]
        return [_Result(list(reversed(p["prompt_token_ids"]))[:n]) for p in prompts]
'''


def expected(ids: list[int], n: int, eos: int = 2) -> list[int]:
    """What the fake engines return: the prompt reversed, cut at the first EOS (kept)."""
    out = list(reversed(ids))[:n]
    return out[:out.index(eos) + 1] if eos in out else out


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch) -> str:
    """A "venv Python" that imports the fake vllm module above."""
    mods = tmp_path / "mods" / "vllm"
    mods.mkdir(parents=True)
    (mods / "__init__.py").write_text(FAKE_VLLM)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{mods.parent}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("FAKE_PEER_LOG", str(tmp_path / "calls.jsonl"))
    return str(python)


def test_peer_syntax():
    labels = [p.label for p in parse_peers("llama.cpp,vllm")]
    assert labels == ["llama.cpp:q4_1", "llama.cpp:f16", "llama.cpp:f32", "vllm:float32"]
    assert [p.label for p in parse_peers("llama.cpp:f16,vllm:bfloat16")] == ["llama.cpp:f16", "vllm:bfloat16"]
    ar = parse_peers("ar:dtype=bfloat16")[0]
    assert (ar.engine, ar.options, ar.strategy) == ("ar", {"dtype": "bfloat16"}, "ar")
    own = parse_peers("hispec:kernel=int4,selfspec:dtype=float32")
    assert [(p.label, p.engine, p.strategy) for p in own] == [("hispec:kernel=int4", "ar", "hispec"),
                                                              ("selfspec:dtype=float32", "ar", "selfspec")]
    assert parse_peers(None) == [] and parse_peers("") == []
    for bad in ("llama", "llama.cpp:q5", "vllm:int8", "ar", "ar:dtype", "vllm,vllm:float32", "ar:kernel=q5",
                "hispec", "lookup:kernel=q5"):
        with pytest.raises(ConfigError):
            parse_peers(bad)
    assert parse_peer_python(["vllm=/x/bin/python"]) == {"vllm": "/x/bin/python"}
    # a speculative mode brings its plain counterpart (its ratio is taken against it) unless named
    spec = parse_peers("llama.cpp:q4_1:lookup,vllm:bfloat16:ngram,vllm:bfloat16")
    assert [(p.label, p.speculative, p.plain_label) for p in spec] == [
        ("llama.cpp:q4_1", None, None), ("llama.cpp:q4_1:lookup", "lookup", "llama.cpp:q4_1"),
        ("vllm:bfloat16:ngram", "ngram", "vllm:bfloat16"), ("vllm:bfloat16", None, None)]
    assert [p.label for p in parse_peers("llama.cpp:lookup")][-1] == "llama.cpp:f32:lookup"
    for bad in ("llama.cpp:ngram", "vllm:lookup", "vllm:ngram:float32", "transformers"):
        with pytest.raises(ConfigError):
            parse_peers(bad)
    with pytest.raises(ConfigError):
        parse_peer_python(["transformers=/x"])


def test_missing_peer_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_PEERS", str(tmp_path))
    assert peers_home() == tmp_path
    python, why = find_python("llama.cpp", {})
    assert python is None and "install-peers.sh llama.cpp" in why and "llama-cpp-python" in why
    python, why = find_python("vllm", {"vllm": str(tmp_path / "nope")})
    assert python is None and "--peer-python given for vllm" in why and str(tmp_path) not in why
    assert find_python("ar", {}) == (sys.executable, None)


def test_protocol_round_trip_and_errors(fake_vllm_python, tmp_path):
    p = PeerProcess(fake_vllm_python, ["--engine", "vllm", "--model", "folder", "--max-batch", "4"], dict(os.environ),
                    tmp_path / "peer.log")
    try:
        assert p.info == {"engine": "vllm", "version": "0.0-fake", "dtype": "float32", "batching": True,
                          "prefix_caching": False, "speculative": None}
        prompts = [[5, 6, 7], [9, 2, 8, 3], [4]]
        reply = p.request(op="generate", prompts=prompts, max_new_tokens=3, eos=[2], ignore_eos=False, batch_size=2)
        assert reply["outputs"] == [expected(x, 3) for x in prompts] and reply["seconds"] >= 0
        reply = p.request(op="generate", prompts=prompts, max_new_tokens=3, eos=[2], ignore_eos=True, batch_size=4)
        assert reply["outputs"][1] == [3, 8, 2]  # past the EOS
        with pytest.raises(RuntimeError, match="KeyError"):
            p.request(op="generate")  # a bad request answers an error; the worker goes on
        assert p.request(op="generate", prompts=[[1]], max_new_tokens=1, eos=[], batch_size=1)["outputs"] == [[1]]
    finally:
        p.close()
    calls = [json.loads(l) for l in Path(os.environ["FAKE_PEER_LOG"]).read_text().splitlines()]
    assert [c["batch"] for c in calls] == [2, 1, 3, 1]  # batch 2 < max 4: static batches; 4: all at once
    assert calls[0]["init"]["max_num_seqs"] == 4 and calls[0]["sampling"]["temperature"] == 0.0
    assert calls[0]["init"]["enable_prefix_caching"] is False  # every prompt prefilled every time, as hispec does
    assert calls[0]["sampling"]["stop_token_ids"] == [2]


def test_engine_that_cannot_load_is_an_error_with_the_log(tmp_path):
    with pytest.raises(RuntimeError, match="ModuleNotFoundError"):
        PeerProcess(sys.executable, ["--engine", "vllm", "--model", "x"], {**os.environ, "PYTHONPATH": ""},
                    tmp_path / "peer.log")


def test_llama_cpp_engine_greedy_and_stops(monkeypatch):
    """The llama.cpp adapter against a fake ``llama_cpp``: greedy settings, reset before each prompt,
    the token ids as given, a stop at EOS (kept) or at max_new_tokens."""
    calls = []

    class Llama:
        def __init__(self, **kw):
            calls.append(("init", kw))

        def reset(self):
            calls.append(("reset",))

        def generate(self, ids, **kw):
            calls.append(("generate", list(ids), kw))
            yield from reversed(ids)

    monkeypatch.setitem(sys.modules, "llama_cpp", type(sys)("llama_cpp"))
    sys.modules["llama_cpp"].Llama, sys.modules["llama_cpp"].__version__ = Llama, "0.0-fake"
    args = peer_worker.parse_args(["--engine", "llama.cpp", "--model", "/m/x.gguf", "--threads", "2"])
    eng = peer_worker.LlamaCpp(args)
    assert eng.info["weights"] == "x.gguf" and calls[0][1]["n_threads"] == 2
    outs = eng.generate([[5, 2, 7, 8], [3, 4, 5]], 2, {2}, False, 16)
    assert outs == [[8, 7], [5, 4]]
    assert eng.generate([[9, 2, 7]], 8, {2}, False, 1) == [[7, 2]]
    assert eng.generate([[9, 2, 7]], 8, {2}, True, 1) == [[7, 2, 9]]
    gen_kw = [c[2] for c in calls if c[0] == "generate"]
    assert all(k["temp"] == 0.0 and k["repeat_penalty"] == 1.0 and k["top_k"] == 1 for k in gen_kw)
    assert [c[0] for c in calls[1:5]] == ["reset", "generate", "reset", "generate"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("peers-data") / "q.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": t}) + "\n"
                            for i, t in enumerate(["Hello there", "Why is the sea salty?", "Count to five"])))
    return path


def bench(model, prompts, out, *extra) -> int:
    return main(["bench", "--model", str(model), "--data", str(prompts), "--max-new-tokens", "6",
                 "--out", str(out), "--no-progress", "--threads", "1", "--no-plots", *extra])


def test_ar_peer_on_another_kernel(tmp_path):
    """``ar:kernel=q4``: the 4-bit kernel goes to the peer process's environment (HISPEC_Q4_KERNEL),
    not to its command line; the other options stay flags."""
    from types import SimpleNamespace

    from hispec.bench.peers import PeerRunner, peer_weights

    spec = parse_peers("ar:kernel=q4:dtype=float32")[0]
    gen = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=512)))
    runner = PeerRunner(spec, gen, model_name="m", threads=1, python_overrides={}, log_dir=tmp_path)
    runner.weights = peer_weights(spec, gen, "m")
    argv = runner._argv()
    assert argv[argv.index("--") + 1:] == ["--dtype", "float32"]
    assert runner._env()["HISPEC_Q4_KERNEL"] == "q4"
    assert runner.weights.describe == "hispec --dtype float32 (4-bit kernel q4)"


def test_bench_with_peers(tiny_text_model_dir, prompt_file, fake_vllm_python, tmp_path, monkeypatch, capsys):
    """Peers interleaved with ar: the fake vLLM gets the prompt token ids (its output is a function
    of them), hispec ar in a second process agrees with ar on every prompt, llama.cpp is refused
    for a model that is not the default one, and the missing peer says how to install it."""
    monkeypatch.setenv("HISPEC_PEERS", str(tmp_path / "no-peers"))
    out = tmp_path / "out"
    rc = bench(tiny_text_model_dir, prompt_file, out, "--strategies", "ar", "--peers",
               "vllm,ar:dtype=float32,llama.cpp:f16,vllm:bfloat16", "--peer-python", f"vllm={fake_vllm_python}",
               "--peer-python", f"llama.cpp={fake_vllm_python}", "--agree-first", "2")
    assert rc == 0  # peers that differ or are missing only warn
    r = json.loads((out / "results.json").read_text())
    s = r["strategies"]
    assert r["config"]["peers"] == ["vllm:float32", "ar:dtype=float32", "llama.cpp:f16", "vllm:bfloat16"]
    assert r["config"]["strategies"] == ["ar"]

    from hispec.generate import Generator
    gen = Generator.from_pretrained(str(tiny_text_model_dir), exits=False)
    ids = [gen.encode_prompt(p, None) for p in ("Hello there", "Why is the sea salty?", "Count to five")]
    vllm_ids_match = [expected(x, 6) for x in ids]
    v = s["vllm:float32"]
    assert v["available"] and v["kind"] == "peer" and v["peer"]["engine"] == "vllm"
    assert v["new_tokens"] == sum(len(x) for x in vllm_ids_match)
    assert v["agreement_with_ar"]["prompts"] == 3 and v["agreement_with_ar"]["first_n"] == 2

    a = s["ar:dtype=float32"]
    assert a["available"] and a["identical_to_ar"] is True and a["agreement_with_ar"]["identical"] == 3
    assert a["new_tokens"] == s["ar"]["new_tokens"]
    assert not s["llama.cpp:f16"]["available"] and "--model default" in s["llama.cpp:f16"]["reason"]
    b = s["vllm:bfloat16"]
    assert b["available"]  # --peer-python vllm= serves both vLLM dtypes
    report = (out / "report.md").read_text()
    assert "## Peer engines" in report and "`vllm:float32`" in report and "same first 2 ids" in report
    assert r["targets"]["all_identical_to_ar"] is None  # vllm differs, but peers are not hispec's own strategies
    assert (out / "peer-vllm_float32.log").exists()

    capsys.readouterr()
    from hispec.bench.report import main as report_main
    report_main([str(out / "results.json"), "--peer-table"])
    table = capsys.readouterr().out
    assert "hispec `ar`" in table and "`ar:dtype=float32`" in table and "3/3 / 3/3" in table


def test_own_strategies_as_peers(tiny_text_model_dir, prompt_file, tmp_path):
    """``hispec:OPT=VALUE`` runs hispec's strategy in a second process with the run's --adaptive:
    lossless there too, so on the same weights its ids are ar's."""
    out = tmp_path / "out"
    rc = bench(tiny_text_model_dir, prompt_file, out, "--strategies", "ar", "--adaptive", "--peers",
               "hispec:dtype=float32,lookup:dtype=float32")
    assert rc == 0
    s = json.loads((out / "results.json").read_text())["strategies"]
    for label, strategy in (("hispec:dtype=float32", "hispec"), ("lookup:dtype=float32", "lookup")):
        assert s[label]["available"] and s[label]["identical_to_ar"] is True, label
        assert (s[label]["peer"]["strategy"], s[label]["peer"]["adaptive"]) == (strategy, True)


def test_batch_sizes_with_peers(tiny_text_model_dir, prompt_file, fake_vllm_python, tmp_path, capsys):
    out = tmp_path / "out"
    rc = bench(tiny_text_model_dir, prompt_file, out, "--strategies", "ar", "--batch-sizes", "1,2", "--peers", "vllm",
               "--peer-python", f"vllm={fake_vllm_python}", "--rounds", "1")
    assert rc == 0
    r = json.loads((out / "batch_results.json").read_text())
    assert set(r["batch_sizes"]["2"]) == {"ar", "vllm:float32"} and r["peers"]["vllm:float32"]["available"]
    assert r["batch_sizes"]["1"]["vllm:float32"]["agreement_with_ar"]["prompts"] == 3
    calls = [json.loads(l) for l in Path(os.environ["FAKE_PEER_LOG"]).read_text().splitlines()]
    assert [c["batch"] for c in calls] == [2, 1, 1, 1, 3]  # warm-up, batch 1 (one by one), batch 2 = the max
    assert "vllm:float32 tokens/s" in (out / "batch_report.md").read_text()


def test_speculative_peers_against_their_own_plain_decoding(tiny_text_model_dir, prompt_file, fake_vllm_python,
                                                            tmp_path, capsys):
    """vLLM's ngram mode gets its speculative config (and its plain counterpart runs too);
    transformers' prompt lookup (``hf-lookup``) gives its own plain greedy ids; each speculative
    entry has its ratio to its own plain decoding, overall and per category, and the report has
    the table."""
    out = tmp_path / "out"
    rc = bench(tiny_text_model_dir, prompt_file, out, "--strategies", "ar,hf,hf-lookup", "--peers", "vllm:ngram",
               "--peer-python", f"vllm={fake_vllm_python}")
    assert rc == 0
    r = json.loads((out / "results.json").read_text())
    s = r["strategies"]
    assert r["config"]["peers"] == ["vllm:float32", "vllm:float32:ngram"]
    calls = [json.loads(l) for l in Path(os.environ["FAKE_PEER_LOG"]).read_text().splitlines()]
    assert {json.dumps(c["init"].get("speculative_config"), sort_keys=True) for c in calls} == {
        "null", json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1}, sort_keys=True)}
    t, lk = s["hf"], s["hf-lookup"]
    assert t["available"] and lk["available"], (t["reason"], lk["reason"])
    assert lk["prompt_lookup_num_tokens"] == 4 and s["vllm:float32:ngram"]["peer"]["speculative"] == {
        "mode": "ngram", "num_draft": 4, "max_ngram": 3}
    assert lk["new_tokens"] == t["new_tokens"] and lk["agreement_with_ar"] == t["agreement_with_ar"]
    for label, plain in (("hf-lookup", "hf"), ("vllm:float32:ngram", "vllm:float32")):
        e = s[label]
        assert e["plain_label"] == plain
        assert e["speedup_vs_plain"] == round(e["tokens_per_second"] / s[plain]["tokens_per_second"], 4)
        assert all(c["speedup_vs_plain"] is not None for c in e["per_category"].values())
    assert s["hf"]["speedup_vs_plain"] is None and s["ar"]["speedup_vs_plain"] is None
    report = (out / "report.md").read_text()
    assert "Speculation against its own plain decoding" in report and "`hf-lookup` vs `hf`" in report


def test_peers_need_greedy(tiny_text_model_dir, prompt_file, tmp_path, capsys):
    assert bench(tiny_text_model_dir, prompt_file, tmp_path, "--peers", "vllm", "--temperature", "0.7") == 2
    assert "greedy" in capsys.readouterr().err


# ---- the real engines, where scripts/install-peers.sh has installed them ---------------------
def _real(engine: str) -> str:
    python, why = find_python(engine, {})
    if python is None:
        pytest.skip(why)
    return python


@pytest.mark.peers
@pytest.mark.parametrize("engine,peer", [("llama.cpp", "llama.cpp:q4_1"), ("vllm", "vllm:float32")])
def test_real_peer_on_the_default_model(engine, peer, tmp_path, four_bit_kernel):
    """The installed engine on the default model: it runs and agrees with ar on the first tokens
    (hispec on ``q4``, whose tokens follow float32's: ``q8a``'s 8-bit activations, the timed choice
    on CPUs with VNNI, part from them at the second token of this prompt)."""
    _real(engine)
    four_bit_kernel("q4")
    from hispec.model.load.registry import DEFAULT_MODEL, KNOWN_MODELS, models_dir
    if not (models_dir() / KNOWN_MODELS[DEFAULT_MODEL].folder).exists():
        pytest.skip("the default model is not converted")
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": "sky", "prompt": "Why is the sky blue?"}) + "\n")
    out = tmp_path / "out"
    assert main(["bench", "--data", str(data), "--strategies", "ar", "--peers", peer, "--max-new-tokens", "8",
                 "--threads", "2", "--out", str(out), "--no-progress", "--no-plots", "--agree-first", "4"]) == 0
    e = json.loads((out / "results.json").read_text())["strategies"][peer]
    assert e["available"], e["reason"]
    assert e["agreement_with_ar"]["first_n_identical"] == 1


def test_llama_cpp_runs_the_gguf_file_hispec_loads(tmp_path, monkeypatch):
    """llama.cpp peers get the GGUF file the model comes from, whatever its architecture and type:
    labelled by its type (``general.file_type``), ``gguf`` the same file, f16/f32 its float copies
    (cached per source file); another type, or a model without a GGUF file, is refused."""
    from types import SimpleNamespace

    gguf = pytest.importorskip("gguf")
    import numpy as np

    from hispec.bench import gguf_float
    from hispec.bench.peers import PeerRunner, model_gguf, model_gguf_type, peer_weights

    def write(path, file_type):
        w = gguf.GGUFWriter(str(path), "gemma3")
        w.add_file_type(file_type)
        w.add_tensor("token_embd.weight", np.ones((4, 32), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    src = write(tmp_path / "gemma-3-270m-q4_k_m.gguf", int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    assert model_gguf(str(src)) == src and model_gguf_type(str(src)) == "q4_k_m"
    specs = parse_peers("llama.cpp", model_gguf_type(str(src)))
    assert [p.label for p in specs] == ["llama.cpp:q4_k_m", "llama.cpp:f16", "llama.cpp:f32"]
    assert [p.label for p in parse_peers("llama.cpp:gguf:lookup", "q4_k_m")] == ["llama.cpp:q4_k_m",
                                                                                  "llama.cpp:q4_k_m:lookup"]
    with pytest.raises(ConfigError, match="Q4_K_M"):
        parse_peers("llama.cpp:q4_1", "q4_k_m")

    gen = SimpleNamespace(model=SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=512)), model_path=None)
    runner = PeerRunner(specs[0], gen, model_name=str(src), threads=2, python_overrides={}, log_dir=tmp_path)
    runner.weights = peer_weights(specs[0], gen, str(src))
    argv = runner._argv()
    assert argv[:4] == ["--engine", "llama.cpp", "--model", str(src)] and runner.weights.describe == src.name
    assert peer_weights(parse_peers("llama.cpp:gguf", None)[0], gen, str(src)).model == str(src)
    with pytest.raises(ConfigError, match="is Q4_K_M"):  # parsed for the default model's Q4_1 file
        peer_weights(parse_peers("llama.cpp:q4_1")[0], gen, str(src))

    monkeypatch.setattr(gguf_float, "cache_dir", lambda: tmp_path / "cache")
    f16 = peer_weights(specs[1], gen, str(src))
    assert Path(f16.model).parent.parent == tmp_path / "cache"
    assert Path(f16.model).name == "gemma-3-270m-q4_k_m.F16.gguf"
    assert f16.describe == "gemma-3-270m-q4_k_m.F16.gguf (dequantized from gemma-3-270m-q4_k_m.gguf)"
    (tmp_path / "other").mkdir()
    other = write(tmp_path / "other" / "gemma-3-270m-q4_k_m.gguf", int(gguf.LlamaFileType.MOSTLY_Q8_0))
    assert model_gguf_type(str(other)) == "q8_0"
    assert peer_weights(parse_peers("llama.cpp:f16", "q8_0")[0], gen, str(other)).model != f16.model  # its own copy

    folder = tmp_path / "hf-folder"
    folder.mkdir()
    assert model_gguf(str(folder)) is None and model_gguf_type(str(folder)) is None
    assert [p.label for p in parse_peers("llama.cpp", None)] == ["llama.cpp:gguf", "llama.cpp:f16", "llama.cpp:f32"]
    with pytest.raises(ConfigError, match="not loaded from one"):
        peer_weights(parse_peers("llama.cpp", None)[0], gen, str(folder))
    default = model_gguf("default")
    if default is not None:  # the default model's own Q4_1 file, as before
        assert model_gguf_type("default") == "q4_1"
        assert peer_weights(parse_peers("llama.cpp:q4_1")[0], gen, "default").model == str(default)
