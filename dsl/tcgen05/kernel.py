"""tcgen05 paged attention over an FP8 KV cache, BF16/FP16 query: the CUTLASS Python DSL kernel.

NEVER RUN ON A GPU: this kernel compiles for sm_100f, B200 and B300 (dsl/build.py), and its index
maps are replayed on the CPU (tests/test_tcgen05_emulation.py); no SM100 GPU has executed it.

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
A sliding window (window_left / window_right, SPEC section 3) limits each CTA to the key tiles its
rows' windows touch and masks their edges; the sinks (fp32 per query head, natural log) join the
denominator once: in the unsplit epilogue, or in the merge after a split launch.
k_scale is folded into the softmax scale and v_scale into the output (SPEC section 3); a bf16
query is made fp16 by a per-row power of two (dsl/tcgen05/layouts.py) folded into the same scale.
The pipeline order (K of tile s+1 converted before V of tile s, so BMM1 of the next tile runs
under the softmax of this one) follows the CUTLASS mixed-input decode example's design.

This module holds the host entry, the shared setup (shared memory, barriers, TMEM) and the two
MMA warps; the converter role is in convert.py, the softmax role and epilogue in softmax.py.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import OperandMajorMode, tcgen05
from cutlass.experimental.primitives.nvvm_wrapper import tcgen05_fence

from dsl.common.entry import LaunchEntry
from dsl.common.work import cta_work
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T
from dsl.tcgen05.convert import ConvertRole
from dsl.tcgen05.softmax import SoftmaxRole
from dsl.tcgen05.traits import Args

MMA = (None, None, None)  # (MMA, #MMA_M, #MMA_K) slice
CPY = (None,) + MMA

_DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


def _handoff(kind, stages: int, barrier_storage):
    """(producer, consumer) of a ``stages``-deep mbarrier pipeline between a 128-thread
    warpgroup and the one thread issuing an MMA warp's tcgen05.mma: ``PipelineAsyncUmma`` when
    the warpgroup produces (Q, converted K/V items, P), ``PipelineUmmaAsync`` when the MMA
    does (S, O). Barriers are initialised without a fence or sync (``defer_sync``): the kernel
    fences all of them once (``fence.mbarrier_init``, as tcgen05.commit arrives on them from the
    async proxy) before the CTA's first sync."""
    one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread)
    warpgroup = pipeline.CooperativeGroup(pipeline.Agent.Thread, 128)
    producer, consumer = (
        (warpgroup, one_thread) if kind is pipeline.PipelineAsyncUmma else (one_thread, warpgroup)
    )
    return kind.create(
        num_stages=stages,
        producer_group=producer,
        consumer_group=consumer,
        barrier_storage=barrier_storage,
        defer_sync=True,
    ).make_participants()


