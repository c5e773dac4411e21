"""Per-token data the OpenAI API needs from the engine, the same whatever the strategy:

- ``logprobs``: the final layer's raw log-probabilities of each committed token (and the top
  alternatives) equal ``log_softmax`` of a plain full forward pass over prompt + output;
- ``prompt_logprobs`` (``echo``): a plain prefill's log-probabilities of the prompt's tokens;
- presence/frequency penalties and ``logit_bias`` change the target's logits identically at
  every level and every verified row: greedy outputs of every strategy equal ``ar``'s, and
  ``ar``'s equal a naive reference decoder.
"""
from __future__ import annotations

import pytest
import torch

from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import KVPool
from hispec.config import SamplingParams, SpecConfig
from hispec.model.runner import LayerRunner
from hispec.engine import Engine
from hispec.generate import make_strategy
from hispec.model.load.checkpoint import load_model
from hispec.sampling.processors import LogitsProcessor

STRATEGIES = {
    "ar": None,
    "selfspec": SpecConfig(2, 6, num_draft=3),
    "hispec": SpecConfig(1, 3, num_draft=3, window=4),
    "hispec-svip": SpecConfig(2, 4, draft_policy="svip", svip_threshold=3.0),
    "lookup": SpecConfig(1, 3, lookup_max_draft=4),
}
PROMPTS = [[5, 17, 3, 99, 42], [7], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    m = load_model(tiny_model_dir("llama"))
    for layer in m.layers[2:]:  # early exits agree often, so drafts get accepted and rows batched
        layer.o_proj.weight.mul_(0.1)
        layer.down_proj.weight.mul_(0.1)
    return m


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    """A plain forward of ``tokens`` through every layer: logits ``[T, V]``."""
    blocks = BlockManager(64, 4, model.num_layers)
    pool = KVPool(model.num_layers, 64, 4, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype, "cpu")
    blocks.add_sequence(0)
    h = LayerRunner(model, blocks, pool).forward(0, 0, torch.tensor(tokens), 0, model.num_layers)
    return model.exit_logits(h, model.num_layers)


def run(model, name, params_list, prompts=PROMPTS, adaptive=False):
    engine = Engine(model, make_strategy(name.split("-")[0], STRATEGIES[name], model.num_layers),
                    kv_blocks=64, block_size=4, max_batch_size=8, adaptive=adaptive)
    ids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    logprobs = {i: [] for i in ids}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += out.new_logprobs or []
            if out.finished:
                final[out.request_id] = out
    return [(final[i], logprobs[i]) for i in ids]


@pytest.mark.parametrize("name", list(STRATEGIES))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_targets_raw_logprobs(model, name, temperature):
    params = [SamplingParams(temperature=temperature, seed=s, max_new_tokens=12, ignore_eos=True, logprobs=3)
              for s in range(len(PROMPTS))]
    for prompt, (out, lps) in zip(PROMPTS, run(model, name, params)):
        assert [lp.token for lp in lps] == out.token_ids
        ref = torch.log_softmax(full_logits(model, prompt + out.token_ids)[len(prompt) - 1:-1].float(), -1)
        got = torch.tensor([lp.logprob for lp in lps])
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
        for lp, row in zip(lps, ref):
            assert len(lp.top) == 3
            top_ids = [t for t, _ in lp.top]
            assert row[top_ids].tolist() == sorted(row[top_ids].tolist(), reverse=True)
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), row.topk(3).values, atol=1e-4, rtol=0)
            if temperature == 0.0:  # greedy: the chosen token is the top one, with the same number
                assert lp.top[0] == (lp.token, lp.logprob)


def test_logprobs_are_the_same_for_every_strategy_and_batch(model):
    params = lambda: [SamplingParams(max_new_tokens=10, ignore_eos=True, logprobs=2) for _ in PROMPTS]  # noqa: E731
    ref = run(model, "ar", params())
    for name in ("selfspec", "hispec", "lookup"):
        for (out, lps), (ref_out, ref_lps) in zip(run(model, name, params(), adaptive=True), ref):
            assert out.token_ids == ref_out.token_ids
            torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]),
                                       torch.tensor([lp.logprob for lp in ref_lps]), atol=1e-4, rtol=0)
            assert [[t for t, _ in lp.top] for lp in lps] == [[t for t, _ in lp.top] for lp in ref_lps]


@pytest.mark.parametrize("name", ["ar", "hispec"])
def test_prompt_logprobs_equal_a_plain_prefill(model, name):
    params = [SamplingParams(max_new_tokens=1, prompt_logprobs=2, logprobs=2) for _ in PROMPTS]
    for prompt, (out, _) in zip(PROMPTS, run(model, name, params)):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        if len(prompt) == 1:
            continue
        ref = torch.log_softmax(full_logits(model, prompt)[:-1].float(), -1)  # rows 0..T-2 predict tokens 1..T-1
        want = ref.gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert [lp.token for lp in plp[1:]] == prompt[1:]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in plp[1:]]), want, atol=1e-4, rtol=0)
        assert all(len(lp.top) == 2 for lp in plp[1:])


# ---- penalties and logit_bias -------------------------------------------------------------------

