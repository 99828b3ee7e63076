"""The host entry both DSL families share: ``__call__`` takes the launch record's fields
(fp8_noncausal_attn/launch_record.py through dsl/common/launch.py; tests/test_dsl_launch.py
checks this signature against it), packs the ones
the kernel reads into the family's :data:`launch.KERNEL_ARGS` tuple and launches the family's
``kernel`` over the grid (row tiles, KV heads, sequences x splits)."""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from dsl.common import launch

LOG2_E = math.log2(math.e)


class LaunchEntry:
    """Base of a family's kernel class, which sets ``family`` and ``threads`` and provides
    ``kernel_objects()`` (the compile-time objects its ``kernel`` takes first: tiled MMAs,
    shared-memory layouts) and ``kernel(*objects, args)``."""

    family: str
    threads: int

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        cu_seqlens_q_ptr: cute.Pointer,
        seq_lens_ptr: cute.Pointer,
        k_scale_ptr: cute.Pointer,
        v_scale_ptr: cute.Pointer,
        causal_per_seq_ptr: cute.Pointer,
        sinks_ptr: cute.Pointer,
        ws_o_ptr: cute.Pointer,
        ws_lse_ptr: cute.Pointer,
        q_stride_t: cutlass.Int64,
        q_stride_h: cutlass.Int64,
        o_stride_t: cutlass.Int64,
        o_stride_h: cutlass.Int64,
        k_stride_b: cutlass.Int64,
        k_stride_s: cutlass.Int64,
        k_stride_h: cutlass.Int64,
        v_stride_b: cutlass.Int64,
        v_stride_s: cutlass.Int64,
        v_stride_h: cutlass.Int64,
        bt_stride_s: cutlass.Int64,
        bt_stride_b: cutlass.Int64,
        cu_stride: cutlass.Int64,
        sl_stride: cutlass.Int64,
        causal_stride: cutlass.Int64,
        causal_bytes: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_seqs: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        num_kv_heads: cutlass.Int32,
        block_shift: cutlass.Int32,
        num_splits: cutlass.Int32,
        causal: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        softmax_scale: cutlass.Float32,
        row_tiles: cutlass.Int32,
        q_is_bf16: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        scale_log2 = softmax_scale * LOG2_E  # the kernels run the softmax in log2 units
        args = launch.kernel_args(self.family, locals())
        self.kernel(*self.kernel_objects(), args).launch(
            grid=(row_tiles, num_kv_heads, num_seqs * num_splits),
            block=[self.threads, 1, 1],
            cluster=[1, 1, 1],
            stream=stream,
        )
