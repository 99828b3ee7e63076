"""CPU emulation of the tcgen05 kernel's data path (dsl/tcgen05/kernel.py), in float64.

The kernel has never run on a GPU. What can be checked without one is that its index maps, which
it imports from dsl/tcgen05/layouts.py (the same functions are called here, not a copy), put the
right bytes in the right places: which CTA owns which rows (token, head) and key tiles (split
ranges), which pages and 16-byte chunks each converter thread copies and where in the swizzled
ring they land, the order in which the two MMA warps consume the converted K/V items, the mask
predicate and per-column constants, the sliding window's key tiles and mask, the bf16 -> fp16
row scaling, the online-softmax update order, the sink in the unsplit epilogue and the split-KV
state handed to the merge. The ring is read back through the UMMA
128-byte-swizzle layout the DSL gives the ldmatrix reads (test_tcgen05_host checks that layout
against the DSL itself). Planted bugs in the maps must make the comparison fail.

What this does not check: the tcgen05 / TMEM fragment layouts inside the DSL's own partitions
(CUTLASS's responsibility), pipelines and barriers (races), anything about speed.
"""

import math
from collections import Counter

import numpy as np
import pytest
import torch
from helpers import TOLERANCE
from helpers.dsl import (
    causal_off_by_one,
    head_from_token,
    index_offset_ignores_stride,
    offsets_ignore_causal,
    page_count_floor,
    poison_pages_outside_windows,
    split_range_drops_last_tile,
    tile_mask_ignores_causal,
    tile_mask_ignores_window_start,
    window_cases,
    window_end_floor,
    window_last_key_of_q_len,
    window_left_unbounded_forgotten,
    window_lower_bound_unmasked,
    worst_row_error,
)
from helpers.dsl_emulation import EmulatedFamily, cta_work, reference, sink_log2

from dsl.common import indexing as X
from dsl.common import precision as P
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T
from fp8_noncausal_attn.synthetic import relative_error

# Replays kernels in numpy from their own index maps (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.emulation


def _select(cond, a, b):
    return a if cond else b


def umma_sw128_read(tile_bytes: np.ndarray) -> np.ndarray:
    """[128 rows, 128 bytes] as ldmatrix sees a staged item: byte b of row j at
    Swizzle<3,4,3>(j * 128 + b), the DSL's make_smem_layout_a for 8-bit K-major (K) and
    MN-major (V) 128 x 128 tiles (test_tcgen05_host compares this with the DSL)."""
    j = np.arange(128)[:, None]
    b = np.arange(128)[None, :]
    linear = j * 128 + b
    swizzled = linear ^ (((linear >> 7) & 7) << 4)
    return tile_bytes[swizzled]


