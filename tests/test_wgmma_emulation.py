"""CPU emulation of the wgmma kernel's data path (dsl/wgmma/kernel.py), in float64.

The kernel has never run on a GPU. What can be checked without one is that its index maps, which
it imports from dsl/wgmma/layouts.py and dsl/common/indexing.py (the same functions are called
here, not a copy), put the right values in the right places: which CTA owns which query rows
(token, head) and key tiles (split ranges); which pages, rows and 16-byte chunks each producer
thread copies, where in the FP8 staging ring they land and in which order the ring's slots are
filled and drained, and where in the swizzled 16-bit ring the converted chunks land; where each
consumer thread puts its Q chunks; which (row, key) every accumulator register of every consumer
thread holds, hence the mask predicate per register, the quad-shuffle row reductions and the
online-softmax update order; the split state handed to the merge. Operands are read back the
way wgmma reads them, through ``operand_offset``, which test_wgmma_host checks against the DSL's
own wgmma layouts (as it checks the accumulator maps against the DSL's fragments). Planted bugs
must make it fail.

What this does not check: the DSL's MMA partitions themselves (CUTLASS's responsibility),
pipelines and barriers (races, deadlocks), anything about speed.
"""

import math

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
from helpers.dsl_emulation import EmulatedFamily, cta_work, sink_log2

from dsl.common import indexing as X
from dsl.common import precision as P
from dsl.wgmma import layouts as L
from dsl.wgmma import traits as T
from fp8_noncausal_attn.scales import check_score_scale
from fp8_noncausal_attn.synthetic import relative_error

# Replays kernels in numpy from their own index maps (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.emulation


def _select(cond, a, b):
    return np.where(cond, a, b)


def _fp8_to_float(b: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(b)).view(dtype).double().numpy()


def _round(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float64 -> a 16-bit dtype -> float64 (P is fp16 when wgmma multiplies it)."""
    return torch.from_numpy(x).to(dtype).double().numpy()


def wgmma_byte_offset(r, d, rows):
    """Where the DSL's wgmma smem layouts (sm90 make_smem_layout_a/b, K-major SW128 for Q and K,
    MN-major SW128 for V) read element (r, d) of a [rows x head_dim] 16-bit tile: 64-wide
    column blocks, 128-byte rows, Swizzle<3,4,3> on byte addresses. Written out here, apart from
    the kernel's writer map, so a writer bug cannot hide; test_wgmma_host ties the two to the DSL.
    """
    linear = 2 * ((d // 64) * rows * 64 + r * 64 + d % 64)
    return linear ^ (((linear >> 7) & 7) << 4)


def read_operand(buffer: np.ndarray, rows: int, head_dim: int) -> np.ndarray:
    """A [rows x head_dim] 16-bit operand tile as wgmma reads it (``buffer``: one value per
    2 bytes)."""
    r = np.arange(rows)[:, None]
    d = np.arange(head_dim)[None, :]
    return buffer[wgmma_byte_offset(r, d, rows) // 2]


@pytest.mark.parametrize(("rows", "head_dim"), [(64, 64), (64, 128), (128, 128), (64, 256)])
def test_wgmma_reader_is_the_kernels_operand_map(rows, head_dim):
    r = np.arange(rows)[:, None]
    d = np.arange(head_dim)[None, :]
    assert np.array_equal(wgmma_byte_offset(r, d, rows), L.operand_offset(r, d, rows))


def block_shift(problem) -> int:
    """The kernel's run-time ``block_shift`` argument (dsl_families.launch_arguments)."""
    return problem.block_size.bit_length() - 1


def tile_pages(problem, variant, seq, key0, kv_len):
    """The page id every producer lane holds for the key tile at key0 (read_tile_pages): lane
    l reads the tile's page lane_page(l), or holds 0 past the sequence's last page."""
    shift = block_shift(problem)
    col0, _ = L.tile_page_slot(key0, shift)
    num_cols = X.page_count(kv_len, shift)
    pages = np.zeros(32, np.int64)
    for lane in range(32):
        col = col0 + L.lane_page(lane, variant.key_tile, shift)
        if col < num_cols:
            pages[lane] = int(problem.block_table[seq, col])
    return pages


