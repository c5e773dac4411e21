"""The adaptive controller: measures both modes, follows the faster one, re-measures the other
less and less often while it keeps losing, and switches when the rates change."""
from hispec.spec.policy import PLAIN, SPECULATE, AdaptiveController


def drive(ctl: AdaptiveController, rates: dict[str, float], steps: int, batch_size: int = 1) -> list[str]:
    modes = []
    for _ in range(steps):
        mode = ctl.choose(batch_size)
        ctl.record(batch_size, mode, tokens=int(rates[mode]), seconds=1.0)
        modes.append(mode)
    return modes


def test_warm_up_measures_both_modes_then_follows_the_faster():
    ctl = AdaptiveController(warmup=3, explore_every=10)
    modes = drive(ctl, {SPECULATE: 20, PLAIN: 10}, 6)
    assert modes.count(SPECULATE) == 3 and modes.count(PLAIN) == 3
    assert drive(ctl, {SPECULATE: 20, PLAIN: 10}, 9) == [SPECULATE] * 9


def test_a_clearly_losing_mode_ends_its_warm_up_early():
    """Each mode is measured once first; one whose rate is below half the best's needs no more
    warm-up rounds (a fresh process pays for each), one within reach gets all of them."""
    ctl = AdaptiveController(warmup=3, explore_every=100)
    modes = drive(ctl, {SPECULATE: 40, PLAIN: 170}, 8)
    assert modes[:2] == [SPECULATE, PLAIN] and modes.count(SPECULATE) == 1
    assert modes[2:] == [PLAIN] * 6  # plain's own warm-up, then the better mode
    close = drive(AdaptiveController(warmup=3, explore_every=100), {SPECULATE: 100, PLAIN: 170}, 8)
    assert close.count(SPECULATE) == 3 and close[-2:] == [PLAIN, PLAIN]


def test_exploration_backs_off_while_the_other_mode_keeps_losing():
    ctl = AdaptiveController(warmup=1, explore_every=4, max_backoff=4)
    modes = drive(ctl, {SPECULATE: 10, PLAIN: 20}, 2 + 60)[2:]
    explored = [i for i, m in enumerate(modes) if m == SPECULATE]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps[:3] == [8, 16, 16]  # 4, then 8, then capped at 16 steps between explorations
    assert explored[0] == 3


def test_a_change_in_rates_is_followed_and_resets_the_backoff():
    ctl = AdaptiveController(warmup=1, explore_every=4, max_backoff=8, alpha=1.0)
    drive(ctl, {SPECULATE: 10, PLAIN: 20}, 40)
    assert ctl._backoff[0] > 1
    modes = drive(ctl, {SPECULATE: 30, PLAIN: 20}, 60)
    switched = modes.index(SPECULATE)
    assert switched <= 4 * 8  # found at the next exploration
    assert modes[switched + 1] == SPECULATE  # and followed from then on, but for explorations
    assert modes[-20:].count(SPECULATE) >= 18
    assert modes.index(PLAIN, switched) - switched <= 4  # the backoff restarted: re-measured soon


def test_buckets_are_measured_separately():
    ctl = AdaptiveController(warmup=2, explore_every=100)
    drive(ctl, {SPECULATE: 20, PLAIN: 10}, 10, batch_size=1)
    drive(ctl, {SPECULATE: 10, PLAIN: 20}, 10, batch_size=16)
    assert ctl.choose(1) == SPECULATE and ctl.choose(16) == PLAIN


def test_three_modes_follow_the_fastest_and_re_measure_each_loser():
    """A tree-drafting strategy's controller weighs trees, chains and plain steps."""
    from hispec.spec.policy import CHAIN

    ctl = AdaptiveController(modes=(SPECULATE, CHAIN, PLAIN), warmup=1, explore_every=4, max_backoff=1)
    modes = drive(ctl, {SPECULATE: 10, CHAIN: 30, PLAIN: 20}, 3 + 40)
    assert modes[:3] == [SPECULATE, CHAIN, PLAIN]
    rest = modes[3:]
    assert rest.count(CHAIN) >= 28 and rest.count(SPECULATE) >= 3 and rest.count(PLAIN) >= 3
    assert ctl.steps == {SPECULATE: modes.count(SPECULATE), CHAIN: modes.count(CHAIN), PLAIN: modes.count(PLAIN)}


