"""Random paged attention problems for the benchmarks (never zeros).

A quantised cache stores FP8 values spread over most of the e4m3 range, with per-KV-head
dequantisation scales that differ by a factor of eight across heads, so a backend that drops
per-head scales or broadcasts element 0 gives a visibly wrong answer. Pages are shuffled, so
the block table is a real indirection and not the identity. A per-token-head cache is vLLM's
inline page written by the library's ``reshape_and_cache`` from 16-bit K/V whose magnitudes
differ by the same factor across heads and by up to 16x across tokens, so its scales differ per
key and a backend that reads one scale per head (or none) is visibly wrong. Sink logits (a
shape with ``sinks``) are spread around the log of the keys a query sees, so a sink takes
anywhere from a few percent to most of a row's probability mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.scales import finite_max, is_per_token_head

from .shapes import Shape

# Stored FP8 values are N(0, STORED_STD) clamped to the e4m3 finite max: most of the format's
# range is used, as with amax-calibrated scales.
STORED_STD = 100.0
# Real K/V standard deviations across KV heads (scale = std / STORED_STD): a factor of 8.
HEAD_STD_RANGE = (0.25, 2.0)
# Elements generated per step, so a multi-GiB cache never needs a float32 copy of itself.
_CHUNK = 1 << 26
# Sink logits: log(keys a query sees) + U(-SINK_SPREAD, SINK_SPREAD), one per query head.
SINK_SPREAD = 3.0
# Per-token-head pages: each token's K/V row is scaled by 2**U(-TOKEN_OCTAVES, TOKEN_OCTAVES)
# on top of its head's standard deviation before the write computes its scale.
TOKEN_OCTAVES = 2.0


@dataclass(frozen=True)
class Case:
    """One problem's tensors, in the library's layout (SPEC §2).

    query:        [batch * q_len, num_q_heads, head_dim], shape.query_dtype.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], shape.kv_cache_dtype
                  (with ``shape.per_token_head``: strided views of ``page``).
    k_scale, v_scale: float32 dequantisation multipliers: [num_kv_heads] (all ones when the
                  cache is not quantised; the API then gets ``None``), or with
                  ``shape.per_token_head`` [num_blocks, block_size, num_kv_heads] strided views
                  of the scales inline in ``page``.
    block_table:  [batch, blocks_per_seq] int32, a random permutation of the pages.
    cu_seqlens_q: [batch + 1] int32; seq_lens: [batch] int32 (all equal to kv_len).
    sinks:        [num_q_heads] float32 sink logits when ``shape.sinks``, else None.
    page:         with ``shape.per_token_head``, vLLM's page [num_blocks, num_kv_heads,
                  block_size, 2 * (head_dim + 4)] (uint8 for FP8 data, int8 for int8; slots
                  outside heads in memory) that the caches and scales view; else None.
    """

    shape: Shape
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    sinks: torch.Tensor | None = None
    page: torch.Tensor | None = None

    @property
    def softmax_scale(self) -> float:
        return self.shape.head_dim**-0.5

    @property
    def storage_bytes(self) -> int:
        """Bytes :meth:`clone_storage` copies: the query and the caches (a page whole)."""
        if self.page is not None:
            return self.query.nbytes + self.page.nbytes
        return self.query.nbytes + self.key_cache.nbytes + self.value_cache.nbytes

    def clone_storage(self) -> Case:
        """Same values in new memory (for L2 rotation); the small index tensors are shared."""
        if self.page is not None:
            return replace(
                self, query=self.query.clone(), **_page_views(self.page.clone(), self.shape)
            )
        return replace(
            self,
            query=self.query.clone(),
            key_cache=self.key_cache.clone(),
            value_cache=self.value_cache.clone(),
        )


def _fill_random(cache: torch.Tensor, head_std: torch.Tensor, generator: torch.Generator) -> None:
    """Fill ``cache`` [num_blocks, block, heads, dim] in place, head h with std head_std[h]."""
    flat = cache.view(-1, *cache.shape[2:])
    rows_per_chunk = max(1, _CHUNK // (cache.shape[2] * cache.shape[3]))
    for start in range(0, flat.shape[0], rows_per_chunk):
        part = flat[start : start + rows_per_chunk]
        values = torch.randn(part.shape, generator=generator, device=cache.device)
        values *= head_std[None, :, None]
        if cache.dtype.itemsize == 1:
            values.clamp_(-finite_max(cache.dtype), finite_max(cache.dtype))
        part.copy_(values)


def _page_views(page: torch.Tensor, shape: Shape) -> dict[str, torch.Tensor]:
    """The :class:`Case` fields that view vLLM's per-token-head ``page``: caches and scales."""
    key_cache, value_cache, k_scale, v_scale = split_per_token_head_cache(page, shape.cache_dtype)
    return {"key_cache": key_cache, "value_cache": value_cache, "k_scale": k_scale,
            "v_scale": v_scale, "page": page}  # fmt: skip


