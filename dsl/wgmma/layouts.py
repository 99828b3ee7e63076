"""Index maps of the wgmma family, shared by the DSL kernel and its CPU emulation.

Plain integer arithmetic (see dsl/common/indexing.py for the maps every family shares): the kernel
(dsl/wgmma/kernel.py) calls these on traced ``cutlass.Int32`` values, the emulation
(tests/test_wgmma_emulation.py) on Python ints / numpy arrays, so the test replays the kernel's
own maps. tests/test_wgmma_host.py checks the operand and accumulator maps against the layouts
the CUTLASS DSL itself builds for wgmma.

Vocabulary: a CTA holds ``consumers`` x 64 query rows of one KV head (warpgroup w owns rows
64 w .. 64 w + 63, the wgmma M); a key tile is ``key_tile`` consecutive keys (the N of
S = Q K^T and the K of O += P V); a staged item is one key tile of K or of V, dequantised to the
16-bit MMA dtype.
"""

from dsl.common import indexing as X
from dsl.common.variant import BLOCK_SHIFTS

ROWS_PER_WARPGROUP = 64  # the wgmma M: query rows one consumer warpgroup owns
WARPGROUP = 128  # threads per warpgroup
CHUNK = 16  # bytes per vector load / store
SW128_ROW_BYTES = 128  # 128-byte swizzle: 16-byte chunk c of row r is stored at c ^ (r % 8)
SW128_ELEMS = 64  # 16-bit elements per 128-byte swizzle row


def sw128(byte_offset):
    """The 128-byte swizzle (CuTe Swizzle<3,4,3> on byte addresses of a 1024-aligned buffer)."""
    return byte_offset ^ (((byte_offset >> 7) & 7) << 4)


def operand_offset(row, dim, rows):
    """Byte offset of 16-bit element (row, dim) of a [rows x head_dim] wgmma operand tile in the
    K-major 128-byte-swizzled layout: 64-dim column blocks of ``rows`` x 128 bytes.

    The same map serves Q (A operand, rows = 64 query rows), K (B operand K-major, rows = keys)
    and V (B operand MN-major for O += P V: the head dim is the contiguous N), so every staged
    item and the Q tile are written row by row in 16-byte chunks.
    """
    block = dim // SW128_ELEMS
    linear = 2 * (block * rows * SW128_ELEMS + row * SW128_ELEMS + dim % SW128_ELEMS)
    return sw128(linear)


# ---------------------------------------------------------------------------------- producer
def loader_chunks_per_row(head_dim):
    """16-byte FP8 chunks of one key row (head_dim bytes)."""
    return head_dim // CHUNK


def loader_steps(key_tile, head_dim):
    """Chunks each of the 128 producer threads copies per staged item."""
    return key_tile * head_dim // (WARPGROUP * CHUNK)


def loader_row(thread, step, head_dim):
    """Key row (0 .. key_tile - 1) producer thread ``thread`` loads at ``step``: consecutive
    threads cover one row's consecutive chunks (coalesced), 128 / chunks-per-row rows a step."""
    per_row = loader_chunks_per_row(head_dim)
    return thread // per_row + step * (WARPGROUP // per_row)


def loader_chunk(thread, head_dim):
    """16-byte FP8 chunk (head dims 16 c .. 16 c + 15) of its row that ``thread`` loads."""
    return thread % loader_chunks_per_row(head_dim)


def loader_rows_per_step(head_dim):
    """Key rows the producer warpgroup covers per step (a power of two, a multiple of 8)."""
    return WARPGROUP // loader_chunks_per_row(head_dim)


# FP8 staging: each producer thread cp.asyncs its chunks into a staging slot (one key tile: K,
# then V) and later reads back exactly those chunks to convert them, so the slot's layout is
# private to the thread (no barrier between the copy and the read, only cp.async.wait_group).
def staging_offset(thread, step):
    """Byte offset in an FP8 staging item (K or V of one key tile) of the chunk ``thread``
    copies at ``step``: a step's 128 chunks side by side (conflict-free 16-byte accesses)."""
    return (step * WARPGROUP + thread) * CHUNK


def staging_slot(tile, fp8_stages):
    """Staging slot of the CTA's ``tile``-th key tile (0 = its first): a ring of fp8_stages."""
    return tile % fp8_stages


