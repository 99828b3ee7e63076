"""Index maps every DSL attention family shares (SPEC section 3), as plain integer arithmetic.

Each function runs unchanged on Python ints (the CPU emulations in tests/) and on the DSL's traced
``cutlass.Int32`` / ``Int64`` values inside a kernel, so an emulation replays the kernel's own maps,
not a copy. Functions that need ``min`` or a select take it as an argument (``builtins.min`` on the
host, ``cutlass.min`` in a kernel), because Python's own would branch on a traced value.

Vocabulary: the R = q_len x group query rows of one (sequence, KV head) are numbered
r = token * group + head-in-group; key j of a sequence lives in page ``block_table[seq, j //
page_size]`` at slot ``j % page_size``; a split owns a contiguous range of key tiles.
"""


def ceil_div(a, b):
    """ceil(a / b) for non-negative a and positive b."""
    return (a + b - 1) // b


def index_offset(i, stride):
    """Element offset of entry ``i`` of a strided index vector (cu_seqlens_q, seq_lens, the
    causal flags, a block-table row): index tensors are read where they lie, through their
    strides (vLLM passes slices of persistent buffers it rewrites between graph replays)."""
    return i * stride


def rows_per_kv_head(q_len, group):
    """R: query rows of one sequence that share a KV head."""
    return q_len * group


def row_token(r, group):
    """Query token (0-based within the sequence) of row r."""
    return r // group


def row_head(r, group, kv_head):
    """Query head of row r under KV head ``kv_head``."""
    return kv_head * group + r % group


def split_tiles(kv_len, num_splits, split, key_tile, minimum):
    """(first key tile, end key tile) of split ``split``: contiguous, ceil-sized ranges.

    A split whose first tile is past the last one gets an empty range (first == end); its CTA
    writes an empty softmax state (O = 0, LSE = -inf) for the merge.
    """
    n_tiles = ceil_div(kv_len, key_tile)
    per_split = ceil_div(n_tiles, num_splits)
    first = minimum(split * per_split, n_tiles)
    end = minimum(first + per_split, n_tiles)
    return first, end


def page_slot(j, page_size):
    """(block-table column, slot in the page) of key j; page_size is a power of two."""
    return j // page_size, j % page_size


def page_slot_of(j, block_shift):
    """(block-table column, slot in the page) of key j for pages of ``2^block_shift`` keys: a
    run-time page size, so shifts and a mask, no division."""
    return j >> block_shift, j & ((1 << block_shift) - 1)


def page_count(kv_len, block_shift):
    """Block-table columns that hold keys 0..kv_len - 1 (pages of ``2^block_shift`` keys)."""
    return (kv_len + (1 << block_shift) - 1) >> block_shift


def key_offset(page, slot, kv_head, stride_block, stride_slot, stride_head):
    """Element offset of key (page, slot) of ``kv_head`` in a cache with the given strides."""
    return page * stride_block + slot * stride_slot + kv_head * stride_head


def query_position(token, q_len, kv_len):
    """Absolute position of query token ``token``: keys 0..position are causal-visible."""
    return kv_len - q_len + token


def last_visible_key(token, q_len, kv_len, causal, select):
    """The last key a query token sees: its position when causal (nonzero), else kv_len - 1."""
    return select(causal != 0, query_position(token, q_len, kv_len), kv_len - 1)


# Sliding window (SPEC section 3, fp8_noncausal_attn.masking.visible_range): (left, right), -1 =
# unbounded. A CTA's key tiles run from its first row's first key to its last row's last
# (window_first_key, window_last_key, window_tiles); per row, the mask compares offsets from the
# row's position with the CTA-wide (before, after) of window_offsets, so a thread keeps one
# value per row. The window is compared before it is added (INT32_MAX never wraps).


def window_first_key(token, q_len, kv_len, left, select, maximum):
    """The first key a query token sees: ``max(position - left, 0)``, 0 when left is -1."""
    return select(left >= 0, maximum(query_position(token, q_len, kv_len) - left, 0), 0)


def window_last_key(token, q_len, kv_len, causal, right, select):
    """The last key a query token sees: last_visible_key, capped at ``position + right`` when
    right >= 0 (and below the cap: causal caps right at 0)."""
    last = last_visible_key(token, q_len, kv_len, causal, select)
    position = query_position(token, q_len, kv_len)
    return select((right >= 0) & (last - position > right), position + right, last)


INT32_MAX = 2**31 - 1


def window_offsets(left, right, causal, select, minimum):
    """(before, after): a row at position p sees keys p - before <= j <= p + after (and
    j < kv_len): -1 (unbounded) becomes INT32_MAX, causal caps ``after`` at 0. Both are the same
    for a whole CTA (uniform registers in a kernel); only p is per row."""
    before = select(left >= 0, left, INT32_MAX)
    after = select(right >= 0, right, INT32_MAX)
    return before, select(causal != 0, minimum(after, 0), after)


def key_in_window(j, kv_len, position, before, after):
    """Mask predicate: key j is seen by the row at ``position`` (compared as offsets from it:
    keys and positions are in [0, 2^31), so neither difference overflows)."""
    return (j < kv_len) & (j - position <= after) & (position - j <= before)


def window_tile_needs_mask(key0, key_end, kv_len, first_position, last_position, before, after):
    """Some key of the tile [key0, key_end) is hidden from one of the rows at positions
    first_position..last_position: past kv_len, past the first row's last key, or before the
    last row's first key. The negation of key_in_window for the tile's corner keys."""
    return (
        (key_end > kv_len)
        | (key_end - 1 - first_position > after)
        | (last_position - key0 > before)
    )


def window_tiles(first_key, last_key, key_tile):
    """[begin, end) key tiles that hold keys first_key..last_key: the tiles a CTA whose rows'
    windows span those keys loads (tiles wholly outside are never read)."""
    return first_key // key_tile, ceil_div(last_key + 1, key_tile)


def key_loaded(j, first_key, kv_len):
    """Whether a CTA copies key j: ``first_key <= j < kv_len`` (first_key: its first row's
    window_first_key). Its first tile starts at first_key rounded down to the tile, and the slots
    before first_key (like those past kv_len) may hold anything, NaN included (SPEC section 5:
    vLLM points pages wholly before a window at its null block): P is 0 there, but 0 x NaN in
    P V is NaN, so those rows are zero-filled or skipped, never read."""
    return (j >= first_key) & (j < kv_len)


def tile_wholly_loaded(key0, key_end, first_key, kv_len):
    """Every key of the tile [key0, key_end) is key_loaded: its copy needs no per-row check."""
    return key_loaded(key0, first_key, kv_len) & key_loaded(key_end - 1, first_key, kv_len)


def split_tile_range(begin, end, num_splits, split, minimum):
    """(first, end) key tiles of split ``split`` of the tile range [begin, end): contiguous,
    ceil-sized; a split past the range gets an empty one (first == end)."""
    per_split = ceil_div(end - begin, num_splits)
    first = minimum(begin + split * per_split, end)
    return first, minimum(first + per_split, end)
