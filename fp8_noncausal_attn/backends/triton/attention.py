"""Triton paged attention (``backend="triton"``).

Shaped for block drafters: one program owns one (sequence, KV head, query tile, KV split). The
query tile packs ``q_len x group`` rows (every query token times every q head that reads this KV
head) into the M dimension, so each KV page is read once per KV head. FP8 pages are converted to
the query's 16-bit dtype on chip (exact for e4m3 and e5m2); k_scale[kv_head] is folded into the
softmax scale and v_scale[kv_head] into the output, never multiplied per element. When too few
programs exist to fill the GPU, the keys are split (flash decoding) and a second kernel merges the
partial results by their log-sum-exp.

Per-token-head scales (vLLM's ``fp8_per_token_head`` / ``int8_per_token_head``: float32
``[num_blocks, block_size, num_kv_heads]``, any strides, e.g. inline in the page) take the
``PER_TOKEN_SCALES`` variant: each key's K scale is read with its page id and multiplies its score
column in fp32 before the softmax; each value's V scale multiplies P's column before the PV dot
(normalised by the tile's largest, see the kernel). int8 codes (|x| <= 128) convert exactly to
either 16-bit dtype. The scale reads cost 4 bytes x 2 (K and V) per key and KV head against
1 x head_dim x 2 bytes of FP8 / int8 data: 4 / head_dim more bytes, 3.1% at head_dim 128 (6.3% at
64, 1.6% at 256). In vLLM's inline page each scale word lies in a 32-byte sector with K or V
bytes that are read anyway (the layout's arithmetic, not a measurement).

Plan once, launch per layer: :func:`launch_plan` decides tiles, grid and split count on the host
from shapes and ``max_seqlen_q/k`` only; :func:`launch` runs it, optionally on a caller-owned
workspace. Lengths, page ids and per-sequence causal flags are read on the device, in place and
with their strides, so a launch captured in a CUDA graph follows the buffers vLLM updates between
replays.

The dots run on fp32 operands (IEEE, not TF32) in two cases: under ``TRITON_INTERPRET=1``, whose
``tl.dot`` on 16-bit operands multiplies raw bit patterns, and when a 16-bit cache's dtype differs
from the query's (bf16 K beyond fp16's range would overflow if converted to an fp16 query's dtype).
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass

import torch

from ...launch_record import TRITON, LaunchInputs, launch_arguments
from ...problem import AttentionProblem, Batch
from ...scales import LOG2E
from ..protocol import Refused

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional dependency
    triton = None

MAX_SPLITS = 64
# An unbounded window side as the kernel gets it: past any position, so the window's clamps
# reduce to the plain mask, and p + WINDOW_UNBOUNDED + 1 stays within int32 for p < 2^30.
WINDOW_UNBOUNDED = 1 << 30


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def availability() -> tuple[bool, str]:
    if triton is None:
        return False, "triton is not installed (pip install triton)"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            return False, f"needs compute capability >= 8.9 for FP8, this GPU is {major}.{minor}"
        return True, f"triton {triton.__version__} on sm_{major}{minor}"
    if interpreting():
        return True, "triton's CPU interpreter (TRITON_INTERPRET=1): for testing, not speed"
    return False, "no CUDA GPU, and TRITON_INTERPRET=1 is not set for the CPU interpreter"


def device_reason(device: torch.device) -> str | None:
    """None when the kernels (attention, cache write, merge) take tensors on ``device``."""
    if device.type == "cpu" and not interpreting():
        return "CPU tensors need TRITON_INTERPRET=1"
    return None


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor | None) -> str | None:
    """Every layer the batch's plan takes: the kernels read any strides and alignment."""
    return None


