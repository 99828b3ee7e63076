"""Softmax warpgroup of the tcgen05 kernel: masked column maxima across the 128 key lanes of
S^T, P in fp16, column sums, O rescale in TMEM, and the epilogue (output with the attention sink
in the denominator, or the split's fp32 partial O and log2 LSE for the merge kernel).

NEVER RUN ON A GPU. A mixin of dsl/tcgen05/kernel.Tcgen05PagedAttention; index maps from
dsl/tcgen05/layouts.py.
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
from dsl.common.work import CtaWork
from dsl.tcgen05 import layouts as L
from dsl.tcgen05.traits import Args

LOG2_E = math.log2(math.e)
MMA = (None, None, None)  # (MMA, #MMA_M, #MMA_K) slice


def _exp2(x):
    return cute.math.exp2(x, fastmath=True)


def _reference(m):
    """The maximum P is taken against: the running column maximum, 0 while the column has seen
    no key (no inf - inf in the new side of a correction, in the LSE and the sink's top)."""
    return cutlass.select_(m == -cutlass.Float32.inf, cutlass.Float32(0.0), m)


def _select_f32(cond, a, b):
    """cutlass.select_ on Float32 operands (the layouts maps pass Python floats)."""
    return cutlass.select_(cond, cutlass.Float32(a), cutlass.Float32(b))


@dsl_user_op
def _stmatrix_x4(address: cutlass.Int32, words, *, loc=None, ip=None):
    """``stmatrix.sync.aligned.m8n8.x4.shared.b16``: four 8x8 fp16 matrices; register m of lane
    l holds row l // 4, columns 2 (l % 4) and + 1 of matrix m, lane l gives the shared-memory
    address of row l % 8 of matrix l // 8 (eight contiguous fp16)."""
    operands = [cutlass.Int32(x).ir_value(loc=loc, ip=ip) for x in (address, *words)]
    llvm.inline_asm(
        None,
        operands,
        "stmatrix.sync.aligned.m8n8.x4.shared.b16 [$0], {$1, $2, $3, $4};",
        "r,r,r,r,r",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def _scale_by_power_of_two(p, t, *, loc=None, ip=None) -> cutlass.Float32:
    """p x 2^n for the integer n that t = x + layouts.ROUNDING_MAGIC holds in its low mantissa
    bits: n << 23 added to p's bits (layouts.correction_exp2)."""
    as_int = lambda v: llvm.bitcast(  # noqa: E731
        cutlass.Int32.mlir_type, cutlass.Float32(v).ir_value(loc=loc, ip=ip), loc=loc, ip=ip
    )
    n = cutlass.Int32(as_int(t)) - cutlass.Int32(as_int(L.ROUNDING_MAGIC))
    bits = cutlass.Int32(as_int(p)) + (n << 23)
    return cutlass.Float32(
        llvm.bitcast(cutlass.Float32.mlir_type, bits.ir_value(loc=loc, ip=ip), loc=loc, ip=ip)
    )


def _correction(x):
    """2^x (x <= 0) on the FMA pipe (layouts.correction_exp2; traced inline)."""
    return L.correction_exp2(
        x,
        cute.arch.fmax,
        lambda a, b, c: a * b + c,
        _scale_by_power_of_two,
    )


def _thread_columns(vector: cute.Pointer, slot0, dtype) -> cute.Tensor:
    """The 8 entries from ``slot0`` (a multiple of 8: layouts.thread_slot, plus a multiple of
    rows for a warp's column of s_sum) of a per-column shared vector, in registers (two 16-byte
    loads; traced inline)."""
    view = cute.make_tensor(
        vector + cute.assume(slot0, divby=L.THREAD_COLUMNS), cute.make_layout(L.THREAD_COLUMNS)
    )
    values = cute.make_rmem_tensor(cute.make_layout(L.THREAD_COLUMNS), dtype)
    values.store(view.load())
    return values


def score_chunk_mode(chunk: int, chunks: int, half: int):
    """Mode 1 of the softmax's 16x256b partition of S is (half of the warp's lanes, chunk),
    flattened to the half alone at 32 rows: the slice that holds registers 16 half .. 16 half
    + 15 of ``chunk`` (layouts.score_key_column)."""
    return (half, chunk) if chunks > 1 else half


def _load_scores(load_s, tStS, chunk, half, stage, score_shape, acc_dtype):
    """Registers 16 half .. 16 half + 15 of column chunk ``chunk`` of S stage ``stage``
    (layouts.score_key_column: 16 keys of the warp's TMEM lanes), read from TMEM into registers
    and visible to the thread (the TMEM-load fence) before use (traced inline). Half a chunk at
    a time keeps the softmax under ptxas' register cap at 128 rows."""
    scores = cute.make_rmem_tensor(score_shape, acc_dtype)
    mode = score_chunk_mode(chunk, cute.size(tStS, mode=[1]) // 2, half)
    cute.copy(load_s, tStS[(None, mode, 0, 0, stage)], scores)
    cute.arch.fence_view_async_tmem_load()
    return scores


def _output_word(value, q_is_bf16):
    """An output element's 16-bit word in the query dtype: bf16 when ``q_is_bf16``, else fp16
    (round to nearest even; the bf16 and fp16 variants run one kernel; traced inline)."""
    as_bf16 = cute.make_rmem_tensor(cute.make_layout(1), cutlass.BFloat16)
    as_bf16[0] = value.to(cutlass.BFloat16)
    as_f16 = cute.make_rmem_tensor(cute.make_layout(1), cutlass.Float16)
    as_f16[0] = value.to(cutlass.Float16)
    return cutlass.select_(
        q_is_bf16 != 0,
        cute.recast_tensor(as_bf16, cutlass.Uint16)[0],
        cute.recast_tensor(as_f16, cutlass.Uint16)[0],
    )


class SoftmaxRole:
    """Warps 0-3 (traits.SOFTMAX_WARPGROUP)."""

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
        s_position: cute.Tensor,
        s_grew: cute.Tensor,
        args: Args,
        work: CtaWork,
        wg_tidx: cutlass.Int32,
        wg_warp: cutlass.Int32,
        lane: cutlass.Int32,
        s_consumer: pipeline.PipelineConsumer,
        p_producer: pipeline.PipelineProducer,
        o_consumer: pipeline.PipelineConsumer,
        softmax_bar: pipeline.NamedBarrier,
        row_scale_bar: pipeline.NamedBarrier,
        tmem_free_bar: pipeline.NamedBarrier,
    ):
        """Online softmax down the key (lane) axis of S^T, one column per query row. Every
        hand-off of TMEM work to or from an MMA thread (mbarrier arrive / wait) is bracketed by
        ``tcgen05.fence::before_thread_sync`` / ``after_thread_sync``, and the last TMEM access
        is announced on ``tmem_free_bar`` (the BMM2 warp frees TMEM after it)."""
        rows = self.v.rows
        d_tiles = self.v.d_tiles
        acc_dtype = self.acc_dtype
        lane_slots = rows // 32  # columns whose exp2 offset each lane of a warp writes
        # Thread n owns column n's running maximum and correction (the threads past ``rows``
        # follow the last column and publish nothing).
        own = cutlass.min(wg_tidx, rows - 1)
        own_slot = L.column_slot(own)
        chunks = rows // L.COLUMN_CHUNK

        # S is read 32 columns at a time with tcgen05.ld.16x256b (layouts.score_key_column: a
        # thread holds 4 keys x 8 columns of the chunk); O^T, a TMEM lane per head dim, with
        # 32x32b (thread t: head dim t, register i: column 32 c + i). test_tcgen05_host checks
        # both partitions on the DSL.
        load_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld16x256bOp(tcgen05.Repetition(4)), acc_dtype),
            tCtS[MMA + (0,)],
        )
        thr_load = load_s.get_slice(wg_tidx)
        # (CPY: 16 registers, (half of the warp's lanes, chunk), 1, 1, s_stages)
        tStS = thr_load.partition_S(tCtS)
        score_shape = thr_load.partition_D(tCsP)[
            (None, score_chunk_mode(0, chunks, 0), 0, 0, 0)
        ].shape
        load_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.Ld32x32bOp(tcgen05.Repetition(32)), acc_dtype),
            tCtO[MMA + (0,)],
        )
        thr_load_o = load_o.get_slice(wg_tidx)
        store_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.St32x32bOp(tcgen05.Repetition(32)), acc_dtype),
            tCtO[MMA + (0,)],
        )
        thr_store_o = store_o.get_slice(wg_tidx)
        tStO = thr_load_o.partition_S(tCtO)  # (CPY, chunks, 1, 1, d_tiles)
        tStO_dst = thr_store_o.partition_D(tCtO)
        o_shape = thr_load_o.partition_D(tCsP)[(None, 0, 0, 0, 0)].shape

        # Zero O (BMM2 always accumulates) and the shared row state.
        zero_o = cute.make_rmem_tensor(o_shape, acc_dtype)
        zero_o.fill(0.0)
        for dm in cutlass.range_constexpr(d_tiles):
            for c in cutlass.range_constexpr(chunks):
                cute.copy(thr_store_o, zero_o, tStO_dst[(None, c, 0, 0, dm)])
        cute.arch.fence_view_async_tmem_store()
        for k in cutlass.range_constexpr(lane_slots):
            if wg_warp == 0:
                s_max[k * 32 + lane, 0] = -acc_dtype.inf
                s_max[k * 32 + lane, 1] = -acc_dtype.inf
        row_scale_bar.arrive_and_wait()  # row scales from the converter's Q prologue
        softmax_bar.arrive_and_wait()

        # Per-column constants in shared memory, at layouts.column_slot (a thread's 8 columns
        # of a chunk contiguous): log2-domain score scale and the column's query position; the
        # window's (before, after) offsets from it are the same for the whole CTA.
        k_scale = cute.make_tensor(args.k_scale_ptr + work.kv_head, cute.make_layout(1))[0]
        # Every column scale has this sign (the bf16 row factors are powers of two): the lazy
        # check's monotonic shortcut (check_pass).
        negative_scale = args.scale_log2 * k_scale < 0.0
        for k in cutlass.range_constexpr((rows + 127) // 128):
            n = k * 128 + wg_tidx
            if n < rows:
                slot = L.column_slot(n)
                s_col_scale[slot] = args.scale_log2 * k_scale * s_row_scale[n]
                s_position[slot] = X.query_position(
                    X.row_token(work.row_base + n, work.group), work.q_len, work.kv_len
                )
        softmax_bar.arrive_and_wait()
        # Column state is the same in every warp: thread n keeps the running maximum of column
        # n (one register) and computes its correction; exact tiles share the corrections
        # through shared memory.
        m_prev = cute.make_rmem_tensor(cute.make_layout(1), acc_dtype)
        m_prev.fill(-acc_dtype.inf)
        # Running column sums of P: per chunk, this thread's 8 columns (layouts.thread_column)
        # summed over its 4 keys, across tiles; the epilogue adds the lanes and warps.
        l_part = cute.make_rmem_tensor(cute.make_layout(chunks * L.THREAD_COLUMNS), acc_dtype)
        l_part.fill(0.0)
        # P's shared-memory tile (BMM2's B operand): stmatrix addresses are byte offsets from it.
        p_base = tCsP.iterator.toint()

        # Only a tile some key of which one of the CTA's rows does not see is masked (the last
        # tile, the causal diagonal, the window's edges: X.window_tile_needs_mask from the first
        # and last row's positions); the rest skip the per-score predicate.
        before, after = X.window_offsets(
            args.window_left, args.window_right, work.causal, cutlass.select_, cutlass.min
        )
        first_position = X.query_position(
            X.row_token(work.row_base, work.group), work.q_len, work.kv_len
        )
        last_position = X.query_position(
            X.row_token(work.last_row, work.group), work.q_len, work.kv_len
        )
        for s in cutlass.range(work.iters):
            parity = s % 2
            s_handle = s_consumer.wait_and_advance()
            tcgen05_fence("after_thread_sync")  # BMM1's S before the loads
            key0 = (work.first_tile + s) * L.KEY_TILE
            needs_mask = X.window_tile_needs_mask(
                key0, key0 + L.KEY_TILE, work.kv_len, first_position, last_position, before, after
            )
            # Lazy rescale (layouts.rescale_needed): past the first tile, an unmasked tile
            # first checks its scores against the reference maxima (half an FFMA2 and an FMNMX
            # per score); only when one outruns them, on masked tiles and on the first tile
            # does it take the exact column maxima and rescale O. A column with no key yet has
            # offset +inf (layouts.exp2_offset): its first visible key always takes that path.
            exact = cutlass.Int32(1)
            if cutlass.select_(needs_mask, cutlass.Int32(0), s) > 0:
                highest = -acc_dtype.inf
                if negative_scale:
                    highest = self.check_pass(
                        load_s, tStS, s_handle.index, score_shape, s_col_scale, s_sum, wg_warp,
                        lane, True,
                    )  # fmt: skip
                else:
                    highest = self.check_pass(
                        load_s, tStS, s_handle.index, score_shape, s_col_scale, s_sum, wg_warp,
                        lane, False,
                    )  # fmt: skip
                grew = cute.arch.vote_any_sync(L.rescale_needed(highest))
                if lane == 0:
                    s_grew[wg_warp, parity] = cutlass.select_(
                        grew, cutlass.Int32(1), cutlass.Int32(0)
                    )
                softmax_bar.arrive_and_wait()  # every warp's vote (double-buffered by parity)
                exact = (
                    s_grew[0, parity] | s_grew[1, parity] | s_grew[2, parity] | s_grew[3, parity]
                )
                if exact != 0:
                    self.exact_maxima(
                        load_s, tStS, s_handle.index, score_shape, s_position, before, after,
                        m_prev, own_slot, l_part, s_max, s_row_scale, s_col_scale, s_sum, parity,
                        key0, work.kv_len, wg_tidx, wg_warp, lane, False, softmax_bar,
                    )  # fmt: skip
            elif needs_mask:
                self.exact_maxima(
                    load_s, tStS, s_handle.index, score_shape, s_position, before, after, m_prev,
                    own_slot, l_part, s_max, s_row_scale, s_col_scale, s_sum, parity, key0,
                    work.kv_len,
                    wg_tidx, wg_warp, lane, True, softmax_bar,
                )  # fmt: skip
            else:
                self.exact_maxima(
                    load_s, tStS, s_handle.index, score_shape, s_position, before, after, m_prev,
                    own_slot, l_part, s_max, s_row_scale, s_col_scale, s_sum, parity, key0,
                    work.kv_len,
                    wg_tidx, wg_warp, lane, False, softmax_bar,
                )  # fmt: skip
            # Pass 2: S read again from TMEM (cheaper than holding it), P in fp16 to shared
            # memory (converted two at a time, stored by stmatrix), and its fp32 column sums
            # added into this thread's running partial sums.
            p_handle = p_producer.acquire_and_advance()
            # Every mbarrier wait before tcgen05 work is fenced (this one orders nothing of
            # TMEM: S was fenced at its own wait; the rule stays checkable on the PTX).
            tcgen05_fence("after_thread_sync")
            p_stage = p_base + p_handle.index * L.p_stage_bytes(rows)
            if needs_mask:
                self.p_pass(
                    load_s, tStS, s_handle.index, score_shape, p_stage, s_position, before,
                    after, s_col_scale, s_sum, l_part, key0, work.kv_len, wg_tidx, wg_warp, lane,
                    True,
                )  # fmt: skip
            else:
                self.p_pass(
                    load_s, tStS, s_handle.index, score_shape, p_stage, s_position, before,
                    after, s_col_scale, s_sum, l_part, key0, work.kv_len, wg_tidx, wg_warp, lane,
                    False,
                )  # fmt: skip
            cute.arch.fence_view_async_shared()
            # This tile's S loads (waited for) and, at tile 0, O's zero stores before the MMAs
            # that the two arrivals release: BMM2 of this tile, BMM1 two tiles on.
            tcgen05_fence("before_thread_sync")
            p_handle.commit()
            s_handle.release()  # after the second read of S

            if s > 0:
                o_handle = o_consumer.wait_and_advance()
                tcgen05_fence("after_thread_sync")
                if exact != 0:
                    self.rescale_o(load_o, thr_store_o, tStO, tStO_dst, s_row_scale, o_shape)
                tcgen05_fence("before_thread_sync")  # the rescale before the next BMM2
                o_handle.release()

        # ---- epilogue: column sums across the 8 lanes that share each column
        # (layouts.COLUMN_LANE_STRIDES) and the 4 warps, then O / l, or the split state.
        for c in cutlass.range_constexpr(chunks):
            sums = [l_part[c * L.THREAD_COLUMNS + i] for i in range(L.THREAD_COLUMNS)]
            for stride in L.COLUMN_LANE_STRIDES:
                sums = [x + cute.arch.shuffle_sync_bfly(x, offset=stride) for x in sums]
            if lane < 4:
                slot0 = L.thread_slot(lane, c)
                for i in cutlass.range_constexpr(L.THREAD_COLUMNS):
                    s_sum[slot0 + i, wg_warp] = sums[i]
        softmax_bar.arrive_and_wait()

        # Thread n: column n's output factor into s_row_scale[n] (the row scales are spent):
        # v_scale / l, or with a sink v_scale x keep / (l x keep + 2^(sink - top)) where both
        # terms are taken at top = max(m, sink) in log2 units (neither can overflow); with
        # splits v_scale / l and the log2 LSE without the sink (the merge adds it once).
        # Column n = wg_tidx is owned by this very thread: its reference maximum.
        m_ref = _reference(m_prev[0])
        v_scale = cute.make_tensor(args.v_scale_ptr + work.kv_head, cute.make_layout(1))[0]
        split_mode = args.num_splits > 1
        if wg_tidx < rows:
            n = wg_tidx
            slot = L.column_slot(n)
            r = work.row_base + n
            l_sum = s_sum[slot, 0] + s_sum[slot, 1] + s_sum[slot, 2] + s_sum[slot, 3]
            m_scaled = m_ref * s_col_scale[slot]
            factor = cutlass.select_(l_sum > 0.0, v_scale / l_sum, cutlass.Float32(0.0))
            if r < work.num_rows:
                token = X.row_token(r, work.group)
                head = X.row_head(r, work.group, work.kv_head)
                if split_mode:
                    # l = 0: no key in this split (-inf, the merge skips it); a NaN l (a NaN
                    # in the cache) is no empty split: its NaN LSE reaches the merge.
                    lse = -acc_dtype.inf
                    if l_sum != 0.0:
                        lse = m_scaled + cute.math.log2(l_sum, fastmath=False)
                    idx = (
                        cutlass.Int64(work.split) * args.num_tokens + work.q_start + token
                    ) * args.num_q_heads + head
                    cute.make_tensor(args.ws_lse_ptr + idx, cute.make_layout(1))[0] = lse
                else:
                    sink = cute.make_tensor(args.sinks_ptr + head, cute.make_layout(1))[0] * LOG2_E
                    top = cute.arch.fmax(m_scaled, sink)
                    top = cutlass.select_(top == -acc_dtype.inf, cutlass.Float32(0.0), top)
                    keep = _exp2(m_scaled - top)
                    denominator = l_sum * keep + _exp2(sink - top)
                    factor = cutlass.select_(
                        denominator > 0.0, v_scale * keep / denominator, cutlass.Float32(0.0)
                    )
            s_row_scale[n] = factor
        softmax_bar.arrive_and_wait()

        # The last O: wait without advancing, read chunk by chunk, release at the end (which
        # lets the MMA warp free TMEM). An empty split writes zeros.
        o_last = o_consumer.current_handle()
        if work.iters > 0:
            o_consumer.wait()
            tcgen05_fence("after_thread_sync")
        for dm in cutlass.range_constexpr(d_tiles):
            d = dm * L.KEY_TILE + wg_tidx
            for c in cutlass.range_constexpr(chunks):
                acc = cute.make_rmem_tensor(o_shape, acc_dtype)
                acc.fill(0.0)
                if work.iters > 0:
                    cute.copy(load_o, tStO[(None, c, 0, 0, dm)], acc)
                    cute.arch.fence_view_async_tmem_load()
                for i in cutlass.range_constexpr(L.COLUMN_CHUNK):
                    n = c * L.COLUMN_CHUNK + i
                    r = work.row_base + n
                    writes = r < work.num_rows
                    if cutlass.const_expr(self.v.head_dim < L.ITEM_BYTES):
                        writes = writes & (d < self.v.head_dim)  # lanes 64..127: no head dim
                    if writes:
                        value = acc[i] * s_row_scale[n]
                        token = X.row_token(r, work.group)
                        head = X.row_head(r, work.group, work.kv_head)
                        if split_mode:
                            idx = (
                                (cutlass.Int64(work.split) * args.num_tokens + work.q_start + token)
                                * args.num_q_heads
                                + head
                            ) * self.v.head_dim + d
                            cute.make_tensor(args.ws_o_ptr + idx, cute.make_layout(1))[0] = value
                        else:
                            off = (
                                cutlass.Int64(work.q_start + token) * args.o_stride_t
                                + cutlass.Int64(head) * args.o_stride_h
                                + d
                            )
                            cute.make_tensor(args.out_ptr + off, cute.make_layout(1))[0] = (
                                _output_word(value, args.q_is_bf16)
                            )
        # The last TMEM access of this warpgroup is behind it (O's loads here, or O's zero
        # stores when the CTA has no key tile): TMEM may be freed.
        tcgen05_fence("before_thread_sync")
        if work.iters > 0:
            o_last.release()
        tmem_free_bar.arrive()

    @cute.jit
    def check_pass(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        stage: cutlass.Int32,
        score_shape: cute.Shape,
        s_col_scale: cute.Tensor,
        s_sum: cute.Tensor,
        wg_warp: cutlass.Int32,
        lane: cutlass.Int32,
        negative_scale: cutlass.Constexpr,
    ) -> cutlass.Float32:
        """The largest exp2 argument (S x scale + offset, the reference maxima's offsets of the
        last exact tile) among this thread's scores of an unmasked tile. S x scale + offset
        (one rounded FFMA) is monotonic in S, non-decreasing for a scale >= 0: the argument of
        each column's largest score (its smallest when ``negative_scale``: the scales' sign is
        the CTA's, from k_scale and the softmax scale) is the column's largest argument, so a
        thread takes its 4 keys' extreme per column (FMNMX) and 8 arguments per chunk."""
        rows = self.v.rows
        acc_dtype = self.acc_dtype
        extreme = cute.arch.fmin if cutlass.const_expr(negative_scale) else cute.arch.fmax
        highest = -acc_dtype.inf
        for c in cutlass.range_constexpr(rows // L.COLUMN_CHUNK):
            slot0 = L.thread_slot(lane, c)
            columns = [None] * L.THREAD_COLUMNS
            for half in cutlass.range_constexpr(2):
                scores = _load_scores(load_s, tStS, c, half, stage, score_shape, acc_dtype)
                for r in cutlass.range_constexpr(L.SCORE_REGISTERS // 2):
                    i = L.score_entry(r)
                    columns[i] = scores[r] if columns[i] is None else extreme(columns[i], scores[r])
            scale = _thread_columns(s_col_scale.iterator, slot0, acc_dtype)
            offset = _thread_columns(s_sum.iterator, wg_warp * rows + slot0, acc_dtype)
            for i in cutlass.range_constexpr(0, L.THREAD_COLUMNS, 2):
                args = cute.arch.fma_packed_f32x2(
                    (columns[i], columns[i + 1]),
                    (scale[i], scale[i + 1]),
                    (offset[i], offset[i + 1]),
                )
                highest = cute.arch.fmax(highest, cute.arch.fmax(args[0], args[1]))
        return highest

    @cute.jit
    def exact_maxima(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        stage: cutlass.Int32,
        score_shape: cute.Shape,
        s_position: cute.Tensor,
        before: cutlass.Int32,
        after: cutlass.Int32,
        m_prev: cute.Tensor,
        own_slot: cutlass.Int32,
        l_part: cute.Tensor,
        s_max: cute.Tensor,
        s_correction: cute.Tensor,
        s_col_scale: cute.Tensor,
        s_sum: cute.Tensor,
        parity: cutlass.Int32,
        key0: cutlass.Int32,
        kv_len: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        wg_warp: cutlass.Int32,
        lane: cutlass.Int32,
        masked: cutlass.Constexpr,
        softmax_bar: pipeline.NamedBarrier,
    ):
        """New reference maxima: the tile's column maxima (masked keys as -inf when ``masked``)
        across the 128 key lanes, joined with the running ones in s_max[:, parity] (shared
        atomics); lane c of each warp then writes column 32 k + c's exp2 offset
        (layouts.exp2_offset: -maximum x scale, +inf for a column with nothing visible yet) into
        this warp's column of s_sum, so the P pass is half a packed FFMA2 per score.
        s_sum[:, warp] is only this warp's (it holds the column sums after the loop). The
        columns' corrections scale ``l_part`` here and go to ``s_correction`` (s_row_scale,
        spent once the column scales are set) for rescale_o after the P pass: every warp writes
        the same values, and the next exact tile writes only after a softmax_bar of its own,
        which every warp reaches after this tile's O rescale."""
        rows = self.v.rows
        acc_dtype = self.acc_dtype
        for c in cutlass.range_constexpr(rows // L.COLUMN_CHUNK):
            slot0 = L.thread_slot(lane, c)
            if cutlass.const_expr(masked):
                position = _thread_columns(s_position.iterator, slot0, cutlass.Int32)
            col_max = [-acc_dtype.inf] * L.THREAD_COLUMNS
            for half in cutlass.range_constexpr(2):
                scores = _load_scores(load_s, tStS, c, half, stage, score_shape, acc_dtype)
                for r in cutlass.range_constexpr(L.SCORE_REGISTERS // 2):
                    i = L.score_entry(r)
                    value = scores[r]
                    if cutlass.const_expr(masked):
                        key, _ = L.score_key_column(wg_tidx, 16 * half + r)
                        visible = X.key_in_window(key0 + key, kv_len, position[i], before, after)
                        value = cutlass.select_(visible, value, -acc_dtype.inf)
                    col_max[i] = cute.arch.fmax(col_max[i], value)
            # Across the 8 lanes that hold the same columns.
            for stride in L.COLUMN_LANE_STRIDES:
                col_max = [
                    cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=stride))
                    for x in col_max
                ]
            if lane < 4:
                for i in cutlass.range_constexpr(L.THREAD_COLUMNS):
                    cute.arch.atomic_fmax(
                        s_max.iterator + s_max.layout((slot0 + i, parity)),
                        col_max[i],
                        sem="relaxed",
                        scope="cta",
                    )
        # With the running maxima, once per column (by its owner thread).
        if wg_tidx < rows:
            cute.arch.atomic_fmax(
                s_max.iterator + s_max.layout((own_slot, parity)),
                m_prev[0],
                sem="relaxed",
                scope="cta",
            )
        softmax_bar.arrive_and_wait()
        # Lane c of each warp: column 32 k + c's offset into this warp's vector.
        for k in cutlass.range_constexpr(rows // 32):
            slot = L.column_slot(k * 32 + lane)
            s_sum[slot, wg_warp] = L.exp2_offset(
                s_max[slot, parity], s_col_scale[slot], _select_f32
            )
        # Thread n: column n's correction (finite for a column that had no key:
        # layouts.correction_old_reference; on the FMA pipe: layouts.correction_exp2) to
        # s_correction, where every thread reads its columns' for the running partial sums and,
        # after the P pass, rescale_o for O.
        m_new = s_max[own_slot, parity]
        old_reference = L.correction_old_reference(m_prev[0], _select_f32)
        correction = _correction((old_reference - _reference(m_new)) * s_col_scale[own_slot])
        m_prev[0] = m_new
        if wg_tidx < rows:
            s_correction[wg_tidx] = correction
        softmax_bar.arrive_and_wait()
        for c in cutlass.range_constexpr(rows // L.COLUMN_CHUNK):
            for i in cutlass.range_constexpr(L.THREAD_COLUMNS):
                factor = s_correction[c * L.COLUMN_CHUNK + L.thread_column(lane, i)]
                l_part[c * L.THREAD_COLUMNS + i] = l_part[c * L.THREAD_COLUMNS + i] * factor
        # Every lane's offsets before any lane reads them (the next tile's writes come after
        # softmax_bar, when no lane reads these any more).
        cute.arch.sync_warp()

    @cute.jit
    def rescale_o(
        self,
        load_o: cute.TiledCopy,
        thr_store_o: cute.TiledCopy,
        tStO: cute.Tensor,
        tStO_dst: cute.Tensor,
        s_correction: cute.Tensor,
        o_shape: cute.Shape,
    ):
        """O^T[:, n] *= column n's correction (s_correction[n]), in TMEM."""
        for dm in cutlass.range_constexpr(self.v.d_tiles):
            for c in cutlass.range_constexpr(self.v.rows // L.COLUMN_CHUNK):
                acc = cute.make_rmem_tensor(o_shape, self.acc_dtype)
                cute.copy(load_o, tStO[(None, c, 0, 0, dm)], acc)
                cute.arch.fence_view_async_tmem_load()  # tcgen05.wait::ld before acc is read
                for i in cutlass.range_constexpr(L.COLUMN_CHUNK):
                    acc[i] = acc[i] * s_correction[c * L.COLUMN_CHUNK + i]
                cute.copy(thr_store_o, acc, tStO_dst[(None, c, 0, 0, dm)])
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def p_pass(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        s_stage: cutlass.Int32,
        score_shape: cute.Shape,
        p_stage: cutlass.Int32,
        s_position: cute.Tensor,
        before: cutlass.Int32,
        after: cutlass.Int32,
        s_col_scale: cute.Tensor,
        s_sum: cute.Tensor,
        l_part: cute.Tensor,
        key0: cutlass.Int32,
        kv_len: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        wg_warp: cutlass.Int32,
        lane: cutlass.Int32,
        masked: cutlass.Constexpr,
    ):
        """P = exp2(S x scale + offset) of this tile (0 at masked keys when ``masked``), its fp32
        sums added into this thread's running partial sums ``l_part`` (per chunk its 8 columns
        over its 4 keys: one packed FADD2 per two scores), and P in fp16 (two values per
        conversion) stored by stmatrix into shared memory at ``p_stage`` (layouts.p_offset, the
        B operand of BMM2)."""
        rows = self.v.rows
        acc_dtype = self.acc_dtype
        for c in cutlass.range_constexpr(rows // L.COLUMN_CHUNK):
            slot0 = L.thread_slot(lane, c)
            # The thread's stmatrix row address of this chunk, less an immediate per store.
            p_row = p_stage + L.p_store_base(wg_tidx, c, rows)
            for half in cutlass.range_constexpr(2):
                # The column constants once per chunk, or per half where registers are short
                # (head_dim 256: held across both halves, they spilled at 64 rows).
                if cutlass.const_expr(half == 0 or self.v.d_tiles > 1):
                    scale = _thread_columns(s_col_scale.iterator, slot0, acc_dtype)
                    offset = _thread_columns(s_sum.iterator, wg_warp * rows + slot0, acc_dtype)
                    if cutlass.const_expr(masked):
                        position = _thread_columns(s_position.iterator, slot0, cutlass.Int32)
                scores = _load_scores(load_s, tStS, c, half, s_stage, score_shape, acc_dtype)
                probs32 = cute.make_rmem_tensor(score_shape, acc_dtype)
                for r in cutlass.range_constexpr(0, L.SCORE_REGISTERS // 2, 2):
                    i = L.score_entry(r)
                    args = cute.arch.fma_packed_f32x2(
                        (scores[r], scores[r + 1]),
                        (scale[i], scale[i + 1]),
                        (offset[i], offset[i + 1]),
                    )
                    for h in cutlass.range_constexpr(2):
                        p = _exp2(args[h])
                        if cutlass.const_expr(masked):
                            key, _ = L.score_key_column(wg_tidx, 16 * half + r + h)
                            visible = X.key_in_window(
                                key0 + key, kv_len, position[i + h], before, after
                            )
                            p = cutlass.Float32(cutlass.select_(visible, p, cutlass.Float32(0.0)))
                        probs32[r + h] = p
                    k = c * L.THREAD_COLUMNS + i
                    l_part[k], l_part[k + 1] = cute.arch.add_packed_f32x2(
                        (l_part[k], l_part[k + 1]), (probs32[r], probs32[r + 1])
                    )
                probs = cute.make_rmem_tensor(score_shape, self.mma_dtype)
                probs.store(probs32.load().to(self.mma_dtype))
                words = cute.recast_tensor(probs, cutlass.Int32)
                for block in cutlass.range_constexpr(2):
                    _stmatrix_x4(
                        p_row + L.p_store_step(c, half, block, rows),
                        [
                            words[(L.p_store_register(half, block, m) - 16 * half) // 2]
                            for m in range(4)
                        ],
                    )
