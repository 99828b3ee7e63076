"""What every backend provides (SPEC §4): one protocol for the PyTorch reference, Triton and each
compiled CUDA kernel family alike. :mod:`fp8_noncausal_attn.registry` lists them.

The plan is the seam and the one answer to "can this backend run this call?": everything
host-side is decided once per batch from the :class:`~fp8_noncausal_attn.problem.Batch` alone
(index tensors, sizes, dtypes, device, mask, window, maximum lengths, the scale kind, whether the
LSE is wanted; never a query or a cache), and ``plan`` either returns the plan of exactly the
kernel that will run or raises :class:`Refused` with the reason. ``run`` only launches, per
layer, after ``run_unsupported_reason`` has accepted what differs per layer (pointers, strides,
alignment).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..problem import AttentionProblem, Batch


class Refused(Exception):
    """A backend cannot plan this batch (a device, size, scale kind or output its kernels do
    not take, a library that does not load); the message says why. ``auto`` moves on to the
    next backend, a named one raises."""


class Backend(Protocol):
    """One backend: a module or an object with these attributes."""

    def availability(self) -> tuple[bool, str]:
        """Whether the backend runs on this machine at all (its library, driver, GPU), and why
        (not): a description of the machine, asked once per process (``available_backends()``
        asks again), never of a call. ``plan`` is not asked when it is False."""

    def plan(self, batch: Batch, workspace: Any = None, num_splits: int | None = None) -> Any:
        """Plan time (host only, never a device value, never under tracing): the plan of the
        kernel that will run ``batch`` (tiles, grid, splits, workspace views), or
        :class:`Refused` with the reason its kernels cannot (the device, sizes, dtypes,
        ``batch.scale_mode``, ``batch.return_lse``).

        ``workspace`` is a :class:`fp8_noncausal_attn.plan.Workspace` (take at most
        ``workspace.max_splits(batch.num_tokens)`` splits and the buffers from
        ``workspace.partials(num_splits, batch.num_tokens)``), or None and the launch allocates
        what it needs. ``num_splits`` forces the split-KV count (tests cover the merge with it).
        """

    def run_unsupported_reason(
        self, problem: AttentionProblem, out: torch.Tensor | None
    ) -> str | None:
        """Run time: None when this layer's own tensors (pointers, strides, alignment) suit the
        planned kernel, else why not; checked before every run."""

    def run(
        self,
        problem: AttentionProblem,
        plan: Any,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Run time, per layer: launch on the real tensors; ``out`` [num_tokens, num_q_heads,
        head_dim] is written in place, rows past ``cu_seqlens_q[-1]`` as zeros, and ``lse``
        (float32 [num_tokens, num_q_heads], any strides), when not None (only under a plan of a
        batch with ``return_lse``), with each row's natural-log log-sum-exp (-inf for those
        rows). ``problem.num_tokens`` is at most the planned batch's. Asynchronous on the
        current stream."""
