"""Triton reshape_and_cache writes the same bytes as the reference, for every cache format."""

import pytest
import torch
from helpers import DEVICE
from helpers.far_offsets import far_apart_views

from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.triton import cache as triton_cache
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.synthetic import allocate_cache


def cache_bytes(cache):
    return cache.view(torch.uint8 if cache.element_size() == 1 else torch.int16).clone()


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16]
)
def test_triton_cache_write_is_bit_exact(cache_dtype, query_dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, heads, dim, blocks, block_size = 40, 3, 64, 6, 16
    # Magnitudes from 1e-4 to 1e3 after scaling reach FP8 subnormals and saturation.
    magnitude = torch.logspace(-4, 3, num_tokens)[:, None, None]
    key = (torch.randn(num_tokens, heads, dim, generator=gen) * magnitude).to(query_dtype)
    key[0, 0, :4] = torch.tensor([1e-9, -0.0, 6e4, -6e4])
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(query_dtype)
    k_scale = torch.rand(heads, generator=gen) + 0.3
    v_scale = torch.rand(heads, generator=gen) + 0.3
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    slots[3] = -1
    written = []
    for module in (triton_cache, reference):
        key_cache, value_cache = allocate_cache(
            blocks, block_size, heads, dim, cache_dtype, "vllm", DEVICE
        )
        for cache in (key_cache, value_cache):
            cache.view(torch.uint8).fill_(7)
        module.reshape_and_cache(CacheWrite(
            key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
            k_scale.to(DEVICE), v_scale.to(DEVICE),
        ))  # fmt: skip
        written.append((cache_bytes(key_cache), cache_bytes(value_cache)))
    assert torch.equal(written[0][0], written[1][0])
    assert torch.equal(written[0][1], written[1][1])


@pytest.mark.parametrize(
    "cache_dtype,query_dtype,big",
    [
        (torch.float16, torch.float16, 6.5e4),  # fp16 in, beyond 65504 once divided by a scale
        (torch.float16, torch.bfloat16, 1e6),
        (torch.bfloat16, torch.bfloat16, 3e38),  # x / scale overflows float32 itself
        (torch.float8_e4m3fn, torch.bfloat16, 1e6),
    ],
)
def test_cache_write_saturates_and_never_stores_inf(cache_dtype, query_dtype, big):
    """SPEC §4: every format, 16-bit ones too, saturates a finite input to its finite max."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, heads, dim, blocks, block_size = 6, 2, 64, 2, 8
    key = torch.randn(num_tokens, heads, dim, generator=gen)
    key[:, :, :8] = big * torch.tensor([1.0, -1.0]).repeat(4)  # out of range, both signs
    key = key.to(query_dtype)
    value = (-key).clone()
    scale = torch.tensor([0.25, 0.5])
    slots = torch.randperm(blocks * block_size, generator=gen)[:num_tokens]
    fmax = torch.finfo(cache_dtype).max
    written = []
    for module in (triton_cache, reference):
        key_cache, value_cache = allocate_cache(
            blocks, block_size, heads, dim, cache_dtype, None, DEVICE
        )
        for cache in (key_cache, value_cache):
            cache.view(torch.uint8).fill_(0)
        module.reshape_and_cache(CacheWrite(
            key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE),
            scale.to(DEVICE), scale.to(DEVICE),
        ))  # fmt: skip
        for cache, sign in ((key_cache, 1.0), (value_cache, -1.0)):
            rows = cache.view(-1, heads, dim)[slots.to(DEVICE)].float()
            assert torch.isfinite(rows).all(), module.__name__
            expected = sign * fmax * torch.tensor([1.0, -1.0]).repeat(4)
            assert torch.equal(rows[:, :, :8].cpu(), expected.expand(num_tokens, heads, 8))
        written.append((cache_bytes(key_cache), cache_bytes(value_cache)))
    assert torch.equal(written[0][0], written[1][0])
    assert torch.equal(written[0][1], written[1][1])


@pytest.mark.parametrize("far_dim", [0, 1])
def test_cache_write_offsets_past_int32(far_dim):
    """Key and value rows (far_dim 0: tokens; 1: heads) 2^31 elements apart are read where they
    lie: the same bytes as from compact copies (an int32 offset product wraps to another row)."""
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(2, 3, 3, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    scale = (torch.rand(3, generator=gen) + 0.3).to(DEVICE)
    slots = torch.tensor([5, 17, 2], device=DEVICE)
    written = []
    for rows in ([key, value], far_apart_views([key, value], far_dim)):
        key_cache, value_cache = allocate_cache(2, 16, 3, 64, torch.float8_e4m3fn, None, DEVICE)
        for cache in (key_cache, value_cache):
            cache.view(torch.uint8).fill_(7)
        triton_cache.reshape_and_cache(
            CacheWrite(*rows, key_cache, value_cache, slots, scale, scale)
        )
        written.append((cache_bytes(key_cache), cache_bytes(value_cache)))
    assert torch.equal(written[0][0], written[1][0])
    assert torch.equal(written[0][1], written[1][1])
