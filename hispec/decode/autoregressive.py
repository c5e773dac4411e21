"""Plain autoregressive decoding: one full-model pass per token. The reference every
speculative strategy must reproduce."""
from __future__ import annotations

from typing import Iterator

from ..sampling.sampler import next_tokens
from .base import DecodeContext
from .stats import phase_timer


class Autoregressive:
    name = "ar"

    def steps(self, ctx: DecodeContext) -> Iterator[list[int]]:
        model, num_layers = ctx.model, ctx.model.num_layers
        while ctx.remaining > 0:
            with phase_timer(ctx.stats, "full_verify", model.device):
                pos = len(ctx.tokens) - 1
                h = ctx.runner.forward(ctx.seq_id, pos, ctx.token_tensor(ctx.tokens[-1:]), 0, num_layers)
                token = int(next_tokens(model.exit_logits(h, num_layers), ctx.params, ctx.generator)[0])
            ctx.stats.full_passes += 1
            yield [token]
