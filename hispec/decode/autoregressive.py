"""Plain autoregressive decoding: one full-model pass per token. The reference every
speculative strategy must reproduce."""
from __future__ import annotations

import torch

from ..kernels.layer_op import RowSampling
from ..settings import StrategyName
from .base import DecodeContext, Strategy, choose_tokens
from .stats import phase_timer


class Autoregressive(Strategy):
    """One full-model pass per token. Sequences that need nothing between their tokens (no logits
    processor, no logprobs) take up to ``run_steps`` tokens per round in one call of the fused op,
    which runs the passes and each token's choice back to back (``LayerRunner.decode_greedy``: the
    argmax, or for a sampled sequence its distribution and its positions' uniform numbers,
    ``DecodeContext.uniforms``): the same tokens, without a return to Python per token (on a 2-core
    CPU, ~0.5-1 ms of the engine's Python and dispatch per token, slow because each pass streams the
    weights through the caches). The engine commits a round's tokens together, cut at EOS, stop
    strings and the token limit, as it does a speculative round's. A batch of several sequences takes
    ``batched_run_steps``: its steps are longer, so the call's overhead matters less, and requests
    waiting to join the batch wait for the round. Where a free-draft round precedes it
    (``DecodeContext.lookup_stop``), the run stops at the step where prompt lookup has drafts that
    pay, so that they are verified before the next plain step."""

    name = StrategyName.AR
    run_steps = 8  # one sequence (8 against 4: ~1.5% more tokens/s at batch 1 on a 2-core CPU)
    batched_run_steps = 4

    @property
    def lookahead(self) -> int:
        # the pending token's slot and the next ones, plus one spare
        return max(self.run_steps, self.batched_run_steps) + 1

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model, num_layers = batch[0].model, batch[0].model.num_layers
        with phase_timer([c.stats for c in batch], "full_verify", model.device):
            runner = batch[0].runner
            chunks = self._run(batch)
            if chunks is not None:
                for c, chunk in zip(batch, chunks):
                    c.stats.full_passes += len(chunk)
                    c.stats.count_round("plain")
                    c.target_logits = None
                return chunks
            logits = runner.decode_logits([(c.seq_id, len(c.tokens) - 1, c.tokens[-1]) for c in batch])  # [B, V]
            if logits is None:  # the general path: layers, then the head
                items = [(c.seq_id, len(c.tokens) - 1, c.token_tensor(c.tokens[-1:])) for c in batch]
                hidden = runner.forward_many(items, 0, num_layers)  # B x [1, H]
                logits = model.exit_logits(hidden[0] if len(batch) == 1 else torch.cat(hidden), num_layers)
            tokens = choose_tokens(batch, logits)
        for b, c in enumerate(batch):
            c.stats.full_passes += 1
            c.stats.count_round("plain")
            c.target_logits = logits[b:b + 1]
        return [[t] for t in tokens.tolist()]

    def _run(self, batch: list[DecodeContext]) -> list[list[int]] | None:
        """Several tokens per sequence in one op call, or None: a sequence with a logits processor or
        logprobs (they need each token's logits), one token left, or no fused op for this model."""
        steps = min(self.run_steps if len(batch) == 1 else self.batched_run_steps, *(c.remaining for c in batch))
        if steps < 2 or any(c.processor is not None or c.params.logprobs is not None for c in batch):
            return None
        sampling = _row_sampling(batch, steps) if any(not c.params.greedy for c in batch) else None
        eos = sorted(set().union(*(c.eos_ids for c in batch)))
        stops = [(c.tokens, c.lookup_stop) for c in batch] if any(c.lookup_stop for c in batch) else None
        chunks = batch[0].runner.decode_greedy([(c.seq_id, len(c.tokens) - 1, c.tokens[-1]) for c in batch], steps,
                                               eos, stops, sampling)
        if stops is not None and chunks is not None and len(chunks[0]) < steps \
                and not all(any(t in eos for t in chunk) for chunk in chunks):  # (not every sequence at an EOS)
            for c in batch:
                c.stats.lookup_stops += 1
        return chunks


def _row_sampling(batch: list[DecodeContext], steps: int) -> RowSampling:
    """How ``decode_greedy`` chooses each sequence's next ``steps`` tokens: greedy ones by the argmax,
    sampled ones with their parameters and the uniform numbers of those positions."""
    return row_sampling(batch, [c.uniforms(len(c.tokens), steps) for c in batch])


def row_sampling(rows: list[DecodeContext], u: list[list[float]]) -> RowSampling:
    """``RowSampling`` for rows of the sequences ``rows[r]`` (each row with its sequence's parameters)
    and their uniform numbers ``u[r]``, one per step."""
    return RowSampling([0.0 if c.params.greedy else c.params.temperature for c in rows],
                       [min(c.params.top_k, 1 << 62) for c in rows],  # (any k >= the vocabulary: off)
                       [c.params.top_p for c in rows], torch.tensor(u, dtype=torch.float64))
