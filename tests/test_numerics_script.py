"""scripts/numerics.py's divergence arithmetic (the script itself runs the model; not here)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "numerics.py"
spec = importlib.util.spec_from_file_location("numerics_script", SCRIPT)
numerics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(numerics)


def test_first_divergence():
    assert numerics.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert numerics.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert numerics.first_divergence([1, 2, 3], [9, 2, 3]) == 0
    assert numerics.first_divergence([1, 2, 3], [1, 2]) == 2  # stopped early (an EOS) where the reference went on
    assert numerics.first_divergence([1, 2], [1, 2, 3]) == 2
    assert numerics.first_divergence([], []) is None


def test_summarize_counts_identical_prompts_at_their_length():
    refs = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6]]
    outs = [[1, 2, 3, 4], [1, 9, 3, 4], [5, 6]]
    same, median, mean = numerics.summarize(refs, outs)
    assert same == 2
    assert median == 2  # agreeing 4, 1, 2
    assert mean == (4 + 1 + 2) / 3
