"""The attention oracle behind every ``rel_err``: dequantise, gather, attend in float32/float64.

Independent of the library's own reference backend (only the mask rule, ``masking.visible_range``,
is shared), so a bug shared by the library's backends cannot hide. Sequences are processed one at
a time and queries in chunks, so a 16k x 16k prefill or a 128k context never materialises more
than about 256 MiB of scores; with a sliding window only the pages the window touches are
gathered. Sink logits join each row's softmax as one more column that has no value.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fp8_noncausal_attn.masking import visible_range

from .inputs import Case, sequence_kv

_SCORE_BYTES = 1 << 28


def row_chunks(case: Case, dtype: torch.dtype) -> Iterator[tuple[int, int]]:
    """(first query row, row count) blocks of one sequence whose scores fit the memory bound."""
    shape = case.shape
    per_row = shape.num_q_heads * shape.keys_read * torch.finfo(dtype).bits // 8
    rows = max(1, _SCORE_BYTES // per_row)
    for start in range(0, shape.q_len, rows):
        yield start, min(rows, shape.q_len - start)


def key_mask(case: Case, start: int, rows: int, first_key: int = 0) -> torch.Tensor | None:
    """[rows, kv_len - first_key] bool, True where query row ``start + i`` may see key
    ``first_key + j`` (SPEC §3, the shape's mask and window); None when every key is visible."""
    shape = case.shape
    if not shape.causal and shape.window == (-1, -1):
        return None
    device = case.query.device
    tokens = start + torch.arange(rows, device=device)
    begin, end = visible_range(tokens, shape.q_len, shape.kv_len, shape.causal, shape.window)
    keys = torch.arange(first_key, shape.kv_len, device=device)[None, :]
    return (keys >= begin[:, None]) & (keys < end[:, None])


def attention_oracle(
    case: Case,
    dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SPEC §3 attention in ``dtype`` on the case's cache: [num_tokens, num_q_heads, head_dim],
    with the shape's mask and window and the case's sinks.

    ``k_scale``/``v_scale`` ([num_kv_heads] float32) override the case's scales, for peers that
    can only be given one scalar scale and must be checked against what they were asked.
    """
    shape = case.shape
    k_scale = case.k_scale if k_scale is None else k_scale
    v_scale = case.v_scale if v_scale is None else v_scale
    group = shape.num_q_heads // shape.num_kv_heads
    out = torch.empty(
        (shape.num_tokens, shape.num_q_heads, shape.head_dim), dtype=dtype, device=case.query.device
    )
    first_key = shape.first_key
    for seq in range(shape.batch):
        pages = case.block_table[seq]
        key = sequence_kv(case.key_cache, k_scale, pages, shape.kv_len, dtype, first_key)
        value = sequence_kv(case.value_cache, v_scale, pages, shape.kv_len, dtype, first_key)
        for start, rows in row_chunks(case, dtype):
            first = seq * shape.q_len + start
            q = case.query[first : first + rows].to(dtype)
            q = q.view(rows, shape.num_kv_heads, group, shape.head_dim)
            scores = torch.einsum("qhgd,khd->hgqk", q, key) * case.softmax_scale
            mask = key_mask(case, start, rows, first_key)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            if case.sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:
                sink = case.sinks.to(dtype).view(shape.num_kv_heads, group, 1, 1)
                column = sink.expand(*scores.shape[:-1], 1)
                probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
            chunk = torch.einsum("hgqk,khd->qhgd", probs, value)
            out[first : first + rows] = chunk.reshape(rows, shape.num_q_heads, shape.head_dim)
    return out
