"""Device-side reads every DSL attention kernel shares (traced inside ``@cute.kernel``). The index
tensors are read where they lie, through their strides (dsl/common/indexing.py index_offset)."""

import cutlass
import cutlass.cute as cute

from dsl.common import indexing as X


@cute.jit
def read_index(ptr: cute.Pointer, i: cutlass.Int32, stride: cutlass.Int64) -> cutlass.Int32:
    """Entry ``i`` of the strided int32 index vector at ``ptr`` (cu_seqlens_q, seq_lens)."""
    return cute.make_tensor(ptr + X.index_offset(cutlass.Int64(i), stride), cute.make_layout(1))[0]


@cute.jit
def read_causal_flag(
    causal: cutlass.Int32,
    causal_ptr: cute.Pointer,
    causal_stride: cutlass.Int64,
    causal_bytes: cutlass.Int32,
    seq: cutlass.Int32,
) -> cutlass.Int32:
    """Causal flag (0 or 1) of sequence ``seq`` (SPEC section 2): the launch-wide ``causal``
    when ``causal_bytes`` is 0, else the sequence's entry of the strided per-sequence flag
    tensor at ``causal_ptr`` (bool when ``causal_bytes`` is 1, int32 when it is 4)."""
    flag_of_seq = causal
    at = X.index_offset(cutlass.Int64(seq), causal_stride)
    if causal_bytes == 1:
        flag_of_seq = cute.make_tensor(causal_ptr + at, cute.make_layout(1))[0].to(cutlass.Int32)
    if causal_bytes == 4:
        flag = cute.make_tensor(
            cute.recast_ptr(causal_ptr, dtype=cutlass.Int32) + at, cute.make_layout(1)
        )[0]
        flag_of_seq = cutlass.select_(flag != 0, cutlass.Int32(1), cutlass.Int32(0))
    return flag_of_seq


@cute.jit
def read_page_id(
    bt_row: cute.Pointer, bt_stride_b: cutlass.Int64, col: cutlass.Int32, num_cols: cutlass.Int32
) -> cutlass.Int32:
    """Entry ``col`` of a sequence's block-table row at ``bt_row`` (strided by ``bt_stride_b``);
    0 for a column past the row's ``num_cols`` (a page no key of the sequence lies in)."""
    page = cutlass.Int32(0)
    if col < num_cols:
        entry = bt_row + X.index_offset(cutlass.Int64(col), bt_stride_b)
        page = cute.make_tensor(entry, cute.make_layout(1))[0]
    return page
