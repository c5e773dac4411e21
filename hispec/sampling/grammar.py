"""Structured output: a grammar (JSON schema, any JSON object) masks the tokens a request may
choose, using llguidance (PyPI; the cheapest of the maintained libraries to install and run
on CPU: see the README).

A request's ``GrammarState`` follows its committed tokens. Like penalties, the mask of a row
depends on the speculative tokens before it: row ``r`` of a pass is masked by the grammar's
state after the committed tokens and the speculative tokens before row ``r``, so drafts the
grammar forbids have probability 0 under the masked target and are rejected like any other,
and the committed output is an exact sample of the constrained distribution.
"""
from __future__ import annotations

import json
import threading

import torch

_TOKENIZERS: dict[tuple[int, int], object] = {}
_LOCK = threading.Lock()


class GrammarError(ValueError):
    """The grammar or schema is invalid; the message says why."""


def llguidance_tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: seconds).
    Tokenizers llguidance cannot read directly (not byte-level BPE, e.g. a character
    tokenizer) are described token by token, each token's bytes being its decoded text."""
    import llguidance
    import llguidance.hf

    key = (id(hf_tokenizer), vocab_size)
    with _LOCK:
        if key not in _TOKENIZERS:
            try:
                _TOKENIZERS[key] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
            except ValueError:
                _TOKENIZERS[key] = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(hf_tokenizer,
                                                                                                  vocab_size)))
        return _TOKENIZERS[key]


class _TokenTexts:
    """The interface ``llguidance.TokenizerWrapper`` reads: each token's bytes, special ids, encode."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        self.hf = hf_tokenizer
        self.eos_token_id, self.bos_token_id = hf_tokenizer.eos_token_id, hf_tokenizer.bos_token_id
        self.special_token_ids = sorted(set(hf_tokenizer.all_special_ids))
        names = hf_tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
        self.tokens = [(hf_tokenizer.decode([i]) if i not in self.special_token_ids else (n or f"<{i}>")).encode()
                       if n is not None else f"<unused {i}>".encode() for i, n in enumerate(names)]

    def __call__(self, text: str) -> list[int]:
        return self.hf(text, add_special_tokens=False)["input_ids"]


class Grammar:
    """A grammar for one tokenizer; ``state()`` makes a request's matcher."""

    def __init__(self, spec: str, tokenizer) -> None:
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(spec, tokenizer)
        except Exception as e:
            error = str(e) or type(e).__name__
        if error:
            raise GrammarError(f"invalid grammar: {error}")
        self.spec, self.tokenizer = spec, tokenizer

    @classmethod
    def json_schema(cls, schema: dict | bool, tokenizer) -> "Grammar":
        import llguidance

        try:
            spec = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        except Exception as e:  # llguidance raises ValueError/RuntimeError with its reason
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return cls(spec, tokenizer)

    def state(self) -> "GrammarState":
        return GrammarState(self)


class GrammarState:
    """One request's position in its grammar."""

    def __init__(self, grammar: Grammar) -> None:
        import llguidance
        import llguidance.torch as llt

        self._llt = llt
        self.matcher = llguidance.LLMatcher(grammar.tokenizer, grammar.spec)
        self.vocab_size = grammar.tokenizer.vocab_size
        self.eos = frozenset(grammar.tokenizer.eos_tokens)

    def commit(self, tokens: list[int]) -> None:
        """Advance over newly committed tokens (every one was allowed: it came from a masked row);
        an end of sequence ends the request, so the matcher does not need it."""
        ends = [j for j, t in enumerate(tokens) if t in self.eos]
        tokens = tokens[:ends[0]] if ends else tokens
        if tokens:
            self.matcher.consume_tokens(tokens)

    def mask(self, logits: torch.Tensor, spec: list[int]) -> torch.Tensor:
        """Mask ``logits [T, V]`` in place (float32), rows as in ``LogitsProcessor.__call__``."""
        t = logits.shape[0]
        before, inside = spec[:len(spec) - (t - 1)], spec[len(spec) - (t - 1):]
        m = self.matcher
        if self.eos.intersection(before):  # rows after an end of sequence are never used
            return logits
        consumed = m.try_consume_tokens(before) if before else 0
        if consumed < len(before):  # a forbidden speculative token earlier: these rows are never used
            m.rollback(consumed)
            return logits
        bitmask = self._llt.allocate_token_bitmask(t, self.vocab_size)  # [T, ceil(V / 32)] int32
        # the pass's tokens the grammar allows, in order, up to an end of sequence (the matcher
        # stops there and cannot be rolled back; rows after it are never used)
        valid = m.validate_tokens(inside) if inside else 0
        valid = min([valid] + [j for j, tok in enumerate(inside) if tok in self.eos])
        for r in range(t):
            self._llt.fill_next_token_bitmask(m, bitmask, r)
            if r < t - 1:
                if r < valid:
                    m.consume_token(inside[r])
                else:  # inside[r] is forbidden: rows after r are never used; keep them valid
                    bitmask[r + 1:] = bitmask[r]
                    break
        m.rollback(consumed + min(valid, t - 1))
        self._llt.apply_token_bitmask_inplace(logits, bitmask)
        dead = torch.isneginf(logits).all(-1)  # a restricted-vocabulary exit with no allowed token left
        if bool(dead.any()):
            allowed = torch.zeros_like(logits[:1]).expand_as(logits).clone()
            self._llt.apply_token_bitmask_inplace(allowed, bitmask)
            logits[dead] = allowed[dead]
        return logits