def test_tree_strategies_get_a_chain_mode():
    from hispec.config import SpecConfig
    from hispec.decode.speculative import HiSpec
    from hispec.spec.policy import CHAIN, adaptive_modes

    spec = SpecConfig(draft_layer=1, verify_layer=3)
    assert adaptive_modes(HiSpec(spec)) == (SPECULATE, PLAIN)
    assert adaptive_modes(HiSpec(SpecConfig(draft_layer=1, verify_layer=3, tree_width=3))) == (SPECULATE, CHAIN, PLAIN)


def test_its_report_shows_only_the_modes_it_measured():
    """Asking for a choice makes a bucket's entries; only those with a measurement are reported."""
    ctl = AdaptiveController(warmup=1)
    assert ctl.choose(1) == SPECULATE
    ctl.record(1, SPECULATE, 10, 0.1)
    assert ctl.to_dict()["tokens_per_second"] == {"batch<=1:speculate": 100.0}


# ---- free-draft rounds: taken while they measure at least as fast as plain steps ----------------
def gate_rounds(gate, gain: float, steps: int, batch_size: int = 8, plain_seconds: float = 0.01) -> list[bool]:
    """Drive ``gate`` for ``steps`` steps whose free rounds (where allowed) commit ``gain`` times the
    tokens a plain step makes in the same time; whether each step took one."""
    taken = []
    for _ in range(steps):
        ok = gate.allows(batch_size)
        if ok:
            gate.record(batch_size, tokens=round(gain * batch_size * 10), seconds=10 * plain_seconds,
                        plain_seconds=plain_seconds)
        taken.append(ok)
    return taken


def test_free_rounds_that_lose_are_skipped_after_their_warm_up_and_re_measured_less_often():
    from hispec.spec.policy import FreeRoundGate
    gate = FreeRoundGate(warmup=4, explore_every=5, max_backoff=4)
    taken = gate_rounds(gate, 0.8, 4 + 80)
    assert taken[:4] == [True] * 4 and not any(taken[4:8]) and taken[8]  # measured, skipped, tried again
    tries = [i for i, t in enumerate(taken) if t][4:]
    assert [b - a for a, b in zip(tries, tries[1:])][:3] == [10, 20, 20]  # 5 skips, then 10, then 20 (capped)
    assert gate.gain_at(8) < 1 and gate.skipped[3] > 0


def test_free_rounds_that_pay_are_always_taken_and_buckets_are_apart():
    from hispec.spec.policy import FreeRoundGate
    gate = FreeRoundGate(warmup=2)
    assert all(gate_rounds(gate, 1.6, 50, batch_size=1))
    gate_rounds(gate, 0.7, 10, batch_size=8)
    assert gate.allows(1) and not gate.allows(8)
    assert gate.to_dict() == {"batch<=1": 1.6, "batch<=8": 0.7}


def test_free_round_gain_weighs_rounds_by_their_time():
    """Many short rounds that barely lose do not outweigh a few long ones that commit much more."""
    from hispec.spec.policy import FreeRoundGate
    gate = FreeRoundGate(warmup=1, decay=1.0)
    for _ in range(6):  # each 1 plain step long, 0.9 of its tokens
        gate.record(1, tokens=9, seconds=0.01, plain_seconds=0.001)
    gate.record(1, tokens=60, seconds=0.02, plain_seconds=0.001)  # 20 plain steps long, 3x its tokens
    assert gate.gain_at(1) == (6 * 9 + 60) / (6 * 10 + 20) > 1
    assert gate.allows(1)


def test_a_free_round_gain_change_is_followed_and_resets_the_backoff():
    from hispec.spec.policy import FreeRoundGate
    gate = FreeRoundGate(warmup=2, explore_every=3, max_backoff=8, decay=0.0)
    gate_rounds(gate, 0.5, 60)
    assert gate._backoff[3] == 8
    taken = gate_rounds(gate, 1.5, 60)
    first = taken.index(True)
    assert first < 3 * 8 and all(taken[first:])  # found at the next try, then taken at every step
    assert gate._backoff[3] == 1
