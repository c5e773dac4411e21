"""Token trees over the paged cache: a tree node computes, bit for bit, what the same token computes
as the last token of a chain (its ancestors), on the fused kernels and on the eager path; keeping a
path moves its K/V into place, so decoding goes on exactly as after the chain."""
from __future__ import annotations

import pytest
import torch

from hispec.cache.block_manager import BlockManager
from hispec.cache.kv_cache import KVPool, TreeLayout
from hispec.model.runner import LayerRunner
from hispec.model.load.checkpoint import apply_quantization, load_model

BLOCK = 4  # small blocks: trees and paths cross block boundaries
PROMPT = [(5 * i + 3) % 97 for i in range(10)]
# node:     0    1    2    3    4    5    6
TOKENS = [11, 40, 12, 41, 13, 42, 14]
PARENTS = (-1, 0, 0, 2, 2, 4, 4)
PATH = [0, 2, 4, 6]  # tokens 11, 12, 13, 14: the chain


@pytest.fixture(scope="module", params=["float32", "int4", "kv-bf16", "eager"])
def model(request, tiny_model_dir):
    m = load_model(tiny_model_dir("llama"))
    if request.param == "int4":
        apply_quantization(m, "int4")
    if request.param == "kv-bf16":
        m.kv_cache_dtype = torch.bfloat16
    m.eager = request.param == "eager"
    m.row_exact = request.param in ROW_EXACT
    return m


def _runner(model) -> LayerRunner:
    cfg, n = model.cfg, model.num_layers
    blocks = BlockManager(32, BLOCK, n)
    pool = KVPool(n, 32, BLOCK, cfg.num_kv_heads, cfg.head_dim, model.kv_dtype, "cpu")
    blocks.add_sequence(0)
    runner = LayerRunner(model, blocks, pool)
    runner.forward(0, 0, torch.tensor(PROMPT), 0, n)
    return runner


@pytest.fixture
def eager(model, monkeypatch):
    if model.eager:
        monkeypatch.setenv("HISPEC_FUSED", "0")


OTHER = [11, 50, 12, 51, 13, 52, 14]  # the same path, other tokens off it
# float32 matmuls may round differently with the number of rows in a call (the kernel is chosen by
# timing: ``kernels.matmul.panel_rows``): a tree and its chain are then equal up to rounding;
# calls with as many rows give the same bits.
ROW_EXACT = {"int4"}


def _check_equal(model, got, want):
    if model.row_exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _tree_states(model, tokens) -> torch.Tensor:
    """The final states ``[7, H]`` of the tree (in two passes over the first layer, nodes 0..3 then
    4..6, their ancestors written before them, then one pass over the other layers)."""
    n, root = model.num_layers, len(PROMPT)
    tree, runner = TreeLayout(root, PARENTS), _runner(model)
    low = runner.forward_many([(0, root, torch.tensor(tokens[:4]))], 0, 1, trees=[tree])[0]
    low = torch.cat([low, runner.forward_many([(0, root + 4, torch.tensor(tokens[4:]))], 0, 1, trees=[tree])[0]])
    return runner.forward_many([(0, root, low)], 1, n, trees=[tree])[0]


@torch.no_grad()
def test_tree_nodes_equal_their_chain(model, eager):
    n, root = model.num_layers, len(PROMPT)
    high = _tree_states(model, TOKENS)  # [7, H]
    # nodes off a node's path are invisible to it: the same path among other branches, the same bits
    assert torch.equal(_tree_states(model, OTHER)[PATH], high[PATH])
    chain = _runner(model).forward(0, root, torch.tensor([TOKENS[i] for i in PATH]), 0, n)  # [4, H]
    _check_equal(model, high[PATH], chain)
    # a branch's node differs from the path's node at its depth (it is another token there)
    assert not torch.allclose(high[1], chain[1])


@torch.no_grad()
def test_kept_path_decodes_as_the_chain(model, eager):
    n, root = model.num_layers, len(PROMPT)
    ref = _runner(model)
    ref.forward(0, root, torch.tensor([TOKENS[i] for i in PATH]), 0, n)
    after_chain = ref.forward(0, root + len(PATH), torch.tensor([7, 8]), 0, n)

    def kept(tokens):
        runner, tree = _runner(model), TreeLayout(root, PARENTS)
        runner.forward_many([(0, root, torch.tensor(tokens))], 0, n, trees=[tree])
        runner.keep_path(0, tree, PATH)
        assert [runner.blocks.length(0, layer) for layer in range(n)] == [root + len(PATH)] * n
        return runner.forward(0, root + len(PATH), torch.tensor([7, 8]), 0, n)

    assert torch.equal(kept(TOKENS), kept(OTHER))  # the other branches left nothing behind
    _check_equal(model, kept(TOKENS), after_chain)


@torch.no_grad()
def test_kept_path_where_deeper_layers_hold_part_of_the_tree(model, eager):
    """Layers that hold only the first nodes keep the part of the path among them."""
    n, root = model.num_layers, len(PROMPT)
    runner, tree = _runner(model), TreeLayout(root, PARENTS)
    h = runner.forward_many([(0, root, torch.tensor(TOKENS))], 0, 1, trees=[tree])[0]
    runner.forward_many([(0, root, h[:3])], 1, n, trees=[tree])  # nodes 0..2 reach the last layers
    runner.keep_path(0, tree, PATH)
    assert runner.blocks.length(0, 0) == root + 4 and runner.blocks.length(0, n - 1) == root + 2


def test_tree_layout_checks_parents():
    with pytest.raises(AssertionError):
        TreeLayout(3, (-1, 2, 0))
    t = TreeLayout(3, PARENTS)
    assert [t.depth(i) for i in range(7)] == [0, 1, 1, 2, 2, 3, 3] and t.path(5) == [0, 2, 4, 5]
