"""tcgen05 paged attention over an FP8 KV cache, BF16/FP16 query: the CUTLASS Python DSL kernel.

NEVER RUN ON A GPU: this kernel compiles for sm_100a / sm_103a (dsl/build.py) and its index maps
are replayed on the CPU (tests/test_tcgen05_emulation.py); no SM100 GPU has executed it.

Swap-AB (docs/tcgen05.md): one CTA = (tile of ``rows`` query rows of one KV head, KV head,
sequence x split). Per 128-key tile:
  S^T[key, row] = K[key, :] . Q[row, :]      tcgen05.mma M=128 keys, N=rows, A = K (TMEM), B = Q
  O^T[d, row]  += V^T[d, key] P[key, row]    tcgen05.mma M=128 dims, N=rows, A = V^T (TMEM), B = P
Warp roles (dsl/tcgen05/traits.py): the converter warpgroup copies FP8 K/V rows page by page with
cp.async into a 128-byte-swizzled ring, converts them exactly to fp16 (ldmatrix -> cvt ->
tcgen05.st into TMEM, the A operand); two MMA warps issue the two GEMMs; the softmax warpgroup
(one TMEM lane = one key per thread) takes column maxima across its 128 threads (redux + shared
atomics), writes P (fp16) to shared memory, keeps per-thread column sums, rescales O in TMEM and
writes the output (or the split's fp32 partial O and log2 LSE for the existing merge kernel).
k_scale is folded into the softmax scale and v_scale into the output (SPEC section 3); a bf16
query is made fp16 by a per-row power of two (dsl/tcgen05/layouts.py) folded into the same scale.
The pipeline order (K of tile s+1 converted before V of tile s, so BMM1 of the next tile runs
under the softmax of this one) follows the CUTLASS mixed-input decode example's design.
"""

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05

from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T

LOG2_E = math.log2(math.e)
MMA = (None, None, None)  # (MMA, #MMA_M, #MMA_K) slice
CPY = (None,) + MMA

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
}


def _exp2(x):
    return cute.math.exp2(x, fastmath=True)


def _warp_column_sums(values, lane):
    """Butterfly transpose-reduce: ``values`` are this lane's 32 column entries (Python list of
    Float32); returns, on lane c, the sum over the warp's 32 lanes of column c. 31 shuffles in
    5 stages: at each, a lane keeps the half of its columns selected by its lane bit and sends
    the other half to its partner, so column index bits end up equal to the lane bits."""
    width = 16
    while width >= 1:
        upper = (lane & width) != 0
        halved = []
        for i in range(width):
            send = cutlass.select_(upper, values[i], values[i + width])
            keep = cutlass.select_(upper, values[i + width], values[i])
            halved.append(keep + cute.arch.shuffle_sync_bfly(send, offset=width))
        values = halved
        width //= 2
    return values[0]


