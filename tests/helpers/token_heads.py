"""Per-token-head problems for the CUDA kernels' tests (the CPU emulation and the GPU tests):
data and scales in pages that keep each token's scales inline after its head's K and V rows,
as vLLM does, but with the rows 16-byte aligned as the kernels' copies need."""

from typing import NamedTuple

import torch

from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.problem import AttentionProblem, CacheWrite
from fp8_noncausal_attn.synthetic import (
    shuffled_block_table,
    slot_mapping,
)
from fp8_noncausal_attn.validation import validate_attention

# Bytes after the K and V rows of each (block, head, slot): K scale, V scale (float32), 8 unused.
_TAIL_BYTES = 16


def aligned_pages(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(key_cache, value_cache, k_scale, v_scale)``: views of one uint8 ``[num_blocks,
    num_kv_heads, block_size, 2 * head_dim + 16]`` page tensor (HND, like vLLM's), each slot
    ``[K | V | K scale | V scale | 8 bytes]``; the caches ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` of ``cache_dtype``, the scales float32 ``[num_blocks, block_size,
    num_kv_heads]``, strided. Filled with 0x5A bytes (scales ~1.5e16), so a slot read that was
    never written shows."""
    row = 2 * head_dim + _TAIL_BYTES
    pages = torch.full((num_blocks, num_kv_heads, block_size, row), 0x5A, dtype=torch.uint8,
                       device=device)  # fmt: skip
    data = pages.view(cache_dtype)
    words = pages.view(torch.float32)
    scale_word = 2 * head_dim // 4
    return (
        data[..., :head_dim].transpose(1, 2),
        data[..., head_dim : 2 * head_dim].transpose(1, 2),
        words[..., scale_word].transpose(1, 2),
        words[..., scale_word + 1].transpose(1, 2),
    )


class Sizes(NamedTuple):
    """A problem's head counts, head size and page size (:func:`synthetic.make_case`'s)."""

    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    block_size: int = 16


def drafter_token_rows(
    gen: torch.Generator, kv_lens: list[int], num_kv_heads: int, head_dim: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per sequence, float32 keys ``[kv_len, num_kv_heads, head_dim]`` of order 1-10 and values
    of order 0.01-0.1, as a drafter's are, each token's magnitude drawn over a decade (one scale
    per head cannot stand in for one per token)."""
    keys, values = [], []
    for kv_len in kv_lens:
        gain = torch.logspace(0, 1, kv_len)[torch.randperm(kv_len, generator=gen)][:, None, None]
        shape = (kv_len, num_kv_heads, head_dim)
        keys.append(torch.randn(shape, generator=gen) * gain)
        values.append(torch.randn(shape, generator=gen) * gain * 0.01)
    return keys, values


def token_head_problem(
    cache_dtype: torch.dtype,
    query_dtype: torch.dtype,
    q_lens: list[int],
    kv_lens: list[int],
    *,
    causal: bool | list[bool] = False,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    padded_rows: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **sizes: int,
) -> AttentionProblem:
    """A random problem over an :func:`aligned_pages` cache written by the reference's
    per-token-head write: :func:`drafter_token_rows` keys and values, shuffled pages;
    ``padded_rows`` random query rows past the last sequence. ``sizes``: :class:`Sizes`'s
    fields (its defaults for those not given)."""
    num_q_heads, num_kv_heads, head_dim, block_size = Sizes(**sizes)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-kv // block_size) for kv in kv_lens) + 1
    key_cache, value_cache, k_scale, v_scale = aligned_pages(
        num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, device
    )
    block_table = shuffled_block_table(kv_lens, block_size, num_blocks, gen)
    keys, values = drafter_token_rows(gen, kv_lens, num_kv_heads, head_dim)
    reference.reshape_and_cache(CacheWrite(
        torch.cat(keys).to(query_dtype).to(device), torch.cat(values).to(query_dtype).to(device),
        key_cache, value_cache, slot_mapping(block_table, kv_lens, block_size).to(device),
        k_scale, v_scale,
    ))  # fmt: skip
    num_tokens = sum(q_lens) + padded_rows
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(query_dtype)
    cu = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
    flags = torch.tensor(causal, dtype=torch.int32) if isinstance(causal, list) else causal
    return validate_attention(
        query.to(device), key_cache, value_cache, block_table.to(device), cu.to(device),
        torch.tensor(kv_lens, dtype=torch.int32, device=device), k_scale=k_scale,
        v_scale=v_scale, causal=flags if isinstance(flags, bool) else flags.to(device),
        softmax_scale=None, max_seqlen_q=None, max_seqlen_k=None, out=None, validate=True,
        window=window, sinks=sinks,
    )  # fmt: skip
