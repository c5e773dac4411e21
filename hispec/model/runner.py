"""The model runner: runs a sequence's tokens through layer ranges of the model over the paged KV
cache, and keeps the block manager in step (nano-vllm's ``model_runner.py``, vLLM's
``GPUModelRunner``).

Every decoding strategy (``decode/``), the speculation proposers (``spec/proposers/``), the engine,
training and the benchmarks run the model through a :class:`LayerRunner`; its public methods are
the interface they call (``forward``, ``forward_many``, ``decode_logits``, ``rows_logits``,
``decode_greedy``, ``greedy_rows``, ``exit_logits``, ``keep_path``, ``truncate``).

The runner decides how the layers run: on the fused CPU kernels where they apply (its fast path,
``model/fast_path.py``: a range of layers or a whole decode step in one op call, else layer by
layer; it hands that backend to ``DecoderModel.run_layers``), else the model's reference PyTorch
computation (``model/decoder.py``).

Why here, in ``model/``, and not beside the engine as nano-vllm has it: the strategies call the
runner, and ``tests/test_layers.py`` puts the strategies (``decode``, ``spec``) below the engine,
so a runner in ``engine/`` would be an upward import from every strategy. The runner needs only
what sits at or below the model (the cache, the kernels' types, the model and its exits), so it
lives beside the model, below the strategies and the engine, and imports neither of them.

Cache invariant between steps (all strategies): every layer holds K/V for a sequence's positions
``0 .. len(tokens) - 2``; the last committed token is *pending*: chosen, not yet run.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..cache.block_manager import BlockManager
from ..cache.kv_cache import AttentionBatch, KVPool, SeqChunk, TreeLayout
from ..kernels.layer_op import RowSampling
from . import fast_path
from .decoder import DecoderModel, LayerBackend
from .exits.head import SharedOutput


class LayerRunner:
    """Runs a sequence's new tokens through a layer range and keeps the block manager in step.

    ``reserved``: the caller (the engine's scheduler) reserves every slot a step writes before
    the step; the runner then only reads the block tables, and a rollback keeps the reserved
    blocks (the scheduler's reservation holds for the whole step). Without it (a strategy
    driven directly, tools, tests) the runner takes blocks as it writes and a rollback returns
    the unused tail blocks.

    ``fused``: run the layers on the fused CPU kernels where they apply (``model/fast_path.py``: a
    range of layers or a whole decode step in one op call, else layer by layer); False: the model's
    reference PyTorch computation alone (``decode_logits`` and the other one-call methods then
    return None).
    """

    def __init__(self, model: DecoderModel, blocks: BlockManager, pool: KVPool, *, reserved: bool = False,
                 fused: bool = True) -> None:
        self.model, self.blocks, self.pool = model, blocks, pool
        self.reserved = reserved
        self.backend: LayerBackend | None = fast_path.FUSED if fused else None

    def forward(self, seq_id: int, start_pos: int, x: torch.Tensor, start_layer: int, end_layer: int) -> torch.Tensor:
        """Run one sequence's positions ``start_pos ..`` through layers ``[start_layer, end_layer)``.

        ``x`` is token ids ``[T]`` when ``start_layer == 0``, else the hidden states ``[T, H]``
        entering ``start_layer``. Returns the hidden states ``[T, H]`` after ``end_layer - 1``.
        """
        return self.forward_many([(seq_id, start_pos, x)], start_layer, end_layer)[0]

    def forward_many(self, items: list[tuple[int, int, torch.Tensor]], start_layer: int, end_layer: int,
                     capture: dict[int, torch.Tensor | None] | None = None, prefill: bool = False,
                     trees: list[TreeLayout | None] | None = None) -> list[torch.Tensor]:
        """``forward`` for a ragged batch of ``(seq_id, start_pos, x)``: one pass, no padding;
        returns each sequence's hidden states ``[T_i, H]``.

        ``capture``: a hook for layer outputs; for each key ``L`` in ``(start_layer, end_layer)``
        it receives the flat hidden states ``[sum T_i, H]`` entering layer ``L`` (the exit after
        ``L`` layers), e.g. to collect distillation data from the same pass that decodes.
        ``prefill``: the tokens are prompt tokens (the layers may take their prefill weights).
        ``trees``: per item, the token tree its tokens are nodes of (``start_pos`` the first one's
        place, ``TreeLayout``), or None for a chain."""
        chunks = []
        for (seq_id, start_pos, x), tree in zip(items, trees or [None] * len(items)):
            self._slots_for(seq_id, start_pos, x.shape[0], start_layer, end_layer)
            chunks.append(SeqChunk(seq_id, start_pos, x.shape[0], tree))
        batch = AttentionBatch(chunks, self.blocks, self.model.device, prefill=prefill)
        x = torch.cat([x for _, _, x in items]) if len(items) > 1 else items[0][2]
        h = self.model.embed(x, batch.positions) if start_layer == 0 else x
        kv_exits = {L: e for L, e in self.model.kv_exits().items() if start_layer < L <= end_layer}
        layer = start_layer
        for stop in sorted({L for L in list(capture or ()) + list(kv_exits) if start_layer < L < end_layer}
                           | {end_layer}):
            h = self.model.run_layers(h, layer, stop, batch, self.pool, self.backend)
            if capture is not None and stop in capture:
                capture[stop] = h
            if stop in kv_exits:
                self._write_exit_kv(kv_exits[stop], h, chunks, batch)
            layer = stop
        for c in chunks:
            self.blocks.set_filled(c.seq_id, start_layer, end_layer, c.start + c.num_tokens)
        return list(h.split([c.num_tokens for c in chunks]))

    def decode_logits(self, items: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """The model's own logits ``[B, V]`` for ``(seq_id, position, token)`` items, one new token per
        sequence through every layer, in one call of the fused op (``fast_path.decode_step``);
        the same values as ``forward_many`` and ``exit_logits`` on the last layer. None where that
        call does not apply: the caller takes the general path (nothing was written)."""
        n = self.model.num_layers
        for seq_id, pos, _ in items:
            self._slots_for(seq_id, pos, 1, 0, n)
        logits = self._decode_step([t for _, _, t in items], [p for _, p, _ in items],
                                   [self.blocks.block_table(s) for s, _, _ in items])
        if logits is not None:
            for seq_id, pos, _ in items:
                self.blocks.set_filled(seq_id, 0, n, pos + 1)
        return logits

    def rows_logits(self, items: list[tuple[int, int, list[int]]]) -> torch.Tensor | None:
        """The model's own logits ``[sum len(tokens), V]`` after each of the tokens of ``(seq_id,
        start_pos, tokens)`` items (a sequence's pending token and its drafts), through every layer in
        one call of the fused op: every token a row of one decode step, as ``greedy_rows`` takes them;
        the same values as ``forward_many`` and ``exit_logits`` on the last layer. None where that call
        does not apply (nothing written)."""
        return self._rows(items, self._decode_step)

    def _rows(self, items: list[tuple[int, int, list[int]]],
              call: Callable[[list[int], list[int], list[list[int]]], torch.Tensor | None]) -> torch.Tensor | None:
        """``call(tokens, positions, tables)`` on every token of the items as a row of one decode step
        (slots allocated first; the items marked filled unless it returns None), and what it returns."""
        n = self.model.num_layers
        for seq_id, pos, toks in items:
            self._slots_for(seq_id, pos, len(toks), 0, n)
        tokens, positions, tables = [], [], []
        for seq_id, pos, toks in items:
            tokens += toks
            positions += range(pos, pos + len(toks))
            tables += [self.blocks.block_table(seq_id)] * len(toks)
        out = call(tokens, positions, tables)
        if out is not None:
            for seq_id, pos, toks in items:
                self.blocks.set_filled(seq_id, 0, n, pos + len(toks))
        return out

    def decode_greedy(self, items: list[tuple[int, int, int]], steps: int, eos: list[int],
                      stops: list[tuple[list[int], int]] | None = None,
                      sampling: RowSampling | None = None) -> list[list[int]] | None:
        """Up to ``steps`` greedy tokens for each ``(seq_id, position, token)`` item, through every
        layer in one call of the fused op (``fast_path.decode_greedy``): ``[B][s]`` host ints,
        the same for every sequence ``s <= steps`` (fewer where the reserved slots end, once every
        sequence has chosen one of ``eos``, or where ``stops`` asks: ``layer_op.decode_steps``; the
        rows ``sampling`` samples, sampled). None where that call does not apply (nothing written)."""
        n = self.model.num_layers
        if self.reserved:  # the slots the scheduler reserved for this step
            steps = min(steps, *(self.blocks.capacity(s) - pos for s, pos, _ in items))
        for seq_id, pos, _ in items:
            self._slots_for(seq_id, pos, steps, 0, n)
        chosen = self._decode_greedy([t for _, _, t in items], [p for _, p, _ in items],
                                     [self.blocks.block_table(s) for s, _, _ in items], steps, eos, stops, sampling)
        if chosen is None:
            return None
        for seq_id, pos, _ in items:
            self.blocks.set_filled(seq_id, 0, n, pos + chosen.shape[1])
        return chosen.tolist()

    def greedy_rows(self, items: list[tuple[int, int, list[int]]],
                    sampling: RowSampling | None = None) -> list[list[int]] | None:
        """The model's greedy choice after each of the tokens of ``(seq_id, start_pos, tokens)``
        items (a sequence's pending token and its drafts, at ``start_pos ..``), through every layer
        in one call of the fused op: every token a row of one decode step (``decode_greedy``, one
        step), its K/V written before any row attends, so a row sees the rows before it as the
        cache. ``[B][len(tokens)]`` host ints: the argmax of each row's logits, the same values as
        ``forward_many`` and ``exit_logits`` on the last layer and ``argmax_of``; the rows ``sampling``
        samples (one entry per row, ``u [rows, 1]``), sampled. None where that call does not apply
        (nothing written)."""
        chosen = self._rows(items, lambda tokens, positions, tables: self._decode_greedy(
            tokens, positions, tables, 1, [], None, sampling))
        if chosen is None:
            return None
        flat = chosen[:, 0].tolist()
        out, at = [], 0
        for _, _, toks in items:
            out.append(flat[at:at + len(toks)])
            at += len(toks)
        return out

    def _decode_step(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor | None:
        """``fast_path.decode_step`` on this runner's pool, or None (nothing written) where it does not
        apply or the runner runs the reference alone."""
        if self.backend is None:
            return None
        return fast_path.decode_step(self.model, tokens, positions, tables, self.pool)

    def _decode_greedy(self, tokens: list[int], positions: list[int], tables: list[list[int]], steps: int,
                       eos: list[int], stops: list[tuple[list[int], int]] | None,
                       sampling: RowSampling | None) -> torch.Tensor | None:
        """``fast_path.decode_greedy`` on this runner's pool, or None (nothing written) where it does
        not apply or the runner runs the reference alone."""
        if self.backend is None:
            return None
        return fast_path.decode_greedy(self.model, tokens, positions, tables, self.pool, steps, eos, stops, sampling)

    def _slots_for(self, seq_id: int, start_pos: int, num_tokens: int, start_layer: int, end_layer: int) -> None:
        """Check that layers ``[start_layer, end_layer)`` hold ``start_pos`` positions of the sequence
        and that positions up to ``start_pos + num_tokens`` have slots (reserved by the scheduler, or
        taken now)."""
        for layer in (start_layer, end_layer - 1):
            assert self.blocks.length(seq_id, layer) == start_pos, \
                f"layer {layer} holds {self.blocks.length(seq_id, layer)} positions, expected {start_pos}"
        if self.reserved:
            assert self.blocks.capacity(seq_id) >= start_pos + num_tokens, \
                f"sequence {seq_id} writes past its reserved slots: the strategy's lookahead is too small"
        else:
            self.blocks.ensure_capacity(seq_id, start_pos + num_tokens)

    def _write_exit_kv(self, block, h: torch.Tensor, chunks: list[SeqChunk], batch: AttentionBatch) -> None:
        """An exit block's K/V for positions that just reached its exit layer (``h [T, H]``)."""
        for c in chunks:
            assert self.blocks.length(c.seq_id, block.kv_layer) == c.start, \
                f"exit block K/V holds {self.blocks.length(c.seq_id, block.kv_layer)} positions, expected {c.start}"
        block.write_kv(h, batch, self.pool, self.model.rope(batch.positions), self.backend)
        for c in chunks:
            self.blocks.set_filled(c.seq_id, block.kv_layer, block.kv_layer + 1, c.start + c.num_tokens)

    def exit_logits(self, items: list[tuple[int, int, torch.Tensor]], layer: int,
                    trees: list[TreeLayout | None] | None = None) -> torch.Tensor:
        """Logits ``[sum T_i, V]`` of the exit after ``layer`` layers for ``(seq_id, start_pos, h)``
        rows (``h [T_i, H]`` the exit layer's states at positions ``start_pos ..``). An exit block
        attends over its K/V of the earlier positions (written when they reached ``layer``)."""
        h = torch.cat([x for _, _, x in items]) if len(items) > 1 else items[0][2]
        block: SharedOutput | None = self.model.exits.get(layer) if layer < self.model.num_layers else None
        if block is None or not block.has_kv:
            return self.model.exit_logits(h, layer)
        chunks = [SeqChunk(s, p, x.shape[0], t) for (s, p, x), t in zip(items, trees or [None] * len(items))]
        for c in chunks:
            assert self.blocks.length(c.seq_id, block.kv_layer) >= c.start + c.num_tokens, \
                "an exit block's logits need its K/V of these positions (run them through the exit layer first)"
        batch = AttentionBatch(chunks, self.blocks, self.model.device)
        return block.forward_paged(h, batch, self.pool, self.model.rope(batch.positions), self.backend)

    def keep_path(self, seq_id: int, tree: TreeLayout, path: list[int]) -> None:
        """Keep a token tree's ``path`` (flat node indices from the root, node 0) as the chain at
        positions ``tree.root ..``: in every layer of the pool that holds path nodes, their K/V
        move into place (path nodes come in increasing order, so none is overwritten before it
        is read), and the layer is cut to the part of the path it holds."""
        bs, table = self.blocks.block_size, self.blocks.block_table(seq_id)
        slot = lambda p: table[p // bs] * bs + p % bs  # noqa: E731
        for layer in reversed(range(len(self.pool.k))):  # deepest first: no layer holds more than one above it
            held = self.blocks.length(seq_id, layer) - tree.root  # nodes 0 .. held - 1 are in this layer
            if held <= 0:
                continue
            kept = next((j for j, n in enumerate(path) if n >= held), len(path))  # path[:kept] held here
            moves = [(slot(tree.root + n), slot(tree.root + j)) for j, n in enumerate(path[:kept]) if n != j]
            if moves:
                self.model.move_kv(self.pool, layer, [m[0] for m in moves], [m[1] for m in moves])
            self.blocks.set_filled(seq_id, layer, layer + 1, tree.root + kept)

    def truncate(self, seq_id: int, length: int) -> None:
        """Roll every layer of the sequence back to at most ``length`` positions."""
        self.blocks.truncate(seq_id, length, keep_blocks=self.reserved)
