"""Converter warpgroup of the tcgen05 kernel: Q prologue, paged cp.async K/V loads into the
swizzled FP8 ring, exact FP8 -> fp16 conversion into TMEM (the A operand of both GEMMs).

NEVER RUN ON A GPU. A mixin of dsl/tcgen05/kernel.Tcgen05PagedAttention (it reads the variant
and dtypes from ``self``); index maps from dsl/tcgen05/layouts.py.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import tcgen05
from cutlass.cutlass_dsl import dsl_user_op
from cutlass.experimental.primitives.nvvm_wrapper import tcgen05_fence

from dsl.common import indexing as X
from dsl.common import precision as P
from dsl.common.kernel_reads import read_page_id
from dsl.common.variant import BLOCK_SHIFTS
from dsl.common.work import CtaWork
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T
from dsl.tcgen05.traits import Args

MMA = (None, None, None)  # (MMA, #MMA_M, #MMA_K) slice
CPY = (None,) + MMA


@dsl_user_op
def bitselect(mask: int, a, b, *, loc=None, ip=None) -> cutlass.Int32:
    """``(a & mask) | (b & ~mask)`` as one ``lop3.b32`` (LUT 0xE4: a where the immediate mask
    is set, else b); written as ``&`` / ``|`` it compiles to two LOP3s in the integer-pipe FP8
    conversion (layouts.e4m3x4_to_f16x2_scaled)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for x in (a, b)]
    return cutlass.Int32(
        llvm.inline_asm(
            cutlass.Int32.mlir_type,
            operands,
            f"lop3.b32 $0, $1, $2, {mask & 0xFFFFFFFF:#x}, 0xE4;",
            "=r,r,r",
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


def _thread_source(ptr, slot, kv_head, chunk, stride_b, stride_s, stride_h):
    """Address (as an integer) of this loader thread's 16-byte chunk of (page 0, ``slot``,
    ``kv_head``) in one cache: everything of a copy's source but its page (traced inline)."""
    offset = X.key_offset(0, slot, kv_head, stride_b, stride_s, stride_h) + chunk * L.CHUNK
    return (ptr + cute.assume(offset, divby=L.CHUNK)).toint()


def _query_value(words: cute.Tensor, i: int, q_is_bf16: cutlass.Int32) -> cutlass.Float32:
    """Query element ``i`` of a piece of 16-bit words in fp32, exact: bf16 when ``q_is_bf16``,
    else fp16 (the bf16 and fp16 variants run one kernel; traced inline)."""
    as_bf16 = cute.recast_tensor(words, cutlass.BFloat16)[i].to(cutlass.Float32)
    as_f16 = cute.recast_tensor(words, cutlass.Float16)[i].to(cutlass.Float32)
    return cutlass.select_(q_is_bf16 != 0, as_bf16, as_f16)


def _first_k_blocks(operand: cute.Tensor, k_blocks: int) -> cute.Tensor:
    """An (MMA, M, K, stages) operand (TMEM or the swizzled ring) restricted to its first
    ``k_blocks`` k-steps (the same tensor when that is all of them)."""
    shape, stride = operand.shape, operand.stride
    if k_blocks == shape[2]:
        return operand
    layout = cute.make_layout((shape[0], shape[1], k_blocks, shape[3]), stride=stride)
    return cute.make_tensor(operand.iterator, layout)


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
        args: Args,
        work: CtaWork,
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
        cache_dtype = self.cache_dtype

        # ---- zero the ring once: rows outside [first_key, kv_len) are never copied, and must
        # hold finite values (P is 0 there, and 0 x NaN would poison O).
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
            args.q_ptr,
            args.q_stride_t,
            args.q_stride_h,
            work.kv_head,
            work.group,
            work.q_start,
            work.num_rows,
            work.row_base,
            args.q_is_bf16,
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
        # K: only the head dims BMM1 reads (layouts.bmm1_k_blocks; head_dim 64: the first 64
        # bytes of each row, half the conversions; the stage's other columns keep whatever
        # an earlier item left there, which no k-step reads).
        k_blocks = L.bmm1_k_blocks(v.head_dim)
        tAtK = _first_k_blocks(tAtK, k_blocks)
        tAsK = _first_k_blocks(tAsK, k_blocks)
        store_atom_k = cute.make_copy_atom(
            tcgen05.St16x256bOp(tcgen05.Repetition(k_blocks * L.UMMA_K * 16 // 256)), mma_dtype
        )
        store_k = tcgen05.make_tmem_copy(store_atom_k, tAtK[MMA + (0,)])
        thr_store_k = store_k.get_slice(wg_tidx)
        k_cvt_shape = thr_store_k.partition_S(tAtK).shape[:-1]
        tKtK = thr_store_k.partition_D(tAtK)
        load_k = cute.make_tiled_copy_S(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x16x8bOp(num_matrices=4), cache_dtype),
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
                cute.nvgpu.warp.LdMatrix16x16x8bOp(transpose=True, num_matrices=2), cache_dtype
            ),
            store_v,
        )
        thr_load_v = load_v.get_slice(wg_tidx)
        tVsV = thr_load_v.partition_S(tAsV)
        v_raw_shape = thr_load_v.partition_D(tAsV).shape[:-1]

        copy16 = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(), cache_dtype, num_bits_per_copy=128
        )
        total = L.item_count(work.iters, d_tiles)
        lookahead = T.LOAD_STAGES - 1

        # Everything of a copy's address but its page, once per thread: the source pointer of
        # (KV head, the thread's slot and chunk) in K and in V, and its ring destination; a
        # copy then costs one shuffle (its page) and one wide multiply-add.
        lane = wg_tidx % 32
        chunk = L.loader_chunk(wg_tidx)
        thread_slot = L.loader_row(wg_tidx, 0)
        k_thread = _thread_source(args.k_ptr, thread_slot, work.kv_head, chunk, args.k_stride_b,
        args.k_stride_s,
                                  args.k_stride_h)  # fmt: skip
        v_thread = _thread_source(args.v_ptr, thread_slot, work.kv_head, chunk, args.v_stride_b,
        args.v_stride_s,
                                  args.v_stride_h)  # fmt: skip
        # The host refuses cache strides of 2^31 elements or more: page x block stride is then
        # one 32 x 32 -> 64-bit multiply-add, and offsets inside a page stay 32-bit.
        k_block, k_slot = args.k_stride_b.to(cutlass.Int32), args.k_stride_s.to(cutlass.Int32)
        v_block, v_slot = args.v_stride_b.to(cutlass.Int32), args.v_stride_s.to(cutlass.Int32)
        ring_thread = cute.recast_ptr(ring, dtype=cache_dtype) + cute.assume(
            L.loader_ring_offset(wg_tidx, 0), divby=L.CHUNK
        )
        bt_row = args.block_table_ptr + cutlass.Int64(work.seq) * args.bt_stride_s
        num_cols = X.page_count(work.kv_len, args.block_shift)

        # The block table is read an item ahead (lane p of each warp: the item's page p), so the
        # read's latency hides behind the copies of the item before.
        pages = self.read_item_pages(
            0,
            work.iters,
            work.first_tile,
            bt_row,
            args.bt_stride_b,
            num_cols,
            args.block_shift,
            lane,
        )
        # A loop, not unrolled: the copies' page-size specialisations are emitted once here and
        # once in the main loop (unrolled, the prologue tripled them: SASS size and compile time).
        for p in cutlass.range(lookahead, unroll=1):
            if p < total:
                pages_next = self.read_item_pages(
                    p + 1,
                    work.iters,
                    work.first_tile,
                    bt_row,
                    args.bt_stride_b,
                    num_cols,
                    args.block_shift,
                    lane,
                )
                self.load_item(
                    p, p, copy16, ring_thread, pages, k_thread, v_thread, k_block, k_slot,
                    v_block, v_slot, work.kv_len, work.first_key, work.first_tile, work.iters,
                    args.block_shift, wg_tidx,
                )  # fmt: skip
                pages = pages_next
            cute.arch.cp_async_commit_group()

        for i in cutlass.range(total):
            ring_bar.arrive_and_wait()  # every thread is done reading the stage refilled next
            nxt = i + lookahead
            if nxt < total:
                pages_next = self.read_item_pages(
                    nxt + 1,
                    work.iters,
                    work.first_tile,
                    bt_row,
                    args.bt_stride_b,
                    num_cols,
                    args.block_shift,
                    lane,
                )
                self.load_item(
                    nxt, nxt % T.LOAD_STAGES, copy16, ring_thread, pages, k_thread, v_thread,
                    k_block, k_slot, v_block, v_slot, work.kv_len, work.first_key, work.first_tile,
                    work.iters, args.block_shift, wg_tidx,
                )  # fmt: skip
                pages = pages_next
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(lookahead)
            ring_bar.arrive_and_wait()  # item i is in shared memory, from every thread
            stage = i % T.LOAD_STAGES
            is_v, _, _ = L.item_of(i, work.iters, d_tiles, cutlass.select_)
            if is_v:
                raw = cute.make_rmem_tensor(v_raw_shape, cache_dtype)
                cute.copy(thr_load_v, tVsV[CPY + (stage,)], raw)
                cvt = cute.make_rmem_tensor(v_cvt_shape, mma_dtype)
                self.convert_exactly(raw, cvt, v_cvt_shape)
                handle = cvt_producer.acquire_and_advance()
                tcgen05_fence("after_thread_sync")  # the MMA that read this stage before the stores
                cute.copy(thr_store_v, cvt, tVtV[CPY + (handle.index,)])
                cute.arch.fence_view_async_tmem_store()
                tcgen05_fence("before_thread_sync")  # the stores before the MMA thread's wait
                handle.commit()
            else:
                raw = cute.make_rmem_tensor(k_raw_shape, cache_dtype)
                cute.copy(thr_load_k, tKsK[CPY + (stage,)], raw)
                cvt = cute.make_rmem_tensor(k_cvt_shape, mma_dtype)
                self.convert_exactly(raw, cvt, k_cvt_shape)
                handle = cvt_producer.acquire_and_advance()
                tcgen05_fence("after_thread_sync")
                cute.copy(thr_store_k, cvt, tKtK[CPY + (handle.index,)])
                cute.arch.fence_view_async_tmem_store()
                tcgen05_fence("before_thread_sync")
                handle.commit()
        return

    @cute.jit
    def convert_exactly(self, raw: cute.Tensor, cvt: cute.Tensor, cvt_shape: cute.Shape):
        """FP8 -> fp16, exact. e4m3: F2FP (two values per instruction) for most words, the
        integer pipe for the first ``traits.INTEGER_CONVERTED_WORDS`` (layouts.
        e4m3x4_to_f16x2_scaled, then x 2^8). e5m2: every word by byte moves (layouts.
        e5m2x4_to_f16x2), no conversion-pipe instruction. Both tensors are compact, so word w
        of ``raw`` is words 2w, 2w + 1 of ``cvt``."""
        raw_words = cute.recast_tensor(raw, cutlass.Int32)
        cvt_words = cute.recast_tensor(cvt, cutlass.Int32)
        prmt = lambda a, b, sel: cutlass.Int32(cute.arch.prmt(a, b, sel))  # noqa: E731
        if cutlass.const_expr(self.cache_dtype is cutlass.Float8E5M2):
            for w in cutlass.range_constexpr(cute.size(raw_words)):
                halves = L.e5m2x4_to_f16x2(raw_words[w], prmt)
                for h in cutlass.range_constexpr(2):
                    cvt_words[2 * w + h] = halves[h]
        else:
            cvt.store(raw.load().to(self.mma_dtype).reshape(cvt_shape))
            two_pow_8 = cutlass.Int32(0x5C005C00)  # fp16x2 (256, 256)
            minus_zero = cutlass.Int32(-0x7FFF8000)  # fp16x2 (-0, -0): keeps -0 as -0
            for w in cutlass.range_constexpr(T.INTEGER_CONVERTED_WORDS):
                halves = L.e4m3x4_to_f16x2_scaled(raw_words[w], prmt, bitselect)
                for h in cutlass.range_constexpr(2):
                    cvt_words[2 * w + h] = cute.arch.fma_packed_f16x2(
                        halves[h], two_pow_8, minus_zero
                    )

    @cute.jit
    def read_item_pages(
        self,
        item: cutlass.Int32,
        iters: cutlass.Int32,
        first_tile: cutlass.Int32,
        bt_row: cute.Pointer,
        bt_stride_b: cutlass.Int64,
        num_cols: cutlass.Int32,
        block_shift: cutlass.Int32,
        lane: cutlass.Int32,
    ) -> cutlass.Int32:
        """This lane's page (layouts.lane_page) of the key tile of staged item ``item``; 0 past
        the sequence's last page (and for an item past the split's last)."""
        v = self.v
        _, tile, _ = L.item_of(item, iters, v.d_tiles, cutlass.select_)
        col0, _ = L.tile_page_slot((first_tile + tile) * L.KEY_TILE, block_shift)
        col = col0 + L.lane_page(lane, block_shift)
        return read_page_id(bt_row, bt_stride_b, col, num_cols)

    @cute.jit
    def load_item(
        self,
        item: cutlass.Int32,
        stage: cutlass.Int32,
        copy16: cute.CopyAtom,
        ring_thread: cute.Pointer,
        pages: cutlass.Int32,
        k_thread: cutlass.Int64,
        v_thread: cutlass.Int64,
        k_block: cutlass.Int32,
        k_slot: cutlass.Int32,
        v_block: cutlass.Int32,
        v_slot: cutlass.Int32,
        kv_len: cutlass.Int32,
        first_key: cutlass.Int32,
        first_tile: cutlass.Int32,
        iters: cutlass.Int32,
        block_shift: cutlass.Int32,
        wg_tidx: cutlass.Int32,
    ):
        """cp.async this thread's 16-byte chunks of staged item ``item`` into ring ``stage``: a
        tile wholly inside [first_key, kv_len) copies every row unchecked; another (the last, a
        window's first) skips the rows outside (indexing.key_loaded; the ring was zeroed once,
        and earlier items left finite bytes there). The copies
        are specialised per page size (variant.BLOCK_SHIFTS, one uniform branch per item), so a
        step's page lane and slots are immediates as with a compile-time page size."""
        is_v, tile, dslice = L.item_of(item, iters, self.v.d_tiles, cutlass.select_)
        key0 = (first_tile + tile) * L.KEY_TILE
        thread_src = cute.make_ptr(
            self.cache_dtype,
            cutlass.Int64(cutlass.select_(is_v, v_thread, k_thread))
            + cutlass.Int64(dslice * L.ITEM_BYTES),
            cute.AddressSpace.gmem,
            assumed_align=L.CHUNK,
        )
        block = cutlass.Int32(cutlass.select_(is_v, v_block, k_block))
        slot_stride = cutlass.Int32(cutlass.select_(is_v, v_slot, k_slot))
        dst = ring_thread + cute.assume(stage * (L.KEY_TILE * L.ITEM_BYTES), divby=L.CHUNK)
        for k in cutlass.range_constexpr(len(BLOCK_SHIFTS)):
            if block_shift == BLOCK_SHIFTS[k]:
                if X.tile_wholly_loaded(key0, key0 + L.KEY_TILE, first_key, kv_len):
                    self.copy_rows(
                        copy16, dst, thread_src, block, slot_stride, pages, key0, first_key,
                        kv_len, wg_tidx, BLOCK_SHIFTS[k], False,
                    )  # fmt: skip
                else:
                    self.copy_rows(
                        copy16, dst, thread_src, block, slot_stride, pages, key0, first_key,
                        kv_len, wg_tidx, BLOCK_SHIFTS[k], True,
                    )  # fmt: skip

    @cute.jit
    def copy_rows(
        self,
        copy16: cute.CopyAtom,
        dst: cute.Pointer,
        thread_src: cute.Pointer,
        block: cutlass.Int32,
        slot_stride: cutlass.Int32,
        pages: cutlass.Int32,
        key0: cutlass.Int32,
        first_key: cutlass.Int32,
        kv_len: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        block_shift: cutlass.Constexpr,
        checked: cutlass.Constexpr,
    ):
        """One cp.async per step: the step's page from the lane that read it, then thread
        pointer + page x block stride + (tile slot + step slot) x slot stride -> the thread's
        ring destination + the step's immediate (pages of ``2^block_shift`` keys); predicated by
        layouts.loader_predicate (rows outside [first_key, kv_len) if ``checked``, head_dim
        64's half rows)."""
        _, slot0 = L.tile_page_slot(key0, block_shift)
        for step in cutlass.range_constexpr(L.LOADER_STEPS):
            step_page, step_slot = L.loader_step_page_slot(step, block_shift)
            page = pages
            if cutlass.const_expr(L.pages_per_tile(block_shift) > 1):
                page = cute.arch.shuffle_sync(pages, offset=step_page)
            # Page ids and strides are non-negative: unsigned, so 32 x 32 -> 64 is one
            # IMAD.WIDE.U32 with the thread pointer as its addend.
            off = cutlass.Int64(
                cutlass.Uint64(page.to(cutlass.Uint32)) * cutlass.Uint64(block.to(cutlass.Uint32))
            )
            slot = slot0 + step_slot
            if cutlass.const_expr(not isinstance(slot, int) or slot != 0):
                off = off + cutlass.Int64(slot * slot_stride)
            src = cute.make_tensor(
                thread_src + cute.assume(off, divby=L.CHUNK), cute.make_layout(L.CHUNK)
            )
            at = cute.make_tensor(dst + L.loader_ring_offset(0, step), cute.make_layout(L.CHUNK))
            keep = L.loader_predicate(
                wg_tidx, step, key0, first_key, kv_len, self.v.head_dim, checked
            )
            if cutlass.const_expr(keep is None):
                cute.copy(copy16, src, at)
            else:
                if keep:
                    cute.copy(copy16, src, at)

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
        q_is_bf16: cutlass.Int32,
        wg_tidx: cutlass.Int32,
    ):
        """Q rows (16-bit words, bf16 when ``q_is_bf16`` else fp16) -> fp16 B operand in smem.
        A bf16 row is multiplied by 2^e (layouts.row_scale_exponent), exact; s_row_scale[row] =
        2^-e rejoins the softmax scale (e = 0 for an fp16 row).
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
            # Read in pieces of at most 32 elements, held in the query dtype (half the
            # registers of fp32) and widened on use; a row longer than one piece (one thread
            # per row at 128 rows) is read twice, for its maximum and for the stores, instead
            # of held whole in registers.
            piece = min(seg, 32)
            pieces = seg // piece
            valid = row_base + r < num_rows
            offset = (
                cutlass.Int64(q_start + token) * q_stride_t
                + cutlass.Int64(head) * q_stride_h
                + part * seg
            )
            vals = self.q_piece(q_ptr + offset, 0, piece, valid)
            biggest = cutlass.Float32(0.0)
            for k in cutlass.range_constexpr(pieces):
                if cutlass.const_expr(k > 0):
                    vals = self.q_piece(q_ptr + offset, k * piece, piece, valid)
                for i in cutlass.range_constexpr(piece):
                    value = _query_value(vals, i, q_is_bf16)
                    biggest = cute.arch.fmax(biggest, cute.math.absf(value))
            for b in cutlass.range_constexpr(int(math.log2(per_row))):
                biggest = cute.arch.fmax(
                    biggest, cute.arch.shuffle_sync_bfly(biggest, offset=1 << b)
                )
            box = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float32)
            box[0] = biggest
            bits = box.load().bitcast(cutlass.Int32)[0]
            exponent = P.row_scale_exponent((bits >> 23) & 0xFF, cutlass.min)
            exponent = cutlass.Int32(cutlass.select_(q_is_bf16 != 0, exponent, cutlass.Int32(0)))
            factor = cute.math.exp2(exponent.to(cutlass.Float32))
            inverse = cute.math.exp2(-exponent.to(cutlass.Float32))
            for k in cutlass.range_constexpr(pieces):
                if cutlass.const_expr(pieces > 1):
                    vals = self.q_piece(q_ptr + offset, k * piece, piece, valid)
                for i in cutlass.range_constexpr(piece):
                    d = part * seg + k * piece + i
                    tBsQ[((r, d % 16), 0, (d % L.ITEM_BYTES) // 16, d // L.ITEM_BYTES)] = (
                        _query_value(vals, i, q_is_bf16) * factor
                    ).to(self.mma_dtype)
            if part == 0:
                s_row_scale[r] = inverse

    @cute.jit
    def q_piece(
        self,
        row_ptr: cute.Pointer,
        first: cutlass.Constexpr,
        length: cutlass.Constexpr,
        valid: cutlass.Boolean,
    ) -> cute.Tensor:
        """Elements first .. first + length - 1 of a query row (zeros for a row past R) as
        their 16-bit words (half the registers of fp32; :func:`_query_value` widens one)."""
        words = cute.make_rmem_tensor(cute.make_layout(length), cutlass.Uint16)
        words.fill(0)
        if valid:
            src = cute.make_tensor(row_ptr + first, cute.make_layout(length))
            for i in cutlass.range_constexpr(length):
                words[i] = src[i]
        return words
