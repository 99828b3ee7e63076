"""Random problems over per-token-head caches (vLLM's ``fp8_per_token_head`` /
``int8_per_token_head``) for the Triton tests: :func:`synthetic.make_case`'s batch (shuffled
pages, strided index tensors, padded rows), its K/V rows brought to unit RMS per KV head, then
given a gain per token and head over a decade (so one scale per head cannot stand for one per
token), written by the reference's per-token-head write into vLLM's inline page (scales as
strided views) or separate tensors."""

from __future__ import annotations

import dataclasses

import torch

from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.problem import AttentionProblem, CacheWrite
from fp8_noncausal_attn.synthetic import PagedCase, make_case, slot_mapping
from fp8_noncausal_attn.validation import validate_attention

# Where the page holds no written key: 0x5A bytes (the scale words ~1.5e16), so a read shows.
GARBAGE = 0x5A
# Each unit-RMS row's gain spans a decade from this: keys of RMS 0.3 to 3 (elements up to about
# 10) and values a decade below, as a drafter's are. The values' amax stays above e5m2's
# 57344 x the scale floor 1e-6, so their scales differ from token to token in every format.
KEY_MAGNITUDE, VALUE_MAGNITUDE = 0.3, 0.03


def make_token_head_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype = torch.bfloat16,
    page: str = "hnd",
    seed: int = 0,
    **batch,
) -> PagedCase:
    """A :class:`PagedCase` whose caches hold ``cache_dtype`` codes and whose ``k_scale`` /
    ``v_scale`` are float32 ``[num_blocks, block_size, num_kv_heads]``.

    ``page``: ``"hnd"`` / ``"nhd"``, vLLM's inline page ``[num_blocks, num_kv_heads, block_size,
    2 * (head_dim + 4)]`` (physically head- or slot-major) seen through
    :func:`layouts.split_per_token_head_cache`; ``"separate"``, contiguous caches and scales.
    ``batch``: :func:`synthetic.make_case`'s other keywords (heads, head_dim, block_size, causal,
    index_step, padded_rows, device).
    """
    base = make_case(q_lens, kv_lens, cache_dtype=query_dtype, query_dtype=query_dtype,
                     scales="none", seed=seed, **batch)  # fmt: skip
    num_blocks, block_size, num_kv_heads, head_dim = base.key_cache.shape
    device = base.query.device
    slots = slot_mapping(base.block_table, kv_lens, block_size).to(device)
    gen = torch.Generator().manual_seed(seed + 1)
    rows = []
    for cache, magnitude in ((base.key_cache, KEY_MAGNITUDE), (base.value_cache, VALUE_MAGNITUDE)):
        gain = 10 ** torch.rand(len(slots), num_kv_heads, 1, generator=gen) * magnitude
        exact = cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
        unit = exact / exact.square().mean(dim=(0, 2), keepdim=True).sqrt()
        rows.append((unit * gain.to(device)).to(query_dtype))
    if page == "separate":
        shape = (num_blocks, block_size, num_kv_heads)
        codes = [torch.full((*shape, head_dim), GARBAGE, dtype=torch.uint8, device=device)
                 .view(cache_dtype) for _ in range(2)]  # fmt: skip
        scales = [torch.full(shape, GARBAGE * 0x01010101, dtype=torch.int32, device=device)
                  .view(torch.float32) for _ in range(2)]  # fmt: skip
        key_cache, value_cache, k_scale, v_scale = *codes, *scales
    else:
        physical = (num_blocks, num_kv_heads, block_size, 2 * (head_dim + 4))
        if page == "nhd":
            physical = (num_blocks, block_size, num_kv_heads, 2 * (head_dim + 4))
        kv_cache = torch.full(physical, GARBAGE, dtype=torch.uint8, device=device)
        if page == "nhd":
            kv_cache = kv_cache.transpose(1, 2)
        key_cache, value_cache, k_scale, v_scale = split_per_token_head_cache(kv_cache, cache_dtype)
    reference.reshape_and_cache(CacheWrite(*rows, key_cache, value_cache, slots, k_scale, v_scale))
    return dataclasses.replace(
        base, key_cache=key_cache, value_cache=value_cache, k_scale=k_scale, v_scale=v_scale
    )


def token_head_problem(
    case: PagedCase,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    **scales: torch.Tensor,
) -> AttentionProblem:
    """The case's validated problem with its per-token-head scales; ``k_scale=`` / ``v_scale=``
    then replace them unchecked (the planted errors: validation would refuse some)."""
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=window, sinks=sinks,
    )  # fmt: skip
    return dataclasses.replace(problem, **scales)
