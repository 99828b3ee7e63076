"""Benchmark shapes and the sweep presets.

Every sequence of a shape has the same ``q_len`` and ``kv_len`` (``kv_len`` counts the new query
tokens, SPEC §3), so a padded batch is exact for the peers that need one. Byte and FLOP counts are
the problem's minimum: each KV byte read once, the query read once, the output written once. With a
sliding window the KV bytes are those of the pages the window touches (from the first page holding
a key some query sees to the end of the sequence; a paged kernel reads whole pages), and the FLOPs
those of the keys each query sees, so a windowed shape's bytes, FLOPs and time scale with the
window, not the context. A per-token-head cache (vLLM's ``fp8_per_token_head`` /
``int8_per_token_head``) also reads each key's float32 K and V scale: 8 bytes per key and KV
head on top of its 1-byte elements, ``4 / head_dim`` more than the per-head FP8 cache (3.1% at
head_dim 128), counted in its bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from fp8_noncausal_attn.config import PER_TOKEN_HEAD_KV_CACHE_DTYPES

KV_CACHE_DTYPES = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    # vLLM's names: the element type of the data; each key's scales sit inline in the page.
    "fp8_per_token_head": torch.float8_e4m3fn,
    "int8_per_token_head": torch.int8,
}
# Bytes a per-token-head cache holds per key and KV head besides its data: one float32 K scale
# and one float32 V scale.
SCALE_BYTES_PER_KEY_HEAD = 2 * torch.float32.itemsize
# What every row's bytes count (the results state it; docs/performance.md says the same).
BYTES_NOTE = (
    "bytes = K and V read once (with a window: the pages it touches) + Q + out; a "
    "per-token-head cache's K and V bytes include its inline float32 scales, "
    f"{SCALE_BYTES_PER_KEY_HEAD} bytes per key and KV head: 4 / head_dim more than its 1-byte "
    f"K and V ({SCALE_BYTES_PER_KEY_HEAD / (2 * 128):.1%} at head_dim 128)"
)
QUERY_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Shapes whose BF16 K+V (the size of the peers' dequantised copy) exceed this are left out of
# the full sweep: with the FP8 cache, its copy, rotations and the oracle they would not fit.
MAX_BF16_KV_BYTES = 8 * 2**30


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: ``batch`` sequences of ``q_len`` queries over ``kv_len`` keys."""

    kind: str  # "drafter" or "prefill"
    batch: int
    q_len: int
    kv_len: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    kv_cache_dtype: str  # a KV_CACHE_DTYPES key
    query_dtype: str = "bfloat16"
    # vLLM's default page since 0.34 (16 before): what a drafter's cache has in the release.
    block_size: int = 64
    # (left, right) sliding window, FlashAttention's convention (-1 = unbounded; SPEC §3).
    window: tuple[int, int] = (-1, -1)
    # gpt-oss-style attention sinks: one float32 logit per query head joins each softmax
    # denominator (SPEC §3); the values are drawn by benchmarks.inputs.make_case.
    sinks: bool = False

    @property
    def cache_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def torch_query_dtype(self) -> torch.dtype:
        return QUERY_DTYPES[self.query_dtype]

    @property
    def quantized(self) -> bool:
        return self.cache_dtype.itemsize == 1

    @property
    def per_token_head(self) -> bool:
        """One scale per key and KV head, inline in vLLM's page (else one per KV head)."""
        return self.kv_cache_dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.kv_len // self.block_size)

    def visible_ranges(self, window: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """Keys ``[start, end)`` each query token of a sequence sees (masking.visible_range),
        under this shape's window or the ``window`` given (to compare what a peer can run)."""
        left, right = self.window if window is None else window
        ranges = []
        for token in range(self.q_len):
            position = self.kv_len - self.q_len + token
            end = position + 1 if self.causal else self.kv_len
            if right >= 0:
                end = min(end, position + right + 1)
            ranges.append((max(position - left, 0) if left >= 0 else 0, end))
        return ranges

    @property
    def first_key(self) -> int:
        """The first key of the first page some query's window touches (0 without a window).

        The first query's range starts first; the last query sees key ``kv_len - 1`` under
        either mask, so the pages read run from here to the end of the sequence.
        """
        start = min(start for start, _ in self.visible_ranges())
        return start // self.block_size * self.block_size

    @property
    def keys_read(self) -> int:
        """Keys of one sequence in the pages the window touches (``kv_len`` without a window)."""
        return self.kv_len - self.first_key

    @property
    def pages_read(self) -> int:
        """Pages of one sequence that hold a key some query sees."""
        return -(-self.keys_read // self.block_size)

    def kv_bytes(self, itemsize: int | None = None) -> int:
        """Bytes of K and V the problem reads once: the keys in the pages the window touches
        (:attr:`keys_read`) in the cache dtype, with a per-token-head cache's scales
        (:data:`SCALE_BYTES_PER_KEY_HEAD`); or, given ``itemsize``, those keys' elements alone
        at that size (a dequantised copy)."""
        keys = self.batch * self.keys_read * self.num_kv_heads
        if itemsize is not None:
            return 2 * keys * self.head_dim * itemsize
        scales = SCALE_BYTES_PER_KEY_HEAD if self.per_token_head else 0
        return keys * (2 * self.head_dim * self.cache_dtype.itemsize + scales)

    @property
    def bytes(self) -> int:
        """Minimum HBM traffic: KV (and per-token-head scales) read once, Q read once, the
        output written once."""
        q_or_out = self.num_tokens * self.num_q_heads * self.head_dim * 2
        return self.kv_bytes() + 2 * q_or_out

    @property
    def flops(self) -> int:
        """2 FLOP per multiply-add of QK^T and of PV, over the keys each query attends to."""
        if self.window != (-1, -1):
            keys_per_seq = sum(end - start for start, end in self.visible_ranges())
        elif self.causal:
            first = self.kv_len - self.q_len + 1
            keys_per_seq = self.q_len * first + self.q_len * (self.q_len - 1) // 2
        else:
            keys_per_seq = self.q_len * self.kv_len
        return 4 * self.batch * keys_per_seq * self.num_q_heads * self.head_dim

    def label(self) -> str:
        mask = "causal" if self.causal else "bidir"
        if self.window != (-1, -1):
            mask += f" window{self.window[0]},{self.window[1]}"
        if self.sinks:
            mask += " sinks"
        return (
            f"{self.kind} b{self.batch} q{self.q_len} kv{self.kv_len} "
            f"{self.num_q_heads}/{self.num_kv_heads}x{self.head_dim} {mask} {self.kv_cache_dtype}"
        )

    def fields(self) -> dict[str, object]:
        """The row fields that identify the shape (JSON-ready)."""
        return asdict(self)


def _drafter(**overrides: object) -> Shape:
    """The DSpark drafter on a Qwen3-8B target: the CUDA issue's acceptance shape by default."""
    base = Shape(
        kind="drafter",
        batch=32,
        q_len=8,
        kv_len=8192,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        causal=False,
        kv_cache_dtype="fp8_e4m3",
    )
    return replace(base, **overrides)


def windowed_drafter(**overrides: object) -> Shape:
    """A drafter for a sliding-window target: vLLM's ``sliding_window=4096`` made symmetric for
    the bidirectional drafter, ``(4095, 4095)``, over a 128k context. Its bytes and FLOPs are the
    window's (~4k keys per sequence), a 32nd of the context's; every runner passes the window
    (a peer that cannot express it is skipped with the reason).
    """
    return replace(_drafter(kv_len=131072, window=(4095, 4095)), **overrides)


def prefill(length: int, **overrides: object) -> Shape:
    """A non-causal prefill of ``length`` query tokens over as many keys, by default
    BF16 query over an e4m3 cache with the drafter's Qwen3-8B-style heads: 32 query / 8 KV heads
    (GQA 4, the common Llama-3 / Qwen3 8B ratio), head_dim 128, page 64 (vLLM 0.34's default block
    size), one sequence. Compute-bound (4 x q x kv x head_dim x heads FLOPs over 2 x kv x
    head_dim x KV heads bytes: 2 x 4 x q FLOP per KV byte), so the report measures it against
    the GPU's dense 16-bit tensor peak, not HBM bandwidth (benchmarks.report.goals).
    """
    return replace(_drafter(kind="prefill", batch=1, q_len=length, kv_len=length), **overrides)


def quick() -> list[Shape]:
    """A few minutes on an H200: the acceptance shape and one step along each axis."""
    shapes = [
        _drafter(),
        _drafter(kv_cache_dtype="bfloat16"),
        *(
            _drafter(kv_cache_dtype=kv_cache_dtype)
            for kv_cache_dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES
        ),
        _drafter(causal=True),
        _drafter(kv_len=2048),
        windowed_drafter(),
        _drafter(kv_len=32768),
        _drafter(kv_len=32768, kv_cache_dtype="bfloat16"),
        _drafter(batch=1),
        _drafter(batch=8),
        _drafter(q_len=16),
        _drafter(num_q_heads=64),
        prefill(4096),  # last: the preset's time budget cuts it first
    ]
    return shapes


def full() -> list[Shape]:
    """The issue's sweep, one axis at a time around the drafter shape, within the memory cap."""
    kv_lens = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    shapes: list[Shape] = []
    for kv_cache_dtype in ("fp8_e4m3", "bfloat16", *PER_TOKEN_HEAD_KV_CACHE_DTYPES):
        for causal in (False, True):
            for batch in (1, 8, 32, 64):
                # One query token sees every key under either mask: q_len 1 is measured once.
                for q_len in (1, 8, 16) if not causal else (8, 16):
                    for kv_len in kv_lens:
                        shapes.append(
                            _drafter(
                                batch=batch,
                                q_len=q_len,
                                kv_len=kv_len,
                                causal=causal,
                                kv_cache_dtype=kv_cache_dtype,
                            )
                        )
            for num_q_heads in (32, 64):
                for head_dim in (64, 128, 256):
                    for kv_len in (8192, 32768):
                        shapes.append(
                            _drafter(
                                num_q_heads=num_q_heads,
                                head_dim=head_dim,
                                kv_len=kv_len,
                                causal=causal,
                                kv_cache_dtype=kv_cache_dtype,
                            )
                        )
        for length in (4096, 8192, 16384):
            shapes.append(prefill(length, kv_cache_dtype=kv_cache_dtype))
    shapes += [windowed_drafter(), windowed_drafter(sinks=True), windowed_drafter(causal=True)]
    return _unique_within_cap(shapes)


# The drafter grid the GPU check measures (tools/gpu_check), in the order it measures it: a
# cut-off run keeps the middle of the grid first, then its ends; the e4m3 cache with per-head
# scales first, then the per-token-head caches on the same shapes.
GRID_KV_LENS = (16384, 131072, 4096, 65536)
GRID_BATCHES = (32, 64)
GRID_Q_LENS = (8, 16)


def grid() -> list[Shape]:
    """Batch 32 and 64 x q_len 8 and 16 x context 4k, 16k, 64k, 128k; the drafter's heads
    (32 q / 8 KV, head_dim 128), bidirectional: the e4m3 cache with per-head scales, then the
    same shapes over vLLM's per-token-head pages (both formats of a shape side by side)."""
    points = [
        {"batch": batch, "q_len": q_len, "kv_len": kv_len}
        for kv_len in GRID_KV_LENS
        for batch in GRID_BATCHES
        for q_len in GRID_Q_LENS
    ]
    per_token_head = [
        _drafter(**point, kv_cache_dtype=kv_cache_dtype)
        for point in points
        for kv_cache_dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES
    ]
    return [_drafter(**point) for point in points] + per_token_head


def dry_run() -> list[Shape]:
    """Tiny CPU shapes: every code path (both masks, FP8 and unquantised, per-token-head pages
    of both formats, a kv sweep, prefill, a sliding window spanning pages with both masks,
    sinks).

    FP16 queries because Triton's CPU interpreter computes ``tl.dot`` on BF16 operands wrongly.
    """
    tiny = {
        "batch": 2,
        "num_q_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 64,
        "query_dtype": "float16",
    }
    return [
        _drafter(q_len=4, kv_len=40, **tiny),
        _drafter(q_len=4, kv_len=75, **tiny),
        _drafter(q_len=4, kv_len=75, causal=True, **tiny),
        _drafter(q_len=1, kv_len=75, **tiny),
        _drafter(q_len=4, kv_len=75, kv_cache_dtype="float16", **tiny),
        *(
            _drafter(q_len=4, kv_len=75, kv_cache_dtype=dtype, **tiny)
            for dtype in PER_TOKEN_HEAD_KV_CACHE_DTYPES
        ),
        _drafter(q_len=4, kv_len=75, causal=True, kv_cache_dtype="int8_per_token_head", **tiny),
        prefill(32, **{**tiny, "batch": 1}),
        _drafter(q_len=4, kv_len=200, window=(40, 40), **tiny),
        _drafter(q_len=4, kv_len=200, window=(40, 0), causal=True, sinks=True, **tiny),
    ]


def _unique_within_cap(shapes: list[Shape]) -> list[Shape]:
    seen: set[Shape] = set()
    kept = []
    for shape in shapes:
        if shape in seen or shape.kv_bytes(itemsize=2) > MAX_BF16_KV_BYTES:
            continue
        seen.add(shape)
        kept.append(shape)
    return kept


PRESETS = {"dry-run": dry_run, "quick": quick, "grid": grid, "full": full}
