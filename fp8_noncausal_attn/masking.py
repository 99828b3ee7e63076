"""The attention mask, in one place (SPEC §3).

Query token ``i`` of a sequence with ``q_len`` new tokens and ``kv_len`` keys sits at absolute
position ``p = kv_len - q_len + i``. Causal: it sees keys ``0 <= j <= p``. Bidirectional: it sees
keys ``0 <= j < kv_len``. A sliding window ``(left, right)`` (FlashAttention's convention, ``-1`` =
unbounded) further limits it to ``p - left <= j <= p + right``; with causal, ``right`` is capped at
0 by the causal bound. The reference and the Triton kernel implement exactly :func:`visible_range`
(Triton also skips whole key tiles outside the union of its rows' ranges); the CUDA kernels
implement it in csrc/mma_sync/index_maps.h (``row_keys``, checked against this function by
tests/test_cuda_kernel_emulation.py) and skip whole key tiles the same way.
"""

from __future__ import annotations

import torch

# No sliding window: FlashAttention's (-1, -1).
NO_WINDOW = (-1, -1)

# Per-sequence flags: bool, or int32 (nonzero = causal) as in vLLM 0.33 CommonAttentionMetadata.
CAUSAL_DTYPES = (torch.bool, torch.int32)


def normalize_causal(
    causal: bool | torch.Tensor, num_seqs: int, device: torch.device
) -> tuple[bool, torch.Tensor | None]:
    """Split ``causal`` into (launch-wide flag, per-sequence tensor or None).

    A per-sequence tensor must be bool or int32 (nonzero = causal) ``[num_seqs]`` on ``device``,
    any stride. It is returned as is, never converted or copied: vLLM 0.33 passes an int32 slice
    of a persistent buffer that it updates in place between CUDA-graph replays, so every backend
    reads the flags where they lie. The launch-wide flag is then unused.
    """
    if isinstance(causal, bool):
        return causal, None
    if not isinstance(causal, torch.Tensor):
        raise TypeError(
            f"causal must be a bool or a bool/int32 tensor [num_seqs], got {type(causal).__name__}"
        )
    if causal.dtype not in CAUSAL_DTYPES:
        raise TypeError(
            f"causal tensor must have dtype in {list(CAUSAL_DTYPES)}, got {causal.dtype}"
        )
    if causal.shape != (num_seqs,):
        raise ValueError(
            f"causal tensor must have shape [num_seqs] = [{num_seqs}], got {list(causal.shape)}"
        )
    if causal.device != device:
        raise ValueError(f"causal tensor must be on {device} like query, got {causal.device}")
    return True, causal


def visible_keys(
    token_index: torch.Tensor, q_len: int, kv_len: int, causal: bool | torch.Tensor
) -> torch.Tensor:
    """Number of leading keys each query token attends to.

    Args:
        token_index: ``[n]`` int64, 0-based index of the query token inside its sequence.
        causal: a bool, or a 0-d bool/int32 tensor for this sequence (nonzero = causal).
    Returns:
        ``[n]`` int64: ``p + 1`` for causal (``p = kv_len - q_len + i``), ``kv_len`` otherwise.
    """
    causal_limit = kv_len - q_len + token_index + 1
    is_causal = torch.as_tensor(causal, device=token_index.device) != 0
    return torch.where(is_causal, causal_limit, torch.full_like(token_index, kv_len))


def visible_range(
    token_index: torch.Tensor,
    q_len: int,
    kv_len: int,
    causal: bool | torch.Tensor,
    window: tuple[int, int] = NO_WINDOW,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys each query token attends to: ``start <= j < end``.

    Args:
        token_index: ``[n]`` int64, 0-based index of the query token inside its sequence.
        causal: a bool, or a 0-d bool/int32 tensor for this sequence (nonzero = causal).
        window: ``(left, right)``, each ``-1`` (unbounded) or ``>= 0``.
    Returns:
        ``(start, end)``, each ``[n]`` int64. Never empty for a valid token: ``p`` itself is
        always visible (``left, right >= 0`` or unbounded, and ``p < kv_len``).
    """
    left, right = window
    position = kv_len - q_len + token_index
    end = visible_keys(token_index, q_len, kv_len, causal)
    if right >= 0:
        end = torch.minimum(end, position + right + 1)
    start = torch.zeros_like(token_index)
    if left >= 0:
        start = torch.clamp(position - left, min=0)
    return start, end
