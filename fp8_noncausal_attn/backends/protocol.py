"""What every backend provides (SPEC §4): one protocol for the PyTorch reference, Triton and each
compiled CUDA kernel family alike. :mod:`fp8_noncausal_attn.registry` lists them.

The plan is the seam: everything host-side is decided once per batch from the
:class:`~fp8_noncausal_attn.problem.Batch` alone (index tensors, sizes, dtypes, device, mask,
window, maximum lengths; never a query or a cache), and ``run`` only launches, per layer.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..problem import AttentionProblem, Batch


class Refused(Exception):
    """A backend cannot plan this batch (a kernel not built for it, a library that does not
    load); the message says why. ``auto`` moves on to the next backend, a named one raises."""


class Backend(Protocol):
    """One backend: a module or an object with these attributes."""

    # None when the kernels read per-token-head scales (float32 [num_blocks, block_size,
    # num_kv_heads], real K = stored K * k_scale[block, slot, kv_head]) and int8 caches, else
    # why not. Asked at plan time for an int8 cache and at run time for such scales (a layer's
    # property): a named backend raises with it, ``auto`` moves on.
    PER_TOKEN_HEAD_REFUSAL: str | None

    def availability(self) -> tuple[bool, str]:
        """Whether the backend runs on this machine, and why (not). Asked once per process
        (``available_backends()`` asks again)."""

    def device_reason(self, device: torch.device) -> str | None:
        """None when the backend's kernels take tensors on ``device``, else why not (the cache
        write and the merge ask only this)."""

    def unsupported_reason(self, batch: Batch) -> str | None:
        """Plan time: None when the backend supports the batch's sizes, dtypes, device and
        index tensors, else why not."""

    def plan(self, batch: Batch, workspace: Any = None, num_splits: int | None = None) -> Any:
        """Plan time (host only, never a device value, never under tracing): what the launch
        needs (tiles, grid, splits, workspace views); raises :class:`Refused` with the reason.

        ``workspace`` is a :class:`fp8_noncausal_attn.plan.Workspace` (take at most
        ``workspace.max_splits(batch.num_tokens)`` splits and the buffers from
        ``workspace.partials(num_splits, batch.num_tokens)``), or None and the launch allocates
        what it needs. ``num_splits`` forces the split-KV count (tests cover the merge with it).
        """

    def run_unsupported_reason(
        self, problem: AttentionProblem, out: torch.Tensor | None
    ) -> str | None:
        """Run time: None when this layer's own tensors (pointers, strides) suit the kernels;
        checked before every run."""

    def run(
        self,
        problem: AttentionProblem,
        plan: Any,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Run time, per layer: launch on the real tensors; ``out`` [num_tokens, num_q_heads,
        head_dim] is written in place, rows past ``cu_seqlens_q[-1]`` as zeros, and ``lse``
        (float32 [num_tokens, num_q_heads], any strides), when not None, with each row's
        natural-log log-sum-exp (-inf for those rows). ``problem.num_tokens`` is at most the
        planned batch's. Asynchronous on the current stream."""
