"""The oracle checked against an independent float64 computation, and the cache-write path."""

import math

import pytest
import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.scales import finite_max
from fp8_noncausal_attn.synthetic import allocate_cache, make_case, relative_error


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


@pytest.mark.parametrize(
    "cache_dtype,query_dtype,causal,scales",
    [
        (torch.float8_e4m3fn, torch.bfloat16, False, "per_head"),
        (torch.float8_e5m2, torch.float16, True, "scalar"),
        (torch.bfloat16, torch.bfloat16, [True, False], "per_head"),
        (torch.float16, torch.float16, False, "none"),
    ],
)
def test_reference_matches_float64(cache_dtype, query_dtype, causal, scales):
    case = make_case(
        [3, 4], [9, 21], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=causal, scales=scales, seed=3,
    )  # fmt: skip
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    exact = float64_attention(case)
    # Only the final rounding to the query dtype separates fp32 math from float64.
    assert relative_error(out, exact) < 2 ** -(8 if query_dtype == torch.bfloat16 else 10)


# Windows inside one 8-key page, spanning pages, past the context, one-sided; sinks with large
# positive and negative logits per q head (+30 outweighs every key, -60 changes nothing).
WINDOW_CASES = [
    (False, (2, 1), None),
    (True, (2, 1), [30.0, -60.0, 0.0, 4.0]),
    ([True, False], (11, 13), [-60.0, 30.0, 2.0, -1.0]),
    (False, (500, 500), [5.0, -5.0, 30.0, -60.0]),
    ([False, True], (-1, 0), None),
    (True, (-1, -1), [30.0, 30.0, -60.0, -60.0]),
    (False, (6, -1), [0.0, 1.0, 2.0, 3.0]),
]


@pytest.mark.parametrize("causal,window,sinks", WINDOW_CASES)
def test_reference_window_and_sinks_match_float64(causal, window, sinks):
    case = make_case(
        [3, 4], [9, 21], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        causal=causal, seed=6,
    )  # fmt: skip
    sinks_t = None if sinks is None else torch.tensor(sinks)
    out = fna.paged_attention(
        *case.args(), **case.kwargs(), window=window, sinks=sinks_t, backend="reference"
    )
    exact = float64_attention(case, window=window, sinks=sinks)
    assert torch.isfinite(out.float()).all()
    # Per q head: a +30 sink scales a head's output down by ~e^-30, which a norm over all heads
    # would not see.
    for h in range(4):
        assert relative_error(out[:, h], exact[:, h]) < 2**-8, h
    if window not in ((-1, -1), (500, 500)):  # the window matters here, the oracle applies it
        assert relative_error(exact, float64_attention(case, sinks=sinks)) > 1e-2


def test_reference_with_vllm_shaped_indices_matches_float64():
    """int32 per-sequence causal, every index tensor a strided view, padded query rows."""
    case = make_case(
        [3, 4, 2], [9, 21, 2], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        causal=[1, 0, 1], causal_dtype=torch.int32, index_step=3, padded_rows=3, seed=4,
    )  # fmt: skip
    assert case.causal.dtype == torch.int32 and case.causal.stride(0) == 3
    out = torch.full_like(case.query, float("nan"))
    fna.paged_attention(*case.args(), **case.kwargs(), out=out, backend="reference")
    exact = float64_attention(case)
    assert (out[9:] == 0).all() and (exact[9:] == 0).all()
    assert relative_error(out, exact) < 2**-8


def test_softmax_scale_is_applied():
    case = make_case([2], [12], num_q_heads=2, num_kv_heads=1, seed=5)
    out = fna.paged_attention(*case.args(), **case.kwargs(), softmax_scale=0.3, backend="reference")
    assert relative_error(out, float64_attention(case, softmax_scale=0.3)) < 2**-8
    default = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert relative_error(out, default) > 1e-2


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reshape_and_cache_quantises_saturates_and_skips_padding(cache_dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, dim, blocks, block_size = 12, 2, 64, 4, 8
    key = (torch.randn(num_tokens, heads, dim, generator=gen) * 300).to(torch.bfloat16)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(torch.bfloat16)
    k_scale = torch.tensor([0.5, 2.0])
    v_scale = torch.tensor([0.01, 3.0])
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    slots[5] = -1
    key_cache, value_cache = allocate_cache(
        blocks, block_size, heads, dim, cache_dtype, "vllm", "cpu"
    )
    for cache in (key_cache, value_cache):
        cache.view(torch.uint8).fill_(0x11)
    fna.reshape_and_cache(
        key, value, key_cache, value_cache, slots, k_scale=k_scale, v_scale=v_scale
    )
    fmax = finite_max(cache_dtype)
    for rows, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        for t in range(num_tokens):
            slot = int(slots[t])
            if slot < 0:
                continue
            stored = cache[slot // block_size, slot % block_size].float()
            expected = (rows[t].float() / scale[:, None]).clamp(-fmax, fmax).to(cache_dtype).float()
            assert torch.equal(stored, expected)
            assert stored.abs().max() <= fmax
    # The padding token's row was never written: every byte outside written slots is untouched.
    written = {int(s) for s in slots if s >= 0}
    untouched = [s for s in range(blocks * block_size) if s not in written]
    for slot in untouched:
        assert (key_cache[slot // block_size, slot % block_size].view(torch.uint8) == 0x11).all()


def test_compute_kv_scales_per_head_and_never_zero():
    key = torch.randn(10, 3, 64, dtype=torch.bfloat16)
    value = torch.randn(10, 3, 64, dtype=torch.bfloat16)
    key[:, 1] = 0
    key[:, 2] *= 100
    k_scale, v_scale = fna.compute_kv_scales(key, value)
    assert k_scale.dtype == torch.float32 and k_scale.shape == (3,)
    assert k_scale[1] == 1.0
    amax = key.float().abs().amax(dim=(0, 2))
    assert torch.allclose(k_scale[[0, 2]], amax[[0, 2]] / 448.0)
    assert (v_scale > 0).all()
    e5m2_k, _ = fna.compute_kv_scales(key, value, fp8_dtype=torch.float8_e5m2)
    assert math.isclose(float(e5m2_k[2]), float(amax[2]) / 57344.0, rel_tol=1e-6)
