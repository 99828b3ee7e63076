"""Device-side reads every DSL attention kernel shares (traced inside ``@cute.kernel``)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def read_causal_flag(
    causal_global: cutlass.Int32,
    causal_ptr: cute.Pointer,
    causal_stride: cutlass.Int64,
    causal_width: cutlass.Int32,
    seq: cutlass.Int32,
) -> cutlass.Int32:
    """Causal flag (0 or 1) of sequence ``seq`` (SPEC section 2): the global flag when
    ``causal_width`` is 0, else the sequence's entry of the strided per-sequence flag tensor at
    ``causal_ptr`` (bool when ``causal_width`` is 1, int32 when it is 4)."""
    causal = causal_global
    if causal_width == 1:
        causal = cute.make_tensor(
            causal_ptr + cutlass.Int64(seq) * causal_stride, cute.make_layout(1)
        )[0].to(cutlass.Int32)
    if causal_width == 4:
        flag = cute.make_tensor(
            cute.recast_ptr(causal_ptr, dtype=cutlass.Int32) + cutlass.Int64(seq) * causal_stride,
            cute.make_layout(1),
        )[0]
        causal = cutlass.select_(flag != 0, cutlass.Int32(1), cutlass.Int32(0))
    return causal


@cute.jit
def read_page_id(
    bt_row: cute.Pointer, bt_stride_b: cutlass.Int64, col: cutlass.Int32, num_cols: cutlass.Int32
) -> cutlass.Int32:
    """Entry ``col`` of a sequence's block-table row at ``bt_row`` (strided by ``bt_stride_b``);
    0 for a column past the row's ``num_cols`` (a page no key of the sequence lies in)."""
    page = cutlass.Int32(0)
    if col < num_cols:
        entry = bt_row + cutlass.Int64(col) * bt_stride_b
        page = cute.make_tensor(entry, cute.make_layout(1))[0]
    return page
