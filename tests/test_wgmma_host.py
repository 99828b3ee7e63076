"""Host-side checks of the wgmma family (never run on a GPU): variant table, shared-memory and
register budgets, producer/Q loader coverage, and the hand-written maps the kernel uses against
the layouts the CUTLASS DSL itself builds for wgmma (those need the DSL, else skipped)."""

import numpy as np
import pytest
import torch

from dsl import build
from dsl.common import indexing as X
from dsl.common.variant import BLOCK_SHIFTS
from dsl.wgmma import layouts as L
from dsl.wgmma import traits as T
from fp8_noncausal_attn.masking import visible_range


def test_variant_table_covers_both_query_dtypes_and_is_buildable():
    assert {v.q_dtype for v in build.WGMMA_VARIANTS} == {"bfloat16", "float16"}
    names = [v.name for v in build.WGMMA_VARIANTS]
    assert len(set(names)) == len(names)
    assert set(build.WGMMA_CI_VARIANTS) <= set(build.WGMMA_VARIANTS)
    for v in build.WGMMA_VARIANTS:
        v.check()


def test_e5m2_builds_on_request_and_names_carry_no_page_size():
    """``--cache-dtype`` widens the table: both FP8 caches are buildable variants, named by their
    cache dtype; the page size is the kernel's run-time argument, so no name carries one."""
    table = build.wgmma_variants(T.CACHE_DTYPES)
    assert len(table) == 2 * len(build.WGMMA_VARIANTS)
    assert build.wgmma_variants() == build.WGMMA_VARIANTS
    for v in table:
        v.check()
    assert "wgmma_d128_m128_f16_e5m2" in {v.name for v in table}
    assert not any("_p" in v.name for v in table)


# barriers + Q + the 16-bit ring (stages x item) + the FP8 staging ring (fp8 stages x K and V)
@pytest.mark.parametrize(
    ("head_dim", "consumers", "key_tile", "stages", "fp8_stages", "smem", "regs"),
    [
        (64, 1, 128, 4, 3, 1024 + 8192 + 4 * 16384 + 3 * 16384, 255),
        (64, 2, 128, 4, 3, 1024 + 16384 + 4 * 16384 + 3 * 16384, 200),
        (128, 1, 128, 4, 2, 1024 + 16384 + 4 * 32768 + 2 * 32768, 255),
        (128, 2, 128, 4, 2, 1024 + 32768 + 4 * 32768 + 2 * 32768, 200),  # setmaxnreg 104/200
        (256, 1, 64, 4, 2, 1024 + 32768 + 4 * 32768 + 2 * 32768, 255),
        # two FP8 tiles fit only beside three 16-bit stages; setmaxnreg 72/216 (O: 128 regs)
        (256, 2, 64, 3, 2, 1024 + 65536 + 3 * 32768 + 2 * 32768, 216),
    ],
)
def test_shared_memory_and_register_budget(
    head_dim, consumers, key_tile, stages, fp8_stages, smem, regs
):
    v = T.Variant(head_dim, consumers, "bfloat16")
    v.check()
    assert (v.key_tile, v.stages, v.fp8_stages, v.smem_bytes) == (
        key_tile, stages, fp8_stages, smem
    )  # fmt: skip
    assert v.smem_bytes <= T.SMEM_BYTES
    assert v.registers_per_thread["consumer"] == regs
    per_role = v.registers_per_thread
    # setmaxnreg moves registers inside the launch's allocation (168 x 384 at 128 rows)
    launch = v.threads * min(255, T.REGISTER_FILE // v.threads // 8 * 8)
    assert 128 * (per_role["producer"] + consumers * per_role["consumer"]) <= launch


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(head_dim=96), "head_dim 96"),
        (dict(consumers=3), "consumers 3"),
        (dict(q_dtype="float32"), "dtypes"),
        (dict(cache_dtype="float8_e4m3fnuz"), "dtypes"),
    ],
)
def test_unbuildable_variants_are_refused(kwargs, message):
    args = dict(head_dim=128, consumers=1, q_dtype="bfloat16") | kwargs
    with pytest.raises(ValueError, match=message):
        T.Variant(**args).check()


@pytest.mark.parametrize("head_dim", T.HEAD_DIMS)
def test_producer_writes_every_16_bit_chunk_of_an_item_once(head_dim):
    """The producer's (row, chunk) pairs cover the item; each FP8 chunk lands as two 16-byte
    chunks at operand_offset, and together they tile the item's bytes exactly once."""
    key_tile = T.Variant(head_dim, 1, "float16").key_tile
    seen = sorted(
        L.operand_offset(L.loader_row(t, s, head_dim), L.loader_chunk(t, head_dim) * 16 + h * 8,
                         key_tile)
        for t in range(L.WARPGROUP)
        for s in range(L.loader_steps(key_tile, head_dim))
        for h in range(2)
    )  # fmt: skip
    assert seen == list(range(0, key_tile * head_dim * 2, L.CHUNK))


