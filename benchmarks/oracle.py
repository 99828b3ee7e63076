"""The attention oracle behind every ``rel_err``: dequantise, gather, attend in float32/float64.

Independent of the library's own reference backend (only the mask rule, ``masking.visible_keys``,
is shared), so a bug shared by the library's backends cannot hide. Sequences are processed one at
a time and queries in chunks, so a 16k x 16k prefill or a 128k context never materialises more
than about 256 MiB of scores.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from fp8_noncausal_attn.masking import visible_keys

from .inputs import Case, sequence_kv

_SCORE_BYTES = 1 << 28


def row_chunks(case: Case, dtype: torch.dtype) -> Iterator[tuple[int, int]]:
    """(first query row, row count) blocks of one sequence whose scores fit the memory bound."""
    shape = case.shape
    per_row = shape.num_q_heads * shape.kv_len * torch.finfo(dtype).bits // 8
    rows = max(1, _SCORE_BYTES // per_row)
    for start in range(0, shape.q_len, rows):
        yield start, min(rows, shape.q_len - start)


def key_mask(case: Case, start: int, rows: int) -> torch.Tensor | None:
    """[rows, kv_len] bool, True where query row ``start + i`` may see key ``j`` (SPEC §3)."""
    shape = case.shape
    if not shape.causal:
        return None
    device = case.query.device
    tokens = start + torch.arange(rows, device=device)
    limit = visible_keys(tokens, shape.q_len, shape.kv_len, causal=True)
    return torch.arange(shape.kv_len, device=device)[None, :] < limit[:, None]


def attention_oracle(
    case: Case,
    dtype: torch.dtype = torch.float32,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """SPEC §3 attention in ``dtype`` on the case's cache: [num_tokens, num_q_heads, head_dim].

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
    for seq in range(shape.batch):
        pages = case.block_table[seq]
        key = sequence_kv(case.key_cache, k_scale, pages, shape.kv_len, dtype)
        value = sequence_kv(case.value_cache, v_scale, pages, shape.kv_len, dtype)
        for start, rows in row_chunks(case, dtype):
            first = seq * shape.q_len + start
            q = case.query[first : first + rows].to(dtype)
            q = q.view(rows, shape.num_kv_heads, group, shape.head_dim)
            scores = torch.einsum("qhgd,khd->hgqk", q, key) * case.softmax_scale
            mask = key_mask(case, start, rows)
            if mask is not None:
                scores.masked_fill_(~mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            chunk = torch.einsum("hgqk,khd->qhgd", probs, value)
            out[first : first + rows] = chunk.reshape(rows, shape.num_q_heads, shape.head_dim)
    return out