def _random_page(
    shape: Shape, num_blocks: int, head_std: torch.Tensor, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A new vLLM page with random K/V in every slot (head h with std ``head_std[h]`` for K, the
    reverse order for V, each token scaled as :data:`TOKEN_OCTAVES` says), written by
    ``reshape_and_cache`` in chunks, so no 16-bit copy of the cache is ever whole."""
    device = head_std.device
    storage = torch.int8 if shape.cache_dtype == torch.int8 else torch.uint8
    cells = (num_blocks, shape.block_size, shape.num_kv_heads, 2 * (shape.head_dim + 4))
    views = _page_views(torch.empty(cells, dtype=storage, device=device).transpose(1, 2), shape)
    slots = num_blocks * shape.block_size
    step = max(1, _CHUNK // (shape.num_kv_heads * shape.head_dim))
    for start in range(0, slots, step):
        rows = min(step, slots - start)
        written = []
        for std in (head_std, head_std.flip(0)):
            octaves = torch.rand(rows, 1, 1, generator=generator, device=device) * 2 - 1
            values = torch.randn(
                (rows, shape.num_kv_heads, shape.head_dim), generator=generator, device=device
            )
            values *= std[None, :, None] * torch.exp2(TOKEN_OCTAVES * octaves)
            written.append(values.to(shape.torch_query_dtype))
        slot_mapping = torch.arange(start, start + rows, device=device)
        fna.reshape_and_cache(*written, views["key_cache"], views["value_cache"], slot_mapping,
                              k_scale=views["k_scale"], v_scale=views["v_scale"])  # fmt: skip
    return views


def make_case(shape: Shape, device: torch.device, seed: int = 0) -> Case:
    """A random problem of ``shape`` on ``device`` (K and V distinct, per-head scales distinct;
    a per-token-head shape: vLLM's page, written once by ``reshape_and_cache``)."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    heads = shape.num_kv_heads
    num_blocks = shape.batch * shape.blocks_per_seq + 1
    cache_shape = (num_blocks, shape.block_size, heads, shape.head_dim)
    # Geometric spread over HEAD_STD_RANGE in a random head order, reversed for V.
    low, high = (math.log10(x) for x in HEAD_STD_RANGE)
    order = torch.randperm(heads, generator=generator, device=device)
    spread = torch.logspace(low, high, heads, device=device)[order]
    if shape.per_token_head:
        cache_fields = _random_page(shape, num_blocks, spread, generator)
    else:
        caches, scales = [], []
        for head_std in (spread, spread.flip(0)):
            cache = torch.empty(cache_shape, dtype=shape.cache_dtype, device=device)
            if shape.quantized:
                _fill_random(cache, torch.full_like(head_std, STORED_STD), generator)
                scales.append(head_std / STORED_STD)
            else:
                _fill_random(cache, head_std, generator)
                scales.append(torch.ones(heads, device=device))
            caches.append(cache)
        cache_fields = {
            "key_cache": caches[0],
            "value_cache": caches[1],
            "k_scale": scales[0].contiguous(),
            "v_scale": scales[1].contiguous(),
        }
    pages = torch.randperm(num_blocks, generator=generator, device=device)[: num_blocks - 1]
    block_table = pages.view(shape.batch, shape.blocks_per_seq).to(torch.int32)
    query = torch.randn(
        (shape.num_tokens, shape.num_q_heads, shape.head_dim), generator=generator, device=device
    ).to(shape.torch_query_dtype)
    cu_seqlens_q = torch.arange(0, shape.num_tokens + 1, shape.q_len, device=device)
    seq_lens = torch.full((shape.batch,), shape.kv_len, device=device)
    sinks = None
    if shape.sinks:
        spread = torch.rand(shape.num_q_heads, generator=generator, device=device) * 2 - 1
        start, end = shape.visible_ranges()[-1]
        sinks = math.log(end - start) + SINK_SPREAD * spread
    return Case(
        shape=shape,
        query=query,
        **cache_fields,
        block_table=block_table.contiguous(),
        cu_seqlens_q=cu_seqlens_q.to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        sinks=sinks,
    )


def gathered_kv(
    case: Case,
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised cache gathered per sequence, as a user would build it for SDPA: the keys
    from ``shape.first_key`` on (the pages the window touches; all keys without a window).

    Returns (key, value), each [batch, num_kv_heads, keys_read, head_dim] in ``dtype``; the
    scales default to the case's (per head or per token and head).
    """
    shape = case.shape
    k_scale = case.k_scale if k_scale is None else k_scale
    v_scale = case.v_scale if v_scale is None else v_scale
    compute = torch.promote_types(dtype, torch.float32)
    out = []
    for cache, scale in ((case.key_cache, k_scale), (case.value_cache, v_scale)):
        dense = torch.empty(
            (shape.batch, shape.num_kv_heads, shape.keys_read, shape.head_dim),
            dtype=dtype,
            device=cache.device,
        )
        for seq in range(shape.batch):
            real = sequence_kv(
                cache, scale, case.block_table[seq], shape.kv_len, compute, shape.first_key
            )
            dense[seq] = real.transpose(0, 1)
        out.append(dense)
    return out[0], out[1]


def sequence_kv(
    cache: torch.Tensor,
    scale: torch.Tensor,
    pages: torch.Tensor,
    kv_len: int,
    dtype: torch.dtype = torch.float32,
    first_key: int = 0,
) -> torch.Tensor:
    """Keys or values ``first_key .. kv_len - 1`` of one sequence, dequantised:
    [kv_len - first_key, num_kv_heads, head_dim] in dtype (only their pages are gathered).
    ``scale``: [num_kv_heads], or per token and head [num_blocks, block_size, num_kv_heads]."""
    block_size = cache.shape[1]
    first_page = first_key // block_size
    pages = pages[first_page : -(-kv_len // block_size)].long()
    offset = first_page * block_size

    def keys_of(paged: torch.Tensor) -> torch.Tensor:
        return paged[pages].flatten(0, 1)[first_key - offset : kv_len - offset]

    if cache.dtype.itemsize == 1:
        # Gather the bytes: indexing kernels cover uint8 on every device, FP8 not everywhere.
        keys = keys_of(cache.view(torch.uint8)).view(cache.dtype)
    else:
        keys = keys_of(cache)
    if is_per_token_head(scale):
        return keys.to(dtype) * keys_of(scale).to(dtype)[:, :, None]
    return keys.to(dtype) * scale.to(dtype)[None, :, None]