@pytest.mark.parametrize("head_dim", T.HEAD_DIMS)
def test_fp8_staging_holds_every_chunk_a_thread_copies_once_and_slots_cycle(head_dim):
    """Each producer thread's cp.async destinations (one per step) tile an FP8 staging item
    exactly once, so the chunk a thread reads back is the one it copied; the slots of
    consecutive tiles cycle through the ring, so a tile's slot is refilled only fp8_stages
    tiles later (after it was converted)."""
    v = T.Variant(head_dim, 1, "float16")
    seen = sorted(
        L.staging_offset(t, s)
        for t in range(L.WARPGROUP)
        for s in range(L.loader_steps(v.key_tile, head_dim))
    )
    assert seen == list(range(0, v.key_tile * head_dim, L.CHUNK))
    assert v.fp8_tile_bytes == 2 * v.key_tile * head_dim
    slots = [L.staging_slot(n, v.fp8_stages) for n in range(3 * v.fp8_stages)]
    assert slots == list(range(v.fp8_stages)) * 3


def test_two_fp8_tiles_are_kept_before_16_bit_stages_and_too_little_room_is_refused(
    monkeypatch,
):
    """Less shared memory takes 16-bit stages first (two FP8 tiles keep one in flight while one
    is converted); below two 16-bit stages the variant is refused."""
    v = T.Variant(128, 2, "bfloat16")
    monkeypatch.setattr(T, "SMEM_BYTES", v.smem_bytes - v.item_bytes)
    assert (v.stages, v.fp8_stages) == (3, 2)
    room = T.BARRIER_BYTES + v.q_bytes + T.MIN_FP8_STAGES * v.fp8_tile_bytes + v.item_bytes
    monkeypatch.setattr(T, "SMEM_BYTES", room)
    assert v.fp8_stages >= 2
    with pytest.raises(ValueError, match="room for 1 staged item"):
        v.check()


@pytest.mark.parametrize("head_dim", T.HEAD_DIMS)
def test_q_loader_writes_every_chunk_of_the_q_tile_once(head_dim):
    seen = sorted(
        L.operand_offset(L.q_row(t, s, head_dim), L.q_chunk(t, s, head_dim) * 8, 64)
        for t in range(L.WARPGROUP)
        for s in range(L.q_steps(head_dim))
    )
    assert seen == list(range(0, 64 * head_dim * 2, L.CHUNK))


