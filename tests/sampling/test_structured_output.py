"""Structured output (llguidance grammars) is lossless with respect to the constrained
distribution in every strategy:

- greedy: every strategy's output equals ``ar``'s under the same grammar, and it parses and
  validates against the JSON schema;
- sampling: on an 8-token model, the joint distribution of the first tokens equals the
  masked target's (chi-square, as in ``test_speculative_sampling``), and the same statistic
  rejects a mask that ignores the speculative tokens before each row.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

import llguidance  # noqa: E402

from hispec.config import SamplingParams, SpecConfig  # noqa: E402
from hispec.generate import Generator  # noqa: E402
from hispec.model.load.checkpoint import load_model  # noqa: E402
from hispec.sampling.grammar import Grammar, llguidance_tokenizer  # noqa: E402

from tests.conftest import write_char_tokenizer  # noqa: E402
from tests.decode.test_speculative_sampling import (PROMPT, hf_model, model_dir, SPEC, VOCAB, fit, reference_probs,  # noqa: E402
                                       report)  # hf_model, model_dir: fixtures

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["ab", "cd", "ef"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
STRATEGIES = {"ar": None, "selfspec": SpecConfig(2, 6, num_draft=3), "hispec": SpecConfig(1, 3, num_draft=3, window=4),
              "hispec-svip": SpecConfig(1, 2, draft_policy="svip", svip_threshold=3.0), "lookup": SpecConfig(1, 3),
              # token trees: each node masked by the grammar's state after its own ancestors
              "selfspec-tree": SpecConfig(2, 6, num_draft=3, tree_width=3, tree_min_prob=0.0),
              "hispec-tree": SpecConfig(1, 3, num_draft=3, window=4, tree_width=3, tree_min_prob=0.0,
                                         lookup_branches=2)}


@pytest.fixture(scope="module", params=["agreeing", "plain"])
def char_gen(request, tiny_model_dir, tmp_path_factory):
    """A character-tokenizer model whose early exits agree often (drafts accepted, EOS inside
    verified passes) or seldom (rejections and recovered tokens)."""
    import shutil

    folder = tmp_path_factory.mktemp("grammar-model") / "m"
    shutil.copytree(tiny_model_dir("llama", eos_token_id=2, bos_token_id=1), folder)
    write_char_tokenizer(folder)
    gen = Generator.from_pretrained(str(folder), progress=False)
    if request.param == "agreeing":
        for layer in gen.model.layers[2:]:
            layer.o_proj.weight.mul_(0.1)
            layer.down_proj.weight.mul_(0.1)
    return gen


@pytest.fixture
def strict_commits(monkeypatch):
    """Every committed token must be one the grammar allows (its state never goes wrong)."""
    from hispec.sampling.grammar import GrammarState

    right = GrammarState.commit

    def commit(self, tokens):
        right(self, tokens)
        assert not self.matcher.is_error(), self.matcher.get_error()

    monkeypatch.setattr(GrammarState, "commit", commit)


def valid(obj: dict) -> bool:
    return set(obj) == {"n", "ok", "tag"} and isinstance(obj["n"], int) and 0 <= obj["n"] <= 999 \
        and isinstance(obj["ok"], bool) and obj["tag"] in ("ab", "cd", "ef")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_in_every_strategy(char_gen, temperature, strict_commits):
    grammar = Grammar.json_schema(SCHEMA, llguidance_tokenizer(char_gen.tokenizer, char_gen.model.cfg.vocab_size))
    outputs = {}
    for name, spec in STRATEGIES.items():
        for prompt in ("Hi", "JSON please: "):
            params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=60, grammar=grammar)
            out = char_gen.generate(prompt, params, name.split("-")[0], spec=spec, chat=True)
            assert out.finish_reason == "eos", (name, out.text)
            assert valid(json.loads(out.text)), (name, out.text)
            outputs[name, prompt] = out.token_ids
    if temperature == 0.0:
        for prompt in ("Hi", "JSON please: "):
            assert len({tuple(outputs[name, prompt]) for name in STRATEGIES}) == 1, prompt


# A prompt that shows the answer's shape twice: prompt lookup drafts the JSON's keys and values.
EXAMPLE = '{"n":12,"ok":true,"tag":"ab"} {"n":12,"ok":true,"tag":"ab"} {"n":12,"ok":'


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_with_lookup_drafts(char_gen, temperature, strict_commits):
    """Lookup drafts under a grammar: each row masked by the grammar's state after the committed
    tokens and the drafts before it. Greedy: ``lookup`` and ``hispec`` give ``ar``'s output;
    sampled: a seeded request gives the same valid JSON twice. Lookup rounds ran."""
    grammar = Grammar.json_schema(SCHEMA, llguidance_tokenizer(char_gen.tokenizer, char_gen.model.cfg.vocab_size))
    outputs, rounds = {}, 0
    for name in ("ar", "lookup", "hispec"):
        for seed in (3, 3) if temperature else (3,):
            params = SamplingParams(temperature=temperature, seed=seed, max_new_tokens=60, grammar=grammar)
            out = char_gen.generate(EXAMPLE, params, name, spec=STRATEGIES.get(name), chat=False)
            assert out.finish_reason == "eos" and valid(json.loads(out.text)), (name, out.text)
            assert outputs.setdefault(name, out.token_ids) == out.token_ids, name  # the seeded run reproduces
            rounds += out.stats.rounds.get("lookup", 0) if name != "ar" else 0
    assert rounds > 0
    if temperature == 0.0:
        assert outputs["lookup"] == outputs["ar"] and outputs["hispec"] == outputs["ar"]


# ---- exactness on an 8-token model ----------------------------------------------------------------------
class EightTokens:
    """A tokenizer for llguidance: token i is the letter 'a' + i; token 2 ('<eos>') ends."""

    eos_token_id, bos_token_id = 2, None
    tokens = [bytes([ord("a") + i]) if i != 2 else b"<eos>" for i in range(VOCAB)]
    special_token_ids = [2]

    def __call__(self, s):
        s = s.decode() if isinstance(s, bytes) else s
        return [ord(ch) - ord("a") for ch in s]


REGEX = "[adf][bd-h](e|[gh]f)"  # which letters may follow depends on the ones before


@pytest.fixture(scope="module")
def eight():
    from llguidance._tokenizer import TokenizerWrapper

    tok = llguidance.LLTokenizer(TokenizerWrapper(EightTokens()))
    return tok, Grammar(llguidance.LLMatcher.grammar_from_regex(REGEX), tok)


@pytest.fixture(scope="module")
def gen8(model_dir):
    g = Generator(load_model(model_dir))
    g.eos_ids = frozenset()
    return g


def allowed(grammar: Grammar, prefix: tuple[int, ...]) -> list[int]:
    m = llguidance.LLMatcher(grammar.tokenizer, grammar.spec)
    assert m.consume_tokens(list(prefix))
    return [t for t in range(VOCAB) if m.validate_tokens([t]) == 1]


def exact_joint(hf, grammar, params) -> dict:
    joint = {(): 1.0}
    for _ in range(params.max_new_tokens):
        prefixes = list(joint)
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(s) for s in prefixes])).logits[:, -1].double()
        for r, s in enumerate(prefixes):
            mask = torch.full((VOCAB,), float("-inf"), dtype=torch.float64)
            mask[allowed(grammar, s)] = 0.0
            logits[r] += mask
        probs = reference_probs(logits, params)
        joint = {s + (t,): joint[s] * float(probs[i, t]) for i, s in enumerate(prefixes) for t in range(VOCAB)
                 if probs[i, t] > 0}
    return joint


def empirical(gen, strategy, params, grammar, num_seeds):
    from collections import Counter

    counts = Counter()
    for seed in range(num_seeds):
        p = SamplingParams(temperature=params.temperature, seed=seed, max_new_tokens=params.max_new_tokens,
                           grammar=grammar)
        counts[tuple(gen.generate(PROMPT, p, strategy, spec=SPEC).token_ids)] += 1
    return counts


def test_hispec_samples_the_constrained_distribution(gen8, hf_model, eight):
    _, grammar = eight
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    joint = exact_joint(hf_model, grammar, params)
    result = fit(empirical(gen8, "hispec", params, grammar, 400), joint)
    report("hispec/T1-grammar", result)
    assert result["stat"] <= result["bound"], result


def lookup_empirical(gen, params, grammar, num_seeds, prompt) -> tuple:
    from collections import Counter

    counts, drafted = Counter(), 0
    for seed in range(num_seeds):
        p = SamplingParams(temperature=params.temperature, seed=seed, max_new_tokens=params.max_new_tokens,
                           grammar=grammar)
        out = gen.generate(prompt, p, "lookup", spec=SpecConfig(1, 2, lookup_ngram=1))
        counts[tuple(out.token_ids)] += 1
        lv = out.stats.levels.get("lookup->final")
        drafted += lv.draft_tokens if lv else 0
    return counts, drafted


@pytest.mark.parametrize("blind", [False, True], ids=["right", "WRONG-blind-mask"])
def test_lookup_samples_the_constrained_distribution(gen8, hf_model, eight, monkeypatch, blind):
    """PROMPT + its first two tokens ends in 5 ('f'), which occurred before 3 7 1 ('d h b'): the
    first round verifies lookup drafts the grammar allows ('d', 'h') and then one it forbids
    ('b'). The committed tokens follow the masked target; a mask that ignores the drafts before
    each row (WRONG) is rejected by the same statistic."""
    _, grammar = eight
    prompt = PROMPT + PROMPT[:2]
    monkeypatch.setitem(globals(), "PROMPT", prompt)  # exact_joint's prompt
    if blind:
        from hispec.sampling.grammar import GrammarState

        right = GrammarState.mask
        monkeypatch.setattr(GrammarState, "mask",
                            lambda self, logits, spec: torch.cat([right(self, row, []) for row in logits.split(1)]))
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    counts, drafted = lookup_empirical(gen8, params, grammar, 150 if blind else 400, prompt)
    assert drafted > 400 if not blind else drafted > 0  # lookup drafts were really verified
    result = fit(counts, exact_joint(hf_model, grammar, params))
    report(f"{'WRONG blind grammar/' if blind else ''}lookup/T1-grammar", result)
    assert (result["stat"] > result["bound"]) if blind else (result["stat"] <= result["bound"]), result


def test_the_statistic_rejects_a_mask_blind_to_speculative_tokens(gen8, hf_model, eight, monkeypatch):
    """WRONG: every row of a pass masked with the committed tokens' state."""
    from hispec.sampling.grammar import GrammarState

    _, grammar = eight
    right = GrammarState.mask
    monkeypatch.setattr(GrammarState, "mask",
                        lambda self, logits, spec: torch.cat([right(self, row, []) for row in logits.split(1)]))
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    joint = exact_joint(hf_model, grammar, params)
    result = fit(empirical(gen8, "hispec", params, grammar, 100), joint)
    report("WRONG blind grammar/hispec/T1-grammar", result)
    assert result["stat"] > result["bound"], result
