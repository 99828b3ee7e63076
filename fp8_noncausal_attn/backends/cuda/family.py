"""What a CUDA kernel family provides to the CUDA backend, which picks one per plan and falls back
on mma_sync (the portable family) when the one asked for cannot take a batch or a layer."""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

from ...problem import AttentionProblem


class Refused(Exception):
    """A family cannot plan this batch; the message says why (the backend falls back)."""


class KernelFamily(Protocol):
    """One kernel family. ``plan`` and ``unsupported_reason`` run at plan time (host sizes only;
    the problem's query and caches may be stand-ins with shape, dtype and device),
    ``run_unsupported_reason`` and ``run`` per layer on the real tensors."""

    name: str

    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        """None when the family can run the batch's sizes, dtypes and device, else why not."""

    def plan(self, problem: AttentionProblem, workspace: Any, num_splits: int | None) -> Any:
        """The launch plan (tiles, split count, workspace views); raises :class:`Refused`.
        ``num_splits`` forces the split-KV count; ``workspace``
        (``fp8_noncausal_attn.plan.Workspace`` or None) bounds it and holds the partials."""

    def run_unsupported_reason(self, problem: AttentionProblem, out: torch.Tensor) -> str | None:
        """None when this layer's own tensors (pointers, strides) suit the kernels."""

    def run(
        self,
        problem: AttentionProblem,
        plan: Any,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Launch, writing ``out`` [num_tokens, num_q_heads, head_dim] in place, rows past
        ``cu_seqlens_q[-1]`` as zeros, and ``lse`` (float32 [num_tokens, num_q_heads], natural
        log) when given. Asynchronous on the current stream."""


_warned: set[str] = set()


def warn_once(why: str) -> None:
    """A RuntimeWarning the first time ``why`` comes up in this process."""
    if why not in _warned:
        _warned.add(why)
        warnings.warn(why, RuntimeWarning, stacklevel=3)
