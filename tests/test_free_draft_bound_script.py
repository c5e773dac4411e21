"""scripts/free-draft-bound.py: its replay of prompt lookup over a known text (the matches, the
accepted drafts, the steps a policy takes) and the oracle's bound."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "free-draft-bound.py"
spec = importlib.util.spec_from_file_location("free_draft_bound", SCRIPT)
fdb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fdb)

# the prompt ends on "1 2 3", seen before with "4 1 2 3 9" after it; the output copies "4 1 2" then differs
PROMPT = [1, 2, 3, 4, 1, 2, 3, 9, 7, 1, 2, 3]
OUTPUT = [4, 1, 2, 8, 5, 6]


def test_the_measured_costs_are_interpolated_and_extrapolated():
    table = [(0, 0.0), (1, 0.1), (2, 0.15), (4, 0.35)]
    assert [round(fdb.interpolate(table, d), 3) for d in (0, 1, 2, 3, 4, 6)] == [0.0, 0.1, 0.15, 0.25, 0.35, 0.55]


def test_no_drafts_is_one_step_a_token():
    assert fdb.replay(PROMPT, OUTPUT, lambda n, cont, truth: []) == [0] * len(OUTPUT)


def test_drafts_accepted_up_to_the_first_wrong_one():
    seen = []

    def policy(n, cont, truth):
        seen.append((n, cont[:4], truth[:4]))
        return cont[:4] if n >= 3 else []

    steps = fdb.replay(PROMPT, OUTPUT, policy)
    # step 1: "1 2 3" matched (most recent: before "9"), drafts [9 7 1 2]: the first is wrong -> 4
    assert seen[0] == (3, [9, 7, 1, 2], [4, 1, 2, 8])
    # step 2: "2 3 4" matched at the prompt's start, drafts [1 2 3 9]: "1 2" accepted, then 8
    assert seen[1][:2] == (3, [1, 2, 3, 9])
    # then "1 2 8" and "2 8 5" have no match of 3 tokens: a token a step
    assert steps == [4, 4, 0, 0]


def test_the_oracle_drafts_only_what_is_accepted():
    assert fdb.replay(PROMPT, OUTPUT, fdb.oracle) == [0, 2, 0, 0]
    assert fdb.oracle(3, [1, 2, 3], [1, 2, 4]) == [1, 2]
    assert fdb.fixed(2, 1)(1, [5, 6], [5]) == [] and fdb.fixed(2, 1)(2, [5, 6], [5]) == [5]
