"""Triton paged attention (``backend="triton"``).

Shaped for block drafters: one program owns one (sequence, KV head, query tile, KV split). The
query tile packs ``q_len x group`` rows (every query token times every q head that reads this KV
head) into the M dimension, so each KV page is read once per KV head. FP8 pages are converted to
the query's 16-bit dtype on chip (exact for e4m3 and e5m2); k_scale[kv_head] is folded into the
softmax scale and v_scale[kv_head] into the output, never multiplied per element. When too few
programs exist to fill the GPU, the keys are split (flash decoding) and a second kernel merges the
partial results by their log-sum-exp.

The dots run on fp32 operands (IEEE, not TF32) in two cases: under ``TRITON_INTERPRET=1``, whose
``tl.dot`` on 16-bit operands multiplies raw bit patterns, and when a 16-bit cache's dtype differs
from the query's (bf16 K beyond fp16's range would overflow if converted to an fp16 query's dtype).
"""

from __future__ import annotations

import functools
import os

import torch

from .problem import AttentionProblem

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is an optional dependency
    triton = None

LOG2E = 1.4426950408889634
MAX_SPLITS = 64


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


def unsupported_reason(problem: AttentionProblem) -> str | None:
    if problem.query.device.type == "cpu" and not interpreting():
        return "CPU tensors need TRITON_INTERPRET=1"
    return None


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
        k_scale_ptr, v_scale_ptr, causal_ptr,
        softmax_scale_log2,
        stride_qt, stride_qh,
        stride_ot, stride_oh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt,
        num_tokens, num_q_heads, num_q_tiles, split_keys,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASK_MODE: tl.constexpr,  # 0 bidirectional, 1 causal, 2 per-sequence flags
        SPLIT: tl.constexpr,
        DOT_FP32: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0) // num_q_tiles
        q_tile = tl.program_id(0) % num_q_tiles
        kv_head = tl.program_id(1)
        split = tl.program_id(2)

        q_start = tl.load(cu_seqlens_q_ptr + seq)
        q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        kv_len = tl.load(seq_lens_ptr + seq)
        first_row = q_tile * BLOCK_M
        if first_row >= q_len * GROUP:
            return

        rows = first_row + tl.arange(0, BLOCK_M)
        token = rows // GROUP
        q_head = kv_head * GROUP + rows % GROUP
        row_valid = token < q_len
        dims = tl.arange(0, HEAD_DIM)

        # The mask (masking.visible_keys): causal rows see keys j <= kv_len - q_len + token.
        if MASK_MODE == 2:
            is_causal = tl.load(causal_ptr + seq).to(tl.int1)
        else:
            is_causal = MASK_MODE == 1
        last_token = tl.minimum(q_len - 1, (first_row + BLOCK_M - 1) // GROUP)
        tile_kv_end = kv_len
        if is_causal:
            tile_kv_end = kv_len - q_len + last_token + 1
        row_limit = tl.where(is_causal, kv_len - q_len + token + 1, kv_len)

        kv_start = split * split_keys
        kv_end = tl.minimum(kv_start + split_keys, tile_kv_end)

        q = tl.load(
            q_ptr + (q_start + token)[:, None] * stride_qt + q_head[:, None] * stride_qh
            + dims[None, :],
            mask=row_valid[:, None], other=0.0,
        )  # fmt: skip
        if DOT_FP32:
            q = q.to(tl.float32)
        dot_dtype = q.dtype
        qk_scale = softmax_scale_log2 * tl.load(k_scale_ptr + kv_head)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for tile_start in range(kv_start, kv_end, BLOCK_N):
            keys = tile_start + tl.arange(0, BLOCK_N)
            key_valid = keys < kv_end
            page = tl.load(
                block_table_ptr + seq * stride_bt + keys // BLOCK_SIZE, mask=key_valid, other=0
            ).to(tl.int64)
            slot = keys % BLOCK_SIZE
            k = tl.load(
                k_cache_ptr + page[None, :] * stride_kb + slot[None, :] * stride_ks
                + kv_head * stride_kh + dims[:, None],
                mask=key_valid[None, :], other=0.0,
            ).to(dot_dtype)  # fmt: skip
            if DOT_FP32:
                scores = tl.dot(q, k, input_precision="ieee") * qk_scale
            else:
                scores = tl.dot(q, k) * qk_scale
            visible = key_valid[None, :] & (keys[None, :] < row_limit[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen no key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_shift[:, None])
            alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vs
                + kv_head * stride_vh + dims[None, :],
                mask=key_valid[:, None], other=0.0,
            ).to(dot_dtype)  # fmt: skip
            if DOT_FP32:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(dot_dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        v_scale = tl.load(v_scale_ptr + kv_head)
        has_keys = l_i > 0
        result = acc * (v_scale / tl.where(has_keys, l_i, 1.0))[:, None]
        if SPLIT:
            # Partial results: fp32 [splits, num_tokens, num_q_heads, HEAD_DIM] and the row's
            # log2-sum-exp [splits, num_tokens, num_q_heads]; -inf marks a split with no keys.
            part_row = (split * num_tokens + q_start + token) * num_q_heads + q_head
            lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
            tl.store(
                part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], result,
                mask=row_valid[:, None],
            )  # fmt: skip
        else:
            tl.store(
                out_ptr + (q_start + token)[:, None] * stride_ot + q_head[:, None] * stride_oh
                + dims[None, :],
                result.to(out_ptr.dtype.element_ty), mask=row_valid[:, None],
            )  # fmt: skip

    @triton.jit
    def _merge_splits_kernel(
        out_ptr, part_out_ptr, part_lse_ptr,
        stride_ot, stride_oh,
        num_tokens, num_q_heads, num_splits,
        HEAD_DIM: tl.constexpr,
        SPLITS_POW2: tl.constexpr,
    ):  # fmt: skip
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS_POW2)
        split_valid = splits < num_splits
        part_row = (splits * num_tokens + token) * num_q_heads + head
        lse = tl.load(part_lse_ptr + part_row, mask=split_valid, other=float("-inf"))
        lse_max = tl.max(lse, 0)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        weight = tl.exp2(lse - lse_max)
        dims = tl.arange(0, HEAD_DIM)
        parts = tl.load(
            part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :],
            mask=split_valid[:, None], other=0.0,
        )  # fmt: skip
        total = tl.sum(weight, 0)
        merged = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + token * stride_ot + head * stride_oh + dims,
            merged.to(out_ptr.dtype.element_ty),
        )


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def needs_fp32_dots(problem: AttentionProblem) -> bool:
    """A 16-bit cache of the other 16-bit dtype than the query's cannot be converted exactly."""
    cache_dtype = problem.key_cache.dtype
    return cache_dtype.itemsize == 2 and cache_dtype != problem.query.dtype


