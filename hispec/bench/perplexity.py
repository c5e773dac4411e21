"""The perplexity of a model over a text (``hispec perplexity``), as llama.cpp's ``llama-perplexity``
or Hugging Face's sliding-window recipe computes it, on whichever weights and kernels the model was
loaded with.

The text is tokenized whole (no chat template). Where the tokenizer adds a BOS token, the token
list starts with it and the first token of every window is BOS (it replaces the text's token
there, as ``llama-perplexity`` does); such a token is never scored. Two ways to cut it into
windows of ``context`` tokens:

- **default** (``stride=None``, ``llama-perplexity``'s): consecutive, non-overlapping windows of
  ``context`` tokens (the tail that does not fill one is left out); in each, the first half
  (``context // 2`` tokens) is context only and the tokens after it are scored, each from the
  logits of the position before it (``context - 1 - context // 2`` tokens a window). The result is
  comparable to ``llama-perplexity -c CONTEXT``'s final estimate on the same tokens (which needs
  at least two windows of text; one is enough here).
- **sliding** (``stride=S``, Hugging Face's ``docs/transformers/perplexity``): windows of up to
  ``context`` tokens starting every ``S`` tokens (``S <= context``), the last one ending at the
  text's end; each scores only the tokens no earlier window scored (the first window every
  token but its first). A smaller stride gives each scored token more context and costs more.

Each window runs as a prompt is prefilled (``LayerRunner.forward_many`` with ``prefill=True``,
the engine's own path for prompt tokens, over a private paged KV pool), in pieces of
``PIECE_TOKENS`` positions, and the model's own head (``final_logits``) is applied to a bounded
number of rows at a time (``LOGIT_ELEMENTS``: never ``[T, V]`` of a long window at once), whose
log-softmax gives each scored token's negative log-likelihood; they are summed in float64.

The ``+/-`` is ``llama-perplexity``'s: the standard error of the mean per-token NLL times the
perplexity (``ppl * sqrt(var(nll) / (n - 1))``).
"""
from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch

from ..cache.paged import PagedCache
from ..config import ConfigError
from ..data import DataError
from ..model.runner import LayerRunner

DEFAULT_CONTEXT = 512
MIN_CONTEXT = 4  # the default method scores context - 1 - context // 2 tokens a window: at least one
PIECE_TOKENS = 512  # positions of a window run through the layers per call (bounds attention's scratch)
LOGIT_ELEMENTS = 1 << 22  # logits held at once (16 MiB of float32): 85 rows of a 49k vocabulary, 16 of 262k
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Window:
    """Tokens ``begin .. end - 1`` of the text go through the model; the tokens at ``first_target ..
    end - 1`` are scored (each from the logits of the position before it)."""

    begin: int
    end: int
    first_target: int

    @property
    def scored(self) -> int:
        return self.end - self.first_target


def windows(num_tokens: int, context: int, stride: int | None = None) -> list[Window]:
    """The windows over a text of ``num_tokens`` tokens (the module docstring's two methods)."""
    check_window_options(context, stride)
    if num_tokens < context:
        raise DataError(f"the text has {num_tokens} tokens; --context {context} needs at least {context} "
                        f"(one window): give a longer text or a smaller --context")
    if stride is None:
        return [Window(b, b + context, b + context // 2 + 1) for b in range(0, num_tokens - context + 1, context)]
    out, scored_to = [], 0  # tokens before scored_to are scored already
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        out.append(Window(begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return out


def check_window_options(context: int, stride: int | None) -> None:
    if context < MIN_CONTEXT:
        raise ConfigError(f"--context must be at least {MIN_CONTEXT}, got {context}")
    if stride is not None and not 0 < stride <= context:
        raise ConfigError(f"--stride must be between 1 and --context ({context}), got {stride}")


def text_tokens(tokenizer, text: str) -> tuple[list[int], int | None]:
    """``(token ids of text, BOS id or None)``: the whole text tokenized without special tokens,
    after the BOS token where the tokenizer adds one (then also the BOS each window starts with)."""
    if not text.strip():
        raise DataError("the text is empty")
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos] \
        and tokenizer("a", add_special_tokens=False)["input_ids"][:1] != [bos]
    ids = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])  # no "too long" warning
    return ([bos] + ids, bos) if adds_bos else (ids, None)


@dataclass
class PerplexityResult:
    context: int
    stride: int | None
    windows: int
    tokens: int  # the text's tokens (BOS included)
    tokens_scored: int
    tokens_evaluated: int  # positions run through the model, all windows
    nll_sum: float
    nll_sq_sum: float
    seconds: float

    @property
    def nll_mean(self) -> float:
        return self.nll_sum / self.tokens_scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_mean)

    @property
    def stderr(self) -> float:
        """``llama-perplexity``'s ``+/-``: the perplexity times the standard error of the mean NLL."""
        n = self.tokens_scored
        var = self.nll_sq_sum / n - self.nll_mean ** 2
        return self.perplexity * math.sqrt(var / (n - 1)) if n > 1 and var > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_evaluated / self.seconds if self.seconds > 0 else 0.0

    @property
    def method(self) -> str:
        return "llama.cpp" if self.stride is None else "sliding"

    def summary(self) -> str:
        how = (f"second half of each scored, as llama-perplexity -c {self.context}" if self.stride is None
               else f"stride {self.stride}")
        return (f"perplexity: {self.perplexity:.3f} +/- {self.stderr:.3f} over {self.tokens_scored} tokens "
                f"({self.windows} windows of {self.context}, {how})")

    def to_dict(self) -> dict:
        return {"context": self.context, "stride": self.stride, "method": self.method, "windows": self.windows,
                "tokens": self.tokens, "tokens_scored": self.tokens_scored, "tokens_evaluated": self.tokens_evaluated,
                "nll_mean": self.nll_mean, "perplexity": self.perplexity, "stderr": self.stderr,
                "seconds": round(self.seconds, 4), "tokens_per_second": round(self.tokens_per_second, 3)}


