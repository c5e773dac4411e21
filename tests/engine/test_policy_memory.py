"""The speculation policy's memory (``spec.memory``): a fresh controller seeded with what an earlier
process measured takes the better mode at once and re-measures a clearly losing one at the longest
interval; an engine writes its measurements and the next engine of the same key starts from them,
with the same tokens."""
from __future__ import annotations

import pytest

from hispec.config import SamplingParams, SpecConfig
from hispec.engine.build import build_engine
from hispec.model.load.checkpoint import load_model
from hispec.spec import memory
from hispec.spec.policy import PLAIN, SPECULATE, AdaptiveController

from tests.engine.test_adaptive import drive, gate_rounds


def test_a_seeded_controller_takes_the_better_mode_at_once_and_explores_rarely():
    first = AdaptiveController(warmup=3, explore_every=10, max_backoff=4)
    drive(first, {SPECULATE: 40, PLAIN: 100}, 30, batch_size=16)
    drive(first, {SPECULATE: 90, PLAIN: 100}, 30, batch_size=1)
    fresh = AdaptiveController(warmup=3, explore_every=10, max_backoff=4)
    fresh.seed(first.state())
    at16 = drive(fresh, {SPECULATE: 40, PLAIN: 100}, 45, batch_size=16)
    assert at16[:39] == [PLAIN] * 39 and SPECULATE in at16[39:]  # first re-measured after 10 * 4 steps
    at1 = drive(fresh, {SPECULATE: 90, PLAIN: 100}, 12, batch_size=1)
    assert at1[:9] == [PLAIN] * 9 and SPECULATE in at1  # close rates: re-measured at the first interval
    unseeded = drive(AdaptiveController(warmup=3, explore_every=10, max_backoff=4), {SPECULATE: 40, PLAIN: 100}, 4,
                     batch_size=16)
    assert unseeded[0] == SPECULATE  # what seeding saves: each mode's first measurements


def test_seeded_free_round_gate_skips_where_free_rounds_lost():
    from hispec.spec.policy import FreeRoundGate

    gate = FreeRoundGate(warmup=4, explore_every=5, max_backoff=4)
    gate_rounds(gate, 0.3, 12)
    fresh = FreeRoundGate(warmup=4, explore_every=5, max_backoff=4)
    fresh.seed(gate.state(), clear_loss=0.5)
    taken = gate_rounds(fresh, 0.3, 25)
    assert taken[:19] == [False] * 19 and True in taken  # the longest interval (5 * 4) at once


def test_an_engine_keeps_its_measurements_for_the_next(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.setenv("HISPEC_POLICY_MEMORY", "1")
    model = load_model(tiny_model_dir("llama"))
    spec = SpecConfig(1, 3, num_draft=3, window=4)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)

    def run():
        engine = build_engine(model, "hispec", spec=spec, block_size=4, kv_blocks=64, max_batch_size=2)
        ids = [engine.add_request([5, 6, 7, 8, 9], params), engine.add_request([9, 8, 7], params)]
        final = engine.run_to_completion()
        return engine, [final[i].token_ids for i in ids]

    engine, first = run()
    files = list((tmp_path / "policy").glob("*.json"))
    assert len(files) == 1 and engine.adaptive.state()["rates"]
    saved = memory.load(files[0].stem)
    assert saved is not None and saved["rates"]
    again, second = run()
    assert second == first  # every mode gives the same tokens
    assert again.speculation.memory is engine.speculation.memory  # one per key for the process
    for key, (tps, _) in saved["rates"].items():  # the new controller started from the saved rates
        b, mode = key.split(":")
        assert (int(b), mode) in again.adaptive.rates
    monkeypatch.setenv("HISPEC_POLICY_MEMORY", "0")
    assert memory.load(files[0].stem) is None


def test_the_key_names_the_model_the_strategy_and_its_settings(tiny_model_dir):
    from hispec.engine.build import build_strategy

    model = load_model(tiny_model_dir("llama"))
    a = memory.policy_key(model, build_strategy("hispec", model.num_layers, spec=SpecConfig(1, 3)))
    b = memory.policy_key(model, build_strategy("hispec", model.num_layers, spec=SpecConfig(1, 2)))
    c = memory.policy_key(model, build_strategy("lookup", model.num_layers, spec=SpecConfig(1, 3)))
    assert len({a, b, c}) == 3
    assert a == memory.policy_key(model, build_strategy("hispec", model.num_layers, spec=SpecConfig(1, 3)))


def test_a_newly_measured_batch_size_is_written_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HISPEC_HOME", str(tmp_path))
    monkeypatch.setenv("HISPEC_POLICY_MEMORY", "1")
    m = memory.Memory("k")
    m.maybe_save({"rates": {"0:plain": [10.0, 3]}})
    m.maybe_save({"rates": {"0:plain": [11.0, 4]}})  # within SAVE_EVERY_S, nothing new: kept for later
    assert memory.load("k")["rates"] == {"0:plain": [10.0, 3]}
    m.maybe_save({"rates": {"0:plain": [12.0, 5], "4:plain": [50.0, 3]}})  # a new batch size: at once
    assert memory.load("k")["rates"]["4:plain"] == [50.0, 3]
    m.maybe_save({"rates": {"0:plain": [13.0, 6], "4:plain": [51.0, 4]}})
    m._flush()  # what the process's exit writes
    assert memory.load("k")["rates"]["0:plain"] == [13.0, 6]