def launch_plan(problem: AttentionProblem, num_splits: int | None = None) -> dict[str, int]:
    """Tile sizes and grid for a call; host arithmetic only (no device sync).

    Splits keys when (sequences x KV heads x query tiles) would leave the GPU's multiprocessors
    idle; ``num_splits`` forces a count (tests use it to cover the merge on the CPU).
    """
    rows = max(problem.max_seqlen_q * problem.group_size, 1)
    block_m = max(16, min(128, triton.next_power_of_2(rows)))
    if problem.head_dim == 256:
        block_m = min(block_m, 64)
    block_n = 128 if interpreting() else (64 if problem.head_dim <= 128 else 32)
    num_q_tiles = triton.cdiv(rows, block_m)
    key_tiles = max(triton.cdiv(problem.max_seqlen_k, block_n), 1)
    if num_splits is None:
        programs = problem.num_seqs * problem.num_kv_heads * num_q_tiles
        num_splits = 1
        if problem.query.is_cuda:
            target = 2 * _multiprocessor_count(problem.query.device.index or 0)
            num_splits = min(max(target // max(programs, 1), 1), MAX_SPLITS)
    num_splits = max(1, min(num_splits, key_tiles))
    split_keys = triton.cdiv(key_tiles, num_splits) * block_n
    num_splits = triton.cdiv(max(problem.max_seqlen_k, 1), split_keys)
    return {
        "block_m": block_m,
        "block_n": block_n,
        "num_q_tiles": num_q_tiles,
        "num_splits": num_splits,
        "split_keys": split_keys,
        "num_warps": 4 if problem.head_dim <= 128 else 8,
        "num_stages": 2,
    }


def paged_attention(
    problem: AttentionProblem, out: torch.Tensor, num_splits: int | None = None
) -> None:
    """Run the Triton kernels; writes ``out`` [num_tokens, num_q_heads, head_dim]."""
    plan = launch_plan(problem, num_splits)
    split = plan["num_splits"] > 1
    if problem.causal_per_seq is not None:
        mask_mode, causal_flags = 2, problem.causal_per_seq
    else:
        mask_mode, causal_flags = int(problem.causal), problem.seq_lens
    if split:
        shape = (plan["num_splits"], problem.num_tokens, problem.num_q_heads)
        part_lse = torch.empty(shape, dtype=torch.float32, device=out.device)
        part_out = torch.empty(shape + (problem.head_dim,), dtype=torch.float32, device=out.device)
    else:
        part_lse = part_out = out
    kc, vc = problem.key_cache, problem.value_cache
    grid = (problem.num_seqs * plan["num_q_tiles"], problem.num_kv_heads, plan["num_splits"])
    _paged_attention_kernel[grid](
        out, part_out, part_lse,
        problem.query, kc, vc, problem.block_table, problem.cu_seqlens_q, problem.seq_lens,
        problem.k_scale, problem.v_scale, causal_flags,
        problem.softmax_scale * LOG2E,
        problem.query.stride(0), problem.query.stride(1),
        out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        problem.block_table.stride(0),
        problem.num_tokens, problem.num_q_heads, plan["num_q_tiles"], plan["split_keys"],
        GROUP=problem.group_size,
        HEAD_DIM=problem.head_dim,
        BLOCK_SIZE=problem.block_size,
        BLOCK_M=plan["block_m"],
        BLOCK_N=plan["block_n"],
        MASK_MODE=mask_mode,
        SPLIT=split,
        DOT_FP32=interpreting() or needs_fp32_dots(problem),
        num_warps=plan["num_warps"],
        num_stages=plan["num_stages"],
    )  # fmt: skip
    if split:
        _merge_splits_kernel[(problem.num_tokens, problem.num_q_heads)](
            out, part_out, part_lse,
            out.stride(0), out.stride(1),
            problem.num_tokens, problem.num_q_heads, plan["num_splits"],
            HEAD_DIM=problem.head_dim,
            SPLITS_POW2=triton.next_power_of_2(plan["num_splits"]),
        )  # fmt: skip
