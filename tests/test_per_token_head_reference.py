"""The reference over per-token-head caches (real K = stored K * k_scale[block, slot, kv_head])
against independent float64 computations: on the dequantised cache, and on the unquantised K/V."""

import math
from dataclasses import dataclass

import pytest
import torch
from helpers import TOLERANCE
from helpers.token_heads import drafter_token_rows

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.scales import PER_TOKEN_HEAD_DTYPES
from fp8_noncausal_attn.synthetic import relative_error, shuffled_block_table, slot_mapping

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
Q_LENS, KV_LENS = [8, 3, 1], [40, 21, 9]
# Against float64 on the unquantised K/V the format's own rounding dominates (a half step: 2^-4
# relative for e4m3, 2^-3 for e5m2, 1/254 of the row's amax for int8), amplified by scores of
# order 10 from keys of order 1-10. Measured on these cases at most 5.2e-2 (e4m3), 1.12e-1
# (e5m2), 1.27e-2 (int8); the bounds are 1.5 times that.
UNQUANTISED_BOUND = {torch.float8_e4m3fn: 8e-2, torch.float8_e5m2: 1.7e-1, torch.int8: 2e-2}


@dataclass
class TokenHeadCase:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    keys: list[torch.Tensor]  # per sequence, unquantised [kv_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor  # [num_blocks, block_size, num_kv_heads], a view of the page
    v_scale: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor


def make_case(cache_dtype, query_dtype, seed=0) -> TokenHeadCase:
    """Drafter-like rows written by the per-token-head cache write into a vLLM page:
    keys of order 1-10 and values of order 0.01-0.1, each token's magnitude drawn over a decade
    (so one scale per head cannot stand in for one per token), shuffled pages."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-kv // BLOCK_SIZE) for kv in KV_LENS) + 1
    physical = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, 2 * (HEAD_DIM + 4))
    # Garbage outside written slots: scales 0x5A5A5A5A (~1.5e16), so reading one shows.
    kv_cache = torch.full(physical, 0x5A, dtype=torch.uint8).transpose(1, 2)
    key_cache, value_cache, k_scale, v_scale = split_per_token_head_cache(kv_cache, cache_dtype)
    block_table = shuffled_block_table(KV_LENS, BLOCK_SIZE, num_blocks, gen)
    rows = drafter_token_rows(gen, KV_LENS, NUM_KV_HEADS, HEAD_DIM)
    keys, values = ([r.to(query_dtype) for r in part] for part in rows)
    fna.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache,
                          slot_mapping(block_table, KV_LENS, BLOCK_SIZE), k_scale=k_scale,
                          v_scale=v_scale)  # fmt: skip
    query = torch.randn(sum(Q_LENS), NUM_Q_HEADS, HEAD_DIM, generator=gen).to(query_dtype)
    cu = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    return TokenHeadCase(query, keys, values, key_cache, value_cache, k_scale, v_scale,
                         block_table, cu, torch.tensor(KV_LENS, dtype=torch.int32))  # fmt: skip


def dequantised_rows(case: TokenHeadCase, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key by key, float64: stored K * k_scale[block, slot, kv_head] (likewise V)."""
    out = []
    for cache, scale in ((case.key_cache, case.k_scale), (case.value_cache, case.v_scale)):
        rows = []
        for j in range(KV_LENS[seq]):
            page, slot = int(case.block_table[seq, j // BLOCK_SIZE]), j % BLOCK_SIZE
            rows.append(cache[page, slot].double() * scale[page, slot].double()[:, None])
        out.append(torch.stack(rows))
    return out[0], out[1]


def float64_attention(case, rows, causal, window=(-1, -1), sinks=None):
    """Token by token in float64 over ``rows(seq) -> (K, V)``; returns (out, lse)."""
    group = NUM_Q_HEADS // NUM_KV_HEADS
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    lse = torch.full(case.query.shape[:2], -math.inf, dtype=torch.float64)
    cu = case.cu_seqlens_q.tolist()
    for seq, kv_len in enumerate(KV_LENS):
        keys, values = rows(seq)
        q_len = cu[seq + 1] - cu[seq]
        for i in range(q_len):
            position = kv_len - q_len + i
            last = position if causal[seq] else kv_len - 1
            first = 0
            if window[1] >= 0:
                last = min(last, position + window[1])
            if window[0] >= 0:
                first = max(position - window[0], 0)
            for h in range(NUM_Q_HEADS):
                k, v = keys[first : last + 1, h // group], values[first : last + 1, h // group]
                scores = k @ case.query[cu[seq] + i, h].double() * HEAD_DIM**-0.5
                logits = scores if sinks is None else torch.cat([scores, torch.tensor([sinks[h]])])
                row_lse = torch.logsumexp(logits, 0)
                out[cu[seq] + i, h] = torch.exp(scores - row_lse) @ v
                lse[cu[seq] + i, h] = row_lse
    return out, lse


def run_reference(case, causal, window=(-1, -1), sinks=None, k_scale=None, v_scale=None):
    return fna.paged_attention(
        case.query, case.key_cache, case.value_cache, case.block_table, case.cu_seqlens_q,
        case.seq_lens, k_scale=case.k_scale if k_scale is None else k_scale,
        v_scale=case.v_scale if v_scale is None else v_scale,
        causal=torch.tensor(causal, dtype=torch.int32), window=window,
        sinks=None if sinks is None else torch.tensor(sinks), backend="reference",
        validate=True, return_lse=True,
    )  # fmt: skip


CAUSAL_WINDOW_SINKS = [
    ([False, False, False], (-1, -1), None),
    ([True, True, True], (-1, -1), None),
    ([False, True, False], (5, 3), [2.0, -30.0, 0.0, 4.0, 30.0, -1.0, 1.0, 0.5]),
    ([True, False, True], (-1, 0), [0.0, 1.0, 2.0, 3.0, -3.0, -2.0, -1.0, 0.0]),
]


@pytest.mark.parametrize("causal,window,sinks", CAUSAL_WINDOW_SINKS)
@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_reference_reads_token_head_scales(cache_dtype, query_dtype, causal, window, sinks):
    case = make_case(cache_dtype, query_dtype)
    out, lse = run_reference(case, causal, window, sinks)
    exact, exact_lse = float64_attention(case, lambda s: dequantised_rows(case, s), causal,
                                         window, sinks)  # fmt: skip
    assert relative_error(out, exact) < TOLERANCE[query_dtype]
    assert torch.allclose(lse.double(), exact_lse, rtol=0, atol=1e-4)
    unquantised, _ = float64_attention(
        case, lambda s: (case.keys[s].double(), case.values[s].double()), causal, window, sinks
    )
    assert relative_error(out, unquantised) < UNQUANTISED_BOUND[cache_dtype]


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_dropped_or_per_head_scales_are_wrong(cache_dtype):
    """What the reference must not do gives a visibly wrong answer on these rows: the scales
    dropped (all ones), or one scale per KV head (token 0's, broadcast over the tokens)."""
    case = make_case(cache_dtype, torch.bfloat16, seed=1)
    causal = [False, True, False]
    exact, _ = float64_attention(case, lambda s: dequantised_rows(case, s), causal)
    ones = torch.ones_like(case.k_scale)
    per_head = case.k_scale[0, :1].expand_as(case.k_scale)
    per_head_v = case.v_scale[0, :1].expand_as(case.v_scale)
    for k_scale, v_scale in ((ones, ones), (per_head, per_head_v)):
        wrong, _ = run_reference(case, causal, k_scale=k_scale, v_scale=v_scale)
        assert relative_error(wrong, exact) > 0.1
