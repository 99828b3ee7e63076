"""Host-side checks of the tcgen05 family (never run on a GPU): variant table, TMEM and shared
memory budgets, and the shared-memory layouts the kernel writes by hand, compared with the
layouts the CUTLASS DSL builds for the UMMA operands (those need the DSL, else skipped)."""

import functools
import re

import numpy as np
import pytest
import torch

from dsl import build
from dsl.common import indexing as X
from dsl.common.variant import BLOCK_SHIFTS
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T


def test_variant_table_covers_both_query_and_cache_dtypes_on_the_family_target():
    assert {v.q_dtype for v in build.VARIANTS} == {"bfloat16", "float16"}
    assert {v.cache_dtype for v in build.VARIANTS} == set(T.CACHE_DTYPES)
    assert T.ARCHS == ("sm_100f",)  # one cubin for sm_100 (B200) and sm_103 (B300)
    names = [v.name for v in build.VARIANTS]
    assert len(set(names)) == len(names)
    # The bf16 and fp16 variants of a shape and cache dtype run one kernel, nothing else does.
    kernels = {}
    for v in build.VARIANTS:
        kernels.setdefault(build.symbol(v, "sm_100f"), set()).add(v.q_dtype)
    assert len(kernels) == len(build.VARIANTS) // 2
    assert all(q == {"bfloat16", "float16"} for q in kernels.values())


def test_each_variant_entry_passes_its_query_dtype_to_the_shared_kernel():
    """The library's C entry: variant i runs its kernel's module with ``q_is_bf16`` fixed (1 for
    bf16, 0 for fp16) in the launch record's place for it (after ``row_tiles``); the two
    variants of a kernel share one module."""
    bf16, f16 = (T.Variant(128, 32, q) for q in ("bfloat16", "float16"))
    sym = build.symbol(bf16, "sm_100f")
    assert sym == build.symbol(f16, "sm_100f") == "fp8nca_tcgen05_d128_n32_e4m3_sm_100f"
    entries = [(sym, f"{v.name}@sm_100f", build.forward(v)) for v in (bf16, f16)]
    source = build.entry_source(entries)
    assert source.count(f"static {sym}_Kernel_Module_t module_") == 1
    calls = [line for line in source.splitlines() if f"cute_dsl_{sym}_wrapper(" in line]
    assert len(calls) == 2
    for call, flag in zip(calls, (1, 0), strict=True):
        assert "(&module_0, q, k, v, out," in call
        assert f"softmax_scale, row_tiles, {flag} /* q_is_bf16 */, stream);" in call
    # A wgmma variant's entry fixes the flag too (the shared entry takes it; its kernel does
    # not read it).
    wgmma = build.WGMMA_VARIANTS[0]
    assert f"{int(wgmma.q_dtype == 'bfloat16')} /* q_is_bf16 */" in build.forward(wgmma)
    assert build.symbol(wgmma, "sm_90a") == f"fp8nca_{wgmma.name}_sm_90a"


@pytest.mark.parametrize("variant", build.VARIANTS, ids=lambda v: v.name)
def test_built_variants_fit_tmem_and_shared_memory(variant):
    variant.check()
    assert variant.tmem_columns <= T.TMEM_COLUMNS
    assert variant.tmem_alloc_columns >= variant.tmem_columns
    assert variant.tmem_alloc_columns & (variant.tmem_alloc_columns - 1) == 0
    assert variant.smem_bytes <= T.SMEM_BYTES
    assert variant.convert_stages >= 2  # the converter can run one item ahead of the MMA


@pytest.mark.parametrize(
    ("head_dim", "rows", "s_stages", "convert_stages", "tmem"),
    [
        (128, 32, 2, 4, 352),  # 2 x 32 (S) + 32 (O) + 4 x 64 (K/V)
        (128, 64, 2, 4, 448),
        (128, 128, 2, 2, 512),  # S double-buffered, two converted items
        (256, 64, 2, 4, 512),
        # head_dim 64 keeps head_dim 128's items and O^T tile (lanes 64..127 unused)
        (64, 32, 2, 4, 352),
        (64, 64, 2, 4, 448),
        (64, 128, 2, 2, 512),
    ],
)
def test_tmem_budget(head_dim, rows, s_stages, convert_stages, tmem):
    v = T.Variant(head_dim, rows, "bfloat16")
    assert (v.s_stages, v.convert_stages, v.tmem_columns) == (s_stages, convert_stages, tmem)