def copy_item(problem, variant, seq, kv_head, key0, first_key, kv_len, cache_bytes, cache, staging,
              checked):  # fmt: skip
    """The producer warpgroup's cp.async of one item (K or V of the key tile at key0) into its
    FP8 staging item ``staging`` (one value per byte), replayed thread by thread: the row's page
    from the lane that read it (a shuffle), the thread's and the step's page/slot parts, the
    thread's chunk at staging_offset; ``checked`` (the prologue, a tile not wholly loaded)
    stores zeros instead for rows outside [first_key, kv_len) (indexing.key_loaded)."""
    kt, d, shift = variant.key_tile, variant.head_dim, block_shift(problem)
    strides, base = cache.stride()[:3], cache.storage_offset()
    pages = tile_pages(problem, variant, seq, key0, kv_len)  # the same in every warp
    _, slot0 = L.tile_page_slot(key0, shift)
    for t in range(L.WARPGROUP):
        thread_page, thread_slot = L.loader_thread_page_slot(t, d, shift)
        chunk = L.loader_chunk(t, d)
        for step in range(L.loader_steps(kt, d)):
            step_page, step_slot = L.loader_step_page_slot(step, d, shift)
            values = np.zeros(L.CHUNK)  # rows outside [first_key, kv_len) are stored as zeros
            if not checked or X.key_loaded(key0 + L.loader_row(t, step, d), first_key, kv_len):
                source_lane = (thread_page + step_page) % 32  # shfl.idx takes 5 lane bits
                page = int(pages[source_lane])
                slot = slot0 + thread_slot + step_slot
                off = base + X.key_offset(page, slot, kv_head, *strides) + chunk * L.CHUNK
                values = np.full(L.CHUNK, np.nan)  # outside the cache: garbage
                if 0 <= off <= len(cache_bytes) - L.CHUNK:
                    values = _fp8_to_float(cache_bytes[off : off + L.CHUNK], cache.dtype)
            at = L.staging_offset(t, step)
            staging[at : at + L.CHUNK] = values


