"""wgmma paged attention over an FP8 KV cache, BF16/FP16 query: the CUTLASS Python DSL kernel.

NEVER RUN ON A GPU: this kernel compiles for sm_90a (dsl/build.py) and its index maps are replayed
on the CPU (tests/test_wgmma_emulation.py); no Hopper GPU has executed it.

One CTA = (``consumers`` x 64 query rows of one KV head, KV head, sequence x split). Per key tile
of ``key_tile`` keys, each consumer warpgroup w (64 rows, the wgmma M) computes

    S = Q_w K^T      wgmma SS: A = Q_w (16-bit, smem, K-major), B = K (16-bit, smem, K-major)
    P = online-softmax(mask(S))          in registers, fp32, rounded to the 16-bit MMA dtype
    O_w += P V       wgmma RS: A = P (registers), B = V (16-bit, smem, MN-major: no transpose)

The MMAs are fp16 for both query dtypes: e4m3 -> fp16 is exact, and a bf16 query row is made
fp16 exactly by its own power of two (dsl/common/precision.py). The producer warpgroup reads
each FP8 K/V row chunk from its page (the block table is read once per page and tile, and K and
V share the read), converts it once per CTA and stores it into a 128-byte-swizzled ring of
staged items that every consumer reads (so R = 128 streams the KV once per CTA). k_scale is
folded into the softmax scale and v_scale into the output (SPEC section 3). With more than one
split, each CTA writes the fp32 partial O (normalised, times v_scale) and the log2 LSE that the
existing merge kernel reads. A sliding window (window_left / window_right, SPEC section 3) limits
each CTA to the key tiles its rows' windows touch and masks their edges; the sinks (fp32 per
query head, -inf = none) join the unsplit epilogue's denominator, or the loader's split merge.

Structure after the CUTLASS Hopper FMHA example (examples/python/CuTeDSL/cute/hopper/kernel/
attention/fmha.py) and FlashAttention-3's hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp (producer /
consumer warpgroups, RS wgmma for P V, accumulator-to-operand reuse), studied, not copied.
"""

import math

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup
from cutlass.tensor_utils import LayoutEnum

from dsl.common import indexing as X
from dsl.common import precision as P
from dsl.common.entry import LaunchEntry
from dsl.common.kernel_reads import read_index, read_page_id
from dsl.common.work import CtaWork, cta_work
from dsl.wgmma import layouts as L
from dsl.wgmma import traits as T
from dsl.wgmma.traits import Args

LOG2_E = math.log2(math.e)

DTYPES = {
    "bfloat16": cutlass.BFloat16,
    "float16": cutlass.Float16,
    "float8_e4m3fn": cutlass.Float8E4M3FN,
    "float8_e5m2": cutlass.Float8E5M2,
}


def _exp2(x):
    return cute.math.exp2(x, fastmath=True)


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """(row slot i, column slot j) view of a wgmma fp32 accumulator fragment
    ((2 columns, 2 rows, N / 8 blocks), 1, 1): j = column + 2 x block, the order of
    layouts.acc_col (tests/test_wgmma_host.py checks it against the DSL's partition_C)."""
    shape, stride = acc_layout.shape[0], acc_layout.stride[0]
    return cute.make_layout(
        (shape[1], (shape[0], shape[2])), stride=(stride[1], (stride[0], stride[2]))
    )


