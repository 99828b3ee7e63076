"""What several test modules share (no test module imports another): the device the tests run
on, SPEC §7's tolerances, and the modules of this package."""

import dataclasses
import os

import torch

from fp8_noncausal_attn.problem import AttentionProblem, Batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# SPEC §7: relative error against the fp32 reference on the same cache.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}

# vLLM's default KV-cache page, 16 slots up to 0.33 and 64 from 0.34: its tests run both.
VLLM_BLOCK_SIZES = (16, 64)

# The CUDA backend the GPU tests' API calls name: mma_sync, unless FP8NCA_BACKEND names another
# (scripts/gpu_check.sh runs them once per CUDA kernel family its GPU has).
GPU_BACKEND = os.environ.get("FP8NCA_BACKEND", "mma_sync")

# The mma.sync attention kernels _C holds: 64-row tile: head dims x query dtypes x caches (e4m3,
# e5m2, the query's own 16-bit dtype); 128-row tile (paged_attention_kernel_m128): head_dim 128 x
# query dtypes x FP8 caches. Each writes the unsplit LSE in its epilogue when asked: no twin.
NUM_ATTENTION_KERNELS = 3 * 2 * 3 + 2 * 2
# The per-token-head kernels (paged_attention_kernel_pth): 64-row tile: head
# dims x query dtypes x caches (e4m3, e5m2, int8); 128-row tile (paged_attention_kernel_m128_pth):
# head_dim 128 x query dtypes x those caches.
NUM_TOKEN_SCALE_KERNELS = 3 * 2 * 3 + 2 * 3


def replaced(problem: AttentionProblem, **changes) -> AttentionProblem:
    """``problem`` with ``changes`` to its batch's fields (``window``, ``seq_lens``, ...) and its
    own (``query``, ``sinks``, ...) alike; a new query also sets the batch's ``num_tokens``."""
    batch_fields = {field.name for field in dataclasses.fields(Batch)}
    if "query" in changes:
        changes.setdefault("num_tokens", changes["query"].shape[0])
    batch = dataclasses.replace(
        problem.batch, **{name: v for name, v in changes.items() if name in batch_fields}
    )
    own = {name: v for name, v in changes.items() if name not in batch_fields}
    return dataclasses.replace(problem, batch=batch, **own)
