"""Token trees: several drafts per position, verified in one pass, the longest accepted path kept.

A ``DraftTree`` holds one sequence's proposal: node 0 is the pending token, node ``i > 0`` is
``tokens[i]`` following node ``parents[i]`` (parents first: the flat order is the cache order,
``cache.kv_cache.TreeLayout``). Its sources are free drafts (several prompt-lookup matches make
several branches, merged where they share a prefix) and an exit's top candidates at each draft
position (the chain of top-1 drafts with the runners-up beside it as leaves).

Verification runs every node through the verifying layers in one pass, each node attending to
the committed prefix and its own ancestors, so each node's row is what the verifier computes
after that node's branch. ``accept_tree`` then walks from the root:

- greedy: go to the child whose token is the verifier's argmax; stop when none is; the argmax
  there is the next token;
- sampling: each position's token is drawn as a plain step would draw it (``DecodeContext.uniforms``:
  the position's uniform number), and the walk goes to the child that has it; stop when none has.
  A child is kept with probability ``p`` of its token (the children's together: the sum of theirs),
  as multi-draft speculative sampling keeps fixed drafts, and the tokens are plain decoding's
  whatever the tree.

The accepted path's K/V then move into place (``LayerRunner.keep_path``), so the cache holds the
path as if it had been a chain.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.kv_cache import TreeLayout
from ..sampling.sampler import argmax, logits_to_probs, pick
from .base import DecodeContext


@dataclass
class DraftTree:
    """One sequence's token tree (node 0: the pending token)."""

    tokens: list[int]  # [N]
    parents: list[int] = field(default_factory=lambda: [-1])  # [N], parents[0] = -1

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int) -> int:
        """The child of ``parent`` with ``token``: an existing one, or a new node appended."""
        for i in range(parent + 1, len(self.tokens)):
            if self.parents[i] == parent and self.tokens[i] == token:
                return i
        self.tokens.append(token)
        self.parents.append(parent)
        return len(self.tokens) - 1

    def add_branch(self, parent: int, tokens: list[int]) -> list[int]:
        """``tokens`` as a branch below ``parent`` (sharing the nodes that exist): its nodes."""
        nodes = []
        for t in tokens:
            parent = self.add(parent, t)
            nodes.append(parent)
        return nodes

    @classmethod
    def of_branches(cls, root_token: int, branches: list[list[int]]) -> "DraftTree":
        """A trie of ``branches`` below the pending token, the first branch first (nodes 0 .. len)."""
        tree = cls([root_token])
        for b in branches:
            tree.add_branch(0, b)
        return tree

    def first(self, n: int) -> "DraftTree":
        """The tree of its first ``n`` nodes (parents come first: a tree again)."""
        return DraftTree(self.tokens[:n], self.parents[:n])

    def children(self, i: int) -> list[int]:
        return [j for j in range(i + 1, len(self.tokens)) if self.parents[j] == i]

    def layout(self, root: int) -> TreeLayout:
        return TreeLayout(root, tuple(self.parents))

    def path_tokens(self, node: int) -> list[int]:
        """The tokens after the root on the way to ``node`` (``node`` included)."""
        return [self.tokens[i] for i in self.layout(0).path(node)[1:]]

    @property
    def depth(self) -> int:
        """The most tokens on a path below the root (a chain's: its drafts)."""
        depths = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depths[i] = depths[self.parents[i]] + 1
        return max(depths)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))


def accept_tree(ctx: DecodeContext, tree: DraftTree, logits: torch.Tensor,
                prefix: list[int] | tuple = (), u: list[float] = ()) -> tuple[list[int], int]:
    """Walk ``tree`` against the verifier's ``logits [N, V]`` (row ``i``: after node ``i``'s
    branch, before the request's logits processing; ``prefix``: the speculative tokens before
    the root's, for that processing): the accepted path (node indices from the root) and the
    next token (the argmax or sampled token after the path's last node). ``u``: the uniform
    numbers of the positions after the root, which a sampled sequence's tokens are drawn with."""
    greedy = ctx.params.greedy and ctx.processor is None
    top = argmax(logits).tolist() if greedy else None
    path = [0]
    while True:
        i, kids = path[-1], tree.children(path[-1])
        if greedy:
            nxt = top[i]
            child = next((c for c in kids if tree.tokens[c] == nxt), None)
        else:
            row = ctx.process(logits[i:i + 1], list(prefix) + tree.path_tokens(i))  # [1, V]
            if ctx.params.greedy:
                nxt = int(argmax(row)[0])
            else:
                probs = logits_to_probs(row, ctx.params)  # [1, V]
                nxt = int(pick(probs, torch.tensor(u[len(path) - 1:len(path)], dtype=torch.float64,
                                               device=probs.device))[0])
            child = next((c for c in kids if tree.tokens[c] == nxt), None)
        if child is None:
            return path, nxt
        path.append(child)


def exit_tree(start_token: int, chain: list[int], runners_up: list[list[int]]) -> DraftTree:
    """The chain of an exit's top drafts ``chain`` (nodes 1 .. k) with, beside draft ``j``, the
    exit's runners-up at that position ``runners_up[j]`` as leaves (nodes k + 1 ..)."""
    tree = DraftTree([start_token] + list(chain), list(range(-1, len(chain))))
    for j, alts in enumerate(runners_up):
        for t in alts:
            tree.add(j, t)
    return tree