@pytest.mark.parametrize(
    ("head_dim", "rows", "smem"),
    [
        # ring 64 KiB + Q (rows x 128-wide B tile, fp16) + P (2 x 128 x rows fp16) + vectors
        (64, 32, 65536 + 8192 + 16384 + 1152 + 1024 + 3072),
        (128, 32, 65536 + 8192 + 16384 + 1152 + 1024 + 3072),
        (64, 128, 65536 + 32768 + 65536 + 4608 + 1024 + 3072),
        (256, 32, 65536 + 16384 + 16384 + 1152 + 1024 + 3072),
    ],
)
def test_smem_budget_takes_a_whole_128_wide_q_tile(head_dim, rows, smem):
    assert T.Variant(head_dim, rows, "bfloat16").smem_bytes == smem


def test_head_dim_64_runs_half_an_item():
    """Head_dim 64: one item per K/V tile (its 128-byte rows half used), BMM1's first 4 of 8
    k-steps, 4 of each 8 loader threads per row copy (their source chunk is 0..3)."""
    v = T.Variant(64, 32, "bfloat16")
    assert (v.d_tiles, L.item_dims(64), L.bmm1_k_blocks(64), L.bmm1_k_blocks(128)) == (1, 64, 4, 8)
    copying = [t for t in range(128) if L.loader_predicate(t, 0, 0, 0, 128, 64, False)]
    assert len(copying) == 64
    assert {L.loader_chunk(t) for t in copying} == {0, 1, 2, 3}
    for t in range(128):
        assert L.loader_predicate(t, 0, 0, 0, 128, 128, False) is None
        assert L.loader_predicate(t, 0, 0, 0, 128, 256, False) is None
        row_kept = L.loader_predicate(t, 3, 0, 49, 50, 128, True)  # keys 49 .. 49
        assert row_kept == (L.loader_row(t, 3) == 49)
        assert L.loader_predicate(t, 3, 0, 49, 50, 64, True) == (row_kept and t in copying)


def test_head_dim_64_loader_fills_the_first_64_bytes_of_every_row_once():
    seen = sorted(
        L.staged_offset(L.loader_row(t, s), L.loader_chunk(t)) + b
        for t in range(128)
        for s in range(L.LOADER_STEPS)
        if L.loader_predicate(t, s, 0, 0, L.KEY_TILE, 64, False)
        for b in range(L.CHUNK)
    )
    want = sorted(
        L.staged_offset(j, c) + b for j in range(L.KEY_TILE) for c in range(4) for b in range(16)
    )
    assert seen == want


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(head_dim=96), "head_dim 96"),
        (dict(rows=12), "rows 12"),
        (dict(q_dtype="float32"), "dtypes"),
        (dict(cache_dtype="bfloat16"), "dtypes"),
        (dict(head_dim=256, rows=256), "need 1088 TMEM columns > 512"),
        # Two S stages (256) + O (256) leave no column for a converted item; one S stage (the
        # only way to fit) is refused, never having been compiled.
        (dict(head_dim=256, rows=128), "need 576 TMEM columns > 512"),
        (dict(rows=160), "need 544 TMEM columns > 512"),
    ],
)
def test_unbuildable_variants_are_refused(kwargs, message):
    args = dict(head_dim=128, rows=32, q_dtype="bfloat16") | kwargs
    with pytest.raises(ValueError, match=message):
        T.Variant(**args).check()


def test_loader_covers_every_chunk_of_an_item_once():
    seen = sorted(
        L.staged_offset(L.loader_row(t, s), L.loader_chunk(t))
        for t in range(128)
        for s in range(L.LOADER_STEPS)
    )
    assert seen == list(range(0, L.KEY_TILE * L.ITEM_BYTES, L.CHUNK))


