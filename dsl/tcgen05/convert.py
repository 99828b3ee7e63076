"""Converter warpgroup of the tcgen05 kernel: Q prologue, paged cp.async K/V loads into the
swizzled FP8 ring, exact FP8 -> fp16 conversion into TMEM (the A operand of both GEMMs).

NEVER RUN ON A GPU. A mixin of dsl/tcgen05/kernel.Tcgen05PagedAttention (it reads the variant
and dtypes from ``self``); index maps from dsl/tcgen05/layouts.py.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import tcgen05

from dsl.common import indexing as X
from dsl.common import precision as P
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T

MMA = (None, None, None)  # (MMA, #MMA_M, #MMA_K) slice
CPY = (None,) + MMA


class ConvertRole:
    """Warps 4-7 (traits.CONVERT_WARPGROUP)."""

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
                col, slot = X.page_slot(j, self.v.page_size)
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
                    off = X.key_offset(page, slot, kv_head, v_stride_b, v_stride_s, v_stride_h)
                    src = cute.make_tensor(
                        v_ptr + cute.assume(off + within, divby=L.CHUNK), cute.make_layout(L.CHUNK)
                    )
                    cute.copy(copy16, src, dst)
                else:
                    off = X.key_offset(page, slot, kv_head, k_stride_b, k_stride_s, k_stride_h)
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
            token = X.row_token(row_base + r, group)
            head = X.row_head(row_base + r, group, kv_head)
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
                exponent = P.row_scale_exponent((bits >> 23) & 0xFF)
                factor = cute.math.exp2(exponent.to(cutlass.Float32))
                inverse = cute.math.exp2(-exponent.to(cutlass.Float32))
            for i in cutlass.range_constexpr(seg):
                d = part * seg + i
                tBsQ[((r, d % 16), 0, (d % L.ITEM_BYTES) // 16, d // L.ITEM_BYTES)] = (
                    vals[i].to(cutlass.Float32) * factor
                ).to(self.mma_dtype)
            if part == 0:
                s_row_scale[r] = inverse