class Tcgen05PagedAttention:
    """One variant (dsl/tcgen05/traits.Variant) of the kernel; ``__call__`` is the host entry
    that ``cute.compile`` traces and ``export_to_c`` exports."""

    def __init__(self, variant: T.Variant):
        variant.check()
        self.v = variant
        self.q_dtype = _DTYPES[variant.q_dtype]
        self.kv_dtype = _DTYPES[variant.kv_dtype]
        self.mma_dtype = cutlass.Float16
        self.acc_dtype = cutlass.Float32
        self.mma_tile = (L.KEY_TILE, variant.rows, L.ITEM_BYTES)

    @cute.jit
    def __call__(
        self,
        q_ptr: cute.Pointer,  # [num_tokens, num_q_heads, head_dim], q dtype
        k_ptr: cute.Pointer,  # [num_blocks, page_size, num_kv_heads, head_dim], fp8
        v_ptr: cute.Pointer,  # same shape as k, own strides
        out_ptr: cute.Pointer,  # [num_tokens, num_q_heads, head_dim], q dtype
        block_table_ptr: cute.Pointer,  # int32 [num_seqs, max_blocks]
        cu_seqlens_q_ptr: cute.Pointer,  # int32 [num_seqs + 1]
        seq_lens_ptr: cute.Pointer,  # int32 [num_seqs]
        k_scale_ptr: cute.Pointer,  # fp32 [num_kv_heads]
        v_scale_ptr: cute.Pointer,  # fp32 [num_kv_heads]
        causal_ptr: cute.Pointer,  # uint8 bytes of the per-sequence flags (bool or int32)
        ws_o_ptr: cute.Pointer,  # fp32 [num_splits, num_tokens, num_q_heads, head_dim]
        ws_lse_ptr: cute.Pointer,  # fp32 [num_splits, num_tokens, num_q_heads], log2
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
        causal_stride: cutlass.Int64,  # in flags (elements), read in place
        causal_width: cutlass.Int32,  # 0: no per-sequence flags, 1: bool, 4: int32
        causal: cutlass.Int32,  # global flag when causal_width == 0
        num_tokens: cutlass.Int32,
        num_seqs: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        num_kv_heads: cutlass.Int32,
        row_tiles: cutlass.Int32,  # ceil(max_seqlen_q * group / rows)
        num_splits: cutlass.Int32,
        softmax_scale: cutlass.Float32,
        stream: cuda.CUstream,
    ):
        tile_m, tile_n, tile_k = self.mma_tile
        # S^T = K Q^T: A = converted K in TMEM (K-major), B = Q in smem (K-major).
        tiled_mma_kq = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype,
            self.mma_dtype,
            OperandMajorMode.K,
            OperandMajorMode.K,
            self.acc_dtype,
            tcgen05.CtaGroup.ONE,
            (tile_m, tile_n),
            tcgen05.OperandSource.TMEM,
        )
        # O^T += V^T P: A = converted V^T in TMEM, B = P in smem (rows contiguous).
        tiled_mma_vp = sm100_utils.make_trivial_tiled_mma(
            self.mma_dtype,
            self.mma_dtype,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            self.acc_dtype,
            tcgen05.CtaGroup.ONE,
            (tile_m, tile_n),
            tcgen05.OperandSource.TMEM,
        )
        self.kernel(
            tiled_mma_kq,
            tiled_mma_vp,
            q_ptr,
            k_ptr,
            v_ptr,
            out_ptr,
            block_table_ptr,
            cu_seqlens_q_ptr,
            seq_lens_ptr,
            k_scale_ptr,
            v_scale_ptr,
            causal_ptr,
            ws_o_ptr,
            ws_lse_ptr,
            q_stride_t,
            q_stride_h,
            o_stride_t,
            o_stride_h,
            k_stride_b,
            k_stride_s,
            k_stride_h,
            v_stride_b,
            v_stride_s,
            v_stride_h,
            bt_stride_s,
            bt_stride_b,
            causal_stride,
            causal_width,
            causal,
            num_tokens,
            num_q_heads,
            num_kv_heads,
            num_splits,
            softmax_scale * LOG2_E,
        ).launch(
            grid=(row_tiles, num_kv_heads, num_seqs * num_splits),
            block=[T.THREADS, 1, 1],
            cluster=[1, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tiled_mma_kq: cute.TiledMma,
        tiled_mma_vp: cute.TiledMma,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        cu_seqlens_q_ptr: cute.Pointer,
        seq_lens_ptr: cute.Pointer,
        k_scale_ptr: cute.Pointer,
        v_scale_ptr: cute.Pointer,
        causal_ptr: cute.Pointer,
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
        causal_stride: cutlass.Int64,
        causal_width: cutlass.Int32,
        causal_global: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        num_kv_heads: cutlass.Int32,
        num_splits: cutlass.Int32,
        scale_log2: cutlass.Float32,
    ):
        v = self.v
        rows = v.rows
        tile_m, tile_n, tile_k = self.mma_tile
        d_tiles = v.d_tiles
        mma_dtype = self.mma_dtype
        acc_dtype = self.acc_dtype

        # ---------------------------------------------------------------- work decomposition
        row_tile, kv_head, seq_split = cute.arch.block_idx()
        seq = seq_split // num_splits
        split = seq_split % num_splits
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(tidx // 32)
        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        wg_tidx = tidx % 128
        wg_warp = warp_idx % 4
        lane = cute.arch.lane_idx()

        group = num_q_heads // num_kv_heads
        q_start = cute.make_tensor(cu_seqlens_q_ptr + seq, cute.make_layout(1))[0]
        q_len = cute.make_tensor(cu_seqlens_q_ptr + seq + 1, cute.make_layout(1))[0] - q_start
        kv_len = cute.make_tensor(seq_lens_ptr + seq, cute.make_layout(1))[0]
        row_base = row_tile * rows
        num_rows = L.rows_per_kv_head(q_len, group)
        first_tile, end_tile = L.split_tiles(kv_len, num_splits, split, cutlass.min)
        iters = end_tile - first_tile
        # A tile of rows past this sequence's R has nothing to do (the grid covers the longest).
        idle = row_base >= num_rows

        # ---------------------------------------------------------------- shared memory
        smem = utils.SmemAllocator()
        tmem_holder = smem.allocate_array(cutlass.Int32)
        q_ready_bar = smem.allocate_array(cutlass.Int64, 2)
        cvt_bar = smem.allocate_array(cutlass.Int64, v.convert_stages * 2)
        s_bar = smem.allocate_array(cutlass.Int64, v.s_stages * 2)
        p_bar = smem.allocate_array(cutlass.Int64, v.s_stages * 2)
        o_bar = smem.allocate_array(cutlass.Int64, 2)
        # Running column maxima, double-buffered by tile parity so a warp that is one tile
        # ahead never raises the maximum another warp is still reading.
        s_max = smem.allocate_tensor(acc_dtype, cute.make_layout((rows, 2)), 16)
        s_sum = smem.allocate_tensor(acc_dtype, cute.make_layout((rows, 4)), 16)
        s_row_scale = smem.allocate_tensor(acc_dtype, cute.make_layout(rows), 16)
        s_col_scale = smem.allocate_tensor(acc_dtype, cute.make_layout(rows), 16)
        s_last_key = smem.allocate_tensor(cutlass.Int32, cute.make_layout(rows), 16)

        ring_bytes = T.LOAD_STAGES * L.KEY_TILE * L.ITEM_BYTES
        ring = smem.allocate_array(cutlass.Int8, ring_bytes, byte_alignment=1024)

        # Q (fp16, rows x head_dim), the B operand of BMM1.
        smem_layout_q = sm100_utils.make_smem_layout_b(
            tiled_mma_kq, self.mma_tile, mma_dtype, d_tiles
        )
        tBsQ = smem.allocate_tensor(mma_dtype, smem_layout_q.outer, 1024, smem_layout_q.inner)
        # The FP8 ring seen as the ldmatrix sources: K (K-major A) and V (MN-major A).
        smem_layout_k = sm100_utils.make_smem_layout_a(
            tiled_mma_kq, self.mma_tile, self.kv_dtype, T.LOAD_STAGES
        )
        smem_layout_v = sm100_utils.make_smem_layout_a(
            tiled_mma_vp, self.mma_tile, self.kv_dtype, T.LOAD_STAGES, is_k_major=False
        )
        tAsK = cute.make_tensor(
            cute.recast_ptr(ring, smem_layout_k.inner, dtype=self.kv_dtype), smem_layout_k.outer
        )
        tAsV = cute.make_tensor(
            cute.recast_ptr(ring, smem_layout_v.inner, dtype=self.kv_dtype), smem_layout_v.outer
        )
        # P (fp16): written as the C tile of BMM1 (key, row), read as the B tile of BMM2.
        tile_nm = (None, tile_n, tile_m)
        tBsP_layout = sm100_utils.make_smem_layout_b(tiled_mma_vp, tile_nm, mma_dtype, v.s_stages)
        tBsP = smem.allocate_tensor(mma_dtype, tBsP_layout.outer, 1024, tBsP_layout.inner)

        # ---------------------------------------------------------------- barriers
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        warpgroup_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
        q_producer, q_consumer = pipeline.PipelineAsyncUmma.create(
            num_stages=1,
            producer_group=warpgroup_threads,
            consumer_group=one_thread,
            barrier_storage=q_ready_bar,
            defer_sync=True,
        ).make_participants()
        cvt_producer, cvt_consumer = pipeline.PipelineAsyncUmma.create(
            num_stages=v.convert_stages,
            producer_group=warpgroup_threads,
            consumer_group=one_thread,
            barrier_storage=cvt_bar,
            defer_sync=True,
        ).make_participants()
        s_producer, s_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=v.s_stages,
            producer_group=one_thread,
            consumer_group=warpgroup_threads,
            barrier_storage=s_bar,
            defer_sync=True,
        ).make_participants()
        p_producer, p_consumer = pipeline.PipelineAsyncUmma.create(
            num_stages=v.s_stages,
            producer_group=warpgroup_threads,
            consumer_group=one_thread,
            barrier_storage=p_bar,
            defer_sync=True,
        ).make_participants()
        o_producer, o_consumer = pipeline.PipelineUmmaAsync.create(
            num_stages=1,
            producer_group=one_thread,
            consumer_group=warpgroup_threads,
            barrier_storage=o_bar,
            defer_sync=True,
        ).make_participants()
        softmax_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=128)
        mma_kq_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=64)
        mma_vp_bar = pipeline.NamedBarrier(barrier_id=3, num_threads=64)
        row_scale_bar = pipeline.NamedBarrier(barrier_id=4, num_threads=256)
        ring_bar = pipeline.NamedBarrier(barrier_id=5, num_threads=128)

        if warp_idx == T.MMA_KQ_WARP and not idle:
            cute.arch.alloc_tmem(v.tmem_alloc_columns, tmem_holder)
        cute.arch.sync_threads()

        # ---------------------------------------------------------------- TMEM tensors
        thr_mma_kq = tiled_mma_kq.get_slice(0)
        thr_mma_vp = tiled_mma_vp.get_slice(0)
        tAtK = thr_mma_kq.make_fragment_A(
            tiled_mma_kq.partition_shape_A((tile_m, tile_k, v.convert_stages))
        )
        tAtV = thr_mma_vp.make_fragment_A(
            tiled_mma_vp.partition_shape_A((tile_m, tile_k, v.convert_stages))
        )
        tCtS_shape = tiled_mma_kq.partition_shape_C((tile_m, tile_n, v.s_stages))
        tCtS = thr_mma_kq.make_fragment_C(tCtS_shape)
        tCtO = thr_mma_vp.make_fragment_C(tiled_mma_vp.partition_shape_C((tile_m, tile_n, d_tiles)))
        tmem_ptr = cute.arch.retrieve_tmem_ptr(cutlass.Int32, 16, tmem_holder)
        col = 0
        tAtK = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=mma_dtype), tAtK.layout)
        tAtV = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=mma_dtype), tAtV.layout)
        col += tcgen05.find_tmem_tensor_col_offset(tAtK)
        tCtS = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=acc_dtype), tCtS.layout)
        col += tcgen05.find_tmem_tensor_col_offset(tCtS)
        tCtO = cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=acc_dtype), tCtO.layout)
        col += tcgen05.find_tmem_tensor_col_offset(tCtO)
        assert col == v.tmem_columns, (col, v.tmem_columns)

        # P seen as BMM1's C tile (key, row) for the softmax threads' TMEM-load partition.
        tCsP = cute.composition(tBsP, cute.make_ordered_layout(tCtS_shape, order=((2, 0), 3, 1, 4)))

        if idle:
            pass
        # ================================================================ converter warpgroup
        elif warpgroup == T.CONVERT_WARPGROUP:
            self.convert_role(
                tiled_mma_kq,
                tiled_mma_vp,
                tAtK,
                tAtV,
                tAsK,
                tAsV,
                ring,
                tBsQ,
                s_row_scale,
                q_ptr,
                k_ptr,
                v_ptr,
                block_table_ptr,
                q_stride_t,
                q_stride_h,
                k_stride_b,
                k_stride_s,
                k_stride_h,
                v_stride_b,
                v_stride_s,
                v_stride_h,
                bt_stride_s,
                bt_stride_b,
                seq,
                kv_head,
                group,
                q_start,
                num_rows,
                row_base,
                kv_len,
                first_tile,
                iters,
                wg_tidx,
                q_producer,
                cvt_producer,
                ring_bar,
                row_scale_bar,
            )
        # ================================================================ MMA warps
        elif warp_idx == T.MMA_KQ_WARP:
            tBsQ_desc = thr_mma_kq.make_fragment_B(tBsQ)
            q_consumer.wait_and_advance()
            s_token = True
            for s in cutlass.range(iters):
                k_token = cvt_consumer.try_wait()
                tiled_mma_kq.set(tcgen05.Field.ACCUMULATE, False)
                s_handle = s_producer.acquire_and_advance(s_token)
                for dk in cutlass.range_constexpr(d_tiles):
                    k_handle = cvt_consumer.wait_and_advance(k_token)
                    if dk == d_tiles - 1:
                        mma_kq_bar.arrive()  # BMM2 of the previous tile may go
                    for kb in cutlass.range_constexpr(cute.size(tAtK, mode=[2])):
                        cute.gemm(
                            tiled_mma_kq,
                            tCtS[MMA + (s_handle.index,)],
                            tAtK[None, None, kb, k_handle.index],
                            tBsQ_desc[None, None, kb, dk],
                            tCtS[MMA + (s_handle.index,)],
                        )
                        tiled_mma_kq.set(tcgen05.Field.ACCUMULATE, True)
                    k_handle.release()
                    if dk != d_tiles - 1:
                        k_token = cvt_consumer.try_wait()
                s_handle.commit()
                if s > 0:
                    for _ in cutlass.range_constexpr(d_tiles):
                        cvt_consumer.advance()  # V items of tile s - 1 belong to BMM2
                    mma_vp_bar.arrive_and_wait()
                    s_token = s_producer.try_acquire()
        elif warp_idx == T.MMA_VP_WARP:
            tiled_mma_vp.set(tcgen05.Field.ACCUMULATE, True)
            tBsP_nk = cute.local_tile(
                tBsP, thr_mma_vp.partition_shape_B((tile_n, tile_k)), (0, 0, None, None)
            )
            tBsP_desc = thr_mma_vp.make_fragment_B(tBsP_nk)
            if iters > 0:
                for _ in cutlass.range_constexpr(d_tiles):
                    cvt_consumer.advance()  # K items of tile 0 belong to BMM1
                mma_kq_bar.arrive_and_wait()
            p_token = False
            o_token = True
            for s in cutlass.range(iters):
                if s < iters - 1:
                    for _ in cutlass.range_constexpr(d_tiles):
                        cvt_consumer.advance()  # K items of tile s + 1
                    mma_kq_bar.arrive_and_wait()
                    p_token = p_consumer.try_wait()
                v_token = cvt_consumer.try_wait()
                p_handle = p_consumer.wait_and_advance(p_token)
                o_handle = o_producer.acquire_and_advance(o_token)
                for dm in cutlass.range_constexpr(d_tiles):
                    v_handle = cvt_consumer.wait_and_advance(v_token)
                    if dm == d_tiles - 1:
                        mma_vp_bar.arrive()
                    for kb in cutlass.range_constexpr(cute.size(tAtV, mode=[2])):
                        cute.gemm(
                            tiled_mma_vp,
                            tCtO[MMA + (dm,)],
                            tAtV[None, None, kb, v_handle.index],
                            tBsP_desc[None, None, kb, 0, p_handle.index],
                            tCtO[MMA + (dm,)],
                        )
                    v_handle.release()
                    if dm != d_tiles - 1:
                        v_token = cvt_consumer.try_wait()
                p_handle.release()
                o_handle.commit()
                o_token = o_producer.try_acquire()
            o_producer.tail()
            cute.arch.relinquish_tmem_alloc_permit()
            cute.arch.dealloc_tmem(tmem_ptr, v.tmem_alloc_columns)
        # ================================================================ softmax warpgroup
        elif warpgroup == T.SOFTMAX_WARPGROUP:
            self.softmax_role(
                tCtS,
                tCtO,
                tCsP,
                s_max,
                s_sum,
                s_row_scale,
                s_col_scale,
                s_last_key,
                out_ptr,
                ws_o_ptr,
                ws_lse_ptr,
                o_stride_t,
                o_stride_h,
                kv_head,
                group,
                q_start,
                q_len,
                kv_len,
                num_rows,
                row_base,
                first_tile,
                iters,
                seq,
                causal_ptr,
                causal_stride,
                causal_width,
                causal_global,
                k_scale_ptr,
                v_scale_ptr,
                scale_log2,
                split,
                num_splits,
                num_tokens,
                num_q_heads,
                wg_tidx,
                wg_warp,
                lane,
                s_consumer,
                p_producer,
                o_consumer,
                softmax_bar,
                row_scale_bar,
            )
        return

    # -------------------------------------------------------------------- converter role
    @cute.jit
    def convert_role(
        self,
        tiled_mma_kq: cute.TiledMma,
        tiled_mma_vp: cute.TiledMma,
        tAtK: cute.Tensor,
        tAtV: cute.Tensor,
        tAsK: cute.Tensor,
        tAsV: cute.Tensor,
        ring: cute.Pointer,
        tBsQ: cute.Tensor,
        s_row_scale: cute.Tensor,
        q_ptr: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        q_stride_t: cutlass.Int64,
        q_stride_h: cutlass.Int64,
        k_stride_b: cutlass.Int64,
        k_stride_s: cutlass.Int64,
        k_stride_h: cutlass.Int64,
        v_stride_b: cutlass.Int64,
        v_stride_s: cutlass.Int64,
        v_stride_h: cutlass.Int64,
        bt_stride_s: cutlass.Int64,
        bt_stride_b: cutlass.Int64,
        seq: cutlass.Int32,
        kv_head: cutlass.Int32,
        group: cutlass.Int32,
        q_start: cutlass.Int32,
        num_rows: cutlass.Int32,
        row_base: cutlass.Int32,
        kv_len: cutlass.Int32,
        first_tile: cutlass.Int32,
        iters: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        q_producer: pipeline.PipelineProducer,
        cvt_producer: pipeline.PipelineProducer,
        ring_bar: pipeline.NamedBarrier,
        row_scale_bar: pipeline.NamedBarrier,
    ):
        """Q prologue, then every staged item: paged cp.async -> smem ring -> fp16 -> TMEM."""
        v = self.v
        d_tiles = v.d_tiles
        mma_dtype = self.mma_dtype
        kv_dtype = self.kv_dtype

        # ---- zero the ring once: rows past kv_len are never copied, and must hold finite
        # values (P is 0 there, and 0 x NaN would poison O).
        ring_words = cute.make_tensor(
            cute.recast_ptr(ring, dtype=cutlass.Int32),
            cute.make_layout(T.LOAD_STAGES * L.KEY_TILE * L.ITEM_BYTES // 4),
        )
        for w in cutlass.range(
            T.LOAD_STAGES * L.KEY_TILE * L.ITEM_BYTES // 4 // 128, unroll_full=True
        ):
            ring_words[w * 128 + wg_tidx] = cutlass.Int32(0)
        ring_bar.arrive_and_wait()  # no zero store may land on another thread's cp.async data

        self.q_prologue(
            tBsQ,
            s_row_scale,
            q_ptr,
            q_stride_t,
            q_stride_h,
            kv_head,
            group,
            q_start,
            num_rows,
            row_base,
            wg_tidx,
        )
        cute.arch.fence_view_async_shared()
        q_handle = q_producer.acquire_and_advance()
        q_handle.commit()
        row_scale_bar.arrive()

        # ---- copies and conversions (partitions after the CUTLASS mixed-input decode example:
        # ldmatrix reads shaped by the tcgen05.st partition of the TMEM A operand).
        store_atom = cute.make_copy_atom(
            tcgen05.St16x256bOp(tcgen05.Repetition(L.ITEM_BYTES * 16 // 256)), mma_dtype
        )
        store_k = tcgen05.make_tmem_copy(store_atom, tAtK[MMA + (0,)])
        thr_store_k = store_k.get_slice(wg_tidx)
        k_cvt_shape = thr_store_k.partition_S(tAtK).shape[:-1]
        tKtK = thr_store_k.partition_D(tAtK)
        load_k = cute.make_tiled_copy_S(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x16x8bOp(num_matrices=4), kv_dtype),
            store_k,
        )
        thr_load_k = load_k.get_slice(wg_tidx)
        tKsK = thr_load_k.partition_S(tAsK)
        k_raw_shape = thr_load_k.partition_D(tAsK).shape[:-1]

        store_v = tcgen05.make_tmem_copy(store_atom, tAtV[MMA + (0,)])
        thr_store_v = store_v.get_slice(wg_tidx)
        v_cvt_shape = thr_store_v.partition_S(tAtV).shape[:-1]
        tVtV = thr_store_v.partition_D(tAtV)
        load_v = cute.make_tiled_copy_S(
            cute.make_copy_atom(
                cute.nvgpu.warp.LdMatrix16x16x8bOp(transpose=True, num_matrices=2), kv_dtype
            ),
            store_v,
        )
        thr_load_v = load_v.get_slice(wg_tidx)
        tVsV = thr_load_v.partition_S(tAsV)
        v_raw_shape = thr_load_v.partition_D(tAsV).shape[:-1]

        copy16 = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(), kv_dtype, num_bits_per_copy=128
        )
        ring_fp8 = cute.recast_ptr(ring, dtype=kv_dtype)
        total = L.item_count(iters, d_tiles)
        lookahead = T.LOAD_STAGES - 1

        for p in cutlass.range_constexpr(lookahead):
            if p < total:
                self.load_item(
                    p,
                    p,
                    copy16,
                    ring_fp8,
                    k_ptr,
                    v_ptr,
                    block_table_ptr,
                    k_stride_b,
                    k_stride_s,
                    k_stride_h,
                    v_stride_b,
                    v_stride_s,
                    v_stride_h,
                    bt_stride_s,
                    bt_stride_b,
                    seq,
                    kv_head,
                    kv_len,
                    first_tile,
                    iters,
                    wg_tidx,
                )
            cute.arch.cp_async_commit_group()

        for i in cutlass.range(total):
            ring_bar.arrive_and_wait()  # every thread is done reading the stage refilled next
            nxt = i + lookahead
            if nxt < total:
                self.load_item(
                    nxt,
                    nxt % T.LOAD_STAGES,
                    copy16,
                    ring_fp8,
                    k_ptr,
                    v_ptr,
                    block_table_ptr,
                    k_stride_b,
                    k_stride_s,
                    k_stride_h,
                    v_stride_b,
                    v_stride_s,
                    v_stride_h,
                    bt_stride_s,
                    bt_stride_b,
                    seq,
                    kv_head,
                    kv_len,
                    first_tile,
                    iters,
                    wg_tidx,
                )
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(lookahead)
            ring_bar.arrive_and_wait()  # item i is in shared memory, from every thread
            stage = i % T.LOAD_STAGES
            is_v, _, _ = L.item_of(i, iters, d_tiles, cutlass.select_)
            if is_v:
                raw = cute.make_rmem_tensor(v_raw_shape, kv_dtype)
                cute.copy(thr_load_v, tVsV[CPY + (stage,)], raw)
                cvt = cute.make_rmem_tensor(v_cvt_shape, mma_dtype)
                cvt.store(raw.load().to(mma_dtype).reshape(v_cvt_shape))
                handle = cvt_producer.acquire_and_advance()
                cute.copy(thr_store_v, cvt, tVtV[CPY + (handle.index,)])
                cute.arch.fence_view_async_tmem_store()
                handle.commit()
            else:
                raw = cute.make_rmem_tensor(k_raw_shape, kv_dtype)
                cute.copy(thr_load_k, tKsK[CPY + (stage,)], raw)
                cvt = cute.make_rmem_tensor(k_cvt_shape, mma_dtype)
                cvt.store(raw.load().to(mma_dtype).reshape(k_cvt_shape))
                handle = cvt_producer.acquire_and_advance()
                cute.copy(thr_store_k, cvt, tKtK[CPY + (handle.index,)])
                cute.arch.fence_view_async_tmem_store()
                handle.commit()
        return

    @cute.jit
    def load_item(
        self,
        item: cutlass.Int32,
        stage: cutlass.Int32,
        copy16: cute.CopyAtom,
        ring_fp8: cute.Pointer,
        k_ptr: cute.Pointer,
        v_ptr: cute.Pointer,
        block_table_ptr: cute.Pointer,
        k_stride_b: cutlass.Int64,
        k_stride_s: cutlass.Int64,
        k_stride_h: cutlass.Int64,
        v_stride_b: cutlass.Int64,
        v_stride_s: cutlass.Int64,
        v_stride_h: cutlass.Int64,
        bt_stride_s: cutlass.Int64,
        bt_stride_b: cutlass.Int64,
        seq: cutlass.Int32,
        kv_head: cutlass.Int32,
        kv_len: cutlass.Int32,
        first_tile: cutlass.Int32,
        iters: cutlass.Int32,
        wg_tidx: cutlass.Int32,
    ):
        """cp.async this thread's 16-byte chunks of staged item ``item`` into ring ``stage``:
        one block-table read per row (page), rows past kv_len skipped."""
        is_v, tile, dslice = L.item_of(item, iters, self.v.d_tiles, cutlass.select_)
        chunk = L.loader_chunk(wg_tidx)
        for step in cutlass.range_constexpr(L.LOADER_STEPS):
            row = L.loader_row(wg_tidx, step)
            j = (first_tile + tile) * L.KEY_TILE + row
            if j < kv_len:
                col, slot = L.page_slot(j, self.v.page_size)
                page = cutlass.Int64(
                    cute.make_tensor(
                        block_table_ptr + (cutlass.Int64(seq) * bt_stride_s + col * bt_stride_b),
                        cute.make_layout(1),
                    )[0]
                )
                within = dslice * L.ITEM_BYTES + chunk * L.CHUNK
                # Offsets are whole 16-byte chunks: the host refuses strides that are not
                # multiples of 16 elements.
                dst_off = stage * (L.KEY_TILE * L.ITEM_BYTES) + L.staged_offset(row, chunk)
                dst = cute.make_tensor(
                    ring_fp8 + cute.assume(dst_off, divby=L.CHUNK), cute.make_layout(L.CHUNK)
                )
                if is_v:
                    off = L.key_offset(page, slot, kv_head, v_stride_b, v_stride_s, v_stride_h)
                    src = cute.make_tensor(
                        v_ptr + cute.assume(off + within, divby=L.CHUNK), cute.make_layout(L.CHUNK)
                    )
                    cute.copy(copy16, src, dst)
                else:
                    off = L.key_offset(page, slot, kv_head, k_stride_b, k_stride_s, k_stride_h)
                    src = cute.make_tensor(
                        k_ptr + cute.assume(off + within, divby=L.CHUNK), cute.make_layout(L.CHUNK)
                    )
                    cute.copy(copy16, src, dst)

    @cute.jit
    def q_prologue(
        self,
        tBsQ: cute.Tensor,
        s_row_scale: cute.Tensor,
        q_ptr: cute.Pointer,
        q_stride_t: cutlass.Int64,
        q_stride_h: cutlass.Int64,
        kv_head: cutlass.Int32,
        group: cutlass.Int32,
        q_start: cutlass.Int32,
        num_rows: cutlass.Int32,
        row_base: cutlass.Int32,
        wg_tidx: cutlass.Int32,
    ):
        """Q rows -> fp16 B operand in smem. A bf16 row is multiplied by 2^e (layouts.
        row_scale_exponent), exact; s_row_scale[row] = 2^-e rejoins the softmax scale.
        Rows past this sequence's R are zero."""
        rows = self.v.rows
        head_dim = self.v.head_dim
        per_row = 128 // rows if rows <= 128 else 1
        passes = 1 if rows <= 128 else rows // 128
        seg = head_dim // per_row
        for pass_ in cutlass.range_constexpr(passes):
            r = wg_tidx // per_row + pass_ * 128
            part = wg_tidx % per_row
            token = L.row_token(row_base + r, group)
            head = L.row_head(row_base + r, group, kv_head)
            # Held in the query dtype (half the registers of fp32), widened on use.
            vals = cute.make_rmem_tensor(cute.make_layout(seg), self.q_dtype)
            vals.fill(0.0)
            if row_base + r < num_rows:
                offset = (
                    cutlass.Int64(q_start + token) * q_stride_t
                    + cutlass.Int64(head) * q_stride_h
                    + part * seg
                )
                src = cute.make_tensor(q_ptr + offset, cute.make_layout(seg))
                for i in cutlass.range_constexpr(seg):
                    vals[i] = src[i]
            biggest = cutlass.Float32(0.0)
            for i in cutlass.range_constexpr(seg):
                biggest = cute.arch.fmax(biggest, cute.math.absf(vals[i].to(cutlass.Float32)))
            for b in cutlass.range_constexpr(int(math.log2(per_row))):
                biggest = cute.arch.fmax(
                    biggest, cute.arch.shuffle_sync_bfly(biggest, offset=1 << b)
                )
            factor = cutlass.Float32(1.0)
            inverse = cutlass.Float32(1.0)
            if cutlass.const_expr(self.q_dtype is cutlass.BFloat16):
                box = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float32)
                box[0] = biggest
                bits = box.load().bitcast(cutlass.Int32)[0]
                exponent = L.row_scale_exponent((bits >> 23) & 0xFF)
                factor = cute.math.exp2(exponent.to(cutlass.Float32))
                inverse = cute.math.exp2(-exponent.to(cutlass.Float32))
            for i in cutlass.range_constexpr(seg):
                d = part * seg + i
                tBsQ[((r, d % 16), 0, (d % L.ITEM_BYTES) // 16, d // L.ITEM_BYTES)] = (
                    vals[i].to(cutlass.Float32) * factor
                ).to(self.mma_dtype)
            if part == 0:
                s_row_scale[r] = inverse

    # -------------------------------------------------------------------- softmax role
    @cute.jit
    def softmax_role(
        self,
        tCtS: cute.Tensor,
        tCtO: cute.Tensor,
        tCsP: cute.Tensor,
        s_max: cute.Tensor,
        s_sum: cute.Tensor,
        s_row_scale: cute.Tensor,
        s_col_scale: cute.Tensor,
        s_last_key: cute.Tensor,
        out_ptr: cute.Pointer,
        ws_o_ptr: cute.Pointer,
        ws_lse_ptr: cute.Pointer,
        o_stride_t: cutlass.Int64,
        o_stride_h: cutlass.Int64,
        kv_head: cutlass.Int32,
        group: cutlass.Int32,
        q_start: cutlass.Int32,
        q_len: cutlass.Int32,
        kv_len: cutlass.Int32,
        num_rows: cutlass.Int32,
        row_base: cutlass.Int32,
        first_tile: cutlass.Int32,
        iters: cutlass.Int32,
        seq: cutlass.Int32,
        causal_ptr: cute.Pointer,
        causal_stride: cutlass.Int64,
        causal_width: cutlass.Int32,
        causal_global: cutlass.Int32,
        k_scale_ptr: cute.Pointer,
        v_scale_ptr: cute.Pointer,
        scale_log2: cutlass.Float32,
        split: cutlass.Int32,
        num_splits: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        wg_warp: cutlass.Int32,
        lane: cutlass.Int32,
        s_consumer: pipeline.PipelineConsumer,
        p_producer: pipeline.PipelineProducer,
        o_consumer: pipeline.PipelineConsumer,
        softmax_bar: pipeline.NamedBarrier,
        row_scale_bar: pipeline.NamedBarrier,
    ):
        """Online softmax down the key (lane) axis of S^T, one column per query row."""
        rows = self.v.rows
        d_tiles = self.v.d_tiles
        acc_dtype = self.acc_dtype
        lane_slots = (rows + 31) // 32  # columns whose shared max/sum this lane publishes

        # S, P and O are handled 32 columns (rows) at a time, so a thread holds one chunk of
        # scores / probabilities / O at once whatever ``rows`` is: chunk c of the TMEM copy
        # partition is columns 32 c .. 32 c + 31 (test_tcgen05_host checks it on the DSL).
        chunk = min(rows, 32)
        chunks = rows // chunk
        load_atom = cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(chunk)), acc_dtype)
        load_s = tcgen05.make_tmem_copy(load_atom, tCtS[MMA + (0,)])
        thr_load = load_s.get_slice(wg_tidx)
        store_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(chunk)), acc_dtype),
            tCtO[MMA + (0,)],
        )
        thr_store_o = store_o.get_slice(wg_tidx)
        tStS = thr_load.partition_S(tCtS)  # (CPY, chunks, 1, 1, s_stages)
        tSsP = thr_load.partition_D(tCsP)  # (CPY, chunks, 1, 1, s_stages)
        tStO = thr_load.partition_S(tCtO)  # (CPY, chunks, 1, 1, d_tiles)
        tStO_dst = thr_store_o.partition_D(tCtO)
        chunk_shape = tSsP[(None, 0, 0, 0, 0)].shape

        # Zero O (BMM2 always accumulates) and the shared row state.
        zero_o = cute.make_rmem_tensor(chunk_shape, acc_dtype)
        zero_o.fill(0.0)
        for dm in cutlass.range_constexpr(d_tiles):
            for c in cutlass.range_constexpr(chunks):
                cute.copy(thr_store_o, zero_o, tStO_dst[(None, c, 0, 0, dm)])
        cute.arch.fence_view_async_tmem_store()
        for k in cutlass.range_constexpr(lane_slots):
            c = k * 32 + lane
            if c < rows:
                if wg_warp == 0:
                    s_max[c, 0] = -acc_dtype.inf
                    s_max[c, 1] = -acc_dtype.inf
        row_scale_bar.arrive_and_wait()  # row scales from the converter's Q prologue
        softmax_bar.arrive_and_wait()

        # Per-column constants in shared memory (read as broadcasts every tile, so they cost no
        # registers): log2-domain score scale and the last key the column's query may see.
        causal = causal_global
        if causal_width == 1:
            causal = cute.make_tensor(
                causal_ptr + cutlass.Int64(seq) * causal_stride, cute.make_layout(1)
            )[0].to(cutlass.Int32)
        if causal_width == 4:
            flag = cute.make_tensor(
                cute.recast_ptr(causal_ptr, dtype=cutlass.Int32)
                + cutlass.Int64(seq) * causal_stride,
                cute.make_layout(1),
            )[0]
            causal = cutlass.select_(flag != 0, cutlass.Int32(1), cutlass.Int32(0))
        k_scale = cute.make_tensor(k_scale_ptr + kv_head, cute.make_layout(1))[0]
        for k in cutlass.range_constexpr((rows + 127) // 128):
            n = k * 128 + wg_tidx
            if n < rows:
                s_col_scale[n] = scale_log2 * k_scale * s_row_scale[n]
                position = L.query_position(L.row_token(row_base + n, group), q_len, kv_len)
                s_last_key[n] = cutlass.select_(causal != 0, position, kv_len - 1)
        softmax_bar.arrive_and_wait()
        # Column state is the same in every thread, so lane c % 32 of each warp keeps the
        # running maximum of column c and computes its correction; the other lanes fetch it
        # with one shuffle per column (cheaper than holding all columns in every thread).
        m_prev = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
        m_prev.fill(-acc_dtype.inf)
        l_mine = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
        l_mine.fill(0.0)

        for s in cutlass.range(iters):
            parity = s % 2
            s_handle = s_consumer.wait_and_advance()
            j = (first_tile + s) * L.KEY_TILE + wg_tidx
            # Pass 1: masked column maxima, chunk by chunk.
            mine = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
            for c in cutlass.range_constexpr(chunks):
                scores = cute.make_rmem_tensor(chunk_shape, acc_dtype)
                cute.copy(load_s, tStS[(None, c, 0, 0, s_handle.index)], scores)
                cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(chunk):
                    n = c * chunk + i
                    visible = L.key_visible(j, kv_len, s_last_key[n], 1)
                    masked = cutlass.select_(visible, scores[i], -acc_dtype.inf)
                    col_max = cute.arch.warp_redux_sync(masked, kind="fmax", nan=True)
                    if n % 32 == lane:
                        mine[n // 32] = cute.arch.fmax(col_max, m_prev[n // 32])
            for k in cutlass.range_constexpr(lane_slots):
                c = k * 32 + lane
                if c < rows:
                    cute.arch.atomic_fmax(
                        s_max.iterator + s_max.layout((c, parity)),
                        mine[k],
                        sem="relaxed",
                        scope="cta",
                    )
            softmax_bar.arrive_and_wait()

            correction = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
            for k in cutlass.range_constexpr(lane_slots):
                c = cutlass.min(k * 32 + lane, rows - 1)
                m_new = s_max[c, parity]
                m_use = cutlass.select_(m_new == -acc_dtype.inf, cutlass.Float32(0.0), m_new)
                correction[k] = _exp2((m_prev[k] - m_use) * s_col_scale[c])
                m_prev[k] = m_new
            # Pass 2: S read again from TMEM (cheaper than holding it), P in fp16 to shared
            # memory, and the column sums of P as BMM2 multiplies it: lane c of each warp gets
            # its 32 keys' sum for column 32 k + c (lane_slots sums per thread, not rows).
            p_handle = p_producer.acquire_and_advance()
            for c in cutlass.range_constexpr(chunks):
                scores = cute.make_rmem_tensor(chunk_shape, acc_dtype)
                cute.copy(load_s, tStS[(None, c, 0, 0, s_handle.index)], scores)
                cute.arch.fence_view_async_tmem_load()
                probs = cute.make_rmem_tensor(chunk_shape, self.mma_dtype)
                for i in cutlass.range_constexpr(chunk):
                    n = c * chunk + i
                    visible = L.key_visible(j, kv_len, s_last_key[n], 1)
                    m_new = s_max[n, parity]
                    m_use = cutlass.select_(m_new == -acc_dtype.inf, cutlass.Float32(0.0), m_new)
                    p = _exp2((scores[i] - m_use) * s_col_scale[n])
                    probs[i] = cutlass.Float32(
                        cutlass.select_(visible, p, cutlass.Float32(0.0))
                    ).to(self.mma_dtype)
                cute.autovec_copy(probs, tSsP[(None, c, 0, 0, p_handle.index)])
                part = _warp_column_sums(
                    [
                        probs[i].to(acc_dtype) if i < chunk else cutlass.Float32(0.0)
                        for i in range(32)
                    ],
                    lane,
                )
                l_mine[c] = l_mine[c] * correction[c] + part
            cute.arch.fence_view_async_shared()
            p_handle.commit()
            s_handle.release()  # after the second read of S

            if s > 0:
                o_handle = o_consumer.wait_and_advance()
                for dm in cutlass.range_constexpr(d_tiles):
                    for c in cutlass.range_constexpr(chunks):
                        acc = cute.make_rmem_tensor(chunk_shape, acc_dtype)
                        cute.copy(load_s, tStO[(None, c, 0, 0, dm)], acc)
                        for i in cutlass.range_constexpr(chunk):
                            n = c * chunk + i
                            acc[i] = acc[i] * cute.arch.shuffle_sync(correction[n // 32], n % 32)
                        cute.copy(thr_store_o, acc, tStO_dst[(None, c, 0, 0, dm)])
                cute.arch.fence_view_async_tmem_store()
                o_handle.release()

        # ---- epilogue: column sums across the 128 key lanes, then O / l, or the split state.
        for k in cutlass.range_constexpr(lane_slots):
            c = k * 32 + lane
            if c < rows:
                s_sum[c, wg_warp] = l_mine[k]
        softmax_bar.arrive_and_wait()

        final = (iters + 1) % 2  # parity of the last tile's maximum
        v_scale = cute.make_tensor(v_scale_ptr + kv_head, cute.make_layout(1))[0]
        split_mode = num_splits > 1
        if wg_tidx < rows:
            n = wg_tidx
            r = row_base + n
            if split_mode and r < num_rows:
                l_sum = s_sum[n, 0] + s_sum[n, 1] + s_sum[n, 2] + s_sum[n, 3]
                m_fin = s_max[n, final]
                scale_n = s_col_scale[n]
                lse = -acc_dtype.inf
                if l_sum > 0.0:
                    lse = m_fin * scale_n + cute.math.log2(l_sum, fastmath=False)
                token = L.row_token(r, group)
                head = L.row_head(r, group, kv_head)
                idx = (cutlass.Int64(split) * num_tokens + q_start + token) * num_q_heads + head
                cute.make_tensor(ws_lse_ptr + idx, cute.make_layout(1))[0] = lse

        # The last O: wait without advancing, read chunk by chunk, release at the end (which
        # lets the MMA warp free TMEM). An empty split writes zeros.
        o_last = o_consumer.current_handle()
        if iters > 0:
            o_consumer.wait()
        for dm in cutlass.range_constexpr(d_tiles):
            d = dm * L.KEY_TILE + wg_tidx
            for c in cutlass.range_constexpr(chunks):
                acc = cute.make_rmem_tensor(chunk_shape, acc_dtype)
                acc.fill(0.0)
                if iters > 0:
                    cute.copy(load_s, tStO[(None, c, 0, 0, dm)], acc)
                    cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(chunk):
                    n = c * chunk + i
                    r = row_base + n
                    if r < num_rows:
                        l_sum = s_sum[n, 0] + s_sum[n, 1] + s_sum[n, 2] + s_sum[n, 3]
                        inv = cutlass.select_(l_sum > 0.0, v_scale / l_sum, cutlass.Float32(0.0))
                        value = acc[i] * inv
                        token = L.row_token(r, group)
                        head = L.row_head(r, group, kv_head)
                        if split_mode:
                            idx = (
                                (cutlass.Int64(split) * num_tokens + q_start + token) * num_q_heads
                                + head
                            ) * self.v.head_dim + d
                            cute.make_tensor(ws_o_ptr + idx, cute.make_layout(1))[0] = value
                        else:
                            off = (
                                cutlass.Int64(q_start + token) * o_stride_t
                                + cutlass.Int64(head) * o_stride_h
                                + d
                            )
                            cute.make_tensor(out_ptr + off, cute.make_layout(1))[0] = value.to(
                                self.q_dtype
                            )
        if iters > 0:
            o_last.release()