def test_loader_ring_offset_is_the_swizzled_offset_of_its_row_and_chunk():
    for t in range(128):
        for s in range(L.LOADER_STEPS):
            want = L.staged_offset(L.loader_row(t, s), L.loader_chunk(t))
            assert L.loader_ring_offset(t, s) == want, (t, s)
            # The kernel adds a per-thread base and a per-step immediate.
            assert L.loader_ring_offset(t, 0) + L.loader_ring_offset(0, s) == want, (t, s)


@pytest.mark.parametrize("block_shift", BLOCK_SHIFTS)
def test_loader_pages_and_slots_are_those_of_its_rows(block_shift):
    """Tile start + the step's (page, slot) + the thread's own slot = page_slot of the row; a
    step's page comes from the lane that read it. The copies' compile-time shift (a plain 0
    slot where a page holds no more than a tile) agrees with the run-time one the block-table
    reads use."""
    page_size = 1 << block_shift
    run_time_shift = np.int32(block_shift)  # not an int: the run-time formulas
    for key0 in range(0, 4 * page_size + 2 * L.KEY_TILE, L.KEY_TILE):
        col0, slot0 = L.tile_page_slot(key0, block_shift)
        assert (col0, slot0) == L.tile_page_slot(key0, run_time_shift)
        for t in range(128):
            for s in range(L.LOADER_STEPS):
                step_page, step_slot = L.loader_step_page_slot(s, block_shift)
                got = (col0 + step_page, slot0 + step_slot + L.loader_row(t, 0))
                assert got == X.page_slot(key0 + L.loader_row(t, s), page_size)
                assert step_page < L.pages_per_tile(block_shift)
        read = {L.lane_page(lane, run_time_shift) for lane in range(32)}
        assert read == set(range(L.pages_per_tile(block_shift)))
        assert L.pages_per_tile(block_shift) == max(1, L.KEY_TILE // page_size)


def _prmt(a, b, selector):
    """PTX prmt.b32 (default mode) on numpy uint64 arrays: byte k of the result is byte
    ``selector`` nibble k (& 7) of {b, a}, or that byte's sign replicated when the nibble's bit 3
    is set."""
    src = (np.asarray(b, np.uint64) << np.uint64(32)) | np.asarray(a, np.uint64)
    out = np.zeros_like(src)
    for k in range(4):
        nibble = (selector >> (4 * k)) & 0xF
        byte = (src >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)
        if nibble & 8:
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte << np.uint64(8 * k)
    return out


def _bitselect(mask, a, b):
    """PTX lop3.b32 with LUT 0xE4 (the kernel's convert.bitselect): a where mask is set, else b."""
    return (a & np.uint64(mask)) | (b & np.uint64(mask ^ 0xFFFFFFFF))


def _f16_lanes(bits):
    halves = np.stack([bits & 0xFFFF, bits >> np.uint64(16)], axis=-1).astype(np.uint16)
    return halves.view(np.float16).astype(np.float64)


def _every_byte_in_every_position():
    """Words holding every pair (x, y) of bytes as bytes x, y, y, x: each byte value in each of
    the four positions, next to every other byte value (a carry into a neighbour shows)."""
    x, y = np.meshgrid(np.arange(256, dtype=np.uint64), np.arange(256, dtype=np.uint64))
    x, y = x.ravel(), y.ravel()
    return x | y << np.uint64(8) | y << np.uint64(16) | x << np.uint64(24), x, y


def _fp8_values(dtype):
    return torch.from_numpy(np.arange(256, dtype=np.uint8)).view(dtype).double().numpy()


def test_integer_e4m3_conversion_is_exact_for_every_byte_in_every_position():
    """layouts.e4m3x4_to_f16x2_scaled (the converter's integer-pipe share) gives value x 2^-8
    for all 256 bytes in all four byte positions, NaN for the e4m3fn NaN bytes 0x7f / 0xff
    (SPEC: NaN in the cache propagates, as the hardware conversion does), and the kernel's
    x 2^8 (fp16, as its HFMA2) gives the value back."""
    words, x, y = _every_byte_in_every_position()
    lo, hi = L.e4m3x4_to_f16x2_scaled(words, _prmt, _bitselect)
    got = np.concatenate([_f16_lanes(lo), _f16_lanes(hi)], axis=1)  # bytes x, y, y, x
    value = _fp8_values(torch.float8_e4m3fn)
    assert np.isnan(value[0x7F]) and np.isnan(value[0xFF])
    want = np.stack([value[x], value[y], value[y], value[x]], axis=1)
    assert np.array_equal(got, want * 2.0**-8, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))  # -0 stays -0, NaN keeps its sign
    back = (got.astype(np.float16) * np.float16(256.0)).astype(np.float64)
    assert np.array_equal(back, want, equal_nan=True)


