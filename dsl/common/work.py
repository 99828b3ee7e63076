"""One CTA's share of a launch (FlashAttention-4's SeqlenInfo and BlockInfo in one): which
sequence, split, KV head and query rows it runs and the key tiles it streams. Both families'
kernels make it once per CTA (:func:`cta_work`) and hand it to their warp roles with the launch
values (dsl/common/launch.py KERNEL_ARGS)."""

from collections import namedtuple

import cutlass

from dsl.common import indexing as X
from dsl.common.kernel_reads import read_causal_flag, read_index

CtaWork = namedtuple(
    "CtaWork",
    [
        "seq",  # the sequence
        "split",  # the split-KV partial (0 when unsplit)
        "kv_head",
        "group",  # query heads per KV head
        "q_start",  # the sequence's first query token
        "q_len",
        "kv_len",
        "num_rows",  # q_len x group: the sequence's query rows of one KV head
        "row_base",  # the CTA's first row
        "last_row",  # the CTA's last row that exists
        "first_key",  # the first key its first row sees: keys before it are never read
        "first_tile",  # the first key tile the CTA streams
        "iters",  # key tiles it streams
        "causal",  # the sequence's causal flag
    ],
)


def cta_work(args, row_tile, kv_head, seq, split, rows: int, key_tile: int) -> CtaWork:
    """The CTA of block (``row_tile``, ``kv_head``, sequence ``seq`` x split ``split``) with
    ``rows`` query rows and key tiles of ``key_tile`` keys: its sequence's lengths (read from
    the index tensors) and causal flag, its rows, and its key tiles, which run from the first
    key its first row sees (window left) to the last key its last row sees (causal, window
    right), split ``split`` of ``args.num_splits`` of that range. Tiles wholly outside it are
    never loaded, nor keys before the first one in its first tile (indexing.key_loaded); every
    role of the CTA runs the same count."""
    group = args.num_q_heads // args.num_kv_heads
    q_start = read_index(args.cu_seqlens_q_ptr, seq, args.cu_stride)
    q_len = read_index(args.cu_seqlens_q_ptr, seq + 1, args.cu_stride) - q_start
    kv_len = read_index(args.seq_lens_ptr, seq, args.sl_stride)
    row_base = row_tile * rows
    num_rows = X.rows_per_kv_head(q_len, group)
    causal = read_causal_flag(
        args.causal, args.causal_per_seq_ptr, args.causal_stride, args.causal_bytes, seq
    )
    last_row = cutlass.min(row_base + rows, num_rows) - 1
    cta_first_key = X.window_first_key(
        X.row_token(row_base, group), q_len, kv_len, args.window_left, cutlass.select_, cutlass.max
    )
    cta_last_key = X.window_last_key(
        X.row_token(last_row, group), q_len, kv_len, causal, args.window_right, cutlass.select_
    )
    begin_tile, end_tile = X.window_tiles(cta_first_key, cta_last_key, key_tile)
    first_tile, end_tile = X.split_tile_range(
        begin_tile, end_tile, args.num_splits, split, cutlass.min
    )
    return CtaWork(
        seq, split, kv_head, group, q_start, q_len, kv_len, num_rows, row_base, last_row,
        cta_first_key, first_tile, end_tile - first_tile, causal,
    )  # fmt: skip
