"""Plain autoregressive decoding: one full-model pass per token. The reference every
speculative strategy must reproduce."""
from __future__ import annotations

import torch

from .base import DecodeContext, Strategy, choose_tokens
from .stats import phase_timer


class Autoregressive(Strategy):
    name = "ar"
    lookahead = 2  # the pending token's slot, plus one spare

    def step(self, batch: list[DecodeContext]) -> list[list[int]]:
        model, num_layers = batch[0].model, batch[0].model.num_layers
        with phase_timer([c.stats for c in batch], "full_verify", model.device):
            runner = batch[0].runner
            logits = runner.decode_logits([(c.seq_id, len(c.tokens) - 1, c.tokens[-1]) for c in batch])  # [B, V]
            if logits is None:  # the general path: layers, then the head
                items = [(c.seq_id, len(c.tokens) - 1, c.token_tensor(c.tokens[-1:])) for c in batch]
                hidden = runner.forward_many(items, 0, num_layers)  # B x [1, H]
                logits = model.exit_logits(hidden[0] if len(batch) == 1 else torch.cat(hidden), num_layers)
            tokens = choose_tokens(batch, logits)
        for b, c in enumerate(batch):
            c.stats.full_passes += 1
            c.target_logits = logits[b:b + 1]
        return [[t] for t in tokens.tolist()]
