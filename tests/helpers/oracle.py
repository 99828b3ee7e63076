"""The float64 oracle the reference backend itself is tested against."""

import math

import torch


def float64_attention(case, softmax_scale=None, window=(-1, -1), sinks=None, return_lse=False):
    """Token-by-token, key-by-key float64 attention read straight from the cache bytes (scales
    per KV head, or per token and head: ``[num_blocks, block_size, num_kv_heads]``).

    ``window=(left, right)``: token at position p sees keys p - left .. p + right (-1 unbounded)
    inside its mask; ``sinks``: a list of per-q-head logits added to the denominator.
    ``return_lse``: also each row's natural-log ``log(e^sink + sum_j e^(s_j))``
    ``[num_tokens, num_q_heads]`` (-inf for rows past the last sequence)."""
    q_all = case.query.double()
    head_dim = q_all.shape[-1]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    num_kv_heads = case.key_cache.shape[2]
    group = q_all.shape[1] // num_kv_heads
    block_size = case.key_cache.shape[1]

    def scale_at(s):
        """(page, slot, kv head) -> the multiplier: per head, or per token and head (rank 3)."""
        if isinstance(s, torch.Tensor) and s.dim() == 3:
            table = s.double().cpu()
            return lambda page, slot, kvh: float(table[page, slot, kvh])
        if s is None or isinstance(s, float):
            per_head = [1.0 if s is None else s] * num_kv_heads
        else:
            per_head = s.double().tolist()
        return lambda page, slot, kvh: per_head[kvh]

    k_scale, v_scale = scale_at(case.k_scale), scale_at(case.v_scale)
    out = torch.zeros_like(q_all)
    lse = torch.full(q_all.shape[:2], -math.inf, dtype=torch.float64)
    cu = case.cu_seqlens_q.tolist()
    for seq, kv_len in enumerate(case.kv_lens):
        q_len = cu[seq + 1] - cu[seq]
        causal = case.causal if isinstance(case.causal, bool) else bool(case.causal[seq])
        for i in range(q_len):
            position = kv_len - q_len + i
            last = position if causal else kv_len - 1
            first = 0
            if window[1] >= 0:
                last = min(last, position + window[1])
            if window[0] >= 0:
                first = max(position - window[0], 0)
            for h in range(q_all.shape[1]):
                kvh = h // group
                keys, vals = [], []
                for j in range(first, last + 1):
                    page, slot = int(case.block_table[seq, j // block_size]), j % block_size
                    keys.append(case.key_cache[page, slot, kvh].double() * k_scale(page, slot, kvh))
                    vals.append(
                        case.value_cache[page, slot, kvh].double() * v_scale(page, slot, kvh)
                    )
                scores = torch.stack(keys) @ q_all[cu[seq] + i, h] * scale
                if sinks is None:
                    shift = float(scores.max())
                    weights = torch.exp(scores - shift)
                    denominator = weights.sum()
                else:
                    shift = max(float(scores.max()), sinks[h])
                    weights = torch.exp(scores - shift)
                    denominator = weights.sum() + math.exp(sinks[h] - shift)
                out[cu[seq] + i, h] = (weights / denominator) @ torch.stack(vals)
                lse[cu[seq] + i, h] = shift + math.log(float(denominator))
    return (out, lse) if return_lse else out
