"""The mma.sync kernels' index maps and bit-level conversions, compiled for the CPU and checked
exhaustively against their definitions (the kernels themselves run on CPU tensors through the
SIMT executor: tests/test_simt_kernels.py).

The maps are not copied: the test extension ``fp8nca_host_hooks`` (helpers/host_hooks.py) runs
csrc/mma_sync/index_maps.h, fp8_bits.h, csrc/common/index_tensors.h, the cache quantisation and
the split-KV merge row compiled for the CPU (the same ``__host__ __device__`` functions the
kernels call): the tile copy's slots, the ldmatrix row addresses, the FP8 and int8 byte moves
for every byte, the per-token-head scale slots, the shared-memory banks of the tile and scale
copies, the pages of a tile, each row's visible key range and the tiles a window touches, the
split of the windowed tile range, the plan's tile choice, the merge row and its sink, the index
tensor readers and the cache quantisation.
"""

import functools
import math

import numpy as np
import pytest
import torch
from helpers import host_hooks

from fp8_noncausal_attn.backends.cuda import extension, simt
from fp8_noncausal_attn.masking import visible_range

# Builds the host-hook extension (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.emulation

LOG2E = 1.4426950408889634


def host():
    """The kernels' maps compiled for the CPU (the test extension, built on first use)."""
    return host_hooks.load()


@functools.cache
def tables(head_dim: int, elt: int, block_m: int = 64) -> dict:
    return host().mma_sync_tables(head_dim, elt, block_m)


