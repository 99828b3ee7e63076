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


def visible_end_tile(first, end, last_key, key_tile, minimum, maximum):
    """End of a split's key tiles [first, end) once the tiles past ``last_key`` (the last key
    any row of the CTA sees) are dropped; never before ``first`` (then the range is empty)."""
    return maximum(first, minimum(end, ceil_div(last_key + 1, key_tile)))


def page_slot(j, page_size):
    """(block-table column, slot in the page) of key j; page_size is a power of two."""
    return j // page_size, j % page_size


def key_offset(page, slot, kv_head, stride_block, stride_slot, stride_head):
    """Element offset of key (page, slot) of ``kv_head`` in a cache with the given strides."""
    return page * stride_block + slot * stride_slot + kv_head * stride_head


def query_position(token, q_len, kv_len):
    """Absolute position of query token ``token``: keys 0..position are causal-visible."""
    return kv_len - q_len + token


def last_visible_key(token, q_len, kv_len, causal, select):
    """The last key a query token sees: its position when causal (nonzero), else kv_len - 1."""
    return select(causal != 0, query_position(token, q_len, kv_len), kv_len - 1)


def key_visible(j, kv_len, last_key):
    """Mask predicate: key j is seen by a query row whose last visible key is ``last_key``."""
    return (j < kv_len) & (j <= last_key)


def tile_needs_mask(key_end, kv_len, last_key):
    """Some key below ``key_end`` is hidden from a row whose last visible key is ``last_key``:
    the negation of key_visible for the tile's last key (keys are visible up to a bound)."""
    return (key_end > kv_len) | (key_end - 1 > last_key)