def _fp8_to_float(b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Exact, as the converter for every byte (NaN bytes give NaN): e4m3's F2FP share is exact,
    and its integer-pipe share (layouts.e4m3x4_to_f16x2_scaled, x 2^8) and e5m2's byte moves
    (layouts.e5m2x4_to_f16x2) are checked exact for every byte by test_tcgen05_host."""
    return torch.from_numpy(b.copy()).view(dtype).double().numpy()


def q_to_fp16(q: np.ndarray, is_bf16: bool) -> tuple[np.ndarray, float]:
    """One query row (float32 values of the query dtype) as the kernel's fp16 operand, and the
    factor 2^-e that rejoins the softmax scale."""
    if not is_bf16:
        return q.astype(np.float16).astype(np.float64), 1.0
    biggest = np.float32(np.abs(q).max())
    biased = int((biggest.view(np.int32) >> 23) & 0xFF)
    e = P.row_scale_exponent(biased, min)
    return (q * np.float32(2.0**e)).astype(np.float16).astype(np.float64), 2.0**-e


def consumer_items(iters: int, d_tiles: int) -> tuple[dict, dict]:
    """Converted-item indices the two MMA warps consume, replaying their loops in kernel.py:
    BMM1 takes ``d_tiles`` items per tile and skips the V items of the previous tile; BMM2 first
    skips tile 0's K items, then per tile skips the next tile's K items and takes its V items."""
    kq, vp = {}, {}
    idx = 0
    for s in range(iters):
        for dk in range(d_tiles):
            kq[s, dk] = idx
            idx += 1
        if s > 0:
            idx += d_tiles
    idx = d_tiles if iters > 0 else 0
    for s in range(iters):
        if s < iters - 1:
            idx += d_tiles
        for dm in range(d_tiles):
            vp[s, dm] = idx
            idx += 1
    return kq, vp


# Staged items converted and NaN values in them (a poisoned byte that reached the ring).
RING_NAN_VALUES: Counter = Counter()
# Tiles the emulation took on the exact path (True) and kept the reference maxima (False).
LAZY_TILES: Counter = Counter()
# Tiles past a CTA's first where some column had seen no key yet: "checked" (an unmasked tile's
# lazy check), "first key" (an exact tile that gives such a column its first key).
NO_KEY_TILES: Counter = Counter()


# The softmax threads' view of a 32-column chunk of S (layouts.score_key_column): per thread and
# register its key within the tile, its column within the chunk and which of the thread's 8
# partial sums it adds into (layouts.score_entry).
def score_maps() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key [128, 32], column [128, 32], entry [32]) of every softmax thread's registers."""
    pairs = [[L.score_key_column(t, r) for r in range(L.SCORE_REGISTERS)] for t in range(128)]
    keys, columns = np.array(pairs).transpose(2, 0, 1)
    entries = np.array([L.score_entry(r) for r in range(L.SCORE_REGISTERS)])
    return keys, columns, entries


def add_thread_partials(l_part: np.ndarray, p_chunk: np.ndarray, maps) -> None:
    """``l_part[t, i] += `` thread t's registers of entry i of one chunk of P (``p_chunk``
    [128 keys, 32 columns]), as the kernel's P pass adds them; ``maps`` from score_maps."""
    keys, columns, entries = maps
    threads = np.repeat(np.arange(128)[:, None], L.SCORE_REGISTERS, axis=1)
    np.add.at(l_part, (threads, np.broadcast_to(entries, threads.shape)), p_chunk[keys, columns])


def epilogue_column_sums(l_part: np.ndarray) -> np.ndarray:
    """The epilogue: each warp's butterfly over layouts.COLUMN_LANE_STRIDES (every lane ends
    with the sums of the lanes that share its columns), lanes 0-3 write their 8 columns
    (layouts.thread_column), the 4 warps add. ``l_part`` [128 threads, 8] of one chunk ->
    [32 columns]."""
    lanes = np.arange(32)
    sums = np.zeros(L.COLUMN_CHUNK)
    for w in range(4):
        values = l_part[32 * w : 32 * w + 32]
        for stride in L.COLUMN_LANE_STRIDES:
            values = values + values[lanes ^ stride]
        for lane in range(4):
            for i in range(L.THREAD_COLUMNS):
                sums[L.thread_column(lane, i)] += values[lane, i]
    return sums


def _reference(m):
    """The maximum P is taken against (softmax._reference): 0 while a column has seen no key."""
    return np.where(m == -np.inf, 0.0, m)


def emulate_cta(problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes, vbytes):
    """One CTA: returns {(token, head): (O / l * v_scale [head_dim], lse log2)} for its rows."""
    rows, d_tiles, head_dim = variant.rows, variant.d_tiles, variant.head_dim
    work = cta_work(problem, "tcgen05", rows, L.KEY_TILE, seq, row_tile, split, num_splits)
    if work is None:
        return {}
    group, q_start, q_len, kv_len, num_rows, row_base, last_row, first_key, first, iters, causal = (
        work
    )
    left, right = problem.window

    # Q prologue: fp16 rows x (d_tiles x 128) B tile, row factors. Head dims past head_dim
    # (head_dim 64: 64..127) are never written: NaN here, so a BMM1 that read them would show.
    is_bf16 = problem.query.dtype == torch.bfloat16
    width = d_tiles * L.ITEM_BYTES
    q16 = np.full((rows, width), np.nan)
    inverse = np.ones(rows)
    for n in range(rows):
        r = row_base + n
        if r < num_rows:
            token, head = X.row_token(r, group), X.row_head(r, group, kv_head)
            q = problem.query[q_start + token, head].float().numpy()
            q16[n, :head_dim], inverse[n] = q_to_fp16(q, is_bf16)
        else:
            q16[n, :head_dim] = 0.0  # rows past R are written as zeros
    k_scale = float(problem.k_scale[kv_head])
    v_scale = float(problem.v_scale[kv_head])
    col_scale = problem.softmax_scale * math.log2(math.e) * k_scale * inverse
    position = X.query_position(X.row_token(row_base + np.arange(rows), group), q_len, kv_len)
    before, after = X.window_offsets(left, right, causal, _select, min)
    first_position = X.query_position(X.row_token(row_base, group), q_len, kv_len)
    last_position = X.query_position(X.row_token(last_row, group), q_len, kv_len)

    # Converter: every staged item through the ring, in the kernel's item order.
    kc, vc = problem.key_cache, problem.value_cache
    k_str, v_str = kc.stride()[:3], vc.stride()[:3]
    bt = problem.block_table
    ring = np.zeros((T.LOAD_STAGES, L.KEY_TILE * L.ITEM_BYTES), np.uint8)
    block_shift = problem.block_size.bit_length() - 1
    num_cols = X.page_count(kv_len, block_shift)
    converted = []
    for i in range(L.item_count(iters, d_tiles)):
        is_v, tile, dslice = L.item_of(i, iters, d_tiles, _select)
        stage = ring[i % T.LOAD_STAGES]
        src, strides, base = (
            (vbytes, v_str, vc.storage_offset()) if is_v else (kbytes, k_str, kc.storage_offset())
        )
        key0 = (first + tile) * L.KEY_TILE
        col0, slot0 = L.tile_page_slot(key0, block_shift)
        # Lane l of every converter warp reads the block table once per item.
        lane_pages = [
            int(bt[seq, col0 + L.lane_page(lane, block_shift)])
            if col0 + L.lane_page(lane, block_shift) < num_cols
            else 0
            for lane in range(32)
        ]
        full = X.tile_wholly_loaded(key0, key0 + L.KEY_TILE, first_key, kv_len)
        for t in range(128):
            # The thread's pointer (KV head, its slot and chunk), computed once in the kernel.
            thread_off = (
                base
                + X.key_offset(0, L.loader_row(t, 0), kv_head, *strides)
                + L.loader_chunk(t) * L.CHUNK
                + dslice * L.ITEM_BYTES
            )
            ring_thread = L.loader_ring_offset(t, 0)
            for step in range(L.LOADER_STEPS):
                step_page, step_slot = L.loader_step_page_slot(step, block_shift)
                page = lane_pages[step_page if L.pages_per_tile(block_shift) > 1 else t % 32]
                keep = L.loader_predicate(t, step, key0, first_key, kv_len, head_dim, not full)
                if keep is not None and not keep:
                    continue
                off = thread_off + X.key_offset(page, slot0 + step_slot, 0, *strides)
                dst = ring_thread + L.loader_ring_offset(0, step)
                chunk = src[off : off + L.CHUNK]
                if len(chunk) < L.CHUNK:  # past the cache (a wrong map): garbage or a fault
                    chunk = np.full(L.CHUNK, 0x7F, np.uint8)
                stage[dst : dst + L.CHUNK] = chunk
        converted.append(_fp8_to_float(umma_sw128_read(stage), kc.dtype))
        RING_NAN_VALUES["items"] += 1
        RING_NAN_VALUES["nan"] += int(np.isnan(converted[-1]).sum())

    # MMA + softmax warps, tile by tile, in the kernel's update order.
    kq, vp = consumer_items(iters, d_tiles)
    m_prev = np.full(rows, -np.inf)
    # Column sums as the softmax threads hold them: per thread and 32-column chunk the running
    # partial sums of its 8 columns over its 4 keys.
    chunks = rows // L.COLUMN_CHUNK
    l_part = np.zeros((chunks, 128, L.THREAD_COLUMNS))
    thread_columns = np.array(
        [[L.thread_column(t % 32, i) for i in range(L.THREAD_COLUMNS)] for t in range(128)]
    )
    # BMM1 runs the k-steps covering each K item's head dims (layouts.bmm1_k_blocks).
    k_dims = L.bmm1_k_blocks(head_dim) * L.UMMA_K
    q_read = np.concatenate(
        [q16[:, dk * L.ITEM_BYTES : dk * L.ITEM_BYTES + k_dims] for dk in range(d_tiles)], axis=1
    )
    maps = score_maps()
    o = np.zeros((width, rows))  # O^T: head_dim 64 leaves lanes 64..127 unwritten
    for s in range(iters):
        k_tile = np.concatenate([converted[kq[s, dk]][:, :k_dims] for dk in range(d_tiles)], axis=1)
        v_tile = np.concatenate([converted[vp[s, dm]] for dm in range(d_tiles)], axis=1)
        scores = k_tile @ q_read.T  # S^T [key, row]
        key0 = (first + s) * L.KEY_TILE
        j = key0 + np.arange(L.KEY_TILE)
        # Only tiles some row does not see whole are masked (the kernel's fast path).
        needs_mask = X.window_tile_needs_mask(
            key0, key0 + L.KEY_TILE, kv_len, first_position, last_position, before, after
        )
        visible = X.key_in_window(j[:, None], kv_len, position[None, :], before, after)
        if not needs_mask:
            visible = np.ones_like(visible)
        # Lazy rescale: past the first tile an unmasked tile keeps the reference maxima unless
        # a score of any column outruns them (every warp's vote), else the exact path.
        # The offsets (layouts.exp2_offset) are the last exact tile's.
        exact = True
        empty = m_prev == -np.inf
        if not needs_mask and s > 0:
            NO_KEY_TILES["checked"] += bool(empty.any())
            highest = (scores * col_scale + L.exp2_offset(m_prev, col_scale, np.where)).max()
            exact = bool(L.rescale_needed(highest))
        LAZY_TILES[exact] += 1
        correction = np.ones(rows)
        if exact:
            m_new = np.maximum(m_prev, np.where(visible, scores, -np.inf).max(axis=0))
            if s > 0:
                NO_KEY_TILES["first key"] += bool((empty & (m_new > -np.inf)).any())
            # In float32 as the kernel (exp2 past 128 is inf there).
            old = L.correction_old_reference(m_prev.astype(np.float32), np.where)
            new = _reference(m_new).astype(np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                correction = np.exp2((old - new) * col_scale.astype(np.float32)).astype(float)
            m_prev = m_new
        offset = L.exp2_offset(m_prev, col_scale, np.where)
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(visible, np.exp2(scores * col_scale + offset), 0.0)
        p16 = p.astype(np.float16).astype(np.float64)
        # The kernel sums P before its fp16 rounding; the partial sums take their column's
        # correction (layouts.thread_column) on exact tiles only.
        for c in range(chunks):
            columns = slice(L.COLUMN_CHUNK * c, L.COLUMN_CHUNK * (c + 1))
            if exact:
                l_part[c] *= correction[columns][thread_columns]
            add_thread_partials(l_part[c], p[:, columns], maps)
        o = o * correction + v_tile.T @ p16

    # Epilogue: lanes, then warps (epilogue_column_sums).
    l_sum = np.concatenate([epilogue_column_sums(l_part[c]) for c in range(chunks)])
    result = {}
    for n in range(rows):
        r = row_base + n
        if r < num_rows:
            token, head = X.row_token(r, group), X.row_head(r, group, kv_head)
            m_scaled = _reference(m_prev[n]) * col_scale[n]
            inv = v_scale / l_sum[n] if l_sum[n] > 0 else 0.0
            if num_splits == 1:  # the sink joins the denominator at max(m, sink)
                sink = sink_log2(problem, head)
                top = max(m_scaled, sink)
                top = 0.0 if top == -math.inf else top
                keep = math.exp2(m_scaled - top)
                denominator = l_sum[n] * keep + math.exp2(sink - top)
                inv = v_scale * keep / denominator if denominator > 0 else 0.0
            lse = m_scaled + math.log2(l_sum[n]) if l_sum[n] > 0 else -math.inf
            result[q_start + token, head] = (o[:head_dim, n] * inv, lse)
    return result


CASES = {
    # drafter block, GQA 4 (R = 64: two row tiles of 32), bidirectional, bf16 query
    "bf16_bidir_gqa4": dict(
        q_lens=[16, 9], kv_lens=[300, 140], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=False, splits=1,
    ),
    # fp16 query, causal, page size 64, split into 3 (one split of the short sequence is empty)
    "f16_causal_split3": dict(
        q_lens=[7, 12], kv_lens=[260, 40], num_q_heads=4, num_kv_heads=1, block_size=64,
        causal=True, query_dtype=torch.float16, splits=3,
    ),
    # the 64-row variant: R = 48 and 80 (one and two row tiles), causal, split in 2
    "bf16_rows64_causal": dict(
        q_lens=[12, 20], kv_lens=[200, 150], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=True, rows=64, splits=2,
    ),
    # the 128-row variant: R = 128 and 40 (GQA 8) in one CTA per KV head, causal, split in 2
    "bf16_rows128_causal": dict(
        q_lens=[16, 5], kv_lens=[300, 200], num_q_heads=16, num_kv_heads=2, block_size=16,
        causal=True, rows=128, splits=2,
    ),
    # e5m2 caches (byte-move conversion): 64 rows, causal, split 2; fp16 query at head_dim 256
    "e5m2_bf16_rows64_causal_split2": dict(
        q_lens=[12, 20], kv_lens=[200, 333], num_q_heads=8, num_kv_heads=2, block_size=16,
        cache_dtype=torch.float8_e5m2, causal=True, rows=64, splits=2,
    ),
    "e5m2_f16_d256_bidir": dict(
        q_lens=[6, 3], kv_lens=[270, 129], num_q_heads=4, num_kv_heads=2, block_size=16,
        cache_dtype=torch.float8_e5m2, causal=False, query_dtype=torch.float16, head_dim=256,
        splits=1,
    ),
    # head_dim 256 x 64 rows (R = 64 and 40), causal, split 2
    "bf16_d256_rows64_causal_split2": dict(
        q_lens=[16, 10], kv_lens=[300, 170], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=True, head_dim=256, rows=64, splits=2,
    ),
    # page size 128 (a page per key tile; the run-time block_shift 7), e5m2, 128 rows (R = 80
    # and 24), bidirectional, split 2
    "page128_e5m2_rows128_split2": dict(
        q_lens=[20, 6], kv_lens=[700, 129], num_q_heads=8, num_kv_heads=2, block_size=128,
        cache_dtype=torch.float8_e5m2, causal=False, rows=128, splits=2,
    ),
    # per-sequence int32 flags read through strided index tensors, page size 32, MHA
    "int32_flags_strided": dict(
        q_lens=[5, 8, 3], kv_lens=[133, 8, 257], num_q_heads=2, num_kv_heads=2, block_size=32,
        causal=[True, False, True], causal_dtype=torch.int32, index_step=2, splits=2,
    ),
    # head_dim 256: two K and two V items per key tile, two O^T M tiles; fp16 query, split 2
    "f16_d256_split2": dict(
        q_lens=[6, 3], kv_lens=[270, 129], num_q_heads=4, num_kv_heads=2, block_size=16,
        causal=False, query_dtype=torch.float16, head_dim=256, splits=2,
    ),
    # bool flags, page size 256 (two key tiles per page), q_len == kv_len
    "bool_flags_page256": dict(
        q_lens=[16, 4], kv_lens=[16, 390], num_q_heads=4, num_kv_heads=2, block_size=256,
        causal=[False, True], causal_dtype=torch.bool, splits=1,
    ),
    **window_cases(mid_tile=dict(rows=64), large_tile=dict(rows=128)),
    # head_dim 64 (half of each staged 128-byte row, BMM1's first 4 k-steps, O^T lanes 0..63):
    # causal, bf16, 32 rows (R = 36: two row tiles), page 16, unsplit
    "d64_bf16_causal_rows32": dict(
        q_lens=[9, 4], kv_lens=[300, 141], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=True, head_dim=64, splits=1,
    ),
    # bidirectional, fp16, e5m2, 64 rows, page 256 (two key tiles per page), split 2
    "d64_f16_e5m2_bidir_rows64_page256_split2": dict(
        q_lens=[12, 20], kv_lens=[333, 600], num_q_heads=8, num_kv_heads=2, block_size=256,
        cache_dtype=torch.float8_e5m2, causal=False, query_dtype=torch.float16, head_dim=64,
        rows=64, splits=2,
    ),
    # per-sequence bool flags, 128 rows (R = 128 and 40), page 16, split 2
    "d64_bool_flags_rows128_split2": dict(
        q_lens=[16, 5, 9], kv_lens=[300, 200, 9], num_q_heads=16, num_kv_heads=2,
        block_size=16, causal=[True, False, True], causal_dtype=torch.bool, head_dim=64,
        rows=128, splits=2,
    ),
    # a two-sided window and sinks over per-sequence int32 flags, 64 rows, page 32, split 2
    "d64_window_sinks_int32_flags_rows64_split2": dict(
        q_lens=[16, 20], kv_lens=[900, 300], num_q_heads=8, num_kv_heads=2, block_size=32,
        causal=[True, False], causal_dtype=torch.int32, head_dim=64, window=(150, 70),
        sinks=[7.0, -30.0, 1.0, 0.0, -1.0, 10.0, 2.0, -3.0], rows=64, splits=2,
    ),
    # a window below a page, causal, sinks, 128 rows, unsplit
    "d64_window_below_a_page_causal_sinks_rows128": dict(
        q_lens=[9, 30], kv_lens=[700, 400], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=True, head_dim=64, window=(5, 0),
        sinks=[9.0, -40.0, 0.5, 3.0, -2.0, 12.0, 0.0, -7.5], rows=128, splits=1,
    ),
}  # fmt: skip


FAMILY = EmulatedFamily(
    cases=CASES, emulate_cta=emulate_cta, make_variant=T.Variant, size_field="rows",
    default_size=32, key_tile=lambda variant: L.KEY_TILE, seed=5,
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_tcgen05_kernel_matches_reference(name):
    error, tolerance = FAMILY.run_case(name)
    assert error <= tolerance


def _k_and_v_swapped(i, iters, d_tiles, select):
    is_v, tile, dslice = PLANTED_ORIGINALS["item_of"](i, iters, d_tiles, select)
    return not is_v, tile, dslice


def _page_off_by_one(j, block_shift):
    return (j >> block_shift) + 1, j & ((1 << block_shift) - 1)


def _pages_per_tile_one(block_shift):
    return 1


def _chunk_unswizzled(thread):
    return thread % (L.ITEM_BYTES // L.CHUNK)


def _step_page_dropped(step, block_shift):
    return 0, PLANTED_ORIGINALS["loader_step_page_slot"](step, block_shift)[1]


def _step_slot_dropped(step, block_shift):
    return PLANTED_ORIGINALS["loader_step_page_slot"](step, block_shift)[0], 0


def _lane_page_shifted(lane, block_shift):
    return (lane + 1) % L.pages_per_tile(block_shift)


def _ring_rows_shifted(thread, step):
    return PLANTED_ORIGINALS["loader_ring_offset"](thread, step % (L.LOADER_STEPS - 1))


def _predicate_on_the_ring_chunk(thread, step, key0, first_key, kv_len, head_dim, checked):
    """Head_dim 64 predicate on the thread's destination chunk (thread % 8) instead of the
    source chunk the swizzle puts there: copies half the wrong chunks."""
    keep = PLANTED_ORIGINALS["loader_predicate"](
        thread, step, key0, first_key, kv_len, 128, checked
    )
    inside = thread % (L.ITEM_BYTES // L.CHUNK) < L.item_dims(head_dim) // L.CHUNK
    return inside if keep is None else keep and inside


def _every_chunk_copied(thread, step, key0, first_key, kv_len, head_dim, checked):
    """The head_dim 64 predicate dropped: every thread copies a whole 128-byte row."""
    return PLANTED_ORIGINALS["loader_predicate"](
        thread, step, key0, first_key, kv_len, 128, checked
    )


def _all_bmm1_k_blocks(head_dim):
    return L.ITEM_BYTES // L.UMMA_K


PLANTED_ORIGINALS = {
    "loader_predicate": L.loader_predicate,
    "item_of": L.item_of,
    "loader_step_page_slot": L.loader_step_page_slot,
    "loader_ring_offset": L.loader_ring_offset,
    "thread_column": L.thread_column,
    "score_key_column": L.score_key_column,
}


def _head_dim_slices_reversed(i, iters, d_tiles, select):
    is_v, tile, dslice = PLANTED_ORIGINALS["item_of"](i, iters, d_tiles, select)
    return is_v, tile, d_tiles - 1 - dslice


def _thread_columns_reversed(lane, i):
    return PLANTED_ORIGINALS["thread_column"](lane, L.THREAD_COLUMNS - 1 - i)


def _score_keys_as_32x32b(thread, reg):
    """The 16x256b fragment read as if a lane held its own key (lane // 4 taken as lane % 8)."""
    key, column = PLANTED_ORIGINALS["score_key_column"](thread, reg)
    lane = thread % 32
    return key - lane // 4 + lane % 8, column


# name: (module of the map: layouts.py or dsl/common/indexing.py, map, planted replacement, case
# it must break)
PLANTED = {
    # the index tensors of a strided case read as if packed
    "index_offset": (X, "index_offset", index_offset_ignores_stride, "int32_flags_strided"),
    "key_in_window": (X, "key_in_window", causal_off_by_one, "f16_causal_split3"),
    "key_in_window:lower": (
        X,
        "key_in_window",
        window_lower_bound_unmasked,
        "window_below_a_page_causal_sinks",
    ),
    "window_tile_needs_mask": (
        X,
        "window_tile_needs_mask",
        tile_mask_ignores_causal,
        "f16_causal_split3",
    ),
    "window_tile_needs_mask:start": (
        X,
        "window_tile_needs_mask",
        tile_mask_ignores_window_start,
        "window_left_only_large_tile_split2",
    ),
    "window_offsets": (X, "window_offsets", offsets_ignore_causal, "f16_causal_split3"),
    "window_tiles": (
        X,
        "window_tiles",
        window_end_floor,
        "window_pages_bidir_split3_sinks",
    ),
    "window_first_key": (
        X,
        "window_first_key",
        window_left_unbounded_forgotten,
        "bf16_bidir_gqa4",
    ),
    "window_last_key": (
        X,
        "window_last_key",
        window_last_key_of_q_len,
        "window_right_only_f16_sinks",
    ),
    "item_of": (L, "item_of", _k_and_v_swapped, "bf16_bidir_gqa4"),
    "item_of_d256": (L, "item_of", _head_dim_slices_reversed, "f16_d256_split2"),
    "page_slot_of": (X, "page_slot_of", _page_off_by_one, "int32_flags_strided"),
    "page_count": (X, "page_count", page_count_floor, "bf16_bidir_gqa4"),
    "pages_per_tile": (L, "pages_per_tile", _pages_per_tile_one, "int32_flags_strided"),
    "row_head": (X, "row_head", head_from_token, "bf16_bidir_gqa4"),
    "split_tile_range": (
        X,
        "split_tile_range",
        split_range_drops_last_tile,
        "window_pages_bidir_split3_sinks",
    ),
    "loader_chunk": (L, "loader_chunk", _chunk_unswizzled, "bf16_bidir_gqa4"),
    "loader_chunk_d64": (L, "loader_chunk", _chunk_unswizzled, "d64_bf16_causal_rows32"),
    "loader_predicate_d64": (
        L,
        "loader_predicate",
        _predicate_on_the_ring_chunk,
        "d64_f16_e5m2_bidir_rows64_page256_split2",
    ),
    "bmm1_k_blocks_d64": (L, "bmm1_k_blocks", _all_bmm1_k_blocks, "d64_bool_flags_rows128_split2"),
    "loader_step_page": (L, "loader_step_page_slot", _step_page_dropped, "bf16_bidir_gqa4"),
    "loader_step_slot": (L, "loader_step_page_slot", _step_slot_dropped, "int32_flags_strided"),
    "lane_page": (L, "lane_page", _lane_page_shifted, "f16_causal_split3"),
    "loader_ring_offset": (L, "loader_ring_offset", _ring_rows_shifted, "bf16_bidir_gqa4"),
    "thread_column": (
        L,
        "thread_column",
        _thread_columns_reversed,
        "window_left_only_large_tile_split2",
    ),
    "score_key_column": (L, "score_key_column", _score_keys_as_32x32b, "bf16_bidir_gqa4"),
    "COLUMN_LANE_STRIDES": (L, "COLUMN_LANE_STRIDES", (4, 8), "bf16_rows64_causal"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_index_bug_is_caught(name, monkeypatch):
    FAMILY.check_planted_bug_is_caught(monkeypatch, *PLANTED[name])


POISONED = ["window_below_a_page_causal_sinks", "window_pages_bidir_split3_sinks",
            "window_d256_causal_sinks", "window_mixed_flags_page256_split2",
            "d64_window_below_a_page_causal_sinks_rows128"]  # fmt: skip


@pytest.mark.parametrize("name", POISONED)
def test_tiles_outside_every_window_are_never_read(name, monkeypatch):
    FAMILY.check_tiles_outside_every_window_are_never_read(name, monkeypatch)


@pytest.mark.parametrize("name", POISONED)
def test_nan_before_the_window_in_its_first_tile_stays_out(name, monkeypatch):
    FAMILY.check_keys_before_the_window_in_its_first_tile_stay_out(name, monkeypatch)


def _pad_rows_with_nan(cache: torch.Tensor) -> torch.Tensor:
    """A head_dim 64 cache as a view of 128-byte key rows whose bytes 64..127 are FP8 NaN
    (0x7F in both formats): where a kernel reading a key's whole 128-byte row would find the
    next head's (or the next slot's) data."""
    padded = torch.full((*cache.shape[:3], L.ITEM_BYTES), 0x7F, dtype=torch.uint8)
    padded[..., : cache.shape[3]] = cache.view(torch.uint8)
    return padded.view(cache.dtype)[..., : cache.shape[3]]


D64_POISONED = ["d64_window_sinks_int32_flags_rows64_split2", "d64_bf16_causal_rows32",
                "d64_window_below_a_page_causal_sinks_rows128"]  # fmt: skip


@pytest.mark.parametrize("name", D64_POISONED)
def test_head_dim_64_never_reads_bytes_past_a_keys_head_dims(name, monkeypatch):
    """Head_dim 64 K/V rows 128 bytes apart with NaN in bytes 64..127 (and, with a window,
    NaN pages outside every window): no NaN reaches the ring and the result matches the
    reference; without the head_dim 64 loader predicate (a planted bug) the NaN reaches the ring
    (it would not show in the output: BMM1 skips those head dims and O^T lanes 64..127 are
    never written out, so the ring is what is checked)."""
    case, problem, variant, splits, extra = FAMILY.prepare(name)
    assert variant.head_dim == 64
    ref = reference(case, extra)
    problem.key_cache = _pad_rows_with_nan(problem.key_cache)
    problem.value_cache = _pad_rows_with_nan(problem.value_cache)
    assert problem.key_cache.stride()[2] == L.ITEM_BYTES
    if problem.window != (-1, -1):
        assert poison_pages_outside_windows(problem, L.KEY_TILE) > 0
    n = int(case.cu_seqlens_q[-1])
    RING_NAN_VALUES.clear()
    out = FAMILY.emulate(problem, variant, splits).to(case.query.dtype)[:n]
    assert RING_NAN_VALUES["items"] > 0 and RING_NAN_VALUES["nan"] == 0
    assert relative_error(out, ref[:n]) <= TOLERANCE[case.query.dtype]
    monkeypatch.setattr(L, "loader_predicate", _every_chunk_copied)
    RING_NAN_VALUES.clear()
    FAMILY.emulate(problem, variant, splits)
    assert RING_NAN_VALUES["nan"] > 0


@pytest.mark.parametrize("seed", range(3))
def test_bf16_row_scaling_is_exact_down_to_2_pow_minus_32_of_the_row_max(seed):
    """bf16 rows with 40 binades of spread: every element whose scaled value is >= 2^-17 (i.e.
    >= 2^-32 of the row's largest binade) survives fp16 exactly, the largest stays <= 65280, and
    the rest moves by less than 2^-25 of the unscaled unit."""
    gen = torch.Generator().manual_seed(seed)
    exps = torch.randint(-30, 10, (64, 128), generator=gen).float()
    q = (torch.randn(64, 128, generator=gen) * torch.exp2(exps)).bfloat16().float().numpy()
    for row in q:
        q16, inv = q_to_fp16(row, True)
        scaled = row.astype(np.float64) / inv
        assert np.abs(scaled).max() <= 65280
        assert np.abs(scaled).max() >= 2.0**15
        big = np.abs(scaled) >= 2.0**-17
        assert np.array_equal(q16[big], scaled[big])
        assert np.all(np.abs(q16 - scaled) <= 2.0**-25)


def _shrink_first_tile_keys(problem, factor: float = 1 / 16) -> None:
    """Scale the K pages of every sequence's first key tile by ``factor`` (a power of two:
    exact for e4m3 normals), so the scores of later tiles outrun its maxima by far more than
    2^LAZY_RESCALE_LOG2."""
    for seq in range(problem.num_seqs):
        cols = min(X.ceil_div(L.KEY_TILE, problem.block_size), int(problem.block_table.shape[1]))
        for col in range(cols):
            page = int(problem.block_table[seq, col])
            values = problem.key_cache[page].float() * factor
            problem.key_cache[page] = values.to(problem.key_cache.dtype)


@pytest.mark.parametrize("never", [False, True])
def test_lazy_rescale_moves_the_reference_when_scores_outrun_it(monkeypatch, never):
    """Keys of the first tile 16x smaller: the second tile's check fires and takes the exact
    path (both paths are taken and the result matches the reference); a check that never fires
    (a planted bug) leaves P above 2^16, past fp16, and fails."""
    case, problem, variant, splits, extra = FAMILY.prepare("bf16_bidir_gqa4")
    _shrink_first_tile_keys(problem)
    ref = reference(case, extra)
    if never:
        monkeypatch.setattr(L, "rescale_needed", lambda highest: False)
    LAZY_TILES.clear()
    n = int(case.cu_seqlens_q[-1])
    out = FAMILY.emulate(problem, variant, splits).to(case.query.dtype)[:n]
    passed = bool(relative_error(out, ref[:n]) <= TOLERANCE[case.query.dtype])
    assert passed != never
    if not never:
        assert LAZY_TILES[True] > 0 and LAZY_TILES[False] > 0


def test_lazy_rescale_keeps_the_reference_on_ordinary_scores():
    """On the random cases most tiles past the first keep their reference (the fast path)."""
    LAZY_TILES.clear()
    for name in ("bf16_bidir_gqa4", "window_pages_bidir_split3_sinks"):
        error, tolerance = FAMILY.run_case(name)
        assert error <= tolerance
    assert LAZY_TILES[False] > 0


SUM_MAP_BUGS = {
    "thread_column": _thread_columns_reversed,
    "score_key_column": _score_keys_as_32x32b,
    "COLUMN_LANE_STRIDES": (4, 8),
}


@pytest.mark.parametrize("planted", [None, *SUM_MAP_BUGS])
def test_thread_partial_sums_and_epilogue_give_every_column_sum(monkeypatch, planted):
    """Every softmax thread's partial sums of a chunk (its registers' keys and columns,
    layouts.score_key_column / score_entry) reduced by the epilogue (layouts.
    COLUMN_LANE_STRIDES, thread_column) give each column's sum over the 128 keys of the tile
    (random values, so a key counted twice or a column mixed up shows); each planted map bug
    fails."""
    if planted is not None:
        monkeypatch.setattr(L, planted, SUM_MAP_BUGS[planted])
    values = np.random.default_rng(7).standard_normal((L.KEY_TILE, L.COLUMN_CHUNK))
    l_part = np.zeros((128, L.THREAD_COLUMNS))
    add_thread_partials(l_part, values, score_maps())
    sums = epilogue_column_sums(l_part)
    assert np.allclose(sums, values.sum(axis=0)) == (planted is None)


# Extreme but valid scales with rows whose first tiles hold no key for them
# (dsl_helpers.extreme_scale_case).
EXTREME_SCALES = {
    # (query exponent, cached key exponent): scores x scale about -300 in log2 units either way
    "ordinary_magnitudes": (0, 0),
    # query 2^-110, keys 2^-6 (e4m3's smallest normal): k_scale about 2e36, within 3x of the
    # largest scales.check_score_scale accepts at head_dim 128 (5.96e36)
    "k_scale_near_the_limit": (-110, -6),
}


def _run_extreme(rows: int, splits: int, scales: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(emulated, reference) output rows of FAMILY.extreme_case with EXTREME_SCALES[scales]."""
    case, extra, variant = FAMILY.extreme_case(rows, *EXTREME_SCALES[scales])
    return FAMILY.launch(case, extra, variant, splits)


EXTREME_LAUNCHES = [(32, 1), (64, 2), (128, 2)]  # (rows, splits: the first row tile has 3 tiles)


@pytest.mark.parametrize("scales", sorted(EXTREME_SCALES))
@pytest.mark.parametrize("rows,splits", EXTREME_LAUNCHES)
def test_extreme_valid_scales_with_rows_that_see_no_key_at_first(rows, splits, scales):
    """Scores x scale about -300 (log2 units) and rows whose first tile(s) are empty for them:
    both hazards of a 0 stand-in maximum are reached (a lazy check that meets a column with no
    key, an exact tile that gives such a column its first key) and the result is finite and
    matches the reference."""
    NO_KEY_TILES.clear()
    out, ref = _run_extreme(rows, splits, scales)
    assert NO_KEY_TILES["checked"] > 0 and NO_KEY_TILES["first key"] > 0
    assert torch.isfinite(out).all()
    assert worst_row_error(out, ref) <= TOLERANCE[out.dtype]


def _zero_offset_for_no_key(m, scale, select):
    return -(_reference(m) * scale)


def _zero_old_reference_for_no_key(m, select):
    return _reference(m)


# The stand-in maximum 0 of a column with no key, as before the fix: the lazy check never fires
# for scores far below 0 (P underflows to 0, l = 0), and the first key's correction
# exp2(0 - new x scale) overflows (0 x inf = NaN).
ZERO_REFERENCE = {
    "exp2_offset": _zero_offset_for_no_key,
    "correction_old_reference": _zero_old_reference_for_no_key,
}


@pytest.mark.parametrize("scales", sorted(EXTREME_SCALES))
@pytest.mark.parametrize("planted", sorted(ZERO_REFERENCE))
@pytest.mark.parametrize("rows,splits", [(32, 1), (128, 2)])
def test_a_zero_reference_for_columns_with_no_key_fails(monkeypatch, planted, rows, splits, scales):
    """The stand-in 0 planted back in either place breaks rows. (At 64 rows with 2 splits
    another column's vote sends the lazy tile down the exact path anyway: the planted offset
    alone stays within tolerance there, 0.8% on the worst row.)"""
    monkeypatch.setattr(L, planted, ZERO_REFERENCE[planted])
    with np.errstate(over="ignore", invalid="ignore"):
        out, ref = _run_extreme(rows, splits, scales)
    assert not worst_row_error(out, ref) <= TOLERANCE[out.dtype]


@pytest.mark.parametrize("rows,splits", [(32, 1), (128, 2)])
def test_tiny_and_zero_query_rows_match_the_reference(rows, splits):
    """bf16 query rows scaled to ~2^-120 / ~2^-112 (precision.row_scale_exponent clamped to
    126: unclamped, 2^e is inf in fp32 and the row NaN) and an all-zero row: every row finite and
    within tolerance of the reference (those rows' softmax is near uniform)."""
    FAMILY.check_tiny_and_zero_query_rows(rows, splits)