@pytest.mark.parametrize(
    "name, planted",
    [
        ("E4M3_MASK", 0xBF80BF80),  # clears the NaN mark: 0x7f / 0xff -> +-480
        ("E4M3_NAN_BORROW", 0x02020202),  # marks 0x7e as NaN too
        ("E4M3_LANES_LO", 0x9180),  # sign from the marked byte: NaN turns negative, -x positive
    ],
)
def test_integer_e4m3_conversion_test_catches_a_planted_bug(monkeypatch, name, planted):
    monkeypatch.setattr(L, name, planted)
    with pytest.raises(AssertionError):
        test_integer_e4m3_conversion_is_exact_for_every_byte_in_every_position()


def test_e5m2_byte_moves_are_exact_for_every_byte_in_every_position():
    """layouts.e5m2x4_to_f16x2 (the converter's e5m2 path: PRMT only) gives each byte's value
    exactly as fp16, subnormals, +-0, +-Inf and NaN included, in all four byte positions."""
    words, x, y = _every_byte_in_every_position()
    lo, hi = L.e5m2x4_to_f16x2(words, _prmt)
    got = np.concatenate([_f16_lanes(lo), _f16_lanes(hi)], axis=1)  # bytes x, y, y, x
    value = _fp8_values(torch.float8_e5m2)
    assert np.isinf(value[0x7C]) and np.isnan(value[0x7F]) and np.isnan(value[0xFE])
    want = np.stack([value[x], value[y], value[y], value[x]], axis=1)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(np.signbit(got), np.signbit(want))
    assert ((lo | hi) >> np.uint64(32) == 0).all()  # nothing above the two lanes


@pytest.mark.parametrize("name, planted", [("E5M2_LANES_LO", 0x0414), ("E5M2_LANES_HI", 0x2434)])
def test_e5m2_byte_move_test_catches_a_planted_bug(monkeypatch, name, planted):
    monkeypatch.setattr(L, name, planted)  # bytes 0 / 1 or 2 / 3 swapped
    with pytest.raises(AssertionError):
        test_e5m2_byte_moves_are_exact_for_every_byte_in_every_position()


def test_item_order_has_every_k_and_v_item_once():
    for iters in range(1, 6):
        for d_tiles in (1, 2):
            items = [
                L.item_of(i, iters, d_tiles, lambda c, a, b: a if c else b)
                for i in range(L.item_count(iters, d_tiles))
            ]
            expected = {
                (v, s, d) for v in (False, True) for s in range(iters) for d in range(d_tiles)
            }
            assert set(items) == expected and len(items) == len(expected)
            # K of a tile always precedes V of the same tile.
            for s in range(iters):
                assert items.index((False, s, 0)) < items.index((True, s, 0))


def test_split_ranges_partition_the_windowed_key_tiles():
    """The kernel's CTA range (X.window_tiles over KEY_TILE-key tiles) split by
    X.split_tile_range: every tile once, in order, whatever the split count."""
    for first_key, last_key in ((0, 0), (0, 126), (0, 127), (5, 128), (130, 999), (256, 1000)):
        begin, end = X.window_tiles(first_key, last_key, L.KEY_TILE)
        assert begin * L.KEY_TILE <= first_key and last_key < end * L.KEY_TILE
        for splits in (1, 2, 3, 7):
            ranges = [X.split_tile_range(begin, end, splits, s, min) for s in range(splits)]
            tiles = [t for first, stop in ranges for t in range(first, stop)]
            assert tiles == list(range(begin, end))


