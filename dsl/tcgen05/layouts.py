"""Index maps of the tcgen05 family, shared by the DSL kernel and its CPU emulation.

Every function here is plain arithmetic on integers (and ``&`` / ``|`` on predicates), so it runs
unchanged on Python ints (the emulation in tests/test_tcgen05_emulation.py) and on the DSL's
traced ``cutlass.Int32`` / ``Int64`` values inside the kernel (dsl/tcgen05/kernel.py): the test
replays the kernel's own maps, not a copy. Functions that need ``min`` take it as an argument
(``builtins.min`` on the host, ``cutlass.min`` in the kernel), because Python's ``min`` would
branch on a traced value.

Vocabulary (swap-AB, SPEC section 3):
 * row r of a CTA's query tile (the MMA's N index) = query token ``r // group`` of the sequence
   and query head ``kv_head * group + r % group``: the R = q_len x group rows of one KV head;
 * key j of the sequence lives in page ``block_table[seq, j >> block_shift]`` at slot
   ``j & (2^block_shift - 1)``; a key tile is ``KEY_TILE`` consecutive keys (the MMA's M index);
 * a CTA's split owns a contiguous range of key tiles.

The family-independent maps (rows, pages, positions, bf16 row scaling) are in dsl/common/
indexing.py and precision.py.
"""

import math

from dsl.common import indexing as X

KEY_TILE = 128  # keys per tile: the UMMA M of S^T = K Q^T (one TMEM lane per key)
ITEM_BYTES = 128  # bytes of one key row inside a staged FP8 item (128 head dims)
SWIZZLE_ROWS = 8  # 128-byte swizzle: 16-byte chunk c of row j is stored at chunk c ^ (j % 8)
CHUNK = 16  # bytes per cp.async copy


def item_count(iters, d_tiles):
    """Staged items of a split: one K and one V item per 128-wide head-dim slice per key tile."""
    return 2 * iters * d_tiles