@torch.inference_mode()
def perplexity(model, tokens: list[int], *, context: int = DEFAULT_CONTEXT, stride: int | None = None,
               bos: int | None = None, progress: bool = False) -> PerplexityResult:
    """The perplexity of ``model`` (a loaded ``DecoderModel``) over ``tokens`` (``text_tokens``'s),
    windows of ``context`` tokens cut by ``windows(len(tokens), context, stride)``; ``bos``: the
    token each window starts with (None: the text's own). ``progress``: a tqdm bar on stderr."""
    from tqdm import tqdm

    if context > model.cfg.max_position_embeddings:
        raise ConfigError(f"--context {context} exceeds the model's {model.cfg.max_position_embeddings} positions")
    wins = windows(len(tokens), context, stride)
    cache = PagedCache.for_model(model, -(-context // BLOCK_SIZE) + 1, BLOCK_SIZE)
    runner = LayerRunner(model, cache.blocks, cache.pool)
    ids = torch.tensor(tokens, dtype=torch.long)
    nll_sum = nll_sq_sum = 0.0
    scored = evaluated = 0
    total = sum(w.scored for w in wins)
    started = time.perf_counter()
    with tqdm(total=total, desc="perplexity", unit="tok", file=sys.stderr, disable=None if progress else True) as bar:
        for w in wins:
            window = ids[w.begin:w.end].clone()
            if bos is not None:
                window[0] = bos
            s, sq = _score_window(runner, window.to(model.device), w.first_target - w.begin)
            nll_sum, nll_sq_sum = nll_sum + s, nll_sq_sum + sq
            scored, evaluated = scored + w.scored, evaluated + w.end - w.begin - 1
            bar.update(w.scored)
            bar.set_postfix(ppl=f"{math.exp(nll_sum / scored):.3f}", refresh=False)
    return PerplexityResult(context=context, stride=stride, windows=len(wins), tokens=len(tokens),
                            tokens_scored=scored, tokens_evaluated=evaluated, nll_sum=nll_sum, nll_sq_sum=nll_sq_sum,
                            seconds=time.perf_counter() - started)


def _score_window(runner: LayerRunner, window: torch.Tensor, first_target: int) -> tuple[float, float]:
    """``(sum, sum of squares)`` of the NLLs of ``window``'s tokens ``first_target ..`` (float64),
    its positions ``0 .. len - 2`` run through every layer as one sequence of the runner's pool."""
    model, blocks = runner.model, runner.blocks
    n, vocab = model.num_layers, model.cfg.vocab_size
    inputs, targets = window[:-1], window[1:]
    rows_at_once = max(1, LOGIT_ELEMENTS // vocab)
    total = torch.zeros(2, dtype=torch.float64)
    blocks.add_sequence(0)
    try:
        for a in range(0, inputs.shape[0], PIECE_TOKENS):
            b = min(a + PIECE_TOKENS, inputs.shape[0])
            h = runner.forward_many([(0, a, inputs[a:b])], 0, n, prefill=True)[0]  # [b - a, H]
            for r in range(max(a, first_target - 1), b, rows_at_once):  # position r predicts token r + 1
                e = min(r + rows_at_once, b)
                logits = model.final_logits(h[r - a:e - a]).float()  # [e - r, V]
                nll = -torch.log_softmax(logits, dim=-1).gather(1, targets[r:e, None]).squeeze(1).double().cpu()
                total += torch.stack((nll.sum(), nll.square().sum()))
    finally:
        blocks.free(0)
    return float(total[0]), float(total[1])
