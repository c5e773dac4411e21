"""The adaptive controller: measures both modes, follows the faster one, re-measures the other
less and less often while it keeps losing, and switches when the rates change."""
from hispec.engine.adaptive import PLAIN, SPECULATE, AdaptiveController


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
    from hispec.engine.adaptive import CHAIN

    ctl = AdaptiveController(modes=(SPECULATE, CHAIN, PLAIN), warmup=1, explore_every=4, max_backoff=1)
    modes = drive(ctl, {SPECULATE: 10, CHAIN: 30, PLAIN: 20}, 3 + 40)
    assert modes[:3] == [SPECULATE, CHAIN, PLAIN]
    rest = modes[3:]
    assert rest.count(CHAIN) >= 28 and rest.count(SPECULATE) >= 3 and rest.count(PLAIN) >= 3
    assert ctl.steps == {SPECULATE: modes.count(SPECULATE), CHAIN: modes.count(CHAIN), PLAIN: modes.count(PLAIN)}


def test_tree_strategies_get_a_chain_mode():
    from hispec.config import SpecConfig
    from hispec.decode.speculative import HiSpec
    from hispec.engine.adaptive import CHAIN, adaptive_modes

    spec = SpecConfig(draft_layer=1, verify_layer=3)
    assert adaptive_modes(HiSpec(spec)) == (SPECULATE, PLAIN)
    assert adaptive_modes(HiSpec(SpecConfig(draft_layer=1, verify_layer=3, tree_width=3))) == (SPECULATE, CHAIN, PLAIN)


def test_its_report_shows_only_the_modes_it_measured():
    """Asking for a choice makes a bucket's entries; only those with a measurement are reported."""
    ctl = AdaptiveController(warmup=1)
    assert ctl.choose(1) == SPECULATE
    ctl.record(1, SPECULATE, 10, 0.1)
    assert ctl.to_dict()["tokens_per_second"] == {"batch<=1:speculate": 100.0}