def convert_item(variant, staging):
    """Each producer thread reads its own chunks back from the staging item, converts them and
    stores them into a swizzled 16-bit stage, which is returned as wgmma reads it."""
    kt, d = variant.key_tile, variant.head_dim
    stage = np.zeros(kt * d)
    for t in range(L.WARPGROUP):
        for step in range(L.loader_steps(kt, d)):
            at = L.staging_offset(t, step)
            values = staging[at : at + L.CHUNK]
            for half in range(2):
                to = L.loader_store_offset(t, step, half, d, kt) // 2
                stage[to : to + L.CHUNK // 2] = values[half * 8 : half * 8 + 8]
    return read_operand(stage, kt, d)


def produce_items(problem, variant, seq, kv_head, work, kbytes, vbytes):
    """[(K, V) of each key tile of the CTA's split (``work``: its CtaWork)] as the producer
    hands them to the consumers, replayed in its order through the FP8 staging ring: the
    prologue copies tiles 0 .. fp8_stages - 2 (every row checked); iteration s copies tile
    s + fp8_stages - 1 (unchecked when indexing.tile_wholly_loaded), then converts tile s from
    its slot (layouts.staging_slot)."""
    first, iters, first_key, kv_len = work.first_tile, work.iters, work.first_key, work.kv_len
    kt, ahead = variant.key_tile, variant.fp8_stages - 1
    staging = np.full((variant.fp8_stages, 2, kt * variant.head_dim), np.nan)
    caches = ((kbytes, problem.key_cache), (vbytes, problem.value_cache))

    def copy(n, prologue):
        key0 = (first + n) * kt
        slot = L.staging_slot(n, variant.fp8_stages)
        for item, (cache_bytes, cache) in enumerate(caches):
            checked = prologue or not X.tile_wholly_loaded(key0, key0 + kt, first_key, kv_len)
            copy_item(problem, variant, seq, kv_head, key0, first_key, kv_len, cache_bytes, cache,
                      staging[slot, item], checked)  # fmt: skip

    for n in range(min(ahead, iters)):
        copy(n, True)
    items = []
    for s in range(iters):
        if s + ahead < iters:
            copy(s + ahead, False)
        slot = L.staging_slot(s, variant.fp8_stages)
        items.append(tuple(convert_item(variant, staging[slot, item]) for item in (0, 1)))
    return items


def load_q_tile(problem, variant, row0, num_rows, group, kv_head, q_start):
    """One consumer warpgroup's Q tile, replayed thread by thread (a bf16 row scaled to fp16 by
    the power of two its threads agree on through their shuffles), read back as wgmma's A;
    and the per-row factors 2^-e the kernel leaves in shared memory."""
    d = variant.head_dim
    tile = np.zeros(L.ROWS_PER_WARPGROUP * d)
    row_scale = np.full(L.ROWS_PER_WARPGROUP, np.nan)
    thread = np.arange(L.WARPGROUP)
    for step in range(L.q_steps(d)):
        r, c = L.q_row(thread, step, d), L.q_chunk(thread, step, d)
        values = np.zeros((L.WARPGROUP, 8), np.float32)
        for t in range(L.WARPGROUP):
            if row0 + r[t] < num_rows:
                token = X.row_token(row0 + int(r[t]), group)
                head = X.row_head(row0 + int(r[t]), group, kv_head)
                values[t] = problem.query[q_start + token, head, c[t] * 8 : c[t] * 8 + 8].float()
        factor = inverse = np.ones(L.WARPGROUP)
        if problem.query.dtype == torch.bfloat16:
            biggest = np.abs(values).max(axis=1)
            for offset in L.q_row_shuffles(d):
                biggest = np.maximum(biggest, biggest[thread ^ offset])
            exponent = P.row_scale_exponent((biggest.view(np.int32) >> 23) & 0xFF, np.minimum)
            factor, inverse = np.exp2(exponent.astype(np.float64)), np.exp2(-exponent * 1.0)
        scaled = (values * factor[:, None].astype(np.float32)).astype(np.float16)
        for t in range(L.WARPGROUP):
            at = L.operand_offset(int(r[t]), int(c[t]) * 8, L.ROWS_PER_WARPGROUP) // 2
            tile[at : at + 8] = scaled[t]
            if c[t] == 0:
                row_scale[r[t]] = inverse[t]
    return read_operand(tile, L.ROWS_PER_WARPGROUP, d), row_scale


def quad_reduce(values: np.ndarray, op) -> np.ndarray:
    """Butterfly shuffles across the lanes that share accumulator rows (axis 0 = thread)."""
    thread = np.arange(L.WARPGROUP)
    for offset in L.QUAD_SHUFFLES:
        values = op(values, values[thread ^ offset])
    return values


# Tiles past a CTA's first that gave some row its first visible key (extreme-scale cases).
FIRST_KEY_LATE = [0]


def emulate_cta(problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes, vbytes):
    """One CTA: returns {(token, head): (O / l * v_scale [head_dim], lse log2)} for its rows."""
    kt, d = variant.key_tile, variant.head_dim
    work = cta_work(problem, "wgmma", variant.rows, kt, seq, row_tile, split, num_splits)
    if work is None:
        return {}
    group, q_start, q_len, kv_len, num_rows, row_base, _, _, first, iters, causal = work
    left, right = problem.window
    # float32 as the kernel: (softmax scale x log2(e)) x k_scale x the row's 2^-e, floored
    f32 = np.float32
    base_scale = f32(f32(problem.softmax_scale) * f32(math.log2(math.e))) * f32(
        problem.k_scale[kv_head]
    )
    v_scale = float(problem.v_scale[kv_head])

    # Producer: K then V of every tile of the split, through the rings in pipeline order.
    items = produce_items(problem, variant, seq, kv_head, work, kbytes, vbytes)

    thread = np.arange(L.WARPGROUP)[:, None]
    rows_of = np.stack([L.acc_row(thread[:, 0], i) for i in range(2)], axis=1)  # [t, 2]
    s_cols = L.acc_col(thread, np.arange(kt // 4)[None, :])  # [t, kt / 4]
    o_cols = L.acc_col(thread, np.arange(d // 4)[None, :])  # [t, d / 4]
    result = {}
    for wg in range(variant.consumers):
        row0 = row_base + wg * L.ROWS_PER_WARPGROUP
        q, q_row_scale = load_q_tile(problem, variant, row0, num_rows, group, kv_head, q_start)
        # [t, 2]: each accumulator row's own scale
        scale = np.maximum(base_scale * q_row_scale[rows_of].astype(f32), f32(P.MIN_SCORE_SCALE))
        scale = scale.astype(np.float64)
        tokens = X.row_token(row0 + rows_of, group)
        before, after = X.window_offsets(left, right, causal, _select, np.minimum)
        positions = X.query_position(tokens, q_len, kv_len)  # [t, 2]
        row_max = np.full((L.WARPGROUP, 2), -np.inf)
        row_sum = np.zeros((L.WARPGROUP, 2))
        o = np.zeros((L.WARPGROUP, 2, d // 4))
        for s in range(iters):
            k_item, v_item = items[s]
            scores = q @ k_item.T  # S [row, key], as the accumulator holds it
            key0 = (first + s) * kt
            p_matrix = np.zeros((L.ROWS_PER_WARPGROUP, kt))
            corrections = np.zeros((L.WARPGROUP, 2))
            # per thread: only a tile some key of which one of its rows does not see is masked
            needs_mask = np.broadcast_to(
                X.window_tile_needs_mask(
                    key0, key0 + kt, kv_len, positions[:, 0], positions[:, 1], before, after
                ),
                positions[:, 0].shape,
            )
            for i in range(2):
                frag = scores[rows_of[:, i : i + 1], s_cols]  # [t, kt / 4]
                visible = X.key_in_window(
                    key0 + s_cols, kv_len, positions[:, i : i + 1], before, after
                )
                frag = np.where(visible | ~needs_mask[:, None], frag, -np.inf)
                m_tile = quad_reduce(frag.max(axis=1), np.maximum)
                m_new = np.maximum(row_max[:, i], m_tile)
                m_use = np.where(m_new == -np.inf, 0.0, m_new) * scale[:, i]
                if s > 0:
                    FIRST_KEY_LATE[0] += bool(
                        ((row_max[:, i] == -np.inf) & (m_new > -np.inf)).any()
                    )
                # The correction in float32 as the kernel (exp2 past 128 is inf there): a row
                # with no key yet has row_max x scale = -inf, so 0, whatever its new maximum.
                m32, s32 = row_max[:, i].astype(np.float32), scale[:, i].astype(np.float32)
                with np.errstate(invalid="ignore", over="ignore"):
                    corrections[:, i] = np.exp2(m32 * s32 - m_use.astype(np.float32))
                    p = np.exp2(frag * scale[:, i : i + 1] - m_use[:, None])
                row_sum[:, i] = row_sum[:, i] * corrections[:, i] + p.sum(axis=1)
                p_matrix[rows_of[:, i : i + 1], s_cols] = _round(p, torch.float16)
                row_max[:, i] = m_new
            pv = p_matrix @ v_item  # O += P V as wgmma RS computes it
            for i in range(2):
                o[:, i] = o[:, i] * corrections[:, i : i + 1] + pv[rows_of[:, i : i + 1], o_cols]
        for i in range(2):
            total = quad_reduce(row_sum[:, i], np.add)
            for t in range(L.WARPGROUP):
                r = row0 + int(rows_of[t, i])
                if r < num_rows:
                    key = (q_start + X.row_token(r, group), X.row_head(r, group, kv_head))
                    m_scaled = row_max[t, i] * scale[t, i]
                    inv = v_scale / total[t] if total[t] > 0 else 0.0
                    if num_splits == 1:  # the sink joins the denominator at max(m, sink)
                        sink = sink_log2(problem, key[1])
                        top = max(m_scaled, sink)
                        top = 0.0 if top == -math.inf else top
                        keep = math.exp2(m_scaled - top)
                        denominator = total[t] * keep + math.exp2(sink - top)
                        inv = v_scale * keep / denominator if denominator > 0 else 0.0
                    lse = m_scaled + math.log2(total[t]) if total[t] > 0 else -math.inf
                    out, lses = result.setdefault(key, (np.full(d, np.nan), []))
                    out[o_cols[t]] = o[t, i] * inv
                    if t % 4 == 0:
                        lses.append(lse)
    return {key: (out, lses[0]) for key, (out, lses) in result.items()}


CASES = {
    # drafter block, GQA 4: R = 64 and 80 (two 64-row CTAs), bidirectional, bf16 query
    "bf16_bidir_gqa4": dict(
        q_lens=[16, 20], kv_lens=[300, 140], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=False, splits=1,
    ),
    # fp16 query, causal, page size 64, split into 3 (one split of the short sequence is empty)
    "f16_causal_split3": dict(
        q_lens=[7, 12], kv_lens=[300, 40], num_q_heads=4, num_kv_heads=1, block_size=64,
        causal=True, query_dtype=torch.float16, splits=3,
    ),
    # two consumer warpgroups (128 rows per CTA): R = 48 and 160, causal, split in 2
    "bf16_m128_causal_split2": dict(
        q_lens=[12, 40], kv_lens=[200, 290], num_q_heads=8, num_kv_heads=2, block_size=16,
        causal=True, consumers=2, splits=2,
    ),
    # causal prefill, q_len == kv_len: whole key tiles inside the sequence still need the
    # causal mask on the diagonal (two 128-row CTAs)
    "f16_causal_prefill_m128": dict(
        q_lens=[130], kv_lens=[130], num_q_heads=2, num_kv_heads=2, block_size=16,
        causal=True, query_dtype=torch.float16, consumers=2, splits=1,
    ),
    # per-sequence int32 flags read through strided index tensors, page size 32, MHA, vLLM cache
    "int32_flags_strided_vllm": dict(
        q_lens=[5, 8, 3], kv_lens=[133, 8, 257], num_q_heads=2, num_kv_heads=2, block_size=32,
        causal=[True, False, True], causal_dtype=torch.int32, index_step=2, layout="vllm",
        splits=2,
    ),
    # bool flags, page size 256 (two key tiles per page), q_len == kv_len
    "bool_flags_page256": dict(
        q_lens=[16, 4], kv_lens=[16, 390], num_q_heads=4, num_kv_heads=2, block_size=256,
        causal=[False, True], causal_dtype=torch.bool, splits=1,
    ),
    # head_dim 64 (3 FP8 staging slots; 2 tiles per split) and 256 (key tile 64 at 256)
    "f16_d64_gqa8": dict(
        q_lens=[9], kv_lens=[420], num_q_heads=8, num_kv_heads=1, block_size=16, head_dim=64,
        causal=False, query_dtype=torch.float16, splits=2,
    ),
    # e5m2 cache, page size 128 (one page per key tile), GQA 4, split in 2
    "bf16_e5m2_page128": dict(
        q_lens=[10, 3], kv_lens=[300, 129], num_q_heads=8, num_kv_heads=2, block_size=128,
        cache_dtype=torch.float8_e5m2, causal=False, splits=2,
    ),
    # head_dim 256 with two consumer warpgroups (R = 160: two 128-row CTAs), causal, split 2
    "bf16_d256_m128_causal_split2": dict(
        q_lens=[40, 20], kv_lens=[300, 150], num_q_heads=8, num_kv_heads=2, block_size=32,
        head_dim=256, causal=True, consumers=2, splits=2,
    ),
    "bf16_d256_causal": dict(
        q_lens=[6, 3], kv_lens=[150, 70], num_q_heads=4, num_kv_heads=2, block_size=16,
        head_dim=256, causal=True, splits=1,
    ),
    **window_cases(mid_tile={}, large_tile=dict(consumers=2)),
}  # fmt: skip


FAMILY = EmulatedFamily(
    cases=CASES, emulate_cta=emulate_cta, make_variant=T.Variant, size_field="consumers",
    default_size=1, key_tile=lambda variant: variant.key_tile, seed=7,
)  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_wgmma_kernel_matches_reference(name):
    error, tolerance = FAMILY.run_case(name)
    assert error <= tolerance


def _no_swizzle(row, dim, rows):
    block = dim // L.SW128_ELEMS
    return 2 * (block * rows * L.SW128_ELEMS + row * L.SW128_ELEMS + dim % L.SW128_ELEMS)


def _slot_in_half_page(j, block_shift):
    return j >> block_shift, j & ((1 << (block_shift - 1)) - 1)


# Relabelings that the kernel applies consistently on both sides (a bijective change of which
# thread loads which row, say) are harmless; the plants below break coverage or agreement.
def _loader_rows_of_half_the_threads(thread, step, head_dim):
    return ORIGINAL["loader_row"](thread % (L.WARPGROUP // 2), step, head_dim)


def _acc_row_without_warp(thread, i):
    return (thread % 32) // 4 + 8 * i


def _q_rows_overlap(thread, step, head_dim):
    return ORIGINAL["q_row"](thread, step // 2 * 2, head_dim)


def _lane_reads_next_page(lane, key_tile, block_shift):
    return (lane + 1) % L.pages_per_tile(key_tile, block_shift)


def _step_slot_dropped(step, head_dim, block_shift):
    return ORIGINAL["loader_step_page_slot"](step, head_dim, block_shift)[0], 0


def _thread_page_dropped(thread, head_dim, block_shift):
    return 0, ORIGINAL["loader_thread_page_slot"](thread, head_dim, block_shift)[1]


def _tile_slot_dropped(key0, block_shift):
    return key0 >> block_shift, 0


def _tile_spans_one_page(key_tile, block_shift):
    return 1


def _store_step_one_row(step, head_dim):
    return step * L.SW128_ROW_BYTES


def _staging_of_half_the_threads(thread, step):
    return (step * L.WARPGROUP + thread % (L.WARPGROUP // 2)) * L.CHUNK


def _one_staging_slot(tile, fp8_stages):
    return 0


ORIGINAL = {
    "loader_row": L.loader_row,
    "q_row": L.q_row,
    "loader_step_page_slot": L.loader_step_page_slot,
    "loader_thread_page_slot": L.loader_thread_page_slot,
}
PLANTED = {
    "operand_offset": (L, _no_swizzle, "bf16_bidir_gqa4"),
    # the index tensors of a strided case read as if packed
    "index_offset": (X, index_offset_ignores_stride, "int32_flags_strided_vllm"),
    "key_in_window": (X, causal_off_by_one, "f16_causal_split3"),
    "key_in_window:lower": (X, window_lower_bound_unmasked, "window_below_a_page_causal_sinks"),
    "window_tile_needs_mask": (X, tile_mask_ignores_causal, "f16_causal_prefill_m128"),
    "window_tile_needs_mask:start": (
        X,
        tile_mask_ignores_window_start,
        "window_left_only_large_tile_split2",
    ),
    "window_offsets": (X, offsets_ignore_causal, "f16_causal_split3"),
    # a page that holds two key tiles: the second tile's slot
    "page_slot_of": (X, _slot_in_half_page, "bool_flags_page256"),
    # the last, partly filled page of a sequence (kv_len 300, pages of 16)
    "page_count": (X, page_count_floor, "bf16_bidir_gqa4"),
    "pages_per_tile": (L, _tile_spans_one_page, "int32_flags_strided_vllm"),
    "tile_page_slot": (L, _tile_slot_dropped, "bool_flags_page256"),
    "lane_page": (L, _lane_reads_next_page, "bf16_bidir_gqa4"),
    "loader_step_page_slot": (L, _step_slot_dropped, "int32_flags_strided_vllm"),
    "loader_thread_page_slot": (L, _thread_page_dropped, "f16_d64_gqa8"),
    "loader_store_step": (L, _store_step_one_row, "bf16_bidir_gqa4"),
    # FP8 staging: chunks of two threads in one place; every tile in one slot (the copy of a
    # later tile lands before the earlier one is converted)
    "staging_offset": (L, _staging_of_half_the_threads, "bf16_bidir_gqa4"),
    "staging_slot": (L, _one_staging_slot, "bf16_bidir_gqa4"),
    "staging_slot:d64": (L, _one_staging_slot, "f16_d64_gqa8"),
    "row_head": (X, head_from_token, "bf16_bidir_gqa4"),
    "split_tile_range": (X, split_range_drops_last_tile, "window_pages_bidir_split3_sinks"),
    "window_tiles": (X, window_end_floor, "f16_causal_prefill_m128"),
    "window_first_key": (X, window_left_unbounded_forgotten, "bf16_bidir_gqa4"),
    "window_last_key": (X, window_last_key_of_q_len, "window_right_only_f16_sinks"),
    "loader_row": (L, _loader_rows_of_half_the_threads, "bf16_bidir_gqa4"),
    "acc_row": (L, _acc_row_without_warp, "f16_causal_split3"),
    "q_row": (L, _q_rows_overlap, "bf16_bidir_gqa4"),
    "QUAD_SHUFFLES": (L, (1,), "bf16_bidir_gqa4"),
    "q_row_shuffles": (L, lambda head_dim: (1,), "bf16_bidir_gqa4"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_index_bug_is_caught(name, monkeypatch):
    module, bug, case = PLANTED[name]
    # "name:what" plants a second bug in the same map
    FAMILY.check_planted_bug_is_caught(monkeypatch, module, name.split(":")[0], bug, case)


POISONED = ["window_below_a_page_causal_sinks", "window_pages_bidir_split3_sinks",
            "window_d256_causal_sinks", "window_mixed_flags_page256_split2"]  # fmt: skip


@pytest.mark.parametrize("name", POISONED)
def test_tiles_outside_every_window_are_never_read(name, monkeypatch):
    FAMILY.check_tiles_outside_every_window_are_never_read(name, monkeypatch)


@pytest.mark.parametrize("name", POISONED)
def test_nan_before_the_window_in_its_first_tile_stays_out(name, monkeypatch):
    FAMILY.check_keys_before_the_window_in_its_first_tile_stay_out(name, monkeypatch)


def _run_first_key_late(case, extra: dict, variant, splits: int):
    """(emulated, reference) output rows of an extreme_scale_case launch (FAMILY.extreme_case);
    asserts some row's first key came past its CTA's first tile and that every emulated row is
    finite."""
    FIRST_KEY_LATE[0] = 0
    out, ref = FAMILY.launch(case, extra, variant, splits)
    assert FIRST_KEY_LATE[0] > 0
    assert torch.isfinite(out).all()
    return out, ref


# Each magnitude once, on each warpgroup count (the four combinations took 44 s of CI).
@pytest.mark.parametrize("consumers,splits,exponents", [(1, 1, (0, 0)), (2, 2, (-110, -6))])
def test_extreme_valid_scales_with_rows_that_see_no_key_at_first(consumers, splits, exponents):
    """Scores x scale about -300 (log2 units; ordinary magnitudes, and k_scale about 2e36, 3x
    below scales.check_score_scale's limit) with rows whose first key comes past their CTA's
    first tile: that tile's correction (float32, as the kernel) stays finite and the result
    matches the reference (no lazy rescale in this family, so no stand-in maximum to check)."""
    case, extra, variant = FAMILY.extreme_case(consumers, *exponents)
    out, ref = _run_first_key_late(case, extra, variant, splits)
    assert relative_error(out, ref) <= TOLERANCE[case.query.dtype]


@pytest.mark.parametrize("consumers,splits", [(1, 1), (2, 2)])
def test_tiny_and_zero_query_rows_match_the_reference(consumers, splits):
    """bf16 query rows scaled to ~2^-120 / ~2^-112 (precision.row_scale_exponent clamped to
    126: unclamped, 2^e is inf in fp32 and the row NaN) and an all-zero row: every row finite and
    within tolerance of the reference (those rows' softmax is near uniform)."""
    FAMILY.check_tiny_and_zero_query_rows(consumers, splits)


def _smallest_accepted_k_scale(softmax_scale: float) -> float:
    """The smallest float32 k_scale scales.check_score_scale accepts (the float32 below it is
    refused)."""
    k = np.float32(torch.finfo(torch.float32).tiny / (softmax_scale * math.log2(math.e)))
    for _ in range(4):
        try:
            check_score_scale(softmax_scale, float(k), None, torch.float8_e4m3fn, True)
            break
        except ValueError:
            k = np.nextafter(k, np.float32(np.inf))
    below = float(np.nextafter(k, np.float32(0)))
    with pytest.raises(ValueError):
        check_score_scale(softmax_scale, below, None, torch.float8_e4m3fn, True)
    return float(k)


@pytest.mark.parametrize("consumers,splits", [(1, 1), (2, 2)])
def test_smallest_accepted_k_scale_with_rows_that_see_no_key_at_first(consumers, splits):
    """k_scale at check_score_scale's lower limit and queries ~2^-10 (row exponent e = 25):
    softmax scale x k_scale x 2^-e underflows to 0 in float32, and unfloored a masked score or
    the no-key row maximum (-inf) x 0 is NaN for rows whose first tile holds no key for them.
    Floored at precision.MIN_SCORE_SCALE the result is finite and matches the reference (a
    near-uniform softmax over each row's visible keys)."""
    case, extra, variant = FAMILY.extreme_case(consumers, -10, 0)
    case.k_scale.fill_(_smallest_accepted_k_scale(case.query.shape[-1] ** -0.5))
    out, ref = _run_first_key_late(case, extra, variant, splits)
    assert worst_row_error(out, ref) <= TOLERANCE[case.query.dtype]