def decode(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Little-endian uint8 array of ``dtype`` elements -> float64."""
    return torch.from_numpy(np.ascontiguousarray(words)).view(dtype).double().numpy()


def pair(word: int, dtype: torch.dtype) -> tuple[float, float]:
    """A register holding two 16-bit values of ``dtype``."""
    raw = bytearray(int(word).to_bytes(4, "little"))
    lo, hi = decode(np.frombuffer(raw, np.uint8), dtype)
    return float(lo), float(hi)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elt", [1, 2])
def test_copy_slots_are_one_unit_of_rows_a_constant_step_apart(head_dim, elt, block_m):
    """The kernel forms a thread's copy row and unit once (slot tid) and steps the row by
    copy_row_step for slots tid + i * threads: the maps must agree with that."""
    T = tables(head_dim, elt, block_m)
    assert T["threads"] == 32 * T["warps"] == 2 * block_m
    threads, step = T["threads"], T["copy_row_step"]
    assert T["copy_slots"] * threads == len(T["copy"]) == T["block_n"] * T["units"]
    for tid in range(threads):
        r0, u0 = T["copy"][tid][:2]
        for i in range(T["copy_slots"]):
            assert T["copy"][tid + i * threads][:2] == [r0 + i * step, u0]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_ldmatrix_addresses_are_a_lane_part_plus_a_step_part(head_dim):
    """pv_tile adds a lane's row address and a (k-step, n-tile pair) offset (an immediate)."""
    vl = tables(head_dim, 2)["v_ldsm"]
    for kk, row in enumerate(vl):
        for jp, lanes in enumerate(row):
            for lane, addr in enumerate(lanes):
                assert (
                    addr
                    == vl[0][0][lane] + vl[kk][jp][0]
                    == vl[0][0][lane] + kk * vl[1][0][0] + vl[0][jp][0]
                )


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_bit_dequantisation_is_exact_for_every_byte(cache_dtype):
    """The kernel's FP8 -> bf16 bit moves (fp8_bits.h) times the format's power of two give
    every finite FP8 value exactly, in bf16_k_dim order; the special test flags exactly the
    Inf / NaN bytes."""
    hk = host()
    codes = extension.DTYPE_CODES
    kv = codes[cache_dtype]
    assert hk.bit_dequant_k(codes[torch.bfloat16], kv)
    assert not hk.bit_dequant_k(codes[torch.float16], kv)
    assert not hk.bit_dequant_k(codes[torch.bfloat16], codes[torch.bfloat16])
    assert [hk.bf16_k_dim(p) for p in range(8)] == [0, 2, 1, 3, 4, 6, 5, 7]
    finite = [
        b for b in range(256) if math.isfinite(decode(np.array([b], np.uint8), cache_dtype)[0])
    ]
    rng = np.random.default_rng(5)
    for b in range(256):
        for pos in range(4):
            raw = rng.choice(finite, 4).astype(np.uint8)  # specials only where placed
            raw[pos] = b
            word = int(raw.view(np.uint32)[0])
            expect = decode(raw, cache_dtype)
            special = not np.isfinite(expect).all()
            assert (hk.fp8x4_special_bits(word, kv) != 0) == special, (b, pos)
            if special:
                continue
            even, odd, scale = hk.fp8x4_to_bf16x2_scaled(word, kv)
            (factor, _) = pair(scale, torch.bfloat16)
            got = [x * factor for x in (*pair(even, torch.bfloat16), *pair(odd, torch.bfloat16))]
            want = [expect[hk.bf16_k_dim(p)] for p in range(4)]
            assert got == want, (b, pos, got, want)
            for g, w in zip(got, want, strict=True):
                assert math.copysign(1.0, g) == math.copysign(1.0, w)


def words_with_every_byte(seed: int):
    """(byte, position, word): 4 random bytes with each of the 256 bytes at each position."""
    rng = np.random.default_rng(seed)
    for b in range(256):
        for pos in range(4):
            raw = rng.integers(0, 256, 4, dtype=np.uint8)
            raw[pos] = b
            yield b, pos, raw


def test_e5m2_to_fp16_byte_moves_are_exact_for_every_byte():
    """e5m2 -> fp16 (V, and K under an fp16 query) is a byte move: each pair equals the fp16
    conversion of the e5m2 values, Inf and NaN included."""
    hk = host()
    for b, pos, raw in words_with_every_byte(6):
        lo, hi = hk.e5m2x4_to_f16x2(int(raw.view(np.uint32)[0]))
        got = np.array([*pair(lo, torch.float16), *pair(hi, torch.float16)])
        want = decode(raw, torch.float8_e5m2)
        assert np.array_equal(got, want, equal_nan=True), (b, pos, got, want)
        finite = ~np.isnan(want)
        assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize("block_size", [8, 16, 64, 128, 256])
def test_tile_page_and_page_key_find_every_key_of_a_tile(block_size):
    """Key n0 + r of a key tile (n0 a multiple of block_n): the kernel's page (first page of the
    tile plus tile_page) and offset in it (page_key) are the key's own."""
    hk = host()
    shift = block_size.bit_length() - 1
    for block_n in (32, 64):
        for n0 in range(0, 4 * max(block_size, block_n), block_n):
            for r in range(block_n):
                key = n0 + r
                assert (n0 >> shift) + hk.tile_page(r, shift) == key // block_size
                assert hk.page_key(n0, r, block_size) == key % block_size


def test_int8_byte_moves_are_exact_for_every_byte():
    """int8 -> fp16 (K and V of int8 caches) is a byte move under fp16's 1024 and one fp16
    subtraction: exact for every byte, in order."""
    hk = host()
    for b, pos, raw in words_with_every_byte(7):
        lo, hi, bias = hk.int8x4_to_biased_f16x2(int(raw.view(np.uint32)[0]))
        biased = [*pair(lo, torch.float16), *pair(hi, torch.float16)]
        # The subtraction is exact in fp16 (an integer of at most 8 bits): modelled in fp64.
        assert [x - bias for x in biased] == raw.view(np.int8).tolist(), (b, pos)


def test_scale_slots_fill_the_stage_past_the_value_tile():
    """A 1-byte stage ends with its keys' scales: K scales in key order, then V scales, 4-byte
    words past the (unpadded) V tile, filling the stage to its end."""
    for head_dim in (64, 128, 256):
        for block_m in (64, 128):
            T = tables(head_dim, 1, block_m)
            n, v_tile = T["block_n"], T["block_n"] * T["v_row"]
            assert T["v_row"] == T["units"] * 16 and T["scale_bytes"] == 8 * n
            assert T["stage_bytes"] == n * T["k_row"] + v_tile + T["scale_bytes"]
            assert T["scale"] == [[v_tile + 4 * r, v_tile + 4 * (n + r)] for r in range(n)]


def wavefronts(offsets: list[int], width: int) -> list[int]:
    """Shared-memory wavefronts of one warp's access of ``width`` bytes a lane (4 or 16) at
    these byte offsets, phase by phase: the hardware serves 128 bytes of lanes at a time (a
    16-byte access a quarter warp, a 4-byte one the whole warp), and a phase takes as many
    wavefronts as the most distinct words one of the 32 banks holds (lanes reading one word
    share it)."""
    lanes = 128 // width
    phases = []
    for first in range(0, len(offsets), lanes):
        words_per_bank: dict[int, set[int]] = {}
        for offset in offsets[first : first + lanes]:
            for word in range(offset // 4, (offset + width) // 4):
                words_per_bank.setdefault(word % 32, set()).add(word)
        phases.append(max(len(words) for words in words_per_bank.values()))
    return phases


def test_wavefronts_count_a_planted_conflict():
    """Negative control: rows 8 apart at a stride of 20 words share banks; 16-byte units of two
    rows 80 bytes apart overlap in banks 0-3; a broadcast and consecutive words do not."""
    assert wavefronts([80 * r for r in range(32)], 4) == [4]
    assert wavefronts([80 * (s // 4) + 16 * (s % 4) for s in range(32)], 16) == [2] * 4
    assert wavefronts([0] * 32, 4) == wavefronts([4 * r for r in range(32)], 4) == [1]


def assert_conflict_free(what: str, offsets: list[int], width: int) -> None:
    assert wavefronts(offsets, width) == [1] * (len(offsets) * width // 128), (what, offsets)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elt", [1, 2])
def test_tile_copies_are_free_of_bank_conflicts(elt, head_dim, block_m):
    """Each warp's 16-byte units of a K and a V stage (load_kv_tile's cp.async slots, and
    dequantize_tile's reads of a 1-byte stage, at the same offsets) fall on distinct banks in
    each quarter warp. Stages start at multiples of 128 bytes (of the bank period)."""
    T = tables(head_dim, elt, block_m)
    assert (T["q_bytes"] % 128, T["stage_bytes"] % 128, T["block_n"] * T["k_row"] % 128) == (0,) * 3
    for first in range(0, len(T["copy"]), 32):
        slots = T["copy"][first : first + 32]
        assert_conflict_free("K copy", [k for _, _, k, _ in slots], 16)
        assert_conflict_free("V copy", [v for _, _, _, v in slots], 16)


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_scale_copies_and_reads_are_free_of_bank_conflicts(head_dim, block_m):
    """Every warp-wide access to the per-token-head scales of a 1-byte stage hits each bank at
    most once (or reads one word, a broadcast): load_scales' copy (thread r copies key row r's
    K scale, then its V scale), scale_key_columns' K reads (lane (g, t) of n-tile j: keys
    8 j + 2t, + 1) and dequantize_tile's V reads (the rows of the warp's copy slots)."""
    T = tables(head_dim, 1, block_m)
    scale = T["scale"]
    for warp in range(T["block_n"] // 32):
        for which in (0, 1):
            rows = range(32 * warp, 32 * warp + 32)
            assert_conflict_free("copy", [scale[r][which] for r in rows], 4)
    for j in range(T["nt"]):
        for column in (0, 1):
            keys = [8 * j + 2 * (lane % 4) + column for lane in range(32)]
            assert_conflict_free("K read", [scale[key][0] for key in keys], 4)
    for first in range(0, len(T["copy"]), 32):
        rows = [r for r, *_ in T["copy"][first : first + 32]]
        assert_conflict_free("V read", [scale[r][1] for r in rows], 4)


def test_plan_picks_the_128_row_tile_past_64_rows_of_an_fp8_cache():
    """block_m_for: 128 rows for R > 64 on 1-byte caches (e4m3, e5m2, int8) at head_dim 128,
    else 64 (16-bit caches, head_dims 64 and 256); the 128-row tile never splits keys and fits
    99 KB of shared memory (sm_89 / sm_120). _C's plan code, built by the SIMT executor."""
    plan_code = simt.loaded()
    codes = extension.DTYPE_CODES
    for head_dim in (64, 128, 256):
        for dtype, code in codes.items():
            fp8 = dtype.itemsize == 1
            for rows in (1, 32, 64, 65, 128, 129, 4096):
                wide = rows > 64 and fp8 and head_dim == 128
                assert plan_code.block_m_for(head_dim, code, rows) == (128 if wide else 64)
            if fp8 and head_dim == 128:
                T = tables(head_dim, 1, 128)
                assert T["max_key_groups"] == 1 and T["smem"] <= 99 * 1024
                assert all(host().key_groups(head_dim, 1, r, 128) == 1 for r in (1, 16, 33, 128))


def merge_formula(o: np.ndarray, lse: np.ndarray, sink: float) -> np.ndarray:
    """The split merge in float64, independently: sum_s 2^lse_s O_s / (sum_s 2^lse_s + 2^sink)
    over the splits that saw a key (lse > -inf), 0 when nothing was seen."""
    seen = lse > -np.inf
    top = max([*lse[seen], sink])
    if top == -np.inf:
        return np.zeros(o.shape[1])
    w = np.exp2(lse[seen] - top)
    return (w[:, None] * o[seen]).sum(0) / (w.sum() + np.exp2(sink - top))


def test_merge_row_matches_the_formula_on_random_partials():
    """merge.cu's arithmetic (merge_row.h, compiled for the CPU) on random partials of 1..6
    splits, some empty (lse -inf, partial NaN: never read), with and without a sink."""
    rng = np.random.default_rng(8)
    for trial in range(200):
        splits = int(rng.integers(1, 7))
        o = rng.standard_normal((splits, 16)).astype(np.float32)
        lse = (rng.standard_normal(splits) * 8).astype(np.float32)
        empty = rng.random(splits) < 0.3
        lse[empty], o[empty] = -np.inf, np.nan
        sink = float(rng.standard_normal() * 8) if trial % 2 else -math.inf
        got = np.array(host().merge_row(o.tolist(), lse.tolist(), sink))
        want = merge_formula(o.astype(np.float64), lse.astype(np.float64), sink)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (trial, got, want)


def test_merge_lse_matches_the_formula_on_random_partials():
    """The merged state's LSE (merge_row.h, compiled for the CPU): log2 of the merged
    denominator, the sink inside it once; -inf when no split saw a key; NaN propagates."""
    rng = np.random.default_rng(9)
    for trial in range(200):
        splits = int(rng.integers(1, 7))
        lse = (rng.standard_normal(splits) * 40).astype(np.float32)
        lse[rng.random(splits) < 0.3] = -np.inf
        sink = float(rng.standard_normal() * 40) if trial % 2 else -math.inf
        terms = np.append(lse.astype(np.float64), sink)
        top = terms.max()
        want = -math.inf if top == -math.inf else top + np.log2(np.exp2(terms - top).sum())
        got = host().merge_lse(lse.tolist(), sink)
        assert got == want if want == -math.inf else abs(got - want) < 1e-4, (trial, got, want)
    assert host().merge_lse([-math.inf, -math.inf], -math.inf) == -math.inf
    assert host().merge_lse([-math.inf], 3.0) == pytest.approx(3.0)
    assert math.isnan(host().merge_lse([2.0, math.nan], -math.inf))


def test_merge_row_adds_the_sink_once_without_overflow():
    """A sink of 500 (natural log) dwarfs a row's LSE of 200 without overflowing; a sink counts
    once however many splits there are; a row no split saw merges to zeros; NaN propagates."""
    hk = host()
    o = [[1.0, -2.0], [4.0, 0.5]]
    got = hk.merge_row(o, [1.0, 3.0], 0.7 * LOG2E)
    w, sink = np.array([2.0, 8.0]), math.exp(0.7)
    assert np.allclose(got, (w[:, None] * np.array(o)).sum(0) / (w.sum() + sink), rtol=1e-6)
    scale = 2.0 ** (200.0 - 500.0 * LOG2E)  # vs the sink's weight 1
    tiny = hk.merge_row([[3.0, 1.0], [math.nan, math.nan]], [200.0, -math.inf], 500.0 * LOG2E)
    assert np.all(np.isfinite(tiny)) and np.allclose(tiny, np.array([3.0, 1.0]) * scale)
    assert hk.merge_row([[math.nan], [math.inf]], [-math.inf, -math.inf], -math.inf) == [0.0]
    # A NaN partial (a NaN in the cache) is no empty split: it reaches the output.
    assert np.isnan(hk.merge_row([[1.0], [math.nan]], [2.0, math.nan], -math.inf)).all()
    assert np.isnan(hk.merge_row([[1.0], [math.nan]], [2.0, 1.0], -math.inf)).all()


WINDOWS = [(-1, -1), (0, 0), (3, 2), (40, 17), (-1, 0), (70, -1), (-1, 5), (1000, 1000),
           (2**31 - 1, 2**31 - 1)]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window_maps_follow_the_masking_rule(window, causal):
    """index_maps.h on the CPU: row_keys is masking.visible_range (any int window, no overflow),
    key_visible its per-key test, cta_keys the union of its rows' ranges, and tile_needs_mask
    exact (false only for tiles every row of the CTA sees whole)."""
    hk = host()
    for kv_len, q_len, group, block_n in ((70, 3, 3, 64), (130, 130, 1, 64), (200, 17, 2, 32)):
        start, end = visible_range(torch.arange(q_len), q_len, kv_len, causal, window)
        ranges = [(int(start[r // group]), int(end[r // group]) - 1) for r in range(q_len * group)]
        got = [hk.row_keys(*window, causal, kv_len, q_len, r, group) for r in range(len(ranges))]
        assert got == ranges
        for r in range(0, len(ranges), 5):
            visible = [hk.key_visible(got[r], key) for key in range(-2, kv_len + 2)]
            assert visible == [ranges[r][0] <= key <= ranges[r][1] for key in range(-2, kv_len + 2)]
        for row0 in range(0, len(ranges), 7):
            rows = ranges[row0 : row0 + 11]
            keys = hk.cta_keys(*window, causal, kv_len, q_len, row0, row0 + len(rows) - 1,
                               group, block_n)  # fmt: skip
            assert keys[:2] == (min(lo for lo, _ in rows), max(hi for _, hi in rows) + 1)
            for n0 in range(0, kv_len + block_n, block_n):
                whole = all(lo <= n0 and n0 + block_n - 1 <= hi for lo, hi in rows)
                assert hk.tile_needs_mask(keys, n0) == (not whole), (row0, n0)


def test_splits_partition_the_windowed_tile_range():
    """Split-KV splits the tiles the window touches, [first, end), in order, each tile once."""
    hk = host()
    for tiles in ((0, 5), (3, 4), (7, 40), (2, 2), (1998, 2003)):
        for num_splits in range(1, 9):
            parts = [hk.split_tiles(tiles, num_splits, s) for s in range(num_splits)]
            assert [t for b, e in parts for t in range(b, e)] == list(range(*tiles))
    keys = hk.cta_keys(4095, 4095, False, 131072, 8, 0, 31, 4, 64)
    assert hk.cta_tiles(keys, 64) == (1983, 2048)  # 65 of 2048 tiles: the window's


def strided(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of 1-D ``t`` (as ``dtype``) in a view with stride 3 into a larger buffer whose
    other elements are garbage, like vLLM's slices of persistent buffers."""
    dtype = dtype or t.dtype
    buffer = torch.full((t.numel(), 3), 7, dtype=dtype)
    buffer[:, 0] = t.to(dtype)
    return buffer[:, 0]


def test_index_tensor_readers_follow_strides_and_flag_width():
    """The kernels' readers on host tensors: int32 flags of any nonzero value are causal, bool
    flags are read as bytes, and a stride skips the garbage between elements."""
    cu = strided(torch.tensor([0, 3, 3, 9], dtype=torch.int32))
    lens = strided(torch.tensor([5, 4, 12], dtype=torch.int32))
    for flags in (strided(torch.tensor([-2, 0, 1], dtype=torch.int32)),
                  strided(torch.tensor([True, False, True]), torch.bool)):  # fmt: skip
        seqs, padding_start = host().sequences(
            cu.data_ptr(), cu.stride(0), lens.data_ptr(), lens.stride(0), flags.data_ptr(),
            flags.element_size(), flags.stride(0), False, 3,
        )  # fmt: skip
        assert seqs == [(0, 3, 5, True), (3, 0, 4, False), (3, 6, 12, True)]
        assert padding_start == 9
    seqs, _ = host().sequences(
        cu.data_ptr(), cu.stride(0), lens.data_ptr(), lens.stride(0), 0, 1, 0, True, 3
    )
    assert [s[3] for s in seqs] == [True, True, True]


CACHE_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.bfloat16: 0, torch.float16: 1}


def spec_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """SPEC section 4's store-side conversion, independently: divide in fp32, saturate to the
    format's finite max (16-bit formats too), round to nearest even (torch's own casts)."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


@pytest.mark.parametrize("dtype", list(CACHE_CODES), ids=str)
def test_cache_write_quantisation_is_bit_exact(dtype):
    """csrc/cache/quantize.h (the cache-write kernel's conversion, compiled for the CPU) gives
    the bytes of fp8_noncausal_attn.scales.quantize and of the spec's rule, over the whole range:
    subnormals, ties, values past the format's max (saturated, never inf)."""
    from fp8_noncausal_attn.scales import quantize

    gen = torch.Generator().manual_seed(int(CACHE_CODES[dtype]))
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    magnitudes = torch.cat([
        torch.rand(2000, generator=gen) * 4,
        torch.exp2(torch.rand(2000, generator=gen) * 40 - 20),
        torch.rand(500, generator=gen) * tiny * 2,  # the subnormal range
        torch.tensor([fmax, fmax * 1.01, fmax * 4, 3e38, 0.0]),
    ])  # fmt: skip
    signs = torch.where(torch.rand(magnitudes.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (magnitudes * signs).to(torch.bfloat16).float()  # what a bf16 key row holds
    x = x[torch.isfinite(x)]
    storage = torch.uint8 if dtype.itemsize == 1 else torch.int16
    for scale in (1.0, 0.37, 3.5e-3):
        codes = host().quantize(x.tolist(), scale, CACHE_CODES[dtype])
        got = torch.tensor(codes, dtype=torch.int64)
        expected = spec_quantize(x, scale, dtype).view(storage).to(torch.int64)
        expected &= 0xFF if dtype.itemsize == 1 else 0xFFFF
        assert torch.equal(got, expected), (scale, (got != expected).sum())
        in_range = (x.abs() / scale) <= fmax
        library = quantize(x[in_range][:, None, None], torch.tensor([scale]), dtype)
        lib = library.flatten().view(storage).to(torch.int64)
        lib &= 0xFF if dtype.itemsize == 1 else 0xFFFF
        assert torch.equal(got[in_range], lib)
    decoded = torch.tensor(codes, dtype=torch.int64).to(storage).view(dtype).float()
    assert torch.isfinite(decoded).all()  # saturated, never inf


def test_cache_write_quantisation_keeps_nan():
    for code, dtype in ((2, torch.float8_e4m3fn), (3, torch.float8_e5m2), (0, torch.bfloat16),
                        (1, torch.float16)):  # fmt: skip
        (bits,) = host().quantize([math.nan], 1.0, code)
        storage = torch.uint8 if dtype.itemsize == 1 else torch.int16
        assert torch.tensor([bits]).to(storage).view(dtype).float().isnan().all()