class Tcgen05PagedAttention(LaunchEntry, ConvertRole, SoftmaxRole):
    """One variant (dsl/tcgen05/traits.Variant) of the kernel; ``__call__`` (the host entry
    that ``cute.compile`` traces and ``export_to_c`` exports) is dsl/common/entry.py's."""

    family = "tcgen05"
    threads = T.THREADS

    def __init__(self, variant: T.Variant):
        variant.check()
        self.v = variant
        self.cache_dtype = _DTYPES[variant.cache_dtype]
        self.mma_dtype = cutlass.Float16
        self.acc_dtype = cutlass.Float32
        self.mma_tile = (L.KEY_TILE, variant.rows, L.ITEM_BYTES)

    def kernel_objects(self):
        """The tiled MMAs the kernel takes first: S^T = K Q^T and O^T += V^T P."""
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
        return tiled_mma_kq, tiled_mma_vp

    @cute.kernel
    def kernel(
        self,
        tiled_mma_kq: cute.TiledMma,
        tiled_mma_vp: cute.TiledMma,
        args: Args,
    ):
        v = self.v
        rows = v.rows
        tile_m, tile_n, tile_k = self.mma_tile
        d_tiles = v.d_tiles
        mma_dtype = self.mma_dtype
        acc_dtype = self.acc_dtype

        # ---------------------------------------------------------------- work decomposition
        row_tile, kv_head, seq_split = cute.arch.block_idx()
        seq = seq_split // args.num_splits
        split = seq_split % args.num_splits
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(tidx // 32)
        warpgroup = cute.arch.make_warp_uniform(tidx // 128)
        wg_tidx = tidx % 128
        wg_warp = warp_idx % 4
        lane = cute.arch.lane_idx()

        work = cta_work(args, row_tile, kv_head, seq, split, rows, L.KEY_TILE)
        # A tile of rows past this sequence's R has nothing to do (the grid covers the longest).
        idle = work.row_base >= work.num_rows

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
        s_position = smem.allocate_tensor(cutlass.Int32, cute.make_layout(rows), 16)
        # Per softmax warp and tile parity: a score outran the reference maxima (lazy rescale).
        s_grew = smem.allocate_tensor(cutlass.Int32, cute.make_layout((4, 2)), 16)

        ring_bytes = T.LOAD_STAGES * L.KEY_TILE * L.ITEM_BYTES
        ring = smem.allocate_array(cutlass.Int8, ring_bytes, byte_alignment=1024)

        # Q (fp16, rows x head_dim), the B operand of BMM1.
        smem_layout_q = sm100_utils.make_smem_layout_b(
            tiled_mma_kq, self.mma_tile, mma_dtype, d_tiles
        )
        tBsQ = smem.allocate_tensor(mma_dtype, smem_layout_q.outer, 1024, smem_layout_q.inner)
        # The FP8 ring seen as the ldmatrix sources: K (K-major A) and V (MN-major A).
        smem_layout_k = sm100_utils.make_smem_layout_a(
            tiled_mma_kq, self.mma_tile, self.cache_dtype, T.LOAD_STAGES
        )
        smem_layout_v = sm100_utils.make_smem_layout_a(
            tiled_mma_vp, self.mma_tile, self.cache_dtype, T.LOAD_STAGES, is_k_major=False
        )
        tAsK = cute.make_tensor(
            cute.recast_ptr(ring, smem_layout_k.inner, dtype=self.cache_dtype), smem_layout_k.outer
        )
        tAsV = cute.make_tensor(
            cute.recast_ptr(ring, smem_layout_v.inner, dtype=self.cache_dtype), smem_layout_v.outer
        )
        # P (fp16): written as the C tile of BMM1 (key, row), read as the B tile of BMM2.
        tile_nm = (None, tile_n, tile_m)
        tBsP_layout = sm100_utils.make_smem_layout_b(tiled_mma_vp, tile_nm, mma_dtype, v.s_stages)
        tBsP = smem.allocate_tensor(mma_dtype, tBsP_layout.outer, 1024, tBsP_layout.inner)

        # ---------------------------------------------------------------- barriers
        # Warpgroup -> MMA thread: Q, converted K/V items, P; MMA thread -> warpgroup: S, O.
        q_producer, q_consumer = _handoff(pipeline.PipelineAsyncUmma, 1, q_ready_bar)
        cvt_producer, cvt_consumer = _handoff(pipeline.PipelineAsyncUmma, v.convert_stages, cvt_bar)
        s_producer, s_consumer = _handoff(pipeline.PipelineUmmaAsync, v.s_stages, s_bar)
        p_producer, p_consumer = _handoff(pipeline.PipelineAsyncUmma, v.s_stages, p_bar)
        o_producer, o_consumer = _handoff(pipeline.PipelineUmmaAsync, 1, o_bar)
        softmax_bar = pipeline.NamedBarrier(barrier_id=1, num_threads=128)
        # The two MMA warps alternate on barriers 2 and 3, in pairs that neither warp skips:
        # BMM1 arrives on 2 and waits on 3 once per tile and once after its last; BMM2 waits on
        # 2 and arrives on 3 once before tile 0 and once per tile. So each arrival of one warp
        # is waited for by the other before it arrives again (two arrivals of one warp would
        # complete a phase alone), and each warp arrives as often as the other waits.
        mma_kq_bar = pipeline.NamedBarrier(barrier_id=2, num_threads=64)
        mma_vp_bar = pipeline.NamedBarrier(barrier_id=3, num_threads=64)
        row_scale_bar = pipeline.NamedBarrier(barrier_id=4, num_threads=256)
        ring_bar = pipeline.NamedBarrier(barrier_id=5, num_threads=128)
        # Softmax warpgroup -> BMM2 warp, once: the softmax's last TMEM access is done and TMEM
        # may be freed (it stores O even when the CTA has no key tile).
        tmem_free_bar = pipeline.NamedBarrier(barrier_id=6, num_threads=128 + 32)
        cute.arch.mbarrier_init_fence()

        # The BMM2 warp allocates TMEM and frees it (tcgen05.alloc and dealloc from one warp, as
        # CUTLASS's and FlashAttention 4's kernels do).
        if warp_idx == T.MMA_VP_WARP and not idle:
            cute.arch.alloc_tmem(v.tmem_alloc_columns, tmem_holder)
            tcgen05_fence("before_thread_sync")
        cute.arch.sync_threads()
        tcgen05_fence("after_thread_sync")

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
                args,
                work,
                wg_tidx,
                q_producer,
                cvt_producer,
                ring_bar,
                row_scale_bar,
            )
        # ================================================================ MMA warps
        elif warp_idx == T.MMA_KQ_WARP:
            tBsQ_desc = thr_mma_kq.make_fragment_B(tBsQ)
            # The k-steps covering a K item's head dims (head_dim 64: 4 of 8; Q's B operand is
            # not written past head_dim).
            assert cute.size(tAtK, mode=[2]) == L.ITEM_BYTES // L.UMMA_K
            k_blocks = L.bmm1_k_blocks(v.head_dim)
            q_consumer.wait_and_advance()
            s_token = True
            for s in cutlass.range(work.iters):
                k_token = cvt_consumer.try_wait()
                tiled_mma_kq.set(tcgen05.Field.ACCUMULATE, False)
                s_handle = s_producer.acquire_and_advance(s_token)
                for dk in cutlass.range_constexpr(d_tiles):
                    k_handle = cvt_consumer.wait_and_advance(k_token)
                    # The converter's tcgen05.st (and, for S, the softmax's tcgen05.ld) before
                    # this MMA: ordered across threads by the mbarrier and the fence pair.
                    tcgen05_fence("after_thread_sync")
                    if dk == d_tiles - 1:
                        mma_kq_bar.arrive()  # BMM2 of the previous tile may go
                    for kb in cutlass.range_constexpr(k_blocks):
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
                # BMM2 has passed the items before K of tile s + 1 (tile 0's K items, or the V
                # items of tile s - 1).
                mma_vp_bar.arrive_and_wait()
                # The S stage of the next tile, whatever the stage count.
                s_token = s_producer.try_acquire()
            if work.iters > 0:
                mma_kq_bar.arrive()  # the pair after the last tile: BMM2 of the last tile may go
                mma_vp_bar.arrive_and_wait()
        elif warp_idx == T.MMA_VP_WARP:
            tiled_mma_vp.set(tcgen05.Field.ACCUMULATE, True)
            tBsP_nk = cute.local_tile(
                tBsP, thr_mma_vp.partition_shape_B((tile_n, tile_k)), (0, 0, None, None)
            )
            tBsP_desc = thr_mma_vp.make_fragment_B(tBsP_nk)
            if work.iters > 0:
                for _ in cutlass.range_constexpr(d_tiles):
                    cvt_consumer.advance()  # K items of tile 0 belong to BMM1
                mma_kq_bar.arrive_and_wait()
                mma_vp_bar.arrive()  # BMM1's wait after tile 0
            o_token = True
            for s in cutlass.range(work.iters):
                if s < work.iters - 1:
                    for _ in cutlass.range_constexpr(d_tiles):
                        cvt_consumer.advance()  # K items of tile s + 1
                # BMM1 has passed the items before V of tile s (K of tile s + 1; after its last
                # tile, all of its items).
                mma_kq_bar.arrive_and_wait()
                # P of this tile, polled every tile (a token left over from the tile before
                # would skip the wait).
                p_token = p_consumer.try_wait()
                v_token = cvt_consumer.try_wait()
                p_handle = p_consumer.wait_and_advance(p_token)
                o_handle = o_producer.acquire_and_advance(o_token)
                for dm in cutlass.range_constexpr(d_tiles):
                    v_handle = cvt_consumer.wait_and_advance(v_token)
                    # The converter's V stores, the softmax's O stores and P hand-off.
                    tcgen05_fence("after_thread_sync")
                    if dm == d_tiles - 1:
                        mma_vp_bar.arrive()  # BMM1's wait after tile s + 1 (after its last)
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
            # Every MMA has completed (the softmax waited for the last S and O) and the softmax's
            # last TMEM load or store is done, with or without a key tile.
            tmem_free_bar.arrive_and_wait()
            tcgen05_fence("after_thread_sync")
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
                s_position,
                s_grew,
                args,
                work,
                wg_tidx,
                wg_warp,
                lane,
                s_consumer,
                p_producer,
                o_consumer,
                softmax_bar,
                row_scale_bar,
                tmem_free_bar,
            )
        return
