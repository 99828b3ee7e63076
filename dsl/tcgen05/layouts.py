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
 * key j of the sequence lives in page ``block_table[seq, j // page_size]`` at slot
   ``j % page_size``; a key tile is ``KEY_TILE`` consecutive keys (the MMA's M index);
 * a CTA's split owns a contiguous range of key tiles.
"""

KEY_TILE = 128  # keys per tile: the UMMA M of S^T = K Q^T (one TMEM lane per key)
ITEM_BYTES = 128  # bytes of one key row inside a staged FP8 item (128 head dims)
SWIZZLE_ROWS = 8  # 128-byte swizzle: 16-byte chunk c of row j is stored at chunk c ^ (j % 8)
CHUNK = 16  # bytes per cp.async copy


def ceil_div(a, b):
    """ceil(a / b) for non-negative a and positive b."""
    return (a + b - 1) // b


def row_token(r, group):
    """Query token (0-based within the sequence) of tile row r."""
    return r // group


def row_head(r, group, kv_head):
    """Query head of tile row r under KV head ``kv_head``."""
    return kv_head * group + r % group


def rows_per_kv_head(q_len, group):
    """R: query rows of one sequence that share a KV head."""
    return q_len * group


def split_tiles(kv_len, num_splits, split, minimum):
    """(first key tile, end key tile) of split ``split``: contiguous, ceil-sized ranges.

    A split whose first tile is past the last one gets an empty range (first == end), and its
    CTA writes an empty softmax state (O = 0, LSE = -inf) for the merge.
    """
    n_tiles = ceil_div(kv_len, KEY_TILE)
    per_split = ceil_div(n_tiles, num_splits)
    first = minimum(split * per_split, n_tiles)
    end = minimum(first + per_split, n_tiles)
    return first, end


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


def page_slot(j, page_size):
    """(block-table column, slot in the page) of key j; page_size is a power of two (a
    compile-time constant in the kernel, so these are a shift and a mask)."""
    return j // page_size, j % page_size


def key_offset(page, slot, kv_head, stride_block, stride_slot, stride_head):
    """Element offset of key (page, slot) of ``kv_head`` in a cache with the given strides."""
    return page * stride_block + slot * stride_slot + kv_head * stride_head


def loader_row(thread, step):
    """Key row (0..127 inside the tile) that converter thread ``thread`` copies at ``step``.

    128 threads copy 128 rows x 8 chunks: 8 consecutive threads cover one 128-byte row (one
    coalesced 128-byte segment), 16 rows per step, 8 steps.
    """
    return thread // (ITEM_BYTES // CHUNK) + step * (128 * CHUNK // ITEM_BYTES)


def loader_chunk(thread):
    """16-byte chunk (0..7) of its row that converter thread ``thread`` copies."""
    return thread % (ITEM_BYTES // CHUNK)


LOADER_STEPS = KEY_TILE * ITEM_BYTES // (128 * CHUNK)  # cp.async copies per thread per item


def staged_offset(row, chunk):
    """Byte offset of (key row, 16-byte chunk) in a staged FP8 item.

    The item is the 128-key x 128-byte tile in the UMMA's 128-byte-swizzled layout, read by
    ldmatrix as K (K-major A operand) and as V (MN-major A operand, transposed on the read).
    ``test_tcgen05_host`` checks this against the DSL's own ``make_smem_layout_a``.
    """
    return row * ITEM_BYTES + ((chunk ^ (row % SWIZZLE_ROWS)) * CHUNK)


def query_position(token, q_len, kv_len):
    """Absolute position of query token ``token``: keys 0..position are causal-visible."""
    return kv_len - q_len + token


def key_visible(j, kv_len, position, causal):
    """Mask predicate: key j is seen by a query at ``position`` (causal: 0 or 1)."""
    return (j < kv_len) & ((causal == 0) | (j <= position))


# bf16 query -> fp16 operand: each row is multiplied by 2^(Q_TARGET_EXP - e), e the exponent of
# the row's largest |q|, which puts the largest element in [2^15, 2^16); bf16's 8 significant
# bits keep it below 65280 <= 65504 (fp16 max). Every element >= 2^-17 after scaling (fp16
# subnormals hold 8 significant bits down to there) is exact: elements smaller than 2^-32 of
# the row's largest may round, by less than 2^-25 of the scaled unit, far under the fp32 error of
# the 64-256 term dot products. The factor 2^(e - Q_TARGET_EXP) rejoins the softmax scale.
Q_TARGET_EXP = 15


def row_scale_exponent(max_abs_biased_exp):
    """Power of two (as an exponent) applied to a bf16 row, from the biased fp32 exponent of
    its largest |q| (0 for an all-zero row: then the row is kept as is)."""
    return (max_abs_biased_exp != 0) * (Q_TARGET_EXP - (max_abs_biased_exp - 127))
