"""Free drafts from earlier requests' outputs (``spec/proposers/suffix.py``'s ``SuffixCache`` and
``SuffixStore``, wired into the engine): a second identical request drafts from the first one's
output and commits more tokens per pass; scopes never share; the memory stays bounded; greedy
output stays ``ar``'s and seeded sampling stays reproducible; the server scopes by API key and
``user``."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from hispec.config import ConfigError, EngineConfig, SamplingParams
from hispec.spec.cost import RowCost
from hispec.spec.proposers.lookup import LOOKUP, SUFFIX, Branch, LookupState, free_drafts
from hispec.spec.proposers.suffix import SuffixCache, SuffixStore
from hispec.engine.engine import Engine
from hispec.generate import Generator, make_strategy
from hispec.model.load.checkpoint import load_model

from tests.decode.test_lookup import PROMPTS, SPEC

# No n-gram repeats inside it: prompt lookup has nothing to draft from until the output loops.
PLAIN_PROMPT = [3, 71, 18, 94, 25, 60, 7, 112, 41, 88, 15, 33]


# ---- the cache and the store ----------------------------------------------------------------

def test_continuations_are_output_only_and_kept_per_next_token():
    cache = SuffixCache(max_ngram=2, k=3, capacity=100, branches=2)
    cache.add([1, 2, 3, 4, 5], start=2)  # the prompt's tail [1, 2] leads the output [3, 4, 5] in
    assert cache.propose([9, 1, 2], 3) == (2, [3, 4, 5])
    assert cache.propose([9, 1], 3) == (0, [])  # 1 -> 2 is the prompt's text, not a continuation
    cache.add([7, 2, 8, 9])
    assert cache.branches_of([5, 2], 3) == [[8, 9], [3, 4, 5]]  # most recent first
    cache.add([0, 2, 6])  # a third next token after 2: only two branches are kept
    assert cache.branches_of([5, 2], 3) == [[6], [8, 9]]
    cache.add([4, 2, 8, 1])  # the same next token as [8, 9]: the more recent one replaces it
    assert cache.branches_of([5, 2], 3) == [[8, 1], [6]]
    assert cache.propose([5, 2], 1) == (1, [8])


def test_scopes_never_share_and_the_least_recently_used_goes():
    store = SuffixStore(entries=64, scopes=2, max_ngram=3, k=4)
    waiting = store.cache_for("a")  # a request in flight holds its scope's cache, empty so far
    assert store.cache_for("a") is waiting
    store.add("a", [1, 2], [5, 6, 7, 8])
    assert waiting.propose([2, 5], 4) == (2, [6, 7, 8])  # it sees what finished meanwhile
    assert store.cache_for("b").propose([2, 5], 4) == (0, [])
    assert store.cache_for("a").propose([2, 5], 4) == (2, [6, 7, 8])
    store.add(None, [1, 2], [5, 9])  # the default scope: a third one, "b" (least recently used) goes
    assert set(store.caches) == {"a", ""}
    assert store.cache_for("a").propose([2, 5], 4) == (2, [6, 7, 8])
    assert store.cache_for(None).propose([2, 5], 4) == (2, [9])


def test_memory_is_bounded():
    """Whatever is added: at most ``scopes`` caches of at most ``entries`` n-grams, each with at
    most ``branches`` continuations of at most ``k`` tokens (about 300-430 bytes an n-gram)."""
    import tracemalloc

    rng = random.Random(0)
    store = SuffixStore(entries=512, scopes=3, max_ngram=3, k=4, branches=4)
    tracemalloc.start()
    for i in range(60):
        scope = f"client {i % 7}" if i < 45 else "busy"
        store.add(scope, [1, 2, 3], [40000 + rng.randrange(40) for _ in range(rng.randrange(1, 200))])
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(store.caches) == 3 and store.num_entries <= 3 * 512
    assert len(store.caches["busy"]) == 512  # full: its oldest n-grams went
    for cache in store.caches.values():
        assert len(cache) <= 512
        assert all(1 <= len(f) <= 4 and len(follows) <= 4 for follows in cache.table.values() for f in follows)
    assert held < 3 * 512 * 1000, held
    assert store.to_dict() == {"scopes": 3, "entries": store.num_entries, "max_scopes": 3,
                               "max_entries_per_scope": 512}


def ctx_of(tokens, suffix, greedy=True, remaining=50):
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    return SimpleNamespace(tokens=list(tokens), suffix=suffix, params=params, remaining=remaining, lookup=None)


def test_the_longer_match_drafts_greedy_or_sampled():
    suffix = SuffixCache(max_ngram=3, k=4)
    suffix.add([10, 11, 12, 13, 14, 15])
    own = [5, 6, 11, 12, 99, 5, 6, 11, 12]  # its own text matches "6 11 12" (3 tokens)
    short = [7, 11, 12]  # only the suffix cache matches "11 12"
    batch = [ctx_of(own, suffix), ctx_of(short, suffix), ctx_of(short, suffix, greedy=False)]
    assert free_drafts(batch, 4, 3, None) == [[99, 5, 6, 11], [13, 14, 15], [13, 14, 15]]
    assert [(c.lookup.source, c.lookup.last_n) for c in batch] == [(LOOKUP, 3), (SUFFIX, 3 + 2), (SUFFIX, 3 + 2)]
    c = ctx_of([11, 12, 2, 7, 11, 12], suffix)  # equal lengths (2): the sequence's own text first
    assert free_drafts([c], 4, 3, None) == [[2, 7, 11, 12]] and c.lookup.source == LOOKUP
    cost = RowCost()  # with a cost: the suffix row's own estimates decide (prior 0.6, rows at 0.25), and learn
    c = ctx_of(short, suffix)
    assert free_drafts([c], 4, 3, cost) == [[13, 14]]
    for _ in range(12):
        c.lookup.length.record(c.lookup.last_n, 2, 0)
    assert free_drafts([c], 4, 3, cost) == [[]]
    c.tokens = own  # prompt lookup's rows are another table, at its measured prior: a 3-token match drafts all
    assert free_drafts([c], 4, 3, cost) == [[99, 5, 6, 11]]


def test_branches_merge_both_sources():
    suffix = SuffixCache(max_ngram=3, k=4)
    suffix.add([8, 11, 12, 40, 41])
    suffix.add([9, 11, 12, 50])
    state = LookupState(4, 3)
    tokens = [11, 12, 30, 31, 11, 12]
    assert state.branches(tokens, suffix, 2) == [Branch(LOOKUP, 2, [30, 31]), Branch(SUFFIX, 2, [50]),
                                                 Branch(SUFFIX, 2, [40, 41])]
    suffix.add([11, 12, 30, 31])  # the same continuation as prompt lookup's: one branch
    assert [b.tokens for b in state.branches(tokens, suffix, 2)] == [[30, 31], [50], [40, 41]]
    assert state.branches(tokens, None, 2) == [Branch(LOOKUP, 2, [30, 31])]


# ---- the engine -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gen(tiny_model_dir) -> Generator:
    return Generator(load_model(tiny_model_dir("llama")))


def engine_for(gen, strategy, adaptive=False, **config):
    return Engine(gen.model, make_strategy(strategy, SPEC, gen.model.num_layers),
                  EngineConfig(max_batch_size=4, adaptive=adaptive, kv_blocks=96, **config), eos_ids=gen.eos_ids)


def run(engine, prompt, params, scope=None):
    rid = engine.add_request(prompt, params, draft_scope=scope)
    return engine.run_to_completion()[rid]


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
def test_a_second_identical_request_drafts_from_the_first(gen, strategy):
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    want = gen.generate(PLAIN_PROMPT, params, "ar").token_ids
    engine = engine_for(gen, strategy)
    first, second = run(engine, PLAIN_PROMPT, params), run(engine, PLAIN_PROMPT, params)
    other = run(engine, PLAIN_PROMPT, params, scope="someone else")
    assert first.token_ids == second.token_ids == other.token_ids == want
    assert "suffix" not in first.stats.rounds and "suffix" not in other.stats.rounds  # never shared
    suffix = second.stats.levels["suffix->final"]
    assert second.stats.rounds["suffix"] > 0 and suffix.accepted_tokens > 0
    assert second.stats.full_passes < first.stats.full_passes  # more tokens per round
    assert second.stats.mean_accepted_length > first.stats.mean_accepted_length
    assert engine.stats()["suffix_cache"]["scopes"] == 2


@pytest.mark.parametrize("strategy", ["lookup", "hispec"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_equals_ar_with_earlier_outputs_drafting(gen, strategy, adaptive):
    """Twice through the same engine (batched, end conditions inside rounds): the second pass
    drafts from the first's outputs (and from each other's, the longer prompts finishing last);
    every output equals its own ``ar`` output; a seeded sampled request gives ``ar``'s tokens both
    times, drafting from the cache or not."""
    prompts = PROMPTS + [PLAIN_PROMPT, PLAIN_PROMPT[:7]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 3, 17, 29, 33)]
    params.append(SamplingParams(max_new_tokens=25))
    want = [gen.generate(p, sp, "ar").token_ids for p, sp in zip(prompts, params)]
    sampled = SamplingParams(temperature=1.0, seed=3, max_new_tokens=30, ignore_eos=True)
    want_sampled = gen.generate(PLAIN_PROMPT, sampled, "ar").token_ids
    engine = engine_for(gen, strategy, adaptive)
    got, suffix_rounds = [], 0
    for _ in range(2):
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        ids.append(engine.add_request(PLAIN_PROMPT, sampled))
        final = engine.run_to_completion()
        assert [final[r].token_ids for r in ids[:-1]] == want
        got.append(final[ids[-1]].token_ids)
        suffix_rounds += sum(final[r].stats.rounds.get("suffix", 0) for r in ids)
        assert engine.blocks.num_used_blocks == 0
    assert got[0] == got[1] == want_sampled
    if not adaptive:
        assert suffix_rounds > 0


def test_off_and_out_of_range(gen):
    assert engine_for(gen, "lookup", suffix_cache_entries=0).suffix is None
    assert engine_for(gen, "ar").suffix is None and engine_for(gen, "selfspec").suffix is None  # no free rounds
    engine = engine_for(gen, "lookup", suffix_cache_entries=0)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    run(engine, PLAIN_PROMPT, params)
    assert "suffix" not in run(engine, PLAIN_PROMPT, params).stats.rounds
    for option, value in (("suffix_cache_entries", -1), ("suffix_cache_entries", 1 << 23),
                          ("suffix_cache_scopes", 0)):
        with pytest.raises(ConfigError, match=option):
            EngineConfig(**{option: value})


def test_generator_keeps_outputs_only_when_given_a_store(gen):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    gen.generate(PLAIN_PROMPT, params, "lookup", spec=SPEC)
    assert "suffix" not in gen.generate(PLAIN_PROMPT, params, "lookup", spec=SPEC).stats.rounds
    store = SuffixStore.for_spec(SPEC, 1024, 4)
    first = gen.generate(PLAIN_PROMPT, params, "lookup", spec=SPEC, suffix=store)
    second = gen.generate(PLAIN_PROMPT, params, "lookup", spec=SPEC, suffix=store)
    assert first.token_ids == second.token_ids and second.stats.rounds["suffix"] > 0


# ---- the command line -----------------------------------------------------------------------

def test_cli_stats_show_suffix_rounds_and_refuse_a_bad_size(tiny_model_dir, tmp_path, capsys):
    from hispec.cli import main

    model = str(tiny_model_dir("llama"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt_ids": PLAIN_PROMPT}) + "\n" for i in range(2)))
    common = ["--model", model, "--no-exits", "--strategy", "lookup", "--max-new-tokens", "30", "--ignore-eos"]
    assert main(["generate", "--prompts", str(prompts), "--stats", "--no-adaptive", *common]) == 0
    err = capsys.readouterr().err
    assert "suffix->final" in err and "suffix " in err.split("rounds:")[1], err
    assert main(["generate", "--prompts", str(prompts), "--stats", "--suffix-cache-entries", "0", *common]) == 0
    assert "suffix" not in capsys.readouterr().err
    assert main(["generate", "[1, 2]", "--suffix-cache-entries", "-1", *common]) == 2
    assert "--suffix-cache-entries must be" in capsys.readouterr().err


# ---- the server -----------------------------------------------------------------------------

def server_state(gen, api_key):
    from hispec.server.async_engine import AsyncEngine
    from hispec.server.state import ServerState

    engine = Engine(gen.model, make_strategy("lookup", SPEC, gen.model.num_layers),
                    EngineConfig(max_batch_size=4, adaptive=False, kv_blocks=96), eos_ids=gen.eos_ids)
    cfg = gen.model.cfg
    return ServerState(engine=AsyncEngine(engine), tokenizer=None, model_names=("tiny",),
                       context_length=cfg.max_position_embeddings, vocab_size=cfg.vocab_size, strategy="lookup",
                       api_key=api_key)


def test_scope_of_a_request():
    from hispec.server.state import ServerState

    keyed = ServerState(engine=None, tokenizer=None, model_names=("m",), context_length=8, vocab_size=8,
                        strategy="lookup", api_key="sk-secret")
    open_ = ServerState(engine=None, tokenizer=None, model_names=("m",), context_length=8, vocab_size=8,
                        strategy="lookup")
    scopes = {keyed.draft_scope("Bearer sk-secret", None), keyed.draft_scope("Bearer sk-secret", "alice"),
              keyed.draft_scope("Bearer sk-secret", "bob"), open_.draft_scope(None, "alice")}
    assert len(scopes) == 4 and None not in scopes
    assert not any("sk-secret" in s or "alice" in s for s in scopes)  # hashed, never kept in the clear
    assert keyed.draft_scope("bearer sk-secret ", "alice") == keyed.draft_scope("Bearer sk-secret", "alice")
    # without a key the bearer token is not checked: it names no one
    assert open_.draft_scope("Bearer x", "alice") == open_.draft_scope("Bearer y", "alice")
    assert open_.draft_scope("Bearer x", None) is None  # the shared default scope


def test_server_scopes_by_key_and_user(gen):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from hispec.server.app import create_app

    auth = {"Authorization": "Bearer k1"}
    with TestClient(create_app(server_state(gen, "k1"))) as client:
        def complete(user=None):
            body = {"model": "tiny", "prompt": PLAIN_PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
            if user is not None:
                body["user"] = user
            r = client.post("/v1/completions", json=body, headers=auth)
            assert r.status_code == 200, r.text
            out = r.json()
            return out["hispec_stats"]["rounds"], out

        assert client.post("/v1/completions", json={"model": "tiny", "prompt": [1]}).status_code == 401
        first, out = complete("alice")
        assert "suffix" not in first
        assert complete("bob")[0] == first  # another user: nothing from alice's output
        assert complete()[0] == first  # the key alone: another scope again
        again, _ = complete("alice")
        assert again.get("suffix", 0) > 0  # alice's own earlier output drafts for her