# ---------------------------------------------------------------------------- DSL layouts
@pytest.fixture(scope="module")
def dsl_layouts():
    """Offsets of the DSL's UMMA smem layouts, evaluated while tracing (no GPU, no kernel)."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    rows = 32
    found = {}

    def mma(b_major):
        return sm100_utils.make_trivial_tiled_mma(
            cutlass.Float16,
            cutlass.Float16,
            OperandMajorMode.K,
            b_major,
            cutlass.Float32,
            tcgen05.CtaGroup.ONE,
            (L.KEY_TILE, rows),
            tcgen05.OperandSource.TMEM,
        )

    @cute.jit
    def probe():
        tile = (L.KEY_TILE, rows, L.ITEM_BYTES)
        fp8 = cutlass.Float8E4M3FN
        k = sm100_utils.make_smem_layout_a(mma(OperandMajorMode.K), tile, fp8, 2)
        v = sm100_utils.make_smem_layout_a(mma(OperandMajorMode.MN), tile, fp8, 2, is_k_major=False)
        q = sm100_utils.make_smem_layout_b(mma(OperandMajorMode.K), tile, cutlass.Float16, 2)
        found["k"] = {
            (j, b): k(((j, b % 16), 0, b // 16, 1)) for j in range(128) for b in range(128)
        }
        found["v"] = {
            (j, b): v(((b, j % 16), 0, j // 16, 1)) for j in range(128) for b in range(128)
        }
        # The kernel's Q-prologue index (kernel.q_prologue) for 2 x 128 head dims.
        found["q"] = [
            q(((r, d % 16), 0, (d % L.ITEM_BYTES) // 16, d // L.ITEM_BYTES))
            for r in range(rows)
            for d in range(2 * L.ITEM_BYTES)
        ]

    cute.compile(probe)
    return found


@pytest.mark.parametrize("operand", ["k", "v"])
def test_staged_offset_is_the_umma_layout_ldmatrix_reads(dsl_layouts, operand):
    """The converter's cp.async destinations (layouts.staged_offset) are where the DSL's K-major
    (K) and MN-major (V) 8-bit A-operand layouts put key row j, byte b (stage 1 of 2)."""
    stage = L.KEY_TILE * L.ITEM_BYTES
    for (j, b), offset in dsl_layouts[operand].items():
        assert offset == stage + L.staged_offset(j, b // L.CHUNK) + b % L.CHUNK, (j, b)


def test_q_prologue_index_fills_the_b_operand_once(dsl_layouts):
    """Every (row, head dim) the Q prologue writes lands on its own fp16 slot of the B tile."""
    offsets = dsl_layouts["q"]
    assert sorted(offsets) == list(range(len(offsets)))


# Every lane of warp 0 and one lane of each other warp (a warp's TMEM lanes, its keys, are warp
# 0's plus 32 x warp): the DSL's partitions are read element by element, slowly, while tracing.
SAMPLED_THREADS = (*range(32), 37, 70, 127)


@pytest.fixture(scope="module")
def softmax_maps():
    """The softmax warps' TMEM-load partitions (S: 16x256b, O: 32x32b) and P's B-operand layout
    for 32, 64 and 128 rows, evaluated while tracing."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from dsl.tcgen05.softmax import score_chunk_mode

    stages = 2
    found = {}

    def mma(rows, b_major):
        return sm100_utils.make_trivial_tiled_mma(
            cutlass.Float16,
            cutlass.Float16,
            OperandMajorMode.K,
            b_major,
            cutlass.Float32,
            tcgen05.CtaGroup.ONE,
            (L.KEY_TILE, rows),
            tcgen05.OperandSource.TMEM,
        )

    def probe(rows):
        @cute.jit
        def traced():
            kq, vp = mma(rows, OperandMajorMode.K), mma(rows, OperandMajorMode.MN)
            shape = kq.partition_shape_C((L.KEY_TILE, rows, stages))
            tCtS = kq.get_slice(0).make_fragment_C(shape)
            coords = kq.get_slice(0).partition_C(cute.make_identity_tensor((128, rows, stages)))
            # S: a chunk's two halves of 16 registers sliced as softmax._load_scores does.
            chunk_mode = functools.partial(score_chunk_mode, chunks=rows // L.COLUMN_CHUNK)
            atom = cute.make_copy_atom(tcgen05.Ld16x256bOp(tcgen05.Repetition(4)), cutlass.Float32)
            load = tcgen05.make_tmem_copy(atom, tCtS[(None, None, None, 0)])
            # One partition per thread; each element read costs about a millisecond here.
            parts = {t: load.get_slice(t).partition_D(coords) for t in SAMPLED_THREADS}
            found["s", rows] = {
                (t, c, i): parts[t][(None, chunk_mode(c, half=i // 16), 0, 0, 1)][i % 16]
                for t in SAMPLED_THREADS
                for c in range(rows // L.COLUMN_CHUNK)
                for i in range(L.SCORE_REGISTERS)
            }
            atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), cutlass.Float32)
            load = tcgen05.make_tmem_copy(atom, tCtS[(None, None, None, 0)])
            parts = {t: load.get_slice(t).partition_D(coords) for t in SAMPLED_THREADS}
            found["o", rows] = {
                (t, c, i): parts[t][(i, c, 0, 0, 1)]
                for t in SAMPLED_THREADS
                for c in range(rows // L.COLUMN_CHUNK)
                for i in range(L.COLUMN_CHUNK)
            }
            # P: BMM2's B operand (fp16 offsets), and kernel.py's tCsP (BMM1's C view of it).
            b = sm100_utils.make_smem_layout_b(
                vp, (None, rows, L.KEY_TILE), cutlass.Float16, stages
            )
            found["b", rows] = {  # stage 1: its offset from stage 0 is part of what is checked
                (k, n, 1): b.outer(((n, k % 16), 0, k // 16, 1))
                for k in range(L.KEY_TILE)
                for n in range(rows)
            }
            found["swizzle", rows] = str(b.inner)
            c_view = cute.composition(
                b.outer, cute.make_ordered_layout(shape, order=((2, 0), 3, 1, 4))
            )
            found["c", rows] = {
                (k, n): c_view(((k, n), 0, 0, 1)) for k in range(L.KEY_TILE) for n in range(rows)
            }

        cute.compile(traced)

    for rows in (32, 64, 128):
        probe(rows)
    return found


ROWS = (32, 64, 128)


@pytest.mark.parametrize("rows", ROWS)
def test_softmax_score_registers_are_layouts_score_key_column(softmax_maps, rows):
    """Register i of chunk c of softmax thread t in the DSL's 16x256b partition of S is
    S^T[layouts.score_key_column(t, i)] (column + 32 c), stage 1 (SAMPLED_THREADS)."""
    for (t, c, i), coord in softmax_maps["s", rows].items():
        key, column = L.score_key_column(t, i)
        assert coord == (key, L.COLUMN_CHUNK * c + column, 1), (t, c, i)


@pytest.mark.parametrize("rows", ROWS)
def test_softmax_o_registers_are_head_dim_lane_and_column_32c_plus_i(softmax_maps, rows):
    """O^T stays on 32x32b: thread t's register i of chunk c is (lane t, column 32 c + i)."""
    for (t, c, i), coord in softmax_maps["o", rows].items():
        assert coord == (t, 32 * c + i, 1)


def test_score_entries_and_column_slots_agree():
    """Register i's entry (layouts.score_entry) names its column (thread_column), a thread's 8
    columns of a chunk are contiguous slots from thread_slot, and column_slot permutes a chunk."""
    for t in range(128):
        lane = t % 32
        for i in range(L.SCORE_REGISTERS):
            assert L.score_key_column(t, i)[1] == L.thread_column(lane, L.score_entry(i))
        for c in range(4):
            slots = [
                L.column_slot(L.COLUMN_CHUNK * c + L.thread_column(lane, e))
                for e in range(L.THREAD_COLUMNS)
            ]
            assert slots == [L.thread_slot(lane, c) + e for e in range(L.THREAD_COLUMNS)]
    assert sorted(L.column_slot(n) for n in range(128)) == list(range(128))


@pytest.mark.parametrize("rows", ROWS)
def test_p_offset_is_the_b_operand_layout_bmm2_reads(softmax_maps, rows):
    """layouts.p_offset (+ stage x p_stage_bytes) is where the DSL's MN-major B layout puts
    P[key, column] (fp16), in stage 1: its outer layout, then its swizzle on the byte address
    (the same S<B,4,3> for every dtype in the DSL's atoms, as the UMMA descriptors read it)."""
    bits, base, shift = map(
        int, re.fullmatch(r"S<(\d+),(\d+),(\d+)>", softmax_maps["swizzle", rows]).groups()
    )
    mask = ((1 << bits) - 1) << base
    for (k, n, stage), offset in softmax_maps["b", rows].items():
        address = 2 * offset  # the outer layout counts fp16; the swizzle acts on bytes
        address ^= (address >> shift) & mask
        assert address == stage * L.p_stage_bytes(rows) + L.p_offset(k, n, rows), (k, n)


@pytest.mark.parametrize("rows", ROWS)
def test_stmatrix_puts_every_score_of_p_where_bmm2_reads_it(rows):
    """The P store replayed as PTX defines stmatrix.x4: lane l addresses row l % 8 of matrix
    l // 8 (layouts.p_store_row), register m of lane l is that matrix's row l // 4, columns
    2 (l % 4) and + 1, taken from score registers layouts.p_store_register (+ 0 / 1) of the
    16x256b fragment. Each (key, column) of the chunk is written once, at p_offset."""
    for chunk in range(rows // L.COLUMN_CHUNK):
        written = {}
        for warp in range(4):
            for half in range(2):
                for block in range(2):
                    for lane in range(32):
                        t = 32 * warp + lane
                        key, column0 = L.p_store_row(t, chunk, half, block)
                        matrix, row = lane // 8, lane % 8
                        for source in range(4 * row, 4 * row + 4):  # lanes holding that row
                            reg = L.p_store_register(half, block, matrix)
                            for h in range(2):
                                element = 2 * (source % 4) + h
                                address = L.p_offset(key, column0, rows) + 2 * element
                                held = L.score_key_column(32 * warp + source, reg + h)
                                held = (held[0], L.COLUMN_CHUNK * chunk + held[1])
                                assert address not in written
                                written[address] = held
                                assert address == L.p_offset(*held, rows), (t, half, block)
        assert len(written) == L.KEY_TILE * L.COLUMN_CHUNK


@pytest.mark.parametrize("rows", ROWS)
def test_stmatrix_address_is_a_thread_base_plus_an_immediate(rows):
    """The kernel computes p_offset(p_store_row(...)) as p_store_base (per thread, once) plus
    p_store_step (compile-time)."""
    for t in range(128):
        for chunk in range(rows // L.COLUMN_CHUNK):
            for half in range(2):
                for block in range(2):
                    row = L.p_store_row(t, chunk, half, block)
                    assert L.p_offset(*row, rows) == L.p_store_base(
                        t, chunk, rows
                    ) + L.p_store_step(chunk, half, block, rows), (t, chunk, half, block)


@pytest.mark.parametrize("rows", ROWS)
def test_p_written_as_c_tile_lands_where_bmm2_reads_b(softmax_maps, rows):
    """kernel.py's tCsP (P as BMM1's C tile, whose pointer the softmax's stores start from)
    is the B operand's layout."""
    for (k, n), offset in softmax_maps["c", rows].items():
        assert offset == softmax_maps["b", rows][k, n, 1]


@pytest.fixture(scope="module")
def converter_k_maps():
    """The converter's K path (convert.py: ldmatrix from the ring -> registers -> tcgen05.st
    into TMEM) at head_dim 64 (BMM1's first 4 k-steps) and 128, evaluated while tracing: per
    sampled thread, the (key, head dim) of each ldmatrix destination register and of each
    tcgen05.st source register."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils
    from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

    from dsl.tcgen05.convert import _first_k_blocks

    stages, threads = 2, (0, 37, 127)
    found = {}

    @cute.jit
    def probe():
        kq = sm100_utils.make_trivial_tiled_mma(
            cutlass.Float16, cutlass.Float16, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, tcgen05.CtaGroup.ONE, (L.KEY_TILE, 32), tcgen05.OperandSource.TMEM,
        )  # fmt: skip
        thr = kq.get_slice(0)
        tAtK = thr.make_fragment_A(kq.partition_shape_A((L.KEY_TILE, L.ITEM_BYTES, stages)))
        coords = thr.partition_A(cute.make_identity_tensor((L.KEY_TILE, L.ITEM_BYTES, stages)))
        for head_dim in cutlass.range_constexpr(64, 129, 64):
            k_blocks = L.bmm1_k_blocks(head_dim)
            repetition = tcgen05.Repetition(k_blocks * L.UMMA_K * 16 // 256)
            atom = cute.make_copy_atom(tcgen05.St16x256bOp(repetition), cutlass.Float16)
            store = tcgen05.make_tmem_copy(
                atom, _first_k_blocks(tAtK, k_blocks)[(None,) * 3 + (0,)]
            )
            ldmatrix = cute.nvgpu.warp.LdMatrix8x16x8bOp(num_matrices=4)
            load = cute.make_tiled_copy_S(
                cute.make_copy_atom(ldmatrix, cutlass.Float8E4M3FN), store
            )
            half = _first_k_blocks(coords, k_blocks)
            parts = [
                (
                    load.get_slice(t).partition_D(half)[(None,) * 4 + (1,)],
                    store.get_slice(t).partition_S(half)[(None,) * 4 + (1,)],
                )
                for t in threads
            ]
            found.update(
                {
                    (head_dim, t): (
                        [read[i] for i in range(cute.size(read))],
                        [kept[i] for i in range(cute.size(kept))],
                    )
                    for t, (read, kept) in zip(threads, parts, strict=True)
                }
            )

    cute.compile(probe)
    return found


def test_converter_k_registers_pair_up_and_head_dim_64_converts_dims_below_64(converter_k_maps):
    """Register i that ldmatrix fills is register i that tcgen05.st stores (the kernel converts
    one into the other in place), at both head dims; at head_dim 64 a thread converts exactly
    the (key, dim < 64) entries it converts at head_dim 128 (stage 1 of 2)."""
    for (head_dim, t), (read, kept) in converter_k_maps.items():
        assert read == kept, (head_dim, t)
        assert len(set(read)) == L.KEY_TILE * L.item_dims(head_dim) // 128
        assert {stage for _, _, stage in read} == {1}
        if head_dim == 64:
            full = converter_k_maps[128, t][0]
            assert set(read) == {c for c in full if c[1] < 64}


def _correction_exp2_host(x: np.ndarray) -> np.ndarray:
    """layouts.correction_exp2 in float32 numpy (the kernel's ops, the power of two as ldexp)."""

    def fma(a, b, c):
        return (np.float32(a) * np.float32(b) + np.float32(c)).astype(np.float32)

    def scale(p, t):
        n = (t - np.float32(L.ROUNDING_MAGIC)).astype(np.int32)
        return np.ldexp(p, n).astype(np.float32)

    return L.correction_exp2(x.astype(np.float32), np.maximum, fma, scale)


def test_correction_exp2_is_as_accurate_as_mufu_down_to_its_floor():
    """The exact path's FMA-pipe exp2 (layouts.correction_exp2): within 3e-7 relative of 2^x on
    [CORRECTION_FLOOR, 0] (MUFU.EX2's approximation is about 2 float32 ulp, 2.4e-7), exactly 1 at
    0 (a correction of a column whose reference stayed), 2^CORRECTION_FLOOR below the floor and
    for -inf; a planted coefficient bug fails."""
    x = np.concatenate([np.linspace(L.CORRECTION_FLOOR, 0.0, 200001), -np.logspace(-8, 0, 1000)])
    got = _correction_exp2_host(x).astype(np.float64)
    want = np.exp2(x.astype(np.float32).astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 3e-7
    assert _correction_exp2_host(np.array([0.0]))[0] == 1.0
    floor = np.exp2(L.CORRECTION_FLOOR)
    assert np.all(_correction_exp2_host(np.array([-200.0, -np.inf, -3.4e38])) == floor)


def test_correction_exp2_test_catches_a_planted_coefficient(monkeypatch):
    coefficients = list(L.CORRECTION_EXP2)
    coefficients[2] *= 1.001
    monkeypatch.setattr(L, "CORRECTION_EXP2", tuple(coefficients))
    x = np.linspace(-10.0, 0.0, 1001)
    got = _correction_exp2_host(x).astype(np.float64)
    assert np.max(np.abs(got / np.exp2(x) - 1)) > 3e-7