def runtime_parameters(kernel) -> tuple[str, ...]:
    """A Triton kernel's parameters but its constexprs, in order: what its launch takes from
    :func:`kernel_arguments` (``kernel.fn``: the Python function, jitted or interpreted)."""
    parameters = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in parameters if not str(p.annotation).endswith("constexpr"))


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, ws_o_ptr, ws_lse_ptr, lse_ptr,
        q_ptr, k_ptr, v_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, causal_per_seq_ptr, sinks_ptr,
        scale_log2, window_left, window_right,
        q_stride_t, q_stride_h,
        o_stride_t, o_stride_h,
        k_stride_b, k_stride_s, k_stride_h,
        v_stride_b, v_stride_s, v_stride_h,
        ks_stride_b, ks_stride_s, ks_stride_h,
        vs_stride_b, vs_stride_s, vs_stride_h,
        bt_stride_s, bt_stride_b, cu_stride, sl_stride, causal_stride,
        ws_o_stride_s, ws_o_stride_t, ws_o_stride_h,
        ws_lse_stride_s, ws_lse_stride_t, ws_lse_stride_h,
        lse_stride_t, lse_stride_h,
        num_seqs, num_tokens, num_q_tiles, num_splits,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASK_MODE: tl.constexpr,  # 0 bidirectional, 1 causal, 2 per-sequence flags
        SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr,
        WINDOW: tl.constexpr,  # a sliding window (window_left/right, -1 = unbounded) applies
        SINKS: tl.constexpr,  # sink logits join the denominator here (unsplit launch only)
        RETURN_LSE: tl.constexpr,  # write each row's natural-log LSE (unsplit launch only)
        PER_TOKEN_SCALES: tl.constexpr,  # k/v_scale per key: [num_blocks, block_size, kv_heads]
    ):  # fmt: skip
        kv_head = tl.program_id(1)
        # Its offsets (kv_head x a cache's or a scale's head stride) are 64-bit products: a
        # head-major view's pass 2^31 elements.
        kv_head_offset = kv_head.to(tl.int64)
        split = tl.program_id(2)
        dims = tl.arange(0, HEAD_DIM)
        tile = tl.program_id(0)
        if tile >= num_seqs * num_q_tiles:
            # Padding tiles (unsplit launch only; the merge zeroes them when split): the rows past
            # cu_seqlens_q[-1], which vLLM pads under CUDA graphs, are written as zeros.
            rows = (tile - num_seqs * num_q_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
            token = (rows // GROUP).to(tl.int64)  # int64 offsets, as the real rows' below
            q_head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
            pad = (token >= tl.load(cu_seqlens_q_ptr + num_seqs * cu_stride)) & (token < num_tokens)
            tl.store(
                out_ptr + token[:, None] * o_stride_t + q_head[:, None] * o_stride_h
                + dims[None, :],
                tl.zeros([BLOCK_M, HEAD_DIM], out_ptr.dtype.element_ty), mask=pad[:, None],
            )  # fmt: skip
            if RETURN_LSE:  # a padded row is an empty state
                tl.store(
                    lse_ptr + token * lse_stride_t + q_head * lse_stride_h,
                    tl.full([BLOCK_M], float("-inf"), tl.float32), mask=pad,
                )  # fmt: skip
            return
        seq = tile // num_q_tiles
        q_tile = tile % num_q_tiles

        # Index tensors are read where they lie, with their strides (vLLM passes slices of
        # persistent buffers and updates them in place between CUDA-graph replays).
        q_start = tl.load(cu_seqlens_q_ptr + seq * cu_stride)
        q_len = tl.load(cu_seqlens_q_ptr + (seq + 1) * cu_stride) - q_start
        kv_len = tl.load(seq_lens_ptr + seq * sl_stride)
        first_row = q_tile * BLOCK_M
        if first_row >= q_len * GROUP:
            return

        rows = first_row + tl.arange(0, BLOCK_M)
        token = rows // GROUP
        # int64 offsets: a row's token (or head) times its stride passes 2^31 elements in a long
        # batch (131,072 tokens x 64 heads x 256 dims) or a head-major view.
        batch_token = (q_start + token).to(tl.int64)
        q_head = (kv_head * GROUP + rows % GROUP).to(tl.int64)
        row_valid = token < q_len

        # The mask (masking.visible_range): causal rows see keys j <= kv_len - q_len + token; a
        # window limits each row to [p - left, p + right] (p = kv_len - q_len + token).
        if MASK_MODE == 2:
            # bool or int32 flags
            is_causal = tl.load(causal_per_seq_ptr + seq * causal_stride) != 0
        else:
            is_causal = MASK_MODE == 1
        last_token = tl.minimum(q_len - 1, (first_row + BLOCK_M - 1) // GROUP)
        tile_kv_end = kv_len
        if is_causal:
            tile_kv_end = kv_len - q_len + last_token + 1
        row_limit = tl.where(is_causal, kv_len - q_len + token + 1, kv_len)
        tile_kv_start = 0
        if WINDOW:
            # The tile's key range is the union of its rows' windows: the loop below starts and
            # ends there, so keys (and pages) outside it are never read. An unbounded side comes
            # as WINDOW_UNBOUNDED, which clamps to the plain mask's range.
            position = kv_len - q_len + token
            row_start = tl.maximum(position - window_left, 0)
            row_limit = tl.minimum(row_limit, position + window_right + 1)
            tile_kv_start = tl.maximum(kv_len - q_len + first_row // GROUP - window_left, 0)
            tile_kv_end = tl.minimum(tile_kv_end, kv_len - q_len + last_token + window_right + 1)

        # The split count is the grid, fixed on the host from max_seqlen_k; each split's key range
        # comes from the real length, so a CUDA graph captured at max_model_len still spreads short
        # sequences over every split. Splits past the keys run no iteration and report lse = -inf.
        tiles_per_split = tl.cdiv(tl.cdiv(tile_kv_end - tile_kv_start, BLOCK_N), num_splits)
        kv_start = tile_kv_start + split * tiles_per_split * BLOCK_N
        kv_end = tl.minimum(kv_start + tiles_per_split * BLOCK_N, tile_kv_end)

        q = tl.load(
            q_ptr + batch_token[:, None] * q_stride_t + q_head[:, None] * q_stride_h
            + dims[None, :],
            mask=row_valid[:, None], other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            q = q.to(tl.float32)
        dot_dtype = q.dtype
        if PER_TOKEN_SCALES:
            qk_scale = scale_log2  # each key's K scale joins its score column below
        else:
            qk_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for tile_start in range(kv_start, kv_end, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_valid = keys < kv_end
            page = tl.load(
                block_table_ptr + seq.to(tl.int64) * bt_stride_s
                + (keys // BLOCK_SIZE) * bt_stride_b,
                mask=key_valid, other=0,
            ).to(tl.int64)  # fmt: skip
            slot = keys % BLOCK_SIZE
            k = tl.load(
                k_ptr + page[None, :] * k_stride_b + slot[None, :] * k_stride_s
                + kv_head_offset * k_stride_h + dims[:, None],
                mask=key_valid[None, :], other=0.0,
            ).to(dot_dtype)  # fmt: skip
            if DOT_FP32:
                scores = tl.dot(q, k, input_precision="ieee")
            else:
                scores = tl.dot(q, k)
            if PER_TOKEN_SCALES:
                # Each key's scale, read with its page id, multiplies its score column in fp32.
                k_key_scale = tl.load(
                    k_scale_ptr + page * ks_stride_b + slot * ks_stride_s
                    + kv_head_offset * ks_stride_h,
                    mask=key_valid, other=0.0,
                )  # fmt: skip
                scores = scores * (qk_scale * k_key_scale)[None, :]
            else:
                scores = scores * qk_scale
            visible = key_valid[None, :] & (keys[None, :] < row_limit[:, None])
            if WINDOW:
                visible = visible & (keys[None, :] >= row_start[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_shift[:, None])
            alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_ptr + page[:, None] * v_stride_b + slot[:, None] * v_stride_s
                + kv_head_offset * v_stride_h + dims[None, :],
                mask=key_valid[:, None], other=0.0,
            ).to(dot_dtype)  # fmt: skip
            p_v = p
            if PER_TOKEN_SCALES:
                # P's columns times each value's scale over the tile's largest, which multiplies
                # the tile's product in fp32: P stays in [0, 1] (fp16's normal range; a value
                # scale of 1e-4 times P would be subnormal there). The row sum l keeps plain P.
                v_key_scale = tl.load(
                    v_scale_ptr + page * vs_stride_b + slot * vs_stride_s
                    + kv_head_offset * vs_stride_h,
                    mask=key_valid, other=0.0,
                )  # fmt: skip
                v_tile_scale = tl.max(v_key_scale, 0)
                # A tile whose value scales are all 0 contributes 0, not 0 / 0.
                v_divisor = tl.where(v_tile_scale > 0, v_tile_scale, 1.0)
                p_v = p * (v_key_scale / v_divisor)[None, :]
                if q_ptr.dtype.element_ty == tl.float16:
                    # fp16's normal range ends at 2^-14: a key whose V scale is 1e-4 of the
                    # tile's largest would be subnormal there. P x ratio <= 1, so 2^15 lifts it
                    # (exactly) while keeping it below fp16's max; the product drops it again.
                    p_v = p_v * 32768.0
                    v_tile_scale = v_tile_scale * (1.0 / 32768.0)
            if DOT_FP32:
                if PER_TOKEN_SCALES and q_ptr.dtype.element_ty == tl.float16:
                    # fp32 dots stand in for the 16-bit ones here (a per-token-head cache is
                    # 1-byte): round P's operand to fp16 as the GPU's dot takes it.
                    p_v = p_v.to(tl.float16).to(tl.float32)
                pv = tl.dot(p_v, v, input_precision="ieee")
            else:
                pv = tl.dot(p_v.to(dot_dtype), v)
            if PER_TOKEN_SCALES:
                pv = pv * v_tile_scale
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if PER_TOKEN_SCALES:
            v_scale = 1.0  # applied per key above
        else:
            v_scale = tl.load(v_scale_ptr + kv_head)
        if SINKS:
            # The sink joins the denominator, shifted by max(m, sink) (log2 units); a row that
            # saw no key (m = -inf) gets alpha 0 and l = 1 at m = sink.
            sink = tl.load(sinks_ptr + q_head, mask=row_valid, other=0.0) * 1.4426950408889634
            m_sink = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_sink)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_sink)
            m_i = m_sink
        # l = 0: the row saw no key here (an empty state, lse -inf). A NaN l (a NaN in the cache,
        # query or scales) is no empty state: it stays NaN in the output and the LSE.
        has_keys = l_i != 0
        result = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
        if SPLIT:
            # Partial results: fp32 ws_o [splits, tokens, q_heads, HEAD_DIM] and the row's
            # log2-sum-exp ws_lse [splits, tokens, q_heads]; -inf marks a split with no keys.
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(
                ws_lse_ptr + split.to(tl.int64) * ws_lse_stride_s + batch_token * ws_lse_stride_t
                + q_head * ws_lse_stride_h,
                lse, mask=row_valid,
            )  # fmt: skip
            part_row = (
                split.to(tl.int64) * ws_o_stride_s + batch_token * ws_o_stride_t
                + q_head * ws_o_stride_h
            )  # fmt: skip
            tl.store(ws_o_ptr + part_row[:, None] + dims[None, :], result, mask=row_valid[:, None])
        else:
            tl.store(
                out_ptr + batch_token[:, None] * o_stride_t + q_head[:, None] * o_stride_h
                + dims[None, :],
                result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
            )  # fmt: skip
            if RETURN_LSE:
                # Natural log: (m + log2 l) ln 2, the sink's term inside l; -inf with no keys.
                lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
                tl.store(
                    lse_ptr + batch_token * lse_stride_t + q_head * lse_stride_h,
                    lse * 0.6931471805599453, mask=row_valid,
                )  # fmt: skip

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, ws_o_ptr, ws_lse_ptr, cu_seqlens_q_ptr, sinks_ptr, lse_ptr,
        o_stride_t, o_stride_h,
        ws_o_stride_s, ws_o_stride_t, ws_o_stride_h,
        ws_lse_stride_s, ws_lse_stride_t, ws_lse_stride_h,
        cu_stride, lse_stride_t, lse_stride_h,
        num_seqs, num_splits, lse_to_log2,
        HEAD_DIM: tl.constexpr,
        HEAD_POW2: tl.constexpr,  # HEAD_DIM rounded up to a power of two (tl.arange's need)
        SPLITS_POW2: tl.constexpr,
        SINKS: tl.constexpr,  # the sink logit joins the merged denominator (exactly once, here)
        RETURN_LSE: tl.constexpr,  # write the merged row's natural-log LSE
    ):  # fmt: skip
        # Also merge_attention_states' Triton kernel: its states' natural-log LSEs come in
        # with lse_to_log2 = log2(e) (the attention's partials are log2 already: 1).
        token = tl.program_id(0).to(tl.int64)  # int64 offsets: see _paged_attention_kernel
        head = tl.program_id(1).to(tl.int64)
        dims = tl.arange(0, HEAD_POW2)
        dim_valid = dims < HEAD_DIM
        out_row = out_ptr + token * o_stride_t + head * o_stride_h + dims
        if RETURN_LSE:  # lse_ptr is None otherwise
            lse_out = lse_ptr + token * lse_stride_t + head * lse_stride_h
        if token >= tl.load(cu_seqlens_q_ptr + num_seqs * cu_stride):
            # Padding row (past the last sequence): zeros, an empty state; its partials were
            # never written.
            tl.store(out_row, tl.zeros([HEAD_POW2], out_ptr.dtype.element_ty), mask=dim_valid)
            if RETURN_LSE:
                tl.store(lse_out, float("-inf"))
            return
        splits = tl.arange(0, SPLITS_POW2).to(tl.int64)
        split_valid = splits < num_splits
        lse = tl.load(
            ws_lse_ptr + splits * ws_lse_stride_s + token * ws_lse_stride_t
            + head * ws_lse_stride_h,
            mask=split_valid, other=float("-inf"),
        ) * lse_to_log2  # fmt: skip
        # A split with no keys (lse = -inf) has weight 0; its partial is not read at all. A NaN
        # lse is no empty split: its NaN weight reaches the output and the merged LSE.
        has_keys = lse != float("-inf")
        lse_max = tl.max(lse, 0)
        if SINKS:
            sink = tl.load(sinks_ptr + head) * 1.4426950408889634  # log2 units, as lse
            lse_max = tl.maximum(lse_max, sink)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        weight = tl.where(has_keys, tl.exp2(lse - lse_max), 0.0)
        parts = tl.load(
            ws_o_ptr
            + (splits * ws_o_stride_s + token * ws_o_stride_t + head * ws_o_stride_h)[:, None]
            + dims[None, :],
            mask=has_keys[:, None] & dim_valid[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        total = tl.sum(weight, 0)
        if SINKS:
            total += tl.exp2(sink - lse_max)
        merged = tl.sum(parts * weight[:, None], 0) / tl.where(total != 0, total, 1.0)
        tl.store(out_row, merged.to(out_ptr.dtype.element_ty), mask=dim_valid)
        if RETURN_LSE:
            merged_lse = tl.where(total != 0, lse_max + tl.log2(tl.where(total != 0, total, 1.0)),
                                  float("-inf"))  # fmt: skip
            tl.store(lse_out, merged_lse * 0.6931471805599453)

    # What each launch passes from kernel_arguments() (the merge's lse_to_log2 is its own).
    _ATTENTION_TAKES = runtime_parameters(_paged_attention_kernel)
    _MERGE_TAKES = tuple(n for n in runtime_parameters(_merge_splits_kernel) if n != "lse_to_log2")


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def needs_fp32_dots(batch: Batch) -> bool:
    """A 16-bit cache of the other 16-bit dtype than the query's cannot be converted exactly."""
    return batch.cache_dtype.itemsize == 2 and batch.cache_dtype != batch.query_dtype


@dataclass(frozen=True)
class TritonLaunchPlan:
    """Everything the host decides for one batch; built by :func:`launch_plan`, no device values.

    ``grid`` is ``(num_seqs * num_q_tiles + padding_tiles, num_kv_heads, num_splits)``; the
    padding tiles (unsplit launch only) zero the rows past ``cu_seqlens_q[-1]``.
    """

    block_m: int
    block_n: int
    num_q_tiles: int
    num_splits: int
    num_warps: int
    num_stages: int
    mask_mode: int  # 0 bidirectional, 1 causal, 2 per-sequence tensor (bool or int32)
    dot_fp32: bool
    grid: tuple[int, int, int]


def workspace_shapes(
    num_splits: int, num_tokens: int, num_q_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the split-KV partials: float32 ``ws_o [splits, tokens, q_heads, head_dim]``
    and ``ws_lse [splits, tokens, q_heads]`` (a buffer at least this large in each dim works)."""
    return (num_splits, num_tokens, num_q_heads, head_dim), (num_splits, num_tokens, num_q_heads)


def _tiles_for_dots(batch: Batch, block_m: int, block_n: int) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of a launch.

    The IEEE fp32 dots (``needs_fp32_dots``) are FMA loops whose operands each thread holds over
    the whole head dim: with the 16-bit tiles they spilled 11-16 KB of stack per thread at d128.
    16 x 16 tiles, 4 warps and one stage compile without spills for head_dim 64-256 on sm_90
    and sm_100 (tests/helpers/gpu_compile_check.py); that rare path streams the KV once per 16 rows.
    Otherwise 4 warps while the fp32 O tile (block_m x head_dim) is at most 64 registers per
    thread, else 8: 4 warps spilled at 128 rows x d128 (200 B on sm_90), 8 warps at 32 rows x
    d256 (16 B on sm_100, where ptxas stopped at 128 registers).

    Per-token-head scales: 4 warps at 64 rows, else 8, at most 32 rows at head_dim 256 (16 x 16
    at d256 spilled 16 B on sm_100 under Triton 3.9). At head_dim 128 the query tile holds at
    least the per-head tile's rows, so the KV is read no more often: 8 warps, 64 keys at 16
    rows, else 32, and 32 rows take the 64-row tile; these compile without spills on sm_90 and
    sm_100 under Triton 3.6 (the H200's) and 3.9. Spilled: at 4 warps with 32-64 keys, 16-744 B
    (16-64 rows, 3.6 on sm_90); at 8 warps 128 x 64 136 B, 32 x 64 16 B (window and sinks),
    32 x 32 8 B (3.6, sm_90) and 64 x 64 16 B (3.9, sm_100). Never run: the H200 run is where
    these tiles get tuned.
    Multiplying the score and P tiles by a vector per key column keeps Triton 3.9's pipeliner
    from making the K and V loads asynchronous (their TTGIR holds plain loads, one byte per
    thread, not cp.async), which costs registers: at 4 warps d128 x 16-32 rows spilled 200-350 B
    of stack on sm_90, 64 rows x d256 120 B even at 8 warps, and 8 warps at 64 rows x d128
    16 B on sm_100 (ptxas stopped at 128 registers).
    """
    if needs_fp32_dots(batch) and not interpreting():
        return 16, 16, 4, 1
    if batch.per_token_head_scales:
        if batch.head_dim == 128:
            if block_m == 32:
                block_m = 64  # 32-row tiles spilled (the docstring's list)
            return block_m, 64 if block_m == 16 else 32, 8, 2
        if batch.head_dim == 256:
            block_m = min(block_m, 32)
        return block_m, block_n, 4 if block_m == 64 else 8, 2
    return block_m, block_n, 4 if block_m * batch.head_dim <= 64 * 128 else 8, 2


def launch_plan(
    batch: Batch,
    num_splits: int | None = None,
    *,
    max_splits: int = MAX_SPLITS,
) -> TritonLaunchPlan:
    """Tile sizes, grid and split count for a call (its scale kind's tiles); host arithmetic
    only (no device sync).

    Splits keys when (sequences x KV heads x query tiles) would leave the GPU's multiprocessors
    idle; ``num_splits`` forces a count (tests use it to cover the merge on the CPU). Either way
    the count is capped by ``max_splits`` (e.g. what a preallocated workspace holds) and by the
    key tiles of ``max_seqlen_k``; each program derives its own key range from the real
    ``seq_lens``, so a plan made for a long ``max_seqlen_k`` still splits short sequences.
    """
    rows = max(batch.max_seqlen_q * batch.group_size, 1)
    block_m = max(16, min(128, triton.next_power_of_2(rows)))
    if batch.head_dim == 256:
        block_m = min(block_m, 64)
    block_n = 128 if interpreting() else (64 if batch.head_dim <= 128 else 32)
    block_m, block_n, num_warps, num_stages = _tiles_for_dots(batch, block_m, block_n)
    num_q_tiles = triton.cdiv(rows, block_m)
    key_span = batch.max_seqlen_k
    left, right = batch.window
    if left >= 0 and (right >= 0 or batch.causal_per_seq is None and batch.causal):
        # A query tile reads at most left + (its tokens - 1) + right + 1 keys (right 0 if causal).
        key_span = min(key_span, left + batch.max_seqlen_q + max(right, 0))
    key_tiles = max(triton.cdiv(key_span, block_n), 1)
    if num_splits is None:
        programs = batch.num_seqs * batch.num_kv_heads * num_q_tiles
        num_splits = 1
        if batch.device.type == "cuda":
            target = 2 * _multiprocessor_count(batch.device.index or 0)
            num_splits = min(max(target // max(programs, 1), 1), max_splits)
    num_splits = max(1, min(num_splits, key_tiles, max_splits))
    padding_tiles = (
        0 if num_splits > 1 else triton.cdiv(batch.num_tokens * batch.group_size, block_m)
    )
    if batch.causal_per_seq is not None:
        mask_mode = 2
    else:
        mask_mode = int(batch.causal)
    return TritonLaunchPlan(
        block_m=block_m,
        block_n=block_n,
        num_q_tiles=num_q_tiles,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        mask_mode=mask_mode,
        dot_fp32=interpreting() or needs_fp32_dots(batch),
        grid=(batch.num_seqs * num_q_tiles + padding_tiles, batch.num_kv_heads, num_splits),
    )


def check_workspace(
    part: torch.Tensor, name: str, shape: tuple[int, ...], out: torch.Tensor
) -> None:
    """ValueError unless the split-KV buffer ``part`` holds ``shape``: float32 on ``out``'s
    device, at least ``shape`` in its first two dims (splits, tokens), exactly in the rest.
    ``ws_o``'s head_dim must be contiguous; ``ws_lse`` may have any strides."""
    strides = part.stride()
    if (
        part.dtype != torch.float32
        or part.device != out.device
        or part.shape[2:] != shape[2:]
        or part.shape[0] < shape[0]
        or part.shape[1] < shape[1]
        or (len(shape) == 4 and strides[3] != 1)
    ):
        raise ValueError(
            f"{name} must be float32 on {out.device} with shape >= {list(shape[:2])} in its "
            f"first two dims and {list(shape[2:])} in the rest (ws_o: head_dim contiguous); "
            f"got {part.dtype} on {part.device}, shape {list(part.shape)}, strides {strides}"
        )


def kernel_arguments(
    problem: AttentionProblem,
    plan: TritonLaunchPlan,
    out: torch.Tensor,
    ws_o: torch.Tensor | None,
    ws_lse: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> dict[str, object]:
    """The runtime arguments of both kernels, by parameter name: the launch record's Triton
    fields (``launch_record.fields(TRITON)``: pointers as the tensors, None where there is
    none, which only a branch a constexpr turns off reads) and Triton's own: the partials'
    and the LSE's strides (0 without them), the softmax scale in log2 units, the window with
    :data:`WINDOW_UNBOUNDED` for an unbounded side, and the query tiles per sequence."""
    inputs = LaunchInputs(problem, out, plan.num_splits, ws_o, ws_lse)
    arguments = launch_arguments(TRITON, inputs)
    window_left, window_right = (WINDOW_UNBOUNDED if side < 0 else side for side in problem.window)
    strided = (("ws_o", ws_o, "sth"), ("ws_lse", ws_lse, "sth"), ("lse", lse, "th"))
    for name, tensor, dims in strided:
        strides = (0,) * len(dims) if tensor is None else tensor.stride()
        arguments.update({f"{name}_stride_{d}": strides[at] for at, d in enumerate(dims)})
    arguments.update(
        lse_ptr=lse, scale_log2=problem.softmax_scale * LOG2E, window_left=window_left,
        window_right=window_right, num_q_tiles=plan.num_q_tiles,
    )  # fmt: skip
    return arguments


def launch(
    problem: AttentionProblem,
    plan: TritonLaunchPlan,
    out: torch.Tensor,
    ws_o: torch.Tensor | None = None,
    ws_lse: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> None:
    """Run a planned launch; writes ``out`` [num_tokens, num_q_heads, head_dim] in place.

    Rows past ``cu_seqlens_q[-1]`` are written as zeros. ``ws_o`` / ``ws_lse`` are the
    split-KV workspace (see :func:`workspace_shapes`; larger buffers and their slices work): used
    only when ``plan.num_splits > 1``, and allocated here when not given. ``lse``, float32
    ``[num_tokens, num_q_heads]`` (any strides), receives each row's natural-log log-sum-exp
    when given (-inf for padded rows). This is the per-layer hot path: each tensor's strides are
    read once.
    """
    num_tokens, num_q_heads, head_dim = problem.query.shape
    split = plan.num_splits > 1
    if split:
        out_shape, lse_shape = workspace_shapes(plan.num_splits, num_tokens, num_q_heads, head_dim)
        if ws_o is None:
            ws_o = torch.empty(out_shape, dtype=torch.float32, device=out.device)
        if ws_lse is None:
            ws_lse = torch.empty(lse_shape, dtype=torch.float32, device=out.device)
        check_workspace(ws_o, "ws_o", out_shape, out)
        check_workspace(ws_lse, "ws_lse", lse_shape, out)
    else:
        ws_o = ws_lse = None  # the unsplit kernel writes out (and lse) itself
    arguments = kernel_arguments(problem, plan, out, ws_o, ws_lse, lse)
    has_sinks = problem.sinks is not None
    return_lse = lse is not None
    _paged_attention_kernel[plan.grid](
        **{name: arguments[name] for name in _ATTENTION_TAKES},
        GROUP=problem.group_size,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=problem.block_size,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        MASK_MODE=plan.mask_mode,
        SPLIT=split,
        DOT_FP32=plan.dot_fp32,
        WINDOW=problem.has_window,
        SINKS=has_sinks and not split,
        RETURN_LSE=return_lse and not split,
        PER_TOKEN_SCALES=problem.per_token_head_scales,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            **{name: arguments[name] for name in _MERGE_TAKES},
            lse_to_log2=1.0,
            HEAD_DIM=head_dim,
            HEAD_POW2=head_dim,
            SPLITS_POW2=1 << (plan.num_splits - 1).bit_length(),
            SINKS=has_sinks,
            RETURN_LSE=return_lse,
        )


def merge_states(
    outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
) -> None:
    """``reference.merge_states``' contract on the split-KV merge kernel: ``outs``
    ``[num_states, num_tokens, num_heads, head_dim]`` (any float dtype, head dims contiguous),
    ``lses`` float32 ``[num_states, num_tokens, num_heads]`` natural-log (any strides); writes
    ``out`` (head dims contiguous) and ``lse`` in place."""
    num_states, num_tokens, num_heads, head_dim = outs.shape
    if num_tokens == 0:
        return
    # The kernel's padding bound cu_seqlens_q[num_seqs]: every row is a real one here.
    bound = torch.full((1,), num_tokens, dtype=torch.int32, device=out.device)
    _merge_splits_kernel[(num_tokens, num_heads)](
        out_ptr=out, ws_o_ptr=outs, ws_lse_ptr=lses, cu_seqlens_q_ptr=bound, sinks_ptr=None,
        lse_ptr=lse, o_stride_t=out.stride(0), o_stride_h=out.stride(1),
        ws_o_stride_s=outs.stride(0), ws_o_stride_t=outs.stride(1), ws_o_stride_h=outs.stride(2),
        ws_lse_stride_s=lses.stride(0), ws_lse_stride_t=lses.stride(1),
        ws_lse_stride_h=lses.stride(2), cu_stride=1, lse_stride_t=lse.stride(0),
        lse_stride_h=lse.stride(1), num_seqs=0, num_splits=num_states, lse_to_log2=LOG2E,
        HEAD_DIM=head_dim, HEAD_POW2=triton.next_power_of_2(head_dim),
        SPLITS_POW2=triton.next_power_of_2(num_states), SINKS=False, RETURN_LSE=True,
    )  # fmt: skip


# Backend contract (backends.protocol.Backend): plan once per batch, run per layer.


@dataclass(frozen=True)
class TritonPlan:
    """A batch's launch plan (for its scale kind) and, when it splits keys, its views of the
    kept workspace."""

    launch: TritonLaunchPlan
    ws_o: torch.Tensor | None
    ws_lse: torch.Tensor | None


def plan(batch: Batch, workspace=None, num_splits: int | None = None) -> TritonPlan:
    """Host-only plan; with a workspace (``fp8_noncausal_attn.plan.Workspace``) the split count
    is capped by what it holds and the partials are its views. ``num_splits`` forces a count.
    Refuses CPU tensors outside Triton's interpreter; every size, scale kind and the LSE run."""
    why = device_reason(batch.device)
    if why is not None:
        raise Refused(why)
    max_splits = MAX_SPLITS
    if workspace is not None:
        max_splits = min(MAX_SPLITS, workspace.max_splits(batch.num_tokens))
    decided = launch_plan(batch, num_splits, max_splits=max_splits)
    if workspace is None or decided.num_splits == 1:
        return TritonPlan(decided, None, None)
    ws_o, ws_lse = workspace.partials(decided.num_splits, batch.num_tokens)
    return TritonPlan(decided, ws_o, ws_lse)


def run(
    problem: AttentionProblem, plan: TritonPlan, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Launch a planned batch for one layer (``lse``: see :func:`launch`)."""
    launch(problem, plan.launch, out, plan.ws_o, plan.ws_lse, lse)
