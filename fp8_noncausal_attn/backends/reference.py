"""The oracle: plain PyTorch, fp32 math, one sequence at a time (``backend="reference"``).

Not CUDA-graph safe (it reads the lengths on the host); every other backend is tested against it,
and it is tested against an independent float64 computation.
"""

from __future__ import annotations

import torch

from ..masking import visible_range
from ..problem import AttentionProblem, Batch, CacheWrite
from ..scales import dequantize, quantize, quantize_per_token_head

# The backend contract (backends/protocol.py): it runs every valid batch and layer, on every
# device, both scale kinds (gather_sequence_kv), and returns the LSE.


def availability() -> tuple[bool, str]:
    return True, "plain PyTorch: runs on every device, fp32 math, reads lengths on the host"


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor | None) -> str | None:
    return None


def gather_sequence_kv(
    problem: AttentionProblem, seq: int, kv_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Real (dequantised) K and V of one sequence, float32 ``[kv_len, num_kv_heads, head_dim]``.

    The scale's rank chooses the rule: ``[num_kv_heads]``, real K = stored K * k_scale[kv_head];
    per token and head, ``[num_blocks, block_size, num_kv_heads]`` (any strides, e.g. vLLM's
    scales inline in the page), real K = stored K * k_scale[block, slot, kv_head].
    """
    num_pages = -(-kv_len // problem.block_size)
    pages = problem.block_table[seq, :num_pages].long()

    def gather(cache: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        rows = cache[pages].reshape(-1, problem.num_kv_heads, problem.head_dim)[:kv_len]
        if scale.dim() == 3:
            scale = scale[pages].reshape(-1, problem.num_kv_heads)[:kv_len]
        return dequantize(rows, scale)

    return gather(problem.key_cache, problem.k_scale), gather(problem.value_cache, problem.v_scale)


def paged_attention(
    problem: AttentionProblem, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Write ``softmax(q K^T * softmax_scale) V`` for every query token into ``out``.

    With ``problem.window`` each token sees only the keys of :func:`masking.visible_range`; with
    ``problem.sinks`` the sink logit of the row's query head joins the softmax denominator:
    ``sum_j e^(s_j) v_j / (e^(sink_h) + sum_j e^(s_j))``. Both come from the row's natural-log
    log-sum-exp ``L = log(e^(sink_h) + sum_j e^(s_j))`` (no sink: ``log sum_j e^(s_j)``), as
    ``out = sum_j e^(s_j - L) v_j``; ``lse`` (float32 ``[num_tokens, num_q_heads]``), when given,
    receives ``L``, -inf for rows past ``cu_seqlens_q[-1]`` and rows that see no key.

    Rows past ``cu_seqlens_q[-1]`` (padding) are written as zeros. The index tensors are read
    as given (any strides; per-sequence causal flags bool or int32, nonzero = causal).
    """
    cu = problem.cu_seqlens_q.tolist()
    kv_lens = problem.seq_lens.tolist()
    group = problem.group_size
    out[cu[-1] :].zero_()
    if lse is not None:
        lse[cu[-1] :] = float("-inf")
    for seq, kv_len in enumerate(kv_lens):
        q_start, q_end = cu[seq], cu[seq + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(problem, seq, kv_len)
        # [q_len, num_q_heads, d] -> [num_kv_heads, group, q_len, d]
        q = problem.query[q_start:q_end].float()
        q = q.view(q_len, problem.num_kv_heads, group, -1).permute(1, 2, 0, 3)
        scores = torch.einsum("hgqd,khd->hgqk", q, keys) * problem.softmax_scale
        causal = problem.causal if problem.causal_per_seq is None else problem.causal_per_seq[seq]
        start, end = visible_range(
            torch.arange(q_len, device=q.device), q_len, kv_len, causal, problem.window
        )
        keys_at = torch.arange(kv_len, device=q.device)[None, :]
        hidden = (keys_at < start[:, None]) | (keys_at >= end[:, None])
        scores = scores.masked_fill(hidden, float("-inf"))
        # A key no row sees may be a slot no token wrote (a sliding window's freed pages point
        # at vLLM's null block): whatever it holds must not reach P V, where 0 * NaN = NaN.
        values = values.masked_fill(hidden.all(dim=0)[:, None, None], 0.0)
        # [num_kv_heads, group, q_len]: q head h = kv_head * group + g.
        row_lse = torch.logsumexp(scores, dim=-1)
        if problem.sinks is not None:
            sink = problem.sinks.float().view(problem.num_kv_heads, group, 1)
            row_lse = torch.logaddexp(row_lse, sink.expand_as(row_lse))
        # A row that sees no key (L = -inf) gets weights e^(-inf - 0) = 0, not NaN.
        shift = torch.where(row_lse == float("-inf"), 0.0, row_lse)
        probs = torch.exp(scores - shift[..., None])
        result = torch.einsum("hgqk,khd->qhgd", probs, values)
        out[q_start:q_end] = result.reshape(q_len, problem.num_q_heads, -1).to(out.dtype)
        if lse is not None:
            lse[q_start:q_end] = row_lse.permute(2, 0, 1).reshape(q_len, problem.num_q_heads)


def merge_states(
    outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """Merge partial attention states over disjoint key sets, in fp32.

    ``outs`` ``[num_states, num_tokens, num_heads, head_dim]`` (each state normalised),
    ``lses`` float32 ``[num_states, num_tokens, num_heads]`` natural-log; writes
    ``out = sum_s e^(lse_s - L) outs_s`` and ``lse = L = log sum_s e^(lse_s)``, shifted by the
    largest ``lse_s``. A state with lse -inf has weight 0; a row no state saw gets zeros and
    -inf (never NaN); a NaN lse propagates.
    """
    top = lses.amax(dim=0)
    top = torch.where(top == float("-inf"), 0.0, top)
    weights = torch.exp(lses - top)[..., None]  # -inf states: 0
    # An empty state's partial is never read (it may hold anything); a NaN weight is no 0.
    terms = torch.where(weights != 0, weights * outs.float(), 0.0)
    total = weights.sum(dim=0)
    merged = terms.sum(dim=0)
    out.copy_(torch.where(total == 0, 0.0, merged / total))
    total = total[..., 0]
    lse.copy_(torch.where(total == 0, float("-inf"), top + torch.log(total)))


def reshape_and_cache(write: CacheWrite) -> None:
    """Quantise ``write.key`` / ``write.value`` rows into the paged caches at
    ``write.slot_mapping`` (< 0: skipped).

    The scale's rank chooses the rule: a ``[num_kv_heads]`` scale divides each row; a
    ``[num_blocks, block_size, num_kv_heads]`` float32 scale (any strides; caches float8_e4m3fn,
    float8_e5m2 or int8) is computed per token and head by
    :func:`scales.quantize_per_token_head` and written there, next to the row.
    """
    keep = write.slot_mapping >= 0
    slots = write.slot_mapping[keep]
    block_size = write.key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    pairs = ((write.key, write.key_cache, write.k_scale), (write.value, write.value_cache,
             write.v_scale))  # fmt: skip
    for rows, cache, scale in pairs:
        if scale.dim() == 3:
            stored, row_scale = quantize_per_token_head(rows[keep], cache.dtype)
            scale[blocks, offsets] = row_scale
        else:
            stored = quantize(rows[keep], scale, cache.dtype)
        # index_put_ is not implemented for FP8 dtypes: write the same bytes through a uint8 view.
        as_bytes = torch.uint8 if cache.element_size() == 1 else torch.int16
        cache.view(as_bytes)[blocks, offsets] = stored.view(as_bytes)


def plan(batch: Batch, workspace: object = None, num_splits: int | None = None) -> None:
    """Backend contract (``backends.protocol.Backend``): every valid batch, nothing to plan, no
    workspace used, no splits."""
    return None


def run(
    problem: AttentionProblem, plan: None, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Backend contract: the one-shot computation (it reads the lengths on the host)."""
    paged_attention(problem, out, lse)
