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
from cutlass.cute.nvgpu import tcgen05

from dsl.common import indexing as X
from dsl.tcgen05 import layouts as L

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


def _column_sums(values, lane, widths):
    """Butterfly transpose-reduce stages ``widths`` (descending powers of two, the first half
    of len(values)) over this lane's column entries (Python list of Float32): at stage w a lane
    keeps the half of its columns selected by its lane bit w and sends the other half to its
    partner, so column index bits end up equal to the lane bits (layouts.partial_sum_column).
    Returns the len(values) / 2^stages sums. The adds go two columns per packed FADD2 where a
    stage has two or more."""
    for width in widths:
        upper = (lane & width) != 0
        keep, received = [], []
        for i in range(width):
            send = cutlass.select_(upper, values[i], values[i + width])
            keep.append(cutlass.select_(upper, values[i + width], values[i]))
            received.append(cute.arch.shuffle_sync_bfly(send, offset=width))
        if width == 1:
            values = [keep[0] + received[0]]
        else:
            values = []
            for i in range(0, width, 2):
                values.extend(
                    cute.arch.add_packed_f32x2(
                        (keep[i], keep[i + 1]), (received[i], received[i + 1])
                    )
                )
    return values


def _load_scores(load_s, tStS, chunk, stage, chunk_shape, acc_dtype):
    """Scores of column chunk ``chunk`` of S stage ``stage``, read from TMEM into registers and
    visible to the thread (the TMEM-load fence) before use (traced inline)."""
    scores = cute.make_rmem_tensor(chunk_shape, acc_dtype)
    cute.copy(load_s, tStS[(None, chunk, 0, 0, stage)], scores)
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
        last_row: cutlass.Int32,
        first_tile: cutlass.Int32,
        iters: cutlass.Int32,
        causal: cutlass.Int32,
        window_left: cutlass.Int32,
        window_right: cutlass.Int32,
        sinks_ptr: cute.Pointer,
        k_scale_ptr: cute.Pointer,
        v_scale_ptr: cute.Pointer,
        scale_log2: cutlass.Float32,
        split: cutlass.Int32,
        num_splits: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        q_is_bf16: cutlass.Int32,
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
        # registers): log2-domain score scale and the column's query position; the window's
        # (before, after) offsets from it are the same for the whole CTA.
        k_scale = cute.make_tensor(k_scale_ptr + kv_head, cute.make_layout(1))[0]
        for k in cutlass.range_constexpr((rows + 127) // 128):
            n = k * 128 + wg_tidx
            if n < rows:
                s_col_scale[n] = scale_log2 * k_scale * s_row_scale[n]
                s_position[n] = X.query_position(X.row_token(row_base + n, group), q_len, kv_len)
        softmax_bar.arrive_and_wait()
        # Column state is the same in every thread, so lane c % 32 of each warp keeps the
        # running maximum of column c and computes its correction; the other lanes fetch it
        # with one shuffle per column (cheaper than holding all columns in every thread).
        m_prev = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
        m_prev.fill(-acc_dtype.inf)
        # Running column sums of P as the lanes' partial sums (layouts.partial_sums per chunk,
        # column layouts.partial_sum_column), reduced across lanes once, in the epilogue.
        partials = L.partial_sums(rows)
        l_part = cute.make_rmem_tensor(cute.make_layout(chunks * partials), acc_dtype)
        l_part.fill(0.0)

        # Only a tile some key of which one of the CTA's rows does not see is masked (the last
        # tile, the causal diagonal, the window's edges: X.window_tile_needs_mask from the first
        # and last row's positions); the rest skip the per-score predicate.
        before, after = X.window_offsets(
            window_left, window_right, causal, cutlass.select_, cutlass.min
        )
        first_position = X.query_position(X.row_token(row_base, group), q_len, kv_len)
        last_position = X.query_position(X.row_token(last_row, group), q_len, kv_len)
        for s in cutlass.range(iters):
            parity = s % 2
            s_handle = s_consumer.wait_and_advance()
            key0 = (first_tile + s) * L.KEY_TILE
            needs_mask = X.window_tile_needs_mask(
                key0, key0 + L.KEY_TILE, kv_len, first_position, last_position, before, after
            )
            # Lazy rescale (layouts.rescale_needed): past the first tile, an unmasked tile
            # first checks its scores against the reference maxima (half an FFMA2 and an FMNMX
            # per score); only when one outruns them, on masked tiles and on the first tile
            # does it take the exact column maxima and rescale O. A column with no key yet has
            # offset +inf (layouts.exp2_offset): its first visible key always takes that path.
            # The old side of each correction (layouts.correction_old_reference).
            old_reference = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
            for k in cutlass.range_constexpr(lane_slots):
                old_reference[k] = L.correction_old_reference(m_prev[k], _select_f32)
            exact = cutlass.Int32(1)
            if cutlass.select_(needs_mask, cutlass.Int32(0), s) > 0:
                highest = self.check_pass(
                    load_s, tStS, tSsP, s_handle.index, s_col_scale, s_sum, wg_warp
                )
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
                        load_s, tStS, tSsP, s_handle.index, s_position, before, after, m_prev,
                        s_max, s_col_scale, s_sum, parity, key0, kv_len, wg_tidx, wg_warp, lane,
                        False, softmax_bar,
                    )  # fmt: skip
            elif needs_mask:
                self.exact_maxima(
                    load_s, tStS, tSsP, s_handle.index, s_position, before, after, m_prev,
                    s_max, s_col_scale, s_sum, parity, key0, kv_len, wg_tidx, wg_warp, lane,
                    True, softmax_bar,
                )  # fmt: skip
            else:
                self.exact_maxima(
                    load_s, tStS, tSsP, s_handle.index, s_position, before, after, m_prev,
                    s_max, s_col_scale, s_sum, parity, key0, kv_len, wg_tidx, wg_warp, lane,
                    False, softmax_bar,
                )  # fmt: skip
            # Lane c of each warp: column 32 k + c's correction (exactly 1 where the reference
            # stayed; finite for a column that had no key: layouts.correction_old_reference).
            correction = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
            for k in cutlass.range_constexpr(lane_slots):
                c = cutlass.min(k * 32 + lane, rows - 1)
                correction[k] = _exp2((old_reference[k] - _reference(m_prev[k])) * s_col_scale[c])
            # The running partial sums follow the new maxima (only on exact tiles: elsewhere
            # every correction is exactly 1); lane c holds column 32 k + c's correction.
            if exact != 0:
                for k in cutlass.range_constexpr(chunks):
                    for i in cutlass.range_constexpr(partials):
                        factor = correction[k]
                        if cutlass.const_expr(partials > 1):
                            column = L.partial_sum_column(lane, i, partials)
                            factor = cute.arch.shuffle_sync(factor, column)
                        l_part[k * partials + i] = l_part[k * partials + i] * factor
            # Pass 2: S read again from TMEM (cheaper than holding it), P in fp16 to shared
            # memory (converted two at a time), and the column sums of P: the first butterfly
            # stages only (layouts.tile_sum_widths), added into the lanes' partial sums.
            p_handle = p_producer.acquire_and_advance()
            if needs_mask:
                self.p_pass(
                    load_s, tStS, tSsP, s_handle.index, p_handle.index, s_position, before, after,
                    s_col_scale, s_sum, l_part, key0, kv_len, wg_tidx, wg_warp, lane,
                    True,
                )  # fmt: skip
            else:
                self.p_pass(
                    load_s, tStS, tSsP, s_handle.index, p_handle.index, s_position, before, after,
                    s_col_scale, s_sum, l_part, key0, kv_len, wg_tidx, wg_warp, lane,
                    False,
                )  # fmt: skip
            cute.arch.fence_view_async_shared()
            p_handle.commit()
            s_handle.release()  # after the second read of S

            if s > 0:
                o_handle = o_consumer.wait_and_advance()
                if exact != 0:
                    self.rescale_o(load_s, thr_store_o, tStO, tStO_dst, correction, chunk_shape)
                o_handle.release()

        # ---- epilogue: column sums across the 128 key lanes, then O / l, or the split state.
        for k in cutlass.range_constexpr(chunks):
            warp_sum = _column_sums(
                [l_part[k * partials + i] for i in range(partials)],
                lane,
                L.epilogue_sum_widths(rows),
            )[0]
            c = k * 32 + lane
            if c < rows:
                s_sum[c, wg_warp] = warp_sum
        softmax_bar.arrive_and_wait()

        # Thread n: column n's output factor into s_row_scale[n] (the row scales are spent):
        # v_scale / l, or with a sink v_scale x keep / (l x keep + 2^(sink - top)) where both
        # terms are taken at top = max(m, sink) in log2 units (neither can overflow); with
        # splits v_scale / l and the log2 LSE without the sink (the merge adds it once).
        # Column n = wg_tidx is owned by this very lane (k = warp): its reference maximum.
        m_ref = m_prev[0]
        for k in cutlass.range_constexpr(1, lane_slots):
            m_ref = cutlass.select_(wg_warp == k, m_prev[k], m_ref)
        m_ref = _reference(m_ref)
        v_scale = cute.make_tensor(v_scale_ptr + kv_head, cute.make_layout(1))[0]
        split_mode = num_splits > 1
        if wg_tidx < rows:
            n = wg_tidx
            r = row_base + n
            l_sum = s_sum[n, 0] + s_sum[n, 1] + s_sum[n, 2] + s_sum[n, 3]
            m_scaled = m_ref * s_col_scale[n]
            factor = cutlass.select_(l_sum > 0.0, v_scale / l_sum, cutlass.Float32(0.0))
            if r < num_rows:
                token = X.row_token(r, group)
                head = X.row_head(r, group, kv_head)
                if split_mode:
                    lse = -acc_dtype.inf
                    if l_sum > 0.0:
                        lse = m_scaled + cute.math.log2(l_sum, fastmath=False)
                    idx = (cutlass.Int64(split) * num_tokens + q_start + token) * num_q_heads + head
                    cute.make_tensor(ws_lse_ptr + idx, cute.make_layout(1))[0] = lse
                else:
                    sink = cute.make_tensor(sinks_ptr + head, cute.make_layout(1))[0] * LOG2_E
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
                    writes = r < num_rows
                    if cutlass.const_expr(self.v.head_dim < L.ITEM_BYTES):
                        writes = writes & (d < self.v.head_dim)  # lanes 64..127: no head dim
                    if writes:
                        value = acc[i] * s_row_scale[n]
                        token = X.row_token(r, group)
                        head = X.row_head(r, group, kv_head)
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
                            cute.make_tensor(out_ptr + off, cute.make_layout(1))[0] = _output_word(
                                value, q_is_bf16
                            )
        if iters > 0:
            o_last.release()

    @cute.jit
    def check_pass(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        tSsP: cute.Tensor,
        stage: cutlass.Int32,
        s_col_scale: cute.Tensor,
        s_sum: cute.Tensor,
        wg_warp: cutlass.Int32,
    ) -> cutlass.Float32:
        """The largest exp2 argument (S x scale + offset, the reference maxima's offsets of the
        last exact tile) among this thread's scores of an unmasked tile."""
        rows = self.v.rows
        chunk = min(rows, 32)
        chunk_shape = tSsP[(None, 0, 0, 0, 0)].shape
        highest = -self.acc_dtype.inf
        for c in cutlass.range_constexpr(rows // chunk):
            scores = _load_scores(load_s, tStS, c, stage, chunk_shape, self.acc_dtype)
            for i in cutlass.range_constexpr(0, chunk, 2):
                n = c * chunk + i
                args = cute.arch.fma_packed_f32x2(
                    (scores[i], scores[i + 1]),
                    (s_col_scale[n], s_col_scale[n + 1]),
                    (s_sum[n, wg_warp], s_sum[n + 1, wg_warp]),
                )
                highest = cute.arch.fmax(highest, cute.arch.fmax(args[0], args[1]))
        return highest

    @cute.jit
    def exact_maxima(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        tSsP: cute.Tensor,
        stage: cutlass.Int32,
        s_position: cute.Tensor,
        before: cutlass.Int32,
        after: cutlass.Int32,
        m_prev: cute.Tensor,
        s_max: cute.Tensor,
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
        across the 128 key lanes, joined with the running ones; lane c of each warp then writes
        column 32 k + c's exp2 offset (layouts.exp2_offset: -maximum x scale, +inf for a column
        with nothing visible yet) into this warp's column of s_sum, so the P pass is half a
        packed FFMA2 per score. s_sum[:, warp] is only this warp's (it holds the column sums
        after the loop)."""
        rows = self.v.rows
        acc_dtype = self.acc_dtype
        lane_slots = (rows + 31) // 32
        mine = cute.make_rmem_tensor(cute.make_layout(lane_slots), acc_dtype)
        mine.fill(-acc_dtype.inf)
        self.max_pass(
            load_s, tStS, tSsP, stage, s_position, before, after, m_prev, mine, key0, kv_len,
            wg_tidx, lane, masked,
        )  # fmt: skip
        for k in cutlass.range_constexpr(lane_slots):
            c = k * 32 + lane
            if c < rows:
                cute.arch.atomic_fmax(
                    s_max.iterator + s_max.layout((c, parity)), mine[k], sem="relaxed", scope="cta"
                )
        softmax_bar.arrive_and_wait()
        for k in cutlass.range_constexpr(lane_slots):
            c = cutlass.min(k * 32 + lane, rows - 1)
            m_new = s_max[c, parity]
            s_sum[c, wg_warp] = L.exp2_offset(m_new, s_col_scale[c], _select_f32)
            m_prev[k] = m_new
        # Every lane's offsets before any lane reads them (the next tile's writes come after
        # softmax_bar, when no lane reads these any more).
        cute.arch.sync_warp()

    @cute.jit
    def rescale_o(
        self,
        load_s: cute.TiledCopy,
        thr_store_o: cute.TiledCopy,
        tStO: cute.Tensor,
        tStO_dst: cute.Tensor,
        correction: cute.Tensor,
        chunk_shape: cute.Shape,
    ):
        """O^T[:, n] *= column n's correction, in TMEM (lane n % 32 holds it)."""
        rows = self.v.rows
        chunk = min(rows, 32)
        for dm in cutlass.range_constexpr(self.v.d_tiles):
            for c in cutlass.range_constexpr(rows // chunk):
                acc = cute.make_rmem_tensor(chunk_shape, self.acc_dtype)
                cute.copy(load_s, tStO[(None, c, 0, 0, dm)], acc)
                for i in cutlass.range_constexpr(chunk):
                    n = c * chunk + i
                    acc[i] = acc[i] * cute.arch.shuffle_sync(correction[n // 32], n % 32)
                cute.copy(thr_store_o, acc, tStO_dst[(None, c, 0, 0, dm)])
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def max_pass(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        tSsP: cute.Tensor,
        stage: cutlass.Int32,
        s_position: cute.Tensor,
        before: cutlass.Int32,
        after: cutlass.Int32,
        m_prev: cute.Tensor,
        mine: cute.Tensor,
        key0: cutlass.Int32,
        kv_len: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        lane: cutlass.Int32,
        masked: cutlass.Constexpr,
    ):
        """Column maxima of this tile's scores across the warp's 32 key lanes (masked keys as
        -inf when ``masked``); lane c keeps column 32 k + c's max with its running one (for
        fewer than 32 columns, the lanes past them keep their running maxima)."""
        rows = self.v.rows
        chunk = min(rows, 32)
        acc_dtype = self.acc_dtype
        j = key0 + wg_tidx
        chunk_shape = tSsP[(None, 0, 0, 0, 0)].shape
        for c in cutlass.range_constexpr(rows // chunk):
            scores = _load_scores(load_s, tStS, c, stage, chunk_shape, acc_dtype)
            for i in cutlass.range_constexpr(chunk):
                n = c * chunk + i
                value = scores[i]
                if cutlass.const_expr(masked):
                    visible = X.key_in_window(j, kv_len, s_position[n], before, after)
                    value = cutlass.select_(visible, scores[i], -acc_dtype.inf)
                col_max = cute.arch.warp_redux_sync(value, kind="fmax", nan=True)
                if n % 32 == lane:
                    mine[n // 32] = col_max
        # With the running maxima once per owned column, not once per score.
        for k in cutlass.range_constexpr((rows + 31) // 32):
            mine[k] = cute.arch.fmax(mine[k], m_prev[k])

    @cute.jit
    def p_pass(
        self,
        load_s: cute.TiledCopy,
        tStS: cute.Tensor,
        tSsP: cute.Tensor,
        s_stage: cutlass.Int32,
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
        """P = exp2(S x scale + offset) of this tile (0 at masked keys when ``masked``), written
        to shared memory in fp16 (vector conversion: two values per instruction), and the
        column sums of P (fp32): the per-tile butterfly stages, added into the lanes' running
        partial sums ``l_part`` (layouts.partial_sums per 32 columns)."""
        rows = self.v.rows
        chunk = min(rows, 32)
        acc_dtype = self.acc_dtype
        j = key0 + wg_tidx
        chunk_shape = tSsP[(None, 0, 0, 0, 0)].shape
        for c in cutlass.range_constexpr(rows // chunk):
            scores = _load_scores(load_s, tStS, c, s_stage, chunk_shape, acc_dtype)
            probs32 = cute.make_rmem_tensor(chunk_shape, acc_dtype)
            for i in cutlass.range_constexpr(0, chunk, 2):
                n = c * chunk + i
                args = cute.arch.fma_packed_f32x2(
                    (scores[i], scores[i + 1]),
                    (s_col_scale[n], s_col_scale[n + 1]),
                    (s_sum[n, wg_warp], s_sum[n + 1, wg_warp]),
                )
                for h in cutlass.range_constexpr(2):
                    p = _exp2(args[h])
                    if cutlass.const_expr(masked):
                        visible = X.key_in_window(j, kv_len, s_position[n + h], before, after)
                        p = cutlass.Float32(cutlass.select_(visible, p, cutlass.Float32(0.0)))
                    probs32[i + h] = p
            probs = cute.make_rmem_tensor(chunk_shape, self.mma_dtype)
            probs.store(probs32.load().to(self.mma_dtype))
            cute.autovec_copy(probs, tSsP[(None, c, 0, 0, p_stage)])
            part = _column_sums(
                [probs32[i] if i < chunk else cutlass.Float32(0.0) for i in range(32)],
                lane,
                L.tile_sum_widths(rows),
            )
            partials = len(part)
            if cutlass.const_expr(partials == 1):
                l_part[c] = l_part[c] + part[0]
            else:
                for i in cutlass.range_constexpr(0, partials, 2):
                    k = c * partials + i
                    l_part[k], l_part[k + 1] = cute.arch.add_packed_f32x2(
                        (l_part[k], l_part[k + 1]), (part[i], part[i + 1])
                    )
