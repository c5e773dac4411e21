"""CPU attention: the batched-matmul path (decode-sized queries) and the fused SDPA path
(prefill-sized queries) both compute masked grouped-query softmax attention."""
import pytest
import torch

from hispec.model.decoder import SDPA_MIN_QUERIES, attend


def reference(q, k, v, mask):
    """Plain grouped-query attention: K/V repeated per query head, [T, Hq, D]."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # [C, Hq, D]
    scores = torch.einsum("thd,chd->htc", q, k) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("htc,chd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("num_queries,start", [(1, 0), (1, 37), (5, 20), (SDPA_MIN_QUERIES, 0),
                                               (SDPA_MIN_QUERIES + 9, 11)])
def test_attend_matches_reference(num_queries, start):
    g = torch.Generator().manual_seed(num_queries + start)
    c = start + num_queries
    q = torch.randn(num_queries, 6, 16, generator=g)
    k, v = torch.randn(c, 2, 16, generator=g), torch.randn(c, 2, 16, generator=g)
    mask = None if num_queries == 1 else torch.arange(c)[None, :] <= torch.arange(start, c)[:, None]
    torch.testing.assert_close(attend(q, k, v, mask), reference(q, k, v, mask), rtol=1e-5, atol=1e-5)
