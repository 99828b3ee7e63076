"""Random paged-attention problems for the tests, the demo and the benchmarks.

Values are random normals with a different magnitude per KV head (so a dropped or broadcast
per-head scale changes the answer), pages are shuffled (so a kernel that ignores the block table
fails), and the cache is written through :func:`reshape_and_cache` with scales from
:func:`compute_kv_scales`, the way a serving stack fills it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .layouts import CacheLayout, split_kv_cache
from .scales import FP8_DTYPES


@dataclass
class PagedCase:
    """Inputs of one ``paged_attention`` call; ``kwargs()`` spreads them into the API."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool | torch.Tensor
    k_scale: torch.Tensor | float | None
    v_scale: torch.Tensor | float | None
    q_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query, self.key_cache, self.value_cache,
            self.block_table, self.cu_seqlens_q, self.seq_lens,
        )  # fmt: skip

    def kwargs(self) -> dict[str, object]:
        return {
            "causal": self.causal,
            "k_scale": self.k_scale,
            "v_scale": self.v_scale,
            "max_seqlen_q": max(self.q_lens, default=0),
            "max_seqlen_k": max(self.kv_lens, default=0),
        }


def allocate_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    layout: CacheLayout | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty K and V caches in the logical shape, as views of ``layout``'s storage.

    ``layout=None`` gives two separate contiguous tensors; ``"vllm"`` gives one uint8 (for FP8)
    ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` tensor, as vLLM 0.33 keeps it.
    """
    if layout is None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return (
            torch.empty(shape, dtype=cache_dtype, device=device),
            torch.empty(shape, dtype=cache_dtype, device=device),
        )
    storage_dtype = torch.uint8 if cache_dtype in FP8_DTYPES else cache_dtype
    if layout == "vllm":
        shape = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
    elif layout == "kv_first":
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    else:
        shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    combined = torch.empty(shape, dtype=storage_dtype, device=device)
    return split_kv_cache(combined, layout, cache_dtype)


def make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    cache_dtype: torch.dtype = torch.float8_e4m3fn,
    query_dtype: torch.dtype = torch.bfloat16,
    causal: bool | list[bool] = False,
    causal_dtype: torch.dtype = torch.bool,
    scales: str = "per_head",
    layout: CacheLayout | None = None,
    index_step: int = 1,
    padded_rows: int = 0,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> PagedCase:
    """Build a random problem with sequences of ``q_lens[i]`` new tokens over ``kv_lens[i]`` keys.

    ``scales``: ``"per_head"`` (float32 ``[num_kv_heads]`` from :func:`compute_kv_scales` for FP8
    caches, distinct random values for 16-bit ones), ``"scalar"`` (one Python float) or
    ``"none"``. ``causal`` as a list gives a per-sequence tensor of ``causal_dtype`` (bool, or
    int32 as vLLM 0.33 passes it). ``index_step > 1`` makes every index tensor (``block_table``
    along its columns, ``cu_seqlens_q``, ``seq_lens``, a per-sequence ``causal``) a strided view
    (:func:`strided_view`); ``padded_rows`` appends that many random query rows past the last
    sequence, as vLLM pads a batch under CUDA graphs.
    """
    from .api import compute_kv_scales, reshape_and_cache

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-kv // block_size) for kv in kv_lens) + 2
    key_cache, value_cache = allocate_cache(
        num_blocks, block_size, num_kv_heads, head_dim, cache_dtype, layout, device
    )
    # Garbage in unused slots: a kernel reading past kv_len sees large values and fails.
    for cache in (key_cache, value_cache):
        if cache.element_size() == 1:
            cache.view(torch.uint8).fill_(0x5A)
        else:
            cache.view(torch.int16).fill_(0x5A5A)
    block_table = shuffled_block_table(kv_lens, block_size, num_blocks, gen)
    slots = slot_mapping(block_table, kv_lens, block_size)

    magnitude = torch.logspace(-1, 1, num_kv_heads)[torch.randperm(num_kv_heads, generator=gen)]
    shape = (len(slots), num_kv_heads, head_dim)
    keys = torch.randn(shape, generator=gen) * magnitude[:, None]
    values = torch.randn(shape, generator=gen) * magnitude[:, None]
    keys, values = keys.to(query_dtype), values.to(query_dtype)

    if scales == "none":
        k_scale = v_scale = None
    elif scales == "scalar":
        k_scale, v_scale = 0.75, 1.25
    elif cache_dtype in FP8_DTYPES:
        k_scale, v_scale = compute_kv_scales(keys, values, fp8_dtype=cache_dtype)
    else:
        k_scale = torch.rand(num_kv_heads, generator=gen) + 0.5
        v_scale = torch.rand(num_kv_heads, generator=gen) + 0.5
    if isinstance(k_scale, torch.Tensor):
        k_scale, v_scale = k_scale.to(device), v_scale.to(device)
    reshape_and_cache(
        keys.to(device), values.to(device), key_cache, value_cache,
        slots.to(device),
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip

    num_tokens = sum(q_lens) + padded_rows
    query = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(query_dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    causal_arg: bool | torch.Tensor = causal
    if isinstance(causal, list):
        causal_arg = torch.tensor(causal, dtype=causal_dtype, device=device)
    block_table = block_table.to(device)
    cu_seqlens_q = cu.to(device)
    seq_lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    if index_step > 1:
        block_table = strided_view(block_table, dim=1, step=index_step)
        cu_seqlens_q = strided_view(cu_seqlens_q, step=index_step)
        seq_lens = strided_view(seq_lens, step=index_step)
        if isinstance(causal_arg, torch.Tensor):
            causal_arg = strided_view(causal_arg, step=index_step)
    return PagedCase(
        query=query.to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table,
        cu_seqlens_q=cu_seqlens_q,
        seq_lens=seq_lens,
        causal=causal_arg,
        k_scale=k_scale,
        v_scale=v_scale,
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
    )


def shuffled_block_table(
    kv_lens: list[int],
    block_size: int,
    num_blocks: int,
    gen: torch.Generator,
    width: int | None = None,
) -> torch.Tensor:
    """int32 ``[len(kv_lens), width]``: each sequence's pages drawn in turn, without
    replacement, from a random permutation of ``num_blocks`` pages (one ``torch.randperm`` on
    ``gen``); ``width`` defaults to one column more than the longest sequence needs, and
    columns past a sequence's pages hold 0."""
    pages_per_seq = [-(-kv // block_size) for kv in kv_lens]
    page_ids = torch.randperm(num_blocks, generator=gen).tolist()
    if width is None:
        width = max(pages_per_seq, default=0) + 1
    block_table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    for seq, n_pages in enumerate(pages_per_seq):
        seq_pages = [page_ids.pop() for _ in range(n_pages)]
        block_table[seq, :n_pages] = torch.tensor(seq_pages, dtype=torch.int32)
    return block_table


def slot_mapping(block_table: torch.Tensor, kv_lens: list[int], block_size: int) -> torch.Tensor:
    """int64 ``[sum(kv_lens)]`` on the CPU: the cache slot (``page * block_size + offset``) of
    every key, sequence after sequence, through ``block_table`` ``[len(kv_lens), pages]``."""
    slots: list[int] = []
    for pages, kv_len in zip(block_table.tolist(), kv_lens, strict=True):
        slots += [pages[j // block_size] * block_size + j % block_size for j in range(kv_len)]
    return torch.tensor(slots, dtype=torch.int64)


def strided_view(x: torch.Tensor, dim: int = -1, step: int = 2) -> torch.Tensor:
    """``x``'s values in a view whose ``dim`` has ``step`` times its contiguous stride.

    The gaps hold zeros: a kernel that ignores the stride reads wrong page ids, lengths or flags
    (and so a wrong answer) that still stay in bounds. vLLM's index tensors arrive as such slices
    of persistent buffers.
    """
    shape = list(x.shape)
    shape[dim] *= step
    index = [slice(None)] * x.dim()
    index[dim] = slice(None, None, step)
    view = torch.zeros(shape, dtype=x.dtype, device=x.device)[tuple(index)]
    view.copy_(x)
    return view


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64."""
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp_min(1e-30))
