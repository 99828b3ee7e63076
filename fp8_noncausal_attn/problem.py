"""The validated, normalised form of one ``paged_attention`` call.

Validation (``validation.py``) turns the user's arguments into an :class:`AttentionProblem`;
every backend (reference, Triton, CUDA) consumes only this, so each kernel sees one layout
convention and never re-checks user input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Not frozen: a frozen dataclass's __init__ costs ~15x a plain one's (one object.__setattr__
# per field), and one problem is built for every layer's run. Treat instances as read-only.
@dataclass(eq=False)
class AttentionProblem:
    """One paged attention call, checked and normalised (read-only by convention).

    Tensors (all on one device):
      query:        [num_tokens, num_q_heads, head_dim], bf16/fp16, last dim contiguous.
      key_cache:    [num_blocks, block_size, num_kv_heads, head_dim], fp8 e4m3/e5m2, bf16 or fp16,
                    any strides with stride(-1) == 1 (a vLLM combined cache arrives as a view).
      value_cache:  same shape and dtype as key_cache, strides may differ.
      block_table:  [num_seqs, max_blocks_per_seq] int32.
      cu_seqlens_q: [num_seqs + 1] int32, non-decreasing, cu_seqlens_q[-1] <= num_tokens; rows
                    past it are padding (vLLM under CUDA graphs), written as zeros.
      seq_lens:     [num_seqs] int32, KV length of each sequence including its new tokens.
                    The index tensors (block_table, cu_seqlens_q, seq_lens, causal_per_seq) are
                    the user's own, any strides: backends read them in place with their strides.
      k_scale, v_scale: [num_kv_heads] float32, contiguous; dequantisation multipliers
                    (real K = stored K * k_scale[kv_head]); all ones when the user gave none.
      causal_per_seq: [num_seqs] bool or int32 (nonzero = causal), the user's tensor itself
                    (never a copy: vLLM updates it in place between graph replays), or None and
                    ``causal`` holds the one mask for the whole launch.
    Scalars:
      softmax_scale:  multiplier of q.k before the softmax (default head_dim ** -0.5).
      max_seqlen_q/k: host-side upper bounds of q_len / kv_len, used to size grids without a
                    device-to-host sync.
      window:       ``(left, right)`` sliding window (masking.visible_range), each -1 (unbounded)
                    or >= 0; default ``(-1, -1)``, no window.
    Tensors (optional):
      sinks:        [num_q_heads] float32 attention-sink logits joining every row's softmax
                    denominator (no value), or None (the default).
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    causal: bool
    causal_per_seq: torch.Tensor | None
    softmax_scale: float
    max_seqlen_q: int
    max_seqlen_k: int
    window: tuple[int, int] = (-1, -1)
    sinks: torch.Tensor | None = None

    @property
    def has_window(self) -> bool:
        return self.window[0] >= 0 or self.window[1] >= 0

    @property
    def per_token_head_scales(self) -> bool:
        """``k_scale`` and ``v_scale`` hold one scale per key: float32 ``[num_blocks, block_size,
        num_kv_heads]`` (any strides), real K = stored K * k_scale[block, slot, kv_head]. Both
        or neither: a problem never mixes them with per-head ``[num_kv_heads]`` scales."""
        return self.k_scale.dim() == 3

    @property
    def num_tokens(self) -> int:
        return self.query.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.query.shape[1]

    @property
    def head_dim(self) -> int:
        return self.query.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.shape[2]

    @property
    def block_size(self) -> int:
        return self.key_cache.shape[1]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True, eq=False)
class CacheWrite:
    """One validated ``reshape_and_cache`` call, as every backend's cache write takes it.

    key, value: [num_tokens, num_kv_heads, head_dim] bf16/fp16, any token and head strides.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], FP8 or 16-bit,
        written in place. slot_mapping: [num_tokens] int64 ``block_id * block_size + offset``
        (< 0: skipped), any stride. k_scale, v_scale: [num_kv_heads] float32, contiguous; the
        stored value is ``x / scale[kv_head]``.
    """

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
