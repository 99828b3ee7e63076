"""A few CUDA-backend calls for compute-sanitizer memcheck and racecheck (run by gpu_check.sh).

Small shapes that reach every boundary: partial last pages, rows past q_len in an M tile, keys
past kv_len in a key tile, empty sequences, split-KV with empty splits, block size 8, the vLLM
combined layout, head_dim 256, and vLLM's CUDA-graph inputs (strided int32 causal flags and
index tensors, padded rows past cu_seqlens_q[-1], an out at an odd element offset). Exits
non-zero if any result is off.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends.cuda import mma_sync
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

CASES = [
    dict(q_lens=[1, 8, 0], kv_lens=[37, 100, 5], causal=[True, False, True], block_size=16),
    dict(q_lens=[16], kv_lens=[16], causal=False, block_size=8, layout="vllm"),
    dict(q_lens=[3, 16], kv_lens=[70, 16], causal=True, head_dim=256, num_kv_heads=1),
    dict(q_lens=[8, 5], kv_lens=[700, 61], causal=False, head_dim=128, num_splits=7),
    dict(q_lens=[8], kv_lens=[90], causal=False, cache_dtype=torch.bfloat16, block_size=32),
]


def strided(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    buffer = torch.full((t.numel(), 2), 3, dtype=dtype, device=t.device)
    buffer[:, 0] = t.to(dtype)
    return buffer[:, 0]


def vllm_inputs(problem):
    """``problem`` with strided int32 index tensors, 5 padded query rows, and an ``out`` at an
    odd element offset (filled with NaN)."""
    flags = problem.causal_per_seq
    if flags is None:
        flags = torch.full((problem.num_seqs,), int(problem.causal), device=problem.query.device)
    query = torch.cat([problem.query, torch.randn_like(problem.query[:5])])
    flat = torch.full((query.numel() + 1,), float("nan"), dtype=query.dtype, device=query.device)
    batch = dataclasses.replace(
        problem.batch,
        num_tokens=query.shape[0],
        cu_seqlens_q=strided(problem.cu_seqlens_q, torch.int32),
        seq_lens=strided(problem.seq_lens, torch.int32),
        causal_per_seq=strided(flags, torch.int32),
    )
    vllm_like = dataclasses.replace(problem, batch=batch, query=query)
    return vllm_like, flat[1:].view_as(query)


def main() -> int:
    runs, why = mma_sync.availability()
    if not runs:
        print(f"mma_sync backend unavailable: {why}")
        return 1
    failures = 0
    for i, spec in enumerate(CASES):
        spec = dict(spec)
        num_splits = spec.pop("num_splits", None)
        case = make_case(
            spec.pop("q_lens"), spec.pop("kv_lens"), num_q_heads=8,
            num_kv_heads=spec.pop("num_kv_heads", 2), device="cuda", seed=i, **spec,
        )  # fmt: skip
        problem = validate_attention(
            *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
        )
        out = torch.empty_like(case.query)
        mma_sync.paged_attention(problem, out, num_splits=num_splits)
        ref = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
        err = relative_error(out, ref)
        ok = err <= 1e-2
        # The same call as vLLM makes it under CUDA graphs.
        vllm_like, padded_out = vllm_inputs(problem)
        mma_sync.paged_attention(vllm_like, padded_out, num_splits=num_splits)
        tokens = case.query.shape[0]
        vllm_err = relative_error(padded_out[:tokens], ref)
        ok = ok and vllm_err <= 1e-2 and bool((padded_out[tokens:] == 0).all())
        failures += not ok
        print(f"case {i}: rel err {err:.2e}, vLLM-style {vllm_err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)  # fmt: skip
    torch.cuda.synchronize()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