def acc_as_a_operand(acc_layout: cute.Layout, key_tile: int) -> cute.Layout:
    """The S accumulator's registers seen as the A fragment of O += P V (((2, 2, 2), 1, K / 16)):
    a 16-bit wgmma A fragment owns the same (row, key) elements per thread as the fp32 C
    fragment of the same tile, 8 per 16-key block = two 8-column C blocks
    (tests/test_wgmma_host.py checks it against the DSL's A and C partitions)."""
    s = acc_layout.stride[0]
    return cute.make_layout(((2, 2, 2), 1, key_tile // 16), stride=(s, 0, 2 * s[2]))


class WgmmaPagedAttention(LaunchEntry):
    """One variant (dsl/wgmma/traits.Variant); ``__call__`` (the host entry that
    ``cute.compile`` traces and ``export_to_c`` exports) is dsl/common/entry.py's, shared with
    the tcgen05 family: both libraries have one C interface (dsl/common/launch.py)."""

    family = "wgmma"

    def __init__(self, variant: T.Variant):
        variant.check()
        self.v = variant
        self.q_dtype = DTYPES[variant.q_dtype]
        self.cache_dtype = DTYPES[variant.cache_dtype]
        # fp16 MMAs for both query dtypes: e4m3 -> fp16 is one instruction per pair, e4m3 ->
        # bf16 three more; a bf16 query is made fp16 exactly by a power of two per row.
        self.mma_dtype = cutlass.Float16
        self.acc_dtype = cutlass.Float32

    @property
    def threads(self) -> int:
        return self.v.threads

    def kernel_objects(self):
        """The tiled MMAs (S = Q K^T, O += P V) and the Q, K, V shared-memory layouts the kernel
        takes first."""
        v = self.v
        dt = self.mma_dtype
        qk_tile = (L.ROWS_PER_WARPGROUP, v.key_tile, v.head_dim)
        pv_tile = (L.ROWS_PER_WARPGROUP, v.head_dim, v.key_tile)
        qk_mma = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            OperandMajorMode.K,
            OperandMajorMode.K,
            self.acc_dtype,
            (1, 1, 1),
            qk_tile[:2],
        )
        pv_mma = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            OperandMajorMode.K,
            OperandMajorMode.MN,
            self.acc_dtype,
            (1, 1, 1),
            pv_tile[:2],
            warpgroup.OperandSource.RMEM,
        )
        q_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, qk_tile, dt, v.consumers)
        k_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, qk_tile, dt, v.stages)
        v_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, pv_tile, dt, v.stages)
        return qk_mma, pv_mma, q_layout, k_layout, v_layout

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        q_layout: cute.ComposedLayout,
        k_layout: cute.ComposedLayout,
        v_layout: cute.ComposedLayout,
        args: Args,
    ):
        v = self.v
        dt = self.mma_dtype

        # ---------------------------------------------------------------- work decomposition
        row_tile, kv_head, seq_split = cute.arch.block_idx()
        seq = seq_split // args.num_splits
        split = seq_split % args.num_splits
        tidx, _, _ = cute.arch.thread_idx()
        role = cute.arch.make_warp_uniform(tidx // L.WARPGROUP)
        wg_tidx = tidx % L.WARPGROUP

        work = cta_work(args, row_tile, kv_head, seq, split, v.rows, v.key_tile)

        # ---------------------------------------------------------------- shared memory
        smem = cutlass.memory.SmemAllocator()
        stage_bars = smem.allocate_array(cutlass.Int64, 2 * v.stages)
        s_row_scale = smem.allocate_tensor(cutlass.Float32, cute.make_layout(v.rows), 16)
        q_raw = smem.allocate_array(cutlass.Int8, v.q_bytes, byte_alignment=1024)
        ring = smem.allocate_array(cutlass.Int8, v.stages * v.item_bytes, byte_alignment=1024)
        staging = smem.allocate_array(
            cutlass.Int8, v.fp8_stages * v.fp8_tile_bytes, byte_alignment=128
        )
        sQ = cute.make_tensor(cute.recast_ptr(q_raw, q_layout.inner, dtype=dt), q_layout.outer)
        sK = cute.make_tensor(cute.recast_ptr(ring, k_layout.inner, dtype=dt), k_layout.outer)
        sV = cute.make_tensor(cute.recast_ptr(ring, v_layout.inner, dtype=dt), v_layout.outer)

        kv_producer, kv_consumer = pipeline.PipelineAsync.create(
            num_stages=v.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, L.WARPGROUP),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, L.WARPGROUP * v.consumers
            ),
            barrier_storage=stage_bars,
            defer_sync=True,
        ).make_participants()
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # A tile of rows past this sequence's R has nothing to do (the grid covers the longest).
        if work.row_base < work.num_rows:
            if role == T.PRODUCER_WARPGROUP:
                if cutlass.const_expr(v.set_max_registers):
                    cute.arch.setmaxregister_decrease(v.registers_per_thread["producer"])
                self.producer_role(
                    ring,
                    staging,
                    args,
                    work,
                    wg_tidx,
                    kv_producer,
                )
            else:
                if cutlass.const_expr(v.set_max_registers):
                    cute.arch.setmaxregister_increase(v.registers_per_thread["consumer"])
                self.consumer_role(
                    qk_mma,
                    pv_mma,
                    sQ,
                    sK,
                    sV,
                    q_raw,
                    s_row_scale,
                    args,
                    work,
                    role - 1,
                    wg_tidx,
                    kv_consumer,
                )
        return

    # -------------------------------------------------------------------- producer role
    @cute.jit
    def producer_role(
        self,
        ring: cute.Pointer,
        staging: cute.Pointer,
        args: Args,
        work: CtaWork,
        wg_tidx: cutlass.Int32,
        kv_producer: pipeline.PipelineProducer,
    ):
        """Iteration s copies key tile s + fp8_stages - 1 (K then V) with cp.async into its FP8
        staging slot and converts tile s: each thread reads back its own chunks, converts them
        exactly to the MMA dtype and stores them swizzled into the 16-bit ring, K item then V
        item. fp8_stages - 1 tiles are in flight while one is converted, without
        registers (only cp.async.wait_group orders a thread's copies before its reads).

        Integer work per row is one shuffle and one wide multiply-add: the block table is read
        once per page per tile (lane p of each warp reads the tile's page p, a tile ahead, and
        K and V both take a row's page from that lane); everything else of a row's address
        (KV head, the thread's slot, chunk) is a per-thread pointer computed once."""
        v = self.v
        ring16 = cute.recast_ptr(ring, dtype=self.mma_dtype)
        lane = wg_tidx % 32
        thread_page, thread_slot = L.loader_thread_page_slot(wg_tidx, v.head_dim, args.block_shift)
        chunk = L.loader_chunk(wg_tidx, v.head_dim)
        k_thread = args.k_ptr + cute.assume(
            X.key_offset(
                0, thread_slot, work.kv_head, args.k_stride_b, args.k_stride_s, args.k_stride_h
            )
            + chunk * L.CHUNK,
            divby=L.CHUNK,
        )
        v_thread = args.v_ptr + cute.assume(
            X.key_offset(
                0, thread_slot, work.kv_head, args.v_stride_b, args.v_stride_s, args.v_stride_h
            )
            + chunk * L.CHUNK,
            divby=L.CHUNK,
        )
        # The host refuses a block stride, or page_size x slot stride, of 2^31 elements or more
        # (docs/wgmma.md): page x block stride is then one 32 x 32 -> 64-bit multiply-add, and
        # offsets inside a page stay 32-bit.
        k_block, k_slot = args.k_stride_b.to(cutlass.Int32), args.k_stride_s.to(cutlass.Int32)
        v_block, v_slot = args.v_stride_b.to(cutlass.Int32), args.v_stride_s.to(cutlass.Int32)
        # This thread's chunk of staging slot 0, K item, step 0: a step and the V item add
        # immediates, a slot one multiply.
        stage_thread = cute.recast_ptr(staging, dtype=self.cache_dtype) + cute.assume(
            L.staging_offset(wg_tidx, 0), divby=L.CHUNK
        )
        # cp.async.cg, 16 bytes: streamed through L2 only (each byte is read once per CTA).
        copy16 = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            self.cache_dtype,
            num_bits_per_copy=128,
        )
        bt_row = args.block_table_ptr + cutlass.Int64(work.seq) * args.bt_stride_s
        num_cols = X.page_count(work.kv_len, args.block_shift)
        ahead = v.fp8_stages - 1
        pages = self.read_tile_pages(
            bt_row, args.bt_stride_b, num_cols, work.first_tile * v.key_tile, lane, args.block_shift
        )
        # Prologue: tiles 0 .. ahead - 1 in flight (one cp.async group each, empty past the
        # last), then iteration s copies tile s + ahead and converts tile s. Only ``pages``
        # (the next tile's, read a tile ahead) is carried from one copy to the next.
        for p in cutlass.range_constexpr(ahead):
            if p < work.iters:
                pages = self.copy_tile(
                    p, work.first_tile, pages, copy16, stage_thread, k_thread, v_thread, k_block,
                    k_slot, v_block, v_slot, thread_page, bt_row, args.bt_stride_b, num_cols, lane,
                    work.kv_len, work.first_key, args.block_shift, wg_tidx, True,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()
        for s in cutlass.range(work.iters):
            if s + ahead < work.iters:
                pages = self.copy_tile(
                    s + ahead, work.first_tile, pages, copy16, stage_thread, k_thread, v_thread,
                    k_block, k_slot, v_block, v_slot, thread_page, bt_row, args.bt_stride_b,
                    num_cols, lane, work.kv_len, work.first_key, args.block_shift, wg_tidx, False,
                )  # fmt: skip
            cute.arch.cp_async_commit_group()  # one group per iteration, empty past the last
            cute.arch.cp_async_wait_group(ahead)  # this thread's copies of tile s have landed
            drain = L.staging_slot(s, v.fp8_stages) * v.fp8_tile_bytes
            src = stage_thread + cute.assume(drain, divby=L.CHUNK)
            k_handle = kv_producer.acquire_and_advance()
            self.store_item(src, ring16 + k_handle.index * (v.item_bytes // 2), wg_tidx)
            k_handle.commit()
            v_handle = kv_producer.acquire_and_advance()
            self.store_item(
                src + v.fp8_tile_bytes // 2, ring16 + v_handle.index * (v.item_bytes // 2),
                wg_tidx,
            )  # fmt: skip
            v_handle.commit()
        kv_producer.tail()

    @cute.jit
    def read_tile_pages(
        self,
        bt_row: cute.Pointer,
        bt_stride_b: cutlass.Int64,
        num_cols: cutlass.Int32,
        key0: cutlass.Int32,
        lane: cutlass.Int32,
        block_shift: cutlass.Int32,
    ) -> cutlass.Int32:
        """This lane's page of the key tile at key0 (lane_page; 0 past the sequence's last)."""
        col0, _ = L.tile_page_slot(key0, block_shift)
        col = col0 + L.lane_page(lane, self.v.key_tile, block_shift)
        return read_page_id(bt_row, bt_stride_b, col, num_cols)

    @cute.jit
    def copy_tile(
        self,
        n: cutlass.Int32,
        first_tile: cutlass.Int32,
        pages: cutlass.Int32,
        copy16: cute.CopyAtom,
        stage_thread: cute.Pointer,
        k_thread: cute.Pointer,
        v_thread: cute.Pointer,
        k_block: cutlass.Int32,
        k_slot: cutlass.Int32,
        v_block: cutlass.Int32,
        v_slot: cutlass.Int32,
        thread_page,
        bt_row: cute.Pointer,
        bt_stride_b: cutlass.Int64,
        num_cols: cutlass.Int32,
        lane: cutlass.Int32,
        kv_len: cutlass.Int32,
        first_key: cutlass.Int32,
        block_shift: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        prologue: cutlass.Constexpr,
    ) -> cutlass.Int32:
        """cp.async this thread's chunks of the CTA's n-th key tile, K then V, into its staging
        slot (``pages``: this lane's page of that tile); returns this lane's page of the next
        tile, read now so that its latency hides behind these copies. A tile wholly inside
        [first_key, kv_len) copies every row unchecked; another stores zeros for the rows
        outside instead (indexing.key_loaded: P is 0 there, and 0 x NaN would poison O). The
        prologue (once per CTA, so the first tile) checks every row: one code path.
        ``thread_page`` is a plain 0 where head_dim fixes it (layouts.loader_thread_page_slot),
        else Int32."""
        v = self.v
        key0 = (first_tile + n) * v.key_tile
        pages_next = self.read_tile_pages(
            bt_row, bt_stride_b, num_cols, key0 + v.key_tile, lane, block_shift
        )
        _, slot0 = L.tile_page_slot(key0, block_shift)
        fill = L.staging_slot(n, v.fp8_stages) * v.fp8_tile_bytes
        dst = stage_thread + cute.assume(fill, divby=L.CHUNK)
        dst_v = dst + v.fp8_tile_bytes // 2
        if cutlass.const_expr(prologue):
            self.copy_rows(
                copy16, dst, k_thread, k_block, k_slot, pages, thread_page, slot0, key0, kv_len,
                first_key, block_shift, wg_tidx, True,
            )  # fmt: skip
            self.copy_rows(
                copy16, dst_v, v_thread, v_block, v_slot, pages, thread_page, slot0, key0,
                kv_len, first_key, block_shift, wg_tidx, True,
            )  # fmt: skip
        else:
            if X.tile_wholly_loaded(key0, key0 + v.key_tile, first_key, kv_len):
                self.copy_rows(
                    copy16, dst, k_thread, k_block, k_slot, pages, thread_page, slot0, key0,
                    kv_len, first_key, block_shift, wg_tidx, False,
                )  # fmt: skip
                self.copy_rows(
                    copy16, dst_v, v_thread, v_block, v_slot, pages, thread_page, slot0, key0,
                    kv_len, first_key, block_shift, wg_tidx, False,
                )  # fmt: skip
            else:
                self.copy_rows(
                    copy16, dst, k_thread, k_block, k_slot, pages, thread_page, slot0, key0,
                    kv_len, first_key, block_shift, wg_tidx, True,
                )  # fmt: skip
                self.copy_rows(
                    copy16, dst_v, v_thread, v_block, v_slot, pages, thread_page, slot0, key0,
                    kv_len, first_key, block_shift, wg_tidx, True,
                )  # fmt: skip
        return pages_next

    @cute.jit
    def copy_rows(
        self,
        copy16: cute.CopyAtom,
        dst: cute.Pointer,
        thread_ptr: cute.Pointer,
        block_stride: cutlass.Int32,
        slot_stride: cutlass.Int32,
        pages: cutlass.Int32,
        thread_page,
        slot0: cutlass.Int32,
        key0: cutlass.Int32,
        kv_len: cutlass.Int32,
        first_key: cutlass.Int32,
        block_shift: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        checked: cutlass.Constexpr,
    ):
        """One 16-byte cp.async per step: the row's page from the lane that read it, then
        thread pointer + page x block stride + (tile slot + step slot) x slot stride -> the
        thread's staging chunk + the step's immediate (layouts.staging_offset)."""
        v = self.v
        zeros = None
        if cutlass.const_expr(checked):
            zeros = cute.make_rmem_tensor(cute.make_layout(L.CHUNK), self.cache_dtype)
            zeros.fill(0.0)
        for step in cutlass.range_constexpr(L.loader_steps(v.key_tile, v.head_dim)):
            # The step's page and slot are uniform (shift and mask of a constant); a page past
            # the tile's first comes from the lane that read it.
            step_page, step_slot = L.loader_step_page_slot(step, v.head_dim, block_shift)
            page = cute.arch.shuffle_sync(pages, offset=thread_page + step_page)
            # Page ids and strides are non-negative: unsigned, so 32 x 32 -> 64 is one
            # IMAD.WIDE.U32 with the thread pointer as its addend.
            off = cutlass.Int64(
                cutlass.Uint64(page.to(cutlass.Uint32))
                * cutlass.Uint64(block_stride.to(cutlass.Uint32))
            )
            off = off + cutlass.Int64((slot0 + step_slot) * slot_stride)
            src = cute.make_tensor(
                thread_ptr + cute.assume(off, divby=L.CHUNK), cute.make_layout(L.CHUNK)
            )
            at = cute.make_tensor(dst + L.staging_offset(0, step), cute.make_layout(L.CHUNK))
            if cutlass.const_expr(checked):
                if X.key_loaded(key0 + L.loader_row(wg_tidx, step, v.head_dim), first_key, kv_len):
                    cute.copy(copy16, src, at)
                else:
                    at.store(zeros.load())
            else:
                cute.copy(copy16, src, at)

    @cute.jit
    def store_item(self, src: cute.Pointer, stage: cute.Pointer, wg_tidx: cutlass.Int32):
        """Read this thread's FP8 chunks of one item back from staging (``src``: its step-0
        chunk), convert them exactly to the MMA dtype and store them, two 16-byte stores per
        chunk, into the swizzled stage; then fence them for wgmma's async proxy."""
        v = self.v
        # Element offsets (16-bit) of this thread's two halves at step 0; a step adds rows.
        bases = [L.loader_store_base(wg_tidx, half, v.head_dim, v.key_tile) // 2 for half in (0, 1)]
        for step in cutlass.range_constexpr(L.loader_steps(v.key_tile, v.head_dim)):
            raw = cute.make_tensor(src + L.staging_offset(0, step), cute.make_layout(L.CHUNK))
            wide = cute.make_rmem_tensor(cute.make_layout((L.CHUNK // 2, 2)), self.mma_dtype)
            wide.store(raw.load().to(self.mma_dtype).reshape((L.CHUNK // 2, 2)))
            for half in cutlass.range_constexpr(2):
                at = bases[half] + L.loader_store_step(step, v.head_dim) // 2
                dst = cute.make_tensor(
                    stage + cute.assume(at, divby=8), cute.make_layout(L.CHUNK // 2)
                )
                dst.store(wide[None, half].load())
        cute.arch.fence_view_async_shared()  # generic-proxy stores -> wgmma's async proxy

    # -------------------------------------------------------------------- consumer role
    @cute.jit
    def consumer_role(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        q_raw: cute.Pointer,
        s_row_scale: cute.Tensor,
        args: Args,
        work: CtaWork,
        wg: cutlass.Int32,
        wg_tidx: cutlass.Int32,
        kv_consumer: pipeline.PipelineConsumer,
    ):
        """Q tile, then per key tile: S = Q K^T, mask, online softmax, O += P V; epilogue."""
        v = self.v
        # Read again here rather than passed from the CTA's setup: passed, the m128 build
        # (ptxas 13.0) kept it in local memory (an 8-byte stack, 12 LDL).
        q_start = read_index(args.cu_seqlens_q_ptr, work.seq, args.cu_stride)
        dt = self.mma_dtype
        f32 = self.acc_dtype
        row0 = work.row_base + wg * L.ROWS_PER_WARPGROUP

        # ---- Q: this warpgroup's 64 rows, 16-byte chunks into the swizzled A tile, in fp16:
        # a bf16 row times 2^e (dsl/common/precision.py), exact; 2^-e rejoins its softmax scale.
        q_tile = cute.recast_ptr(q_raw, dtype=dt) + wg * (L.ROWS_PER_WARPGROUP * v.head_dim)
        for step in cutlass.range_constexpr(L.q_steps(v.head_dim)):
            r = L.q_row(wg_tidx, step, v.head_dim)
            c = L.q_chunk(wg_tidx, step, v.head_dim)
            vals = cute.make_rmem_tensor(cute.make_layout(8), self.q_dtype)
            vals.fill(0.0)
            if row0 + r < work.num_rows:
                token = X.row_token(row0 + r, work.group)
                head = X.row_head(row0 + r, work.group, work.kv_head)
                off = (
                    cutlass.Int64(q_start + token) * args.q_stride_t
                    + cutlass.Int64(head) * args.q_stride_h
                    + c * 8
                )
                src = cute.make_tensor(args.q_ptr + cute.assume(off, divby=8), cute.make_layout(8))
                vals.store(src.load())
            factor = cutlass.Float32(1.0)
            inverse = cutlass.Float32(1.0)
            if cutlass.const_expr(self.q_dtype is cutlass.BFloat16):
                biggest = cutlass.Float32(0.0)
                for e in cutlass.range_constexpr(8):
                    biggest = cute.arch.fmax(biggest, cute.math.absf(vals[e].to(f32)))
                for offset in L.q_row_shuffles(v.head_dim):
                    biggest = cute.arch.fmax(
                        biggest, cute.arch.shuffle_sync_bfly(biggest, offset=offset)
                    )
                box = cute.make_rmem_tensor(cute.make_layout(1), f32)
                box[0] = biggest
                bits = box.load().bitcast(cutlass.Int32)[0]
                exponent = P.row_scale_exponent((bits >> 23) & 0xFF, cutlass.min)
                factor = cute.math.exp2(exponent.to(f32))
                inverse = cute.math.exp2(-exponent.to(f32))
            if c == 0:
                s_row_scale[wg * L.ROWS_PER_WARPGROUP + r] = inverse
            scaled = cute.make_rmem_tensor(cute.make_layout(8), dt)
            scaled.store((vals.load().to(f32) * factor).to(dt))
            at = L.operand_offset(r, c * 8, L.ROWS_PER_WARPGROUP) // 2
            dst = cute.make_tensor(q_tile + cute.assume(at, divby=8), cute.make_layout(8))
            dst.store(scaled.load())
        cute.arch.fence_view_async_shared()
        pipeline.NamedBarrier(barrier_id=1 + wg, num_threads=L.WARPGROUP).arrive_and_wait()

        # ---- per-row constants: the two rows this thread holds in every accumulator.
        k_scale = cute.make_tensor(args.k_scale_ptr + work.kv_head, cute.make_layout(1))[0]
        v_scale = cute.make_tensor(args.v_scale_ptr + work.kv_head, cute.make_layout(1))[0]
        # The mask: one position per row, the window's (before, after) per CTA (uniform).
        before, after = X.window_offsets(
            args.window_left, args.window_right, work.causal, cutlass.select_, cutlass.min
        )
        position = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
        scale = cute.make_rmem_tensor(cute.make_layout(2), f32)
        for i in cutlass.range_constexpr(2):
            token = X.row_token(row0 + L.acc_row(wg_tidx, i), work.group)
            position[i] = X.query_position(token, work.q_len, work.kv_len)
            # log2-domain score scale of the row: softmax scale x k_scale (one KV head per
            # CTA) x the row's 2^-e, at least P.MIN_SCORE_SCALE (an underflow to 0 would give
            # -inf x 0 = NaN for masked scores and for a row with no key yet)
            row_scale = s_row_scale[wg * L.ROWS_PER_WARPGROUP + L.acc_row(wg_tidx, i)]
            scale[i] = cute.arch.fmax(
                args.scale_log2 * k_scale * row_scale, cutlass.Float32(P.MIN_SCORE_SCALE)
            )

        # ---- MMA fragments
        thr_qk = qk_mma.get_slice(wg_tidx)
        thr_pv = pv_mma.get_slice(wg_tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))
        acc_s_shape = thr_qk.partition_shape_C((L.ROWS_PER_WARPGROUP, v.key_tile))
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((L.ROWS_PER_WARPGROUP, v.head_dim)))
        acc_o.fill(0.0)
        o_mn = cute.make_tensor(acc_o.iterator, acc_mn_layout(acc_o.layout))
        row_max = cute.make_rmem_tensor(cute.make_layout(2), f32)
        row_max.fill(-f32.inf)
        row_sum = cute.make_rmem_tensor(cute.make_layout(2), f32)  # this thread's columns only
        row_sum.fill(0.0)

        for s in cutlass.range(work.iters):
            acc_s = thr_qk.make_fragment_C(acc_s_shape)
            k_handle = kv_consumer.wait_and_advance()
            warpgroup.fence()
            for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                qk_mma.set(warpgroup.Field.ACCUMULATE, kb != 0)
                cute.gemm(
                    qk_mma,
                    acc_s,
                    tSrQ[None, None, kb, wg],
                    tSrK[None, None, kb, k_handle.index],
                    acc_s,
                )
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            k_handle.release()

            s_mn = cute.make_tensor(acc_s.iterator, acc_mn_layout(acc_s.layout))
            key0 = (work.first_tile + s) * v.key_tile
            # Only a tile some key of which one of this thread's rows does not see is masked
            # (the last tile, the causal diagonal, the window's edges): the rest skip the
            # per-element predicate. Per thread, and no shuffle inside, so diverging lanes are
            # harmless.
            # acc_row(t, 1) > acc_row(t, 0): row 0 has the smaller position
            if X.window_tile_needs_mask(
                key0, key0 + v.key_tile, work.kv_len, position[0], position[1], before, after
            ):
                for i in cutlass.range_constexpr(2):
                    for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                        col = key0 + L.acc_col(wg_tidx, j)
                        visible = X.key_in_window(col, work.kv_len, position[i], before, after)
                        s_mn[i, j] = cutlass.select_(visible, s_mn[i, j], -f32.inf)
            for i in cutlass.range_constexpr(2):
                m_tile = -f32.inf
                for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    m_tile = cute.arch.fmax(m_tile, s_mn[i, j])
                for offset in L.QUAD_SHUFFLES:
                    m_tile = cute.arch.fmax(
                        m_tile, cute.arch.shuffle_sync_bfly(m_tile, offset=offset)
                    )
                m_new = cute.arch.fmax(row_max[i], m_tile)
                # A row that has seen no key yet keeps -inf: use 0 as its reference (no inf-inf).
                m_use = cutlass.select_(m_new == -f32.inf, cutlass.Float32(0.0), m_new) * scale[i]
                correction = _exp2(row_max[i] * scale[i] - m_use)
                tile_sum = cutlass.Float32(0.0)
                for j in cutlass.range_constexpr(cute.size(s_mn, mode=[1])):
                    s_mn[i, j] = _exp2(s_mn[i, j] * scale[i] - m_use)
                    tile_sum += s_mn[i, j]
                row_sum[i] = row_sum[i] * correction + tile_sum
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    o_mn[i, c] = o_mn[i, c] * correction
                row_max[i] = m_new

            tOrP = cute.make_rmem_tensor(acc_as_a_operand(acc_s.layout, v.key_tile), dt)
            cute.make_tensor(tOrP.iterator, acc_s.layout).store(acc_s.load().to(dt))
            v_handle = kv_consumer.wait_and_advance()
            warpgroup.fence()
            pv_mma.set(warpgroup.Field.ACCUMULATE, True)
            for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(
                    pv_mma,
                    acc_o,
                    tOrP[None, None, kb],
                    tOrV[None, None, kb, v_handle.index],
                    acc_o,
                )
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            v_handle.release()

        # ---- epilogue: row sums across the quad, O / l x v_scale, or the split's state.
        for i in cutlass.range_constexpr(2):
            total = row_sum[i]
            for offset in L.QUAD_SHUFFLES:
                total = total + cute.arch.shuffle_sync_bfly(total, offset=offset)
            self.store_row(
                o_mn, i, row_max[i] * scale[i], total, v_scale, row0 + L.acc_row(wg_tidx, i),
                work.num_rows, work.group, work.kv_head, q_start, work.split, args.num_splits,
                args.num_tokens, args.num_q_heads,
                args.out_ptr, args.ws_o_ptr, args.ws_lse_ptr, args.sinks_ptr, args.o_stride_t,
                args.o_stride_h, wg_tidx,
            )  # fmt: skip

    @cute.jit
    def store_row(
        self,
        o_mn: cute.Tensor,
        i: cutlass.Constexpr,
        m_scaled: cutlass.Float32,
        total: cutlass.Float32,
        v_scale: cutlass.Float32,
        r: cutlass.Int32,
        num_rows: cutlass.Int32,
        group: cutlass.Int32,
        kv_head: cutlass.Int32,
        q_start: cutlass.Int32,
        split: cutlass.Int32,
        num_splits: cutlass.Int32,
        num_tokens: cutlass.Int32,
        num_q_heads: cutlass.Int32,
        out_ptr: cute.Pointer,
        ws_o_ptr: cute.Pointer,
        ws_lse_ptr: cute.Pointer,
        sinks_ptr: cute.Pointer,
        o_stride_t: cutlass.Int64,
        o_stride_h: cutlass.Int64,
        wg_tidx: cutlass.Int32,
    ):
        """Row slot i of this thread's O: out (query dtype) = O / (l + e^sink) x v_scale, the
        sink joining the denominator at max(m, sink) in log2 units (no overflow either way); or
        with splits the fp32 partial O and the log2 LSE (-inf for an empty split), without the
        sink: the merge adds it once."""
        head_dim = self.v.head_dim
        q_dtype = self.q_dtype
        if r < num_rows:
            token = X.row_token(r, group)
            head = X.row_head(r, group, kv_head)
            row_ws = (cutlass.Int64(split) * num_tokens + q_start + token) * num_q_heads + head
            out_row = cutlass.Int64(q_start + token) * o_stride_t + cutlass.Int64(head) * o_stride_h
            if num_splits > 1:
                inv = cutlass.select_(total > 0.0, v_scale / total, cutlass.Float32(0.0))
                if wg_tidx % 4 == 0:
                    # total = 0: no key in this split (-inf, the merge skips it); a NaN total
                    # (a NaN in the cache) is no empty split: its NaN LSE reaches the merge.
                    lse = cutlass.Float32(-math.inf)
                    if total != 0.0:
                        lse = m_scaled + cute.math.log2(total, fastmath=False)
                    cute.make_tensor(ws_lse_ptr + row_ws, cute.make_layout(1))[0] = lse
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    d = L.acc_col(wg_tidx, c)
                    cute.make_tensor(ws_o_ptr + (row_ws * head_dim + d), cute.make_layout(1))[0] = (
                        o_mn[i, c] * inv
                    )
            else:
                sink = cute.make_tensor(sinks_ptr + head, cute.make_layout(1))[0] * LOG2_E
                top = cute.arch.fmax(m_scaled, sink)
                top = cutlass.select_(top == -cutlass.Float32.inf, cutlass.Float32(0.0), top)
                keep = _exp2(m_scaled - top)
                denominator = total * keep + _exp2(sink - top)
                inv = cutlass.select_(
                    denominator > 0.0, v_scale * keep / denominator, cutlass.Float32(0.0)
                )
                for c in cutlass.range_constexpr(cute.size(o_mn, mode=[1])):
                    d = L.acc_col(wg_tidx, c)
                    cute.make_tensor(out_ptr + (out_row + d), cute.make_layout(1))[0] = (
                        o_mn[i, c] * inv
                    ).to(q_dtype)