def item_of(i, iters, d_tiles, select):
    """(is_v, key tile within the split, head-dim slice) of staged item i.

    Order K0, K1, V0, K2, V1, ..., K(n-1), V(n-2), V(n-1) (each block ``d_tiles`` items): the K
    items of tile s + 1 come before the V items of tile s, so BMM1 of the next tile can run while
    the softmax warps work on this one. Both MMA warps consume the converted items in this order.
    """
    block = i // d_tiles
    last = 2 * iters - 1
    is_v = ((block % 2 == 0) & (block > 0)) | (block == last)
    tile = select(block == last, iters - 1, select(is_v, block // 2 - 1, (block + 1) // 2))
    return is_v, tile, i % d_tiles


ROWS_PER_STEP = 128 * CHUNK // ITEM_BYTES  # key rows one copy step of the warpgroup covers
LOADER_STEPS = KEY_TILE // ROWS_PER_STEP  # cp.async copies per thread per item


def loader_row(thread, step):
    """Key row (0..127 inside the tile) that converter thread ``thread`` copies at ``step``.

    128 threads copy 128 rows x 8 chunks: 8 consecutive threads cover one 128-byte row (one
    coalesced 128-byte segment), 16 rows per step, 8 steps. A thread's rows are 16 apart, so
    ``row % SWIZZLE_ROWS`` is the same at every step.
    """
    return thread // (ITEM_BYTES // CHUNK) + step * ROWS_PER_STEP


def loader_chunk(thread):
    """Source 16-byte chunk (0..7) of its row that converter thread ``thread`` copies.

    The thread owns *destination* chunk ``thread % 8`` of its rows, which holds source chunk
    ``(thread % 8) ^ (row % 8)`` (the swizzle is an involution), so its ring offsets are one
    affine map (``loader_ring_offset``) and the swizzle costs nothing per copy.
    """
    return (thread % (ITEM_BYTES // CHUNK)) ^ (loader_row(thread, 0) % SWIZZLE_ROWS)


def item_dims(head_dim):
    """Head dims (= FP8 bytes) of a key row that one staged item holds: 128 (head_dim 128 and
    each 128-wide slice of 256), or all of a 64-dim row (the other half of the item's 128-byte
    row is never copied and stays 0)."""
    return min(head_dim, ITEM_BYTES)


def loader_predicate(thread, step, key0, first_key, kv_len, head_dim, checked):
    """Whether converter thread ``thread`` issues its copy at ``step`` of a tile starting at key
    ``key0``, or None where every copy goes (the kernel then emits no predicate).

    ``checked`` (a tile not wholly inside [first_key, kv_len): the sequence's last, a window's
    first): rows outside it are skipped (indexing.key_loaded). Head_dim 64: a key
    row is 64 bytes, source chunks 0..3; a thread whose source chunk (``loader_chunk``, the same
    at every step) is 4..7 never copies (one per-thread predicate), so bytes 64..127 past a
    key's head dims (the next head's) are never read and their ring chunks keep the zeros the
    ring starts with.
    """
    keep = None
    if checked:
        keep = X.key_loaded(key0 + loader_row(thread, step), first_key, kv_len)
    if item_dims(head_dim) < ITEM_BYTES:
        inside = loader_chunk(thread) < item_dims(head_dim) // CHUNK
        keep = inside if keep is None else keep & inside
    return keep


def loader_ring_offset(thread, step):
    """Byte offset in a staged item where thread ``thread``'s copy at ``step`` lands:
    ``staged_offset(loader_row(thread, step), loader_chunk(thread))`` as the kernel computes
    it, a per-thread base plus an immediate per step (test_tcgen05_host checks they agree)."""
    return thread * CHUNK + step * ROWS_PER_STEP * ITEM_BYTES


# Pages: the block table is read once per page and item, not per row. The page size is a
# run-time argument, ``block_shift`` = log2(page size), 4..8 (16..256 keys). A key tile starts on
# a page boundary (page size <= KEY_TILE) or lies inside one page (page size > KEY_TILE; both are
# powers of two, page size >= ROWS_PER_STEP), so a step's 16 rows share one page:
# ``tile_page_slot`` gives the block-table column and slot of the tile's first key and
# ``loader_step_page_slot`` what a step adds; a thread's own row adds ``loader_row(thread, 0)``
# slots (< 16, never a page). The kernel's copies run one specialisation per page shift
# (``BLOCK_SHIFTS``, chosen once per item by a uniform branch), so these are plain ints there.
KEY_TILE_SHIFT = 7  # log2(KEY_TILE)


def pages_per_tile(block_shift):
    """Pages one key tile spans: ceil(KEY_TILE / page size) (both powers of two: at least 1)."""
    return ((KEY_TILE - 1) >> block_shift) + 1


def tile_page_slot(key0, block_shift):
    """(block-table column, slot) of the key tile starting at key ``key0`` (a multiple of
    KEY_TILE): the slot is 0 unless a page holds several tiles (a plain 0 the kernel folds where
    the shift is a compile-time int)."""
    col, slot = X.page_slot_of(key0, block_shift)
    return col, (0 if isinstance(block_shift, int) and block_shift <= KEY_TILE_SHIFT else slot)


def loader_step_page_slot(step, block_shift):
    """(pages past the tile's first, slots past its first key's) of the 16 rows of ``step``."""
    return X.page_slot_of(step * ROWS_PER_STEP, block_shift)


def lane_page(lane, block_shift):
    """Which of the tile's pages lane ``lane`` of every converter warp reads from the block
    table (one read per lane per item); a step takes its page from lane
    ``loader_step_page_slot(step)[0]`` by a shuffle."""
    return lane & (pages_per_tile(block_shift) - 1)


UMMA_K = 16  # fp16 elements (head dims) of one tcgen05.mma k-step


def bmm1_k_blocks(head_dim):
    """BMM1 k-steps per K item: those covering the item's head dims (4 of 8 at head_dim 64: Q's
    B operand holds no head dim 64..127 and is never written there)."""
    return item_dims(head_dim) // UMMA_K


def staged_offset(row, chunk):
    """Byte offset of (key row, 16-byte chunk) in a staged FP8 item.

    The item is the 128-key x 128-byte tile in the UMMA's 128-byte-swizzled layout, read by
    ldmatrix as K (K-major A operand) and as V (MN-major A operand, transposed on the read).
    ``test_tcgen05_host`` checks this against the DSL's own ``make_smem_layout_a``.
    """
    return row * ITEM_BYTES + ((chunk ^ (row % SWIZZLE_ROWS)) * CHUNK)


# FP8 -> fp16 on the integer pipe, for a share of each item (traits.INTEGER_CONVERTED_WORDS): the
# conversion pipe (F2FP, 16 results / clk / SM) would otherwise bound the converter. e4m3 byte
# S EEEE MMM placed as S | N | EEEEMMM << 7 in a 16-bit lane, N = 1 for the e4m3fn NaN bytes
# (magnitude 0x7f) and 0 otherwise, is the fp16 of its value x 2^-8 for every other byte (normal
# and subnormal) and an fp16 NaN (exponent 11111, mantissa 1110000000) for 0x7f / 0xff, as the
# hardware conversion gives. Per word: each byte's inverted magnitude with bit 7 set, minus 1,
# keeps bit 7 unless the magnitude is 0x7f (never borrowing from the next byte); that bit,
# inverted, replaces the sign bit (one LOP3, one IADD, one LOP3 bit-select). PRMT then puts each
# marked byte in the low half of its lane with its sign (replicated, from the raw word) above
# it, a shift by 7 moves it in place and the mask keeps bits 15-7. The kernel then multiplies
# by 2^8 (HFMA2, exact; NaN stays NaN).
E4M3_MAGNITUDES = 0x7F7F7F7F
E4M3_SIGNS = 0x80808080
E4M3_NAN_BORROW = 0x01010101  # clears bit 7 of a byte exactly when its magnitude is 0x7f
E4M3_LANES_LO = 0xD1C0  # PRMT(marked, raw): lanes (byte 0, byte 1), raw byte's sign above each
E4M3_LANES_HI = 0xF3E2  # lanes (byte 2, byte 3)
E4M3_SHIFT = 7
E4M3_MASK = 0xFF80FF80  # per lane: sign (bit 15), NaN mark (bit 14), EEEEMMM (bits 13-7)


def e4m3x4_to_f16x2_scaled(word, prmt, bitselect):
    """(fp16x2 bits of bytes 0-1, of bytes 2-3) of a 32-bit word of four e4m3 bytes, each value
    times 2^-8 (NaN bytes give an fp16 NaN of their sign). ``prmt(a, b, selector)`` is PTX
    ``prmt.b32`` (the kernel's cute.arch.prmt, a Python replica in the tests);
    ``bitselect(mask, a, b)`` is ``(a & mask) | (b & ~mask)`` for a 32-bit constant mask (one
    LOP3 in the kernel, which ptxas would otherwise split in two here)."""
    not_nan = (~word | E4M3_SIGNS) - E4M3_NAN_BORROW  # bit 7 of a byte: not a NaN byte
    marked = bitselect(E4M3_MAGNITUDES, word, ~not_nan)
    lo = (prmt(marked, word, E4M3_LANES_LO) << E4M3_SHIFT) & E4M3_MASK
    hi = (prmt(marked, word, E4M3_LANES_HI) << E4M3_SHIFT) & E4M3_MASK
    return lo, hi


# e5m2 is the high byte of an IEEE fp16 (1 sign, 5 exponent, 2 mantissa bits, the same bias): a
# byte moved into the high half of a 16-bit lane is its exact fp16, subnormals, Inf and NaN
# included. One PRMT per pair and no conversion-pipe instruction (as csrc/mma_sync/fp8_bits.h).
E5M2_LANES_LO = 0x1404  # PRMT(raw, 0): lanes (byte 0 << 8, byte 1 << 8)
E5M2_LANES_HI = 0x3424  # lanes (byte 2 << 8, byte 3 << 8)


def e5m2x4_to_f16x2(word, prmt):
    """(fp16x2 bits of bytes 0-1, of bytes 2-3) of a 32-bit word of four e5m2 bytes, exact."""
    return prmt(word, 0, E5M2_LANES_LO), prmt(word, 0, E5M2_LANES_HI)


# Lazy rescale (after FA4): past a CTA's first key tile, an unmasked tile keeps the columns'
# reference maxima (no exact column maxima, no O rescale) unless some score's exp2 argument
# against them exceeds LAZY_RESCALE_LOG2: then the tile takes the exact path. P stays <= 2^8, which
# fp16 P, the fp32 column sums and O hold exactly as well as P <= 1; O / l is the same whatever
# reference both were accumulated against.
LAZY_RESCALE_LOG2 = 8.0


def rescale_needed(max_exponent):
    """The largest exp2 argument of a tile's scores against the reference maxima (log2 units)
    asks for new maxima."""
    return max_exponent > LAZY_RESCALE_LOG2


# A column (query row) that has seen no visible key yet has the running maximum -inf; its first
# visible key may come on any tile (a window or causal mask empties its first tiles) and its
# scores x scale may lie anywhere in float32 (extreme but valid k_scale: -300, -1e6 in log2
# units). So its exp2 offset is +inf, never a stand-in maximum such as 0: the lazy check of an
# unmasked tile then always finds it grown (the first visible key takes the exact path; on masked
# tiles its P is masked to 0), and the old side of its correction is -FLT_MAX, not 0: the
# correction exp2((old - new reference) x scale) is then 0 (or 1 at a scale flushed to 0), finite
# either way, where exp2(0 - new x scale) overflowed to inf and 0 x inf made NaN in its (still
# zero) sums and O. Same instruction count as a 0 reference (one compare and select each).
NO_KEY_OLD_REFERENCE = -3.4028234663852886e38  # -FLT_MAX


def exp2_offset(m, scale, select):
    """Column's exp2 offset (P = exp2(S x scale + offset)): -m x scale, +inf while the column
    has seen no key (m = -inf); ``select(cond, a, b)``."""
    return select(m == -math.inf, math.inf, -(m * scale))


def correction_old_reference(m, select):
    """The old side of a column's correction exp2((old - new reference) x scale): its running
    maximum, -FLT_MAX while it has seen no key (m = -inf)."""
    return select(m == -math.inf, NO_KEY_OLD_REFERENCE, m)


# The softmax threads' view of S: each 32-column chunk of S^T (128 keys x 32 query rows) is read
# from TMEM with tcgen05.ld.16x256b.x4, twice per warp (the warp's TMEM lanes 0-15, then 16-31).
# PTX ISA (tcgen05 matrix fragments, shape 16x256b): register r (0..15) of lane l holds TMEM lane
# l // 4 + 8 ((r // 2) % 2) of the 16, column r % 2 + 2 (l % 4) + 8 (r // 4). So a thread holds 4
# keys x 8 columns of a chunk: the column pairs 2 (l % 4) + 8 j, j = 0..3, adjacent pairs in
# adjacent registers (one FFMA2 / F2FP / FADD2 each). Its column sums need no shuffle per tile: it
# adds its 4 keys into 8 running partial sums per chunk; the 8 lanes that share l % 4 and the 4
# warps add theirs once, in the epilogue. test_tcgen05_host checks score_key_column against the
# DSL's own partition of the copy; the emulation replays the sums through these maps.
COLUMN_CHUNK = 32  # columns (query rows) of S / P the softmax handles at once
SCORE_REGISTERS = 32  # fp32 registers of one chunk per softmax thread: 4 keys x 8 columns
THREAD_COLUMNS = 8  # columns of a chunk one thread holds (its partial sums per chunk)
# Lane strides between the lanes that hold the same columns (lane bits 2..4): the epilogue's
# butterfly over them, and the exact column maxima's.
COLUMN_LANE_STRIDES = (4, 8, 16)


def thread_column(lane, i):
    """Column (within its 32-column chunk) of entry ``i`` (0..7) of a thread's columns: pairs of
    adjacent columns, 8 apart (the 16x256b fragment)."""
    return 8 * (i // 2) + 2 * (lane % 4) + i % 2


def score_entry(reg):
    """Which of its 8 columns (``thread_column``) register ``reg`` (0..31) of a chunk holds."""
    r = reg % 16
    return 2 * (r // 4) + r % 2


def score_key_column(thread, reg):
    """(key within the 128-key tile, column within the chunk) of register ``reg`` (0..31) of a
    32-column chunk of S held by softmax thread ``thread`` (0..127): registers 0-15 come from the
    warp's TMEM lanes 0-15, 16-31 from lanes 16-31."""
    warp, lane = thread // 32, thread % 32
    half, r = reg // 16, reg % 16
    key = 32 * warp + 16 * half + lane // 4 + 8 * ((r // 2) % 2)
    return key, r % 2 + 2 * (lane % 4) + 8 * (r // 4)


def column_slot(column):
    """Slot of ``column`` in the softmax's per-column shared vectors (score scale, exp2 offsets,
    positions, maxima, sums): the 8 columns a thread holds of a chunk are contiguous, slot
    32 c + 8 (lane % 4) + i for entry i, so a thread reads them with two 16-byte loads. A
    permutation of each chunk (swaps column bits 1-2 with bits 3-4)."""
    chunk, x = column - column % COLUMN_CHUNK, column % COLUMN_CHUNK
    return chunk + 8 * ((x // 2) % 4) + 2 * (x // 8) + x % 2


def thread_slot(lane, chunk):
    """First slot (``column_slot``) of the 8 columns of ``chunk`` that lane ``lane`` holds."""
    return COLUMN_CHUNK * chunk + THREAD_COLUMNS * (lane % 4)


# P (fp16) goes to shared memory as BMM2's B operand: MN-major (a key's columns contiguous),
# swizzle atoms of P_SWIZZLE_BYTES = min(128, 2 rows) bytes x 8 keys (the DSL's
# make_smem_layout_b; test_tcgen05_host checks p_offset on it). The softmax writes it with
# stmatrix.x4 (PTX: register m of lane l holds row l // 4, columns 2 (l % 4) and + 1 of 8x8
# matrix m; lane l addresses row l % 8 of matrix l // 8): per chunk, for each half of the warp's
# keys (16x256b load) and block of 8 keys, the four column blocks of 8 are the four matrices,
# so a lane's registers are exactly its F2FP-packed column pairs (no shuffle).
def p_stage_bytes(rows):
    """Bytes of one P stage: 128 keys x rows fp16."""
    return KEY_TILE * rows * 2


def p_offset(key, column, rows):
    """Byte offset of P[key, column] in one stage of P's shared tile: a key's ``width`` bytes of
    columns per swizzle atom, keys after keys (the 128 keys of one atom column), then the next
    atom column; 16-byte chunk bits 4.. XORed with bits 7.. (the UMMA swizzle, in bytes)."""
    width = min(128, 2 * rows)  # bytes of one key's columns in a swizzle atom
    atom_columns = width // 2
    linear = (column % atom_columns) * 2 + key * width + (column // atom_columns) * KEY_TILE * width
    return linear ^ (((linear >> 7) & (width // 16 - 1)) << 4)


def p_store_register(half, block, matrix):
    """The score register (even; with the next one, packed into one fp16x2 word) that goes to
    register ``matrix`` of stmatrix (``half``, ``block``) of a chunk: keys 16 half + 8 block +
    lane // 4 of the warp, columns 8 matrix + 2 (lane % 4) + 0 / 1 (score_key_column)."""
    return 16 * half + 4 * matrix + 2 * block


def p_store_row(thread, chunk, half, block):
    """(key, first column) of the 8-column row of P whose address softmax thread ``thread``
    gives to stmatrix (``half``, ``block``) of ``chunk``: row lane % 8 of matrix lane // 8."""
    warp, lane = thread // 32, thread % 32
    key = 32 * warp + 16 * half + 8 * block + lane % 8
    return key, COLUMN_CHUNK * chunk + 8 * (lane // 8)


def p_store_base(thread, chunk, rows):
    """The part of thread ``thread``'s stmatrix addresses in ``chunk`` that depends on the
    thread: p_offset of its row for (half, block) = (0, 0) of the chunk that shares ``chunk``'s
    swizzle pattern (chunk % (atom columns / 32)); computed once per thread."""
    same_swizzle = chunk % max(1, min(128, 2 * rows) // 2 // COLUMN_CHUNK)
    return p_offset(*p_store_row(thread, same_swizzle, 0, 0), rows)


def p_store_step(chunk, half, block, rows):
    """What (``chunk``, ``half``, ``block``) adds to p_store_base (a compile-time immediate):
    16 half + 8 block keys move whole swizzle rows (8 keys), and chunks past the first atom
    column whole atom columns, so the swizzle is unchanged (test_tcgen05_host checks
    p_store_base + p_store_step = p_offset(p_store_row) for every thread)."""
    width = min(128, 2 * rows)
    atom_chunks = max(1, width // 2 // COLUMN_CHUNK)
    return (16 * half + 8 * block) * width + (chunk // atom_chunks) * KEY_TILE * width


# The exact path's corrections, exp2 of an argument <= 0 (old minus new reference), on the FMA
# pipe: 2^x = 2^n x p(x - n), n = x rounded to an integer (the float32 magic-number rounding),
# p a degree-6 polynomial fit of 2^f on [-1/2, 1/2] (relative error 2e-8; about 1e-7 with float32
# Horner steps, as accurate as MUFU.EX2's approximation). A correction multiplies a column's sums
# and O alike, so its rounding cancels in O / l. The MUFU pipe is then P's alone, and the static
# SASS model (which follows the path with the most MUFU work per iteration) does not count the
# exact tiles' block on every tile. Arguments below CORRECTION_FLOOR give 2^CORRECTION_FLOOR
# (where MUFU.EX2's flush gave 0): the old part is then at most 2^-100 of the new maximum's term.
CORRECTION_EXP2 = (
    1.0,
    0.6931471824645996,
    0.24022650718688965,
    0.05550327152013779,
    0.00961802527308464,
    0.0013400441966950893,
    0.0001546974090160802,
)
CORRECTION_FLOOR = -125.0
ROUNDING_MAGIC = 12582912.0  # 1.5 x 2^23: x + it rounds x to an integer in the low mantissa bits


def correction_exp2(x, fmax, fma, scale_by_power_of_two):
    """2^x for x <= 0 (a correction) as the kernel computes it. ``fmax(a, b)``, ``fma(a, b, c)``
    (float32 ops), ``scale_by_power_of_two(p, t)``: p x 2^n where n is the integer that
    ``t = x + ROUNDING_MAGIC`` holds in its low mantissa bits (the kernel adds n << 23 to p's
    bits)."""
    x = fmax(x, CORRECTION_FLOOR)
    t = x + ROUNDING_MAGIC
    f = x - (t - ROUNDING_MAGIC)  # in [-1/2, 1/2]
    p = CORRECTION_EXP2[-1]
    for c in CORRECTION_EXP2[-2::-1]:
        p = fma(p, f, c)
    return scale_by_power_of_two(p, t)