def loader_store_base(thread, half, head_dim, key_tile):
    """Byte offset in a staged item where ``thread`` stores the 8 converted elements ``half``
    (0, 1) of the chunk it loads at step 0 (computed once per producer thread)."""
    dim = loader_chunk(thread, head_dim) * CHUNK + half * (CHUNK // 2)
    return operand_offset(loader_row(thread, 0, head_dim), dim, key_tile)


def loader_store_step(step, head_dim):
    """What step ``step`` adds to that offset: whole 128-byte rows, because a step advances a
    multiple of 8 rows and leaves the swizzle phase (row % 8) alone (a plain int: an
    immediate in the kernel's stores)."""
    return step * loader_rows_per_step(head_dim) * SW128_ROW_BYTES


def loader_store_offset(thread, step, half, head_dim, key_tile):
    """Where the kernel stores half ``half`` of the chunk ``thread`` loads at ``step``: its base
    plus the step's rows, as the kernel adds them."""
    return loader_store_base(thread, half, head_dim, key_tile) + loader_store_step(step, head_dim)


# Pages: the block table is read once per page, not per row. The page size is a run-time
# argument, ``block_shift`` = log2(page size), 4..8 (16..256 keys). A key tile starts on a page
# boundary (page size <= key_tile) or lies inside one page (page size > key_tile; both are
# powers of two), so tile_page_slot gives the block-table column and slot of its first key, and
# the row a thread loads at a step sits ``loader_page_slot`` pages and slots past it.
MIN_BLOCK_SHIFT = BLOCK_SHIFTS[0]  # pages of 16 keys: the smallest the kernel takes


def pages_per_tile(key_tile, block_shift):
    """Pages one key tile spans: ceil(key_tile / page size) (both powers of two: at least 1)."""
    return ((key_tile - 1) >> block_shift) + 1


def tile_page_slot(key0, block_shift):
    """(block-table column, slot) of tile start key0 (a multiple of the key tile): the slot is
    0 unless a page holds several tiles."""
    return X.page_slot_of(key0, block_shift)


def loader_thread_page_slot(thread, head_dim, block_shift):
    """(page past the tile's first, slot past its first key's) of the row ``thread`` loads at
    step 0; computed once per producer thread. Where a step's rows fit the smallest page
    (head_dim >= 128) the page part is a plain 0 the kernel folds."""
    first = loader_row(thread, 0, head_dim)
    if loader_rows_per_step(head_dim) <= 1 << MIN_BLOCK_SHIFT:
        return 0, first  # first < rows per step <= page size
    return X.page_slot_of(first, block_shift)


def loader_step_page_slot(step, head_dim, block_shift):
    """What step ``step`` adds to that (uniform across the warpgroup): the rows a step advances
    and the thread's first row are powers of two below / multiples of the page, so pages and
    slots add without carry."""
    return X.page_slot_of(step * loader_rows_per_step(head_dim), block_shift)


def loader_page_slot(thread, step, head_dim, block_shift):
    """(page past the tile's first, slot past its first key's) of the row ``thread`` loads at
    ``step``: the thread's part plus the step's, as the kernel adds them."""
    thread_page, thread_slot = loader_thread_page_slot(thread, head_dim, block_shift)
    step_page, step_slot = loader_step_page_slot(step, head_dim, block_shift)
    return thread_page + step_page, thread_slot + step_slot


def lane_page(lane, key_tile, block_shift):
    """Which of the tile's pages lane ``lane`` of every producer warp reads from the block table
    (one read per lane per tile); the page of a row comes from lane ``page`` by a shuffle."""
    return lane & (pages_per_tile(key_tile, block_shift) - 1)


# ---------------------------------------------------------------------------------- Q tile
def q_chunks_per_row(head_dim):
    """16-byte chunks (8 elements of the 16-bit query) of one query row."""
    return head_dim * 2 // CHUNK


def q_steps(head_dim):
    """Chunks each consumer thread copies into its warpgroup's Q tile."""
    return ROWS_PER_WARPGROUP * q_chunks_per_row(head_dim) // WARPGROUP


def q_row(thread, step, head_dim):
    """Row (0..63) of the warpgroup's Q tile that consumer thread ``thread`` copies at ``step``."""
    return (step * WARPGROUP + thread) // q_chunks_per_row(head_dim)


def q_chunk(thread, step, head_dim):
    """Chunk (8 head dims) of that row."""
    return (step * WARPGROUP + thread) % q_chunks_per_row(head_dim)


def q_row_shuffles(head_dim):
    """Butterfly offsets that combine the row maximum across the threads holding one Q row in
    one step: q_chunks_per_row (8, 16 or 32) consecutive, aligned threads of one warp."""
    offsets, offset = [], 1
    while offset < q_chunks_per_row(head_dim):
        offsets.append(offset)
        offset *= 2
    return tuple(offsets)


# ---------------------------------------------------------------------------------- accumulator
def acc_row(thread, i):
    """Row (0..63) of the warpgroup's 64 x N fp32 accumulator held in fragment row slot i (0, 1)
    by warpgroup thread ``thread``: warp w owns rows 16 w .. 16 w + 15, a quad of lanes one row."""
    return 16 * (thread // 32) + (thread % 32) // 4 + 8 * i


def acc_col(thread, j):
    """Column of the accumulator in fragment column slot j (0 .. N / 4 - 1) of ``thread``: two
    adjacent columns per 8-column block."""
    return 8 * (j // 2) + 2 * (thread % 4) + j % 2


# Lanes that hold the same accumulator rows differ in these lane bits: row maxima and sums are
# combined with butterfly shuffles at these offsets.
QUAD_SHUFFLES = (1, 2)