def test_run_time_page_maps_are_division_by_the_page_size():
    """page_slot_of / page_count (shifts and a mask: what the kernel runs with a run-time page
    size) equal division by the page size for every key, sequence length and page size."""
    j = np.arange(5000)
    for shift in BLOCK_SHIFTS:
        col, slot = X.page_slot_of(j, shift)
        assert np.array_equal(col, j // 2**shift) and np.array_equal(slot, j % 2**shift)
        assert np.array_equal(X.page_count(j, shift), -(-j // 2**shift))


@pytest.mark.parametrize("head_dim", T.HEAD_DIMS)
@pytest.mark.parametrize("block_shift", BLOCK_SHIFTS)
def test_producer_page_and_slot_parts_add_up_to_the_rows_page_and_slot(head_dim, block_shift):
    """The producer's row address is the tile's first (column, slot), plus the thread's part
    (computed once), plus the step's (uniform): together, the (column, slot) of the key it
    loads, for every thread, step and tile start; the page comes from a lane of its own warp
    that read exactly that column."""
    page_size = 2**block_shift
    key_tile = T.Variant(head_dim, 1, "float16").key_tile
    lanes = [L.lane_page(lane, key_tile, block_shift) for lane in range(32)]
    for key0 in range(0, 4 * max(page_size, key_tile), key_tile):
        col0, slot0 = L.tile_page_slot(key0, block_shift)
        for t in range(L.WARPGROUP):
            for step in range(L.loader_steps(key_tile, head_dim)):
                page, slot = L.loader_page_slot(t, step, head_dim, block_shift)
                j = key0 + L.loader_row(t, step, head_dim)
                assert (col0 + lanes[page], slot0 + slot) == (j // page_size, j % page_size)
                assert page < L.pages_per_tile(key_tile, block_shift) <= 32


@pytest.mark.parametrize("head_dim", T.HEAD_DIMS)
def test_producer_store_offsets_are_the_operand_map_of_the_row(head_dim):
    """A step adds whole swizzle groups of rows: base + step constant is operand_offset."""
    key_tile = T.Variant(head_dim, 1, "float16").key_tile
    for t in range(L.WARPGROUP):
        for step in range(L.loader_steps(key_tile, head_dim)):
            for half in range(2):
                dim = L.loader_chunk(t, head_dim) * 16 + half * 8
                want = L.operand_offset(L.loader_row(t, step, head_dim), dim, key_tile)
                assert L.loader_store_offset(t, step, half, head_dim, key_tile) == want


def test_accumulator_maps_cover_the_tile_once_and_quads_share_rows():
    cells = sorted((L.acc_row(t, i), L.acc_col(t, j)) for t in range(128) for i in range(2)
                   for j in range(32))  # fmt: skip
    assert cells == [(r, c) for r in range(64) for c in range(128)]
    for t in range(128):
        for off in L.QUAD_SHUFFLES:
            assert [L.acc_row(t ^ off, i) for i in range(2)] == [L.acc_row(t, i) for i in range(2)]


def test_split_ranges_partition_the_windowed_key_tiles():
    for begin, end in ((0, 1), (0, 8), (3, 4), (5, 12), (2, 9)):
        for splits in (1, 2, 3, 7):
            ranges = [X.split_tile_range(begin, end, splits, s, min) for s in range(splits)]
            tiles = [t for first, last in ranges for t in range(first, last)]
            assert tiles == list(range(begin, end))


INT32_MAX = 2**31 - 1


@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (5, 0), (40, 7), (-1, 3), (17, -1),
                                    (INT32_MAX, INT32_MAX), (3000, 3000)])  # fmt: skip
@pytest.mark.parametrize("causal", [0, 1])
def test_window_maps_are_masking_visible_range_in_int32(window, causal):
    """As the kernel runs them in int32 (INT32_MAX does not wrap): key_in_window with the CTA's
    window_offsets and each row's position is masking.visible_range; window_tile_needs_mask is
    false exactly on tiles every key of which both of a thread's rows (positions p, p') see;
    window_first_key / window_last_key bound the rows' keys, and window_tiles the tiles."""
    i32 = np.int32
    for q_len, kv_len in ((1, 1), (5, 300), (130, 130), (16, 900)):
        tokens = np.arange(q_len, dtype=i32)
        left, right = i32(window[0]), i32(window[1])
        before, after = X.window_offsets(left, right, i32(causal), np.where, np.minimum)
        positions = X.query_position(tokens, i32(q_len), i32(kv_len))
        assert positions.dtype == i32 and np.asarray(before).dtype == i32
        start, end = visible_range(torch.arange(q_len), q_len, kv_len, bool(causal), window)
        keys = np.arange(kv_len + 64, dtype=i32)
        seen = X.key_in_window(keys[None, :], i32(kv_len), positions[:, None], before, after)
        expected = (keys[None, :] >= start.numpy()[:, None]) & (
            keys[None, :] < end.numpy()[:, None]
        )
        assert np.array_equal(seen, expected)
        first = X.window_first_key(tokens, i32(q_len), i32(kv_len), left, np.where, np.maximum)
        last = X.window_last_key(tokens, i32(q_len), i32(kv_len), i32(causal), right, np.where)
        assert first.tolist() == start.tolist() and (last + 1).tolist() == end.tolist()
        for gap in (0, 1, 3):  # a thread's rows: positions p and p + gap (same token or later)
            p0, p1 = positions[: q_len - gap], positions[gap:]
            for key0 in range(0, kv_len + 63, 64):
                whole = seen[: q_len - gap, key0 : key0 + 64].all(1) & seen[
                    gap:, key0 : key0 + 64
                ].all(1)
                needs = X.window_tile_needs_mask(key0, key0 + 64, kv_len, p0, p1, before, after)
                assert needs.tolist() == (~whole).tolist()
        begin, stop = X.window_tiles(int(first.min()), int(last.max()), 64)
        assert begin * 64 <= int(start.min()) < (begin + 1) * 64
        assert (stop - 1) * 64 < int(end.max()) <= stop * 64


# ---------------------------------------------------------------------------- DSL layouts
def _probe(head_dim: int, q_dtype: str) -> dict:
    """Offsets and fragment coordinates from the DSL's own wgmma layouts (traced, no GPU)."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
    from cutlass.tensor_utils import LayoutEnum

    from dsl.wgmma.kernel import DTYPES, acc_as_a_operand, acc_mn_layout

    v = T.Variant(head_dim, 1, q_dtype)
    kt, dt = v.key_tile, DTYPES[q_dtype]
    found = {}

    @cute.jit
    def probe():
        qk_tile, pv_tile = (64, kt, head_dim), (64, head_dim, kt)
        q = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tile, dt, 2)
        k = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tile, dt, 2)
        vv = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, pv_tile, dt, 2)
        found["swizzles"] = {str(x.inner) for x in (q, k, vv)}
        # Every row; the first and last element of every 16-byte chunk (the swizzle moves
        # whole chunks): a quarter of the trace-time evaluations of every element.
        dims = [d for d in range(head_dim) if d % 8 in (0, 7)]
        found["q"] = {(r, d): q.outer((r, d, 1)) for r in range(64) for d in dims}
        found["k"] = {(j, d): k.outer((j, d, 1)) for j in range(kt) for d in dims}
        found["v"] = {(j, d): vv.outer((d, j, 1)) for j in range(kt) for d in dims}
        mode = OperandMajorMode
        qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mode.K, mode.K, cutlass.Float32, (1, 1, 1), (64, kt)
        )
        pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, mode.K, mode.MN, cutlass.Float32, (1, 1, 1), (64, head_dim),
            warpgroup.OperandSource.RMEM)  # fmt: skip
        found["c"], found["a"] = {}, {}
        for t in (0, 5, 37, 70, 127):
            thr = qk.get_slice(t)
            frag = cute.make_layout(thr.partition_shape_C((64, kt)))
            coords = thr.partition_C(cute.make_identity_tensor((64, kt)))
            mn = acc_mn_layout(frag)
            found["c"][t] = {(i, j): coords[mn((i, j))] for i in range(2) for j in range(kt // 4)}
            a_coords = pv.get_slice(t).partition_A(cute.make_identity_tensor((64, kt)))
            a_regs = acc_as_a_operand(frag, kt)
            found["a"][t] = [(a_coords[f], coords[a_regs(f)]) for f in range(cute.size(a_coords))]

    cute.compile(probe, options="--gpu-arch=sm_90a")
    return found


@pytest.fixture(scope="module", params=T.HEAD_DIMS)
def dsl_layouts(request):
    return request.param, _probe(request.param, "bfloat16")


def test_operand_offset_is_the_dsl_wgmma_smem_layout(dsl_layouts):
    """Where the producer and the Q loader store (layouts.operand_offset) is where the DSL's
    K-major Q (A) and K (B) layouts and the MN-major V (B) layout put (row, head dim), stage 1,
    under the DSL's 128-byte swizzle on byte addresses."""
    head_dim, found = dsl_layouts
    assert found["swizzles"] == {"S<3,4,3>"}
    key_tile = T.Variant(head_dim, 1, "bfloat16").key_tile
    for name, rows in (("q", 64), ("k", key_tile), ("v", key_tile)):
        stage = rows * head_dim * 2
        for (row, dim), element in found[name].items():
            assert L.sw128(2 * element) == stage + L.operand_offset(row, dim, rows), (name, row)


def test_accumulator_maps_are_the_dsl_fragment(dsl_layouts):
    """acc_row / acc_col (the mask's row and key) are the DSL's C-fragment coordinates, and the
    S registers reused as the A fragment of O += P V hold the (row, key) wgmma expects there."""
    _, found = dsl_layouts
    for t, cells in found["c"].items():
        for (i, j), coord in cells.items():
            assert tuple(coord) == (L.acc_row(t, i), L.acc_col(t, j)), (t, i, j)
    for t, pairs in found["a"].items():
        for a_coord, c_coord in pairs:
            assert tuple(a_coord) == tuple(c_coord), t


@pytest.mark.parametrize("seed", range(3))
def test_bf16_rows_scaled_to_fp16_are_exact_down_to_2_pow_minus_32_of_the_row_max(seed):
    """The consumer's bf16 -> fp16 Q step (dsl/common/precision.py): rows with 40 binades of
    spread keep every element whose scaled value is >= 2^-17 exactly, the largest lands in
    [2^15, 65280], and the rest moves by less than 2^-25 of the scaled unit."""
    import numpy as np
    import torch

    from dsl.common import precision as P

    gen = torch.Generator().manual_seed(seed)
    exps = torch.randint(-30, 10, (64, 128), generator=gen).float()
    q = (torch.randn(64, 128, generator=gen) * torch.exp2(exps)).bfloat16().float().numpy()
    for row in q:
        biased = int((np.float32(np.abs(row).max()).view(np.int32) >> 23) & 0xFF)
        scaled = row.astype(np.float64) * 2.0 ** P.row_scale_exponent(biased, min)
        fp16 = scaled.astype(np.float16).astype(np.float64)
        assert 2.0**15 <= np.abs(scaled).max() <= 65280
        big = np.abs(scaled) >= 2.0**-17
        assert np.array_equal(fp16[big], scaled[big])
        assert np.all(np.abs(fp16 - scaled) <= 2.0**-25)