def reference_greedy(model, prompt, params: SamplingParams) -> list[int]:
    """Plain greedy decoding with OpenAI's penalty formula, one full forward per token."""
    out: list[int] = []
    bias = dict(params.logit_bias)
    for _ in range(params.max_new_tokens):
        logits = full_logits(model, prompt + out)[-1].double()
        for t, b in bias.items():
            logits[t] += b
        for t in set(out):
            logits[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        out.append(int(logits.argmax()))
    return out


PENALTIES = [
    dict(frequency_penalty=1.5),
    dict(presence_penalty=2.0, frequency_penalty=0.3),
    dict(logit_bias=((3, 5.0), (17, -100.0))),
    dict(presence_penalty=-1.0, logit_bias=((42, 2.0),)),
]


@pytest.mark.parametrize("penalty", PENALTIES, ids=lambda p: ",".join(p))
def test_penalised_greedy_output_is_the_same_for_every_strategy(model, penalty):
    params = lambda: [SamplingParams(max_new_tokens=16, ignore_eos=True, **penalty) for _ in PROMPTS]  # noqa: E731
    plain = [out.token_ids for out, _ in run(model, "ar", params())]
    unpenalised = [out.token_ids for out, _ in run(model, "ar", [SamplingParams(max_new_tokens=16, ignore_eos=True)
                                                              for _ in PROMPTS])]
    assert plain != unpenalised  # the penalty changes the output: the test has power
    assert plain[0] == reference_greedy(model, PROMPTS[0], params()[0])
    for name in ("selfspec", "hispec", "hispec-svip", "lookup"):
        assert [out.token_ids for out, _ in run(model, name, params())] == plain, name


# ---- on rows of free drafts (prompt lookup) -------------------------------------------------------

# Prompts that repeat themselves: prompt lookup drafts from the first round on.
REPEATING = [[5, 17, 3, 99, 42] * 3, [7, 8] * 6, [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21] * 2 + [11, 12]]


def lookup_rounds(results) -> int:
    return sum(out.stats.rounds.get("lookup", 0) for out, _ in results)


# Besides PENALTIES (which push the model away from its loops: lookup drafts are rejected), two
# that let it repeat, so drafts are accepted and the rows after them count them; with these a row
# that counted its own draft among its ancestors (off by one) changes the output.
LOOKUP_PENALTIES = PENALTIES + [dict(presence_penalty=-2.0), dict(frequency_penalty=0.2, presence_penalty=-1.0),
                                dict(logit_bias=((12, 4.0), (5, 3.0)))]


@pytest.mark.parametrize("penalty", LOOKUP_PENALTIES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("name", ["lookup", "hispec"])
def test_penalties_on_lookup_rows_equal_ar(model, name, penalty):
    """Each row of a lookup pass is penalised and biased by the committed output plus the drafts
    before it (its own ancestors): the output and its log-probabilities equal ``ar``'s."""
    params = lambda: [SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=2, **penalty)  # noqa: E731
                      for _ in REPEATING]
    want = run(model, "ar", params(), REPEATING)
    got = run(model, name, params(), REPEATING)
    assert [out.token_ids for out, _ in got] == [out.token_ids for out, _ in want]
    assert lookup_rounds(got) > 0
    for (_, lps), (_, ref_lps) in zip(got, want):
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]),
                                   torch.tensor([lp.logprob for lp in ref_lps]), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["lookup", "hispec"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_on_lookup_rows_are_the_targets_raw_logprobs(model, name, temperature):
    """Greedy: the same log-probabilities and top alternatives as ``ar``; sampled: those of a
    plain full forward pass over prompt + output, for tokens committed by lookup rounds."""
    params = [SamplingParams(temperature=temperature, seed=s, max_new_tokens=14, ignore_eos=True, logprobs=3)
              for s in range(len(REPEATING))]
    got = run(model, name, params, REPEATING)
    assert lookup_rounds(got) > 0
    for prompt, (out, lps) in zip(REPEATING, got):
        assert [lp.token for lp in lps] == out.token_ids
        ref = torch.log_softmax(full_logits(model, prompt + out.token_ids)[len(prompt) - 1:-1].float(), -1)
        want = ref.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in lps]), want, atol=1e-4, rtol=0)
        for lp, row in zip(lps, ref):
            torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), row.topk(3).values, atol=1e-4, rtol=0)
    if temperature == 0.0:
        want = run(model, "ar", [SamplingParams(max_new_tokens=14, ignore_eos=True, logprobs=3) for _ in REPEATING],
                   REPEATING)
        assert [out.token_ids for out, _ in got] == [out.token_ids for out, _ in want]
        assert [[t for t, _ in lp.top] for _, lps in got for lp in lps] == \
            [[t for t, _ in lp.top] for _, lps in want for lp in lps]


def test_processor_rows_follow_their_speculative_prefix():
    """Row r of a pass counts the committed tokens plus the speculative tokens before it."""
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=1.0, logit_bias=((1, 3.0),))
    proc = LogitsProcessor(params, 8, torch.device("cpu"))
    proc.commit([2, 2, 5])
    logits = torch.randn(4, 8)
    spec = [7, 2, 5, 6]  # 7 precedes the pass; the pass's rows follow [7], [7, 2], [7, 2, 5], [7, 2, 5, 6]
    got = proc(logits, spec)
    for r in range(4):
        before = [2, 2, 5] + spec[:r + 1]
        want = logits[r].clone()
        want[1] += 3.0
        for t in set(before):
            want[t] -= 1.0 * before.count(t) + 0.5
        torch.testing.assert_close(got[r], want)
