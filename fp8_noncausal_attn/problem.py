"""The validated, normalised records of one ``paged_attention`` call.

A call is a batch and a layer (FlashInfer's ``plan``/``run`` split): the :class:`Batch` is what
every layer of one batch shares (index tensors, sizes, dtypes, device, mask, window, maximum
lengths), checked once by :func:`fp8_noncausal_attn.validation.validate_batch`; backends plan
from it alone. An :class:`AttentionProblem` is one layer's run on a planned batch: its query,
caches, scales and sinks. Backends consume only these records, so each kernel sees one layout
convention and never re-checks user input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# Not frozen: a frozen dataclass's __init__ costs ~15x a plain one's (one object.__setattr__
# per field). Treat instances as read-only.
@dataclass(eq=False)
class Batch:
    """One batch as every backend plans it (read-only by convention; host values and the
    index tensors, never a query or a cache).

    Tensors (on ``device``; the user's own, any strides: backends read them in place with their
    strides, and vLLM rewrites them between CUDA-graph replays):
      block_table:  [num_seqs, max_blocks_per_seq] int32.
      cu_seqlens_q: [num_seqs + 1] int32, non-decreasing, cu_seqlens_q[-1] <= num_tokens; rows
                    past it are padding (vLLM under CUDA graphs), written as zeros.
      seq_lens:     [num_seqs] int32, KV length of each sequence including its new tokens.
      causal_per_seq: [num_seqs] bool or int32 (nonzero = causal), the user's tensor itself, or
                    None and ``causal`` holds the one mask for the whole launch.
    Host values:
      causal:        the launch-wide mask when ``causal_per_seq`` is None.
      softmax_scale: multiplier of q.k before the softmax (default head_dim ** -0.5).
      max_seqlen_q/k: upper bounds of q_len / kv_len, sizing grids without a device sync.
      window:        ``(left, right)`` sliding window (masking.visible_range), each -1
                     (unbounded) or >= 0.
      num_tokens:    the most query rows a run of this batch brings (the plan's bound).
      num_q_heads, num_kv_heads, head_dim, block_size, query_dtype, cache_dtype, device: the
                     layer tensors' sizes, dtypes and device, the same for every layer.
    What its runs need (a backend's ``plan()`` refuses what its kernels cannot do):
      scale_mode:    the layers' scale kind, a key of ``launch_record.SCALE_MODES``:
                     ``"per_head"`` (float32 [num_kv_heads]) or ``"per_token_head"`` (float32
                     [num_blocks, block_size, num_kv_heads]; an int8 cache has no other).
      return_lse:    whether its runs write each row's LSE.
    """

    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    causal: bool
    causal_per_seq: torch.Tensor | None
    softmax_scale: float
    max_seqlen_q: int
    max_seqlen_k: int
    window: tuple[int, int]
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    device: torch.device
    scale_mode: str = "per_head"
    return_lse: bool = False

    @property
    def per_token_head_scales(self) -> bool:
        """Whether the layers' scales are per token and head (:attr:`scale_mode`)."""
        return self.scale_mode == "per_token_head"

    @property
    def has_window(self) -> bool:
        return self.window[0] >= 0 or self.window[1] >= 0

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(eq=False)
class AttentionProblem:
    """One layer's run on a planned :class:`Batch` (read-only by convention). The batch's
    fields read through as the problem's own (``problem.block_table``, ``problem.window``).

    Tensors (on the batch's device, its sizes and dtypes):
      query:       [num_tokens, num_q_heads, head_dim], bf16/fp16, last dim contiguous;
                   ``num_tokens`` at most the batch's.
      key_cache:   [num_blocks, block_size, num_kv_heads, head_dim], fp8 e4m3/e5m2, bf16,
                   fp16 or int8 (per-token-head scales only), any strides with stride(-1) == 1
                   (a vLLM combined cache arrives as a view).
      value_cache: same shape and dtype as key_cache, strides may differ.
      k_scale, v_scale: dequantisation multipliers, float32, both of one kind: [num_kv_heads],
                   contiguous (real K = stored K * k_scale[kv_head]; all ones when the user gave
                   none), or per token and head [num_blocks, block_size, num_kv_heads], the
                   user's tensors with any strides (real K = stored K * k_scale[block, slot,
                   kv_head]; FP8 and int8 caches); ``k_scale.dim()`` tells them apart.
      sinks:       [num_q_heads] float32 attention-sink logits joining every row's softmax
                   denominator (no value), or None.
    """

    batch: Batch
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    sinks: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """This layer's query rows (at most the batch's ``num_tokens``)."""
        return self.query.shape[0]

    @property
    def per_token_head_scales(self) -> bool:
        """Whether ``k_scale`` / ``v_scale`` hold one scale per key and KV head (3-D) rather
        than one per KV head: the batch's :attr:`Batch.scale_mode`, which validation makes
        the scales' own."""
        return self.batch.scale_mode == "per_token_head"

    # The batch's fields, read through (plain properties: the launch path reads them per layer).
    @property
    def block_table(self) -> torch.Tensor:
        return self.batch.block_table

    @property
    def cu_seqlens_q(self) -> torch.Tensor:
        return self.batch.cu_seqlens_q

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.batch.seq_lens

    @property
    def causal(self) -> bool:
        return self.batch.causal

    @property
    def causal_per_seq(self) -> torch.Tensor | None:
        return self.batch.causal_per_seq

    @property
    def softmax_scale(self) -> float:
        return self.batch.softmax_scale

    @property
    def max_seqlen_q(self) -> int:
        return self.batch.max_seqlen_q

    @property
    def max_seqlen_k(self) -> int:
        return self.batch.max_seqlen_k

    @property
    def window(self) -> tuple[int, int]:
        return self.batch.window

    @property
    def num_q_heads(self) -> int:
        return self.batch.num_q_heads

    @property
    def num_kv_heads(self) -> int:
        return self.batch.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.batch.head_dim

    @property
    def block_size(self) -> int:
        return self.batch.block_size

    @property
    def has_window(self) -> bool:
        return self.batch.has_window

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def group_size(self) -> int:
        return self.batch.group_size


@dataclass(frozen=True, eq=False)
class CacheWrite:
    """One validated ``reshape_and_cache`` call, as every backend's cache write takes it.

    key, value: [num_tokens, num_kv_heads, head_dim] bf16/fp16, any token and head strides.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], FP8, 16-bit or
        int8 (per-token-head scales only), written in place. slot_mapping: [num_tokens] int64
        ``block_id * block_size + offset`` (< 0: skipped), any stride. k_scale, v_scale: float32,
        both of one kind: [num_kv_heads], contiguous, the stored value is
        ``x / scale[kv_head]``; or per token and head [num_blocks, block_size, num_kv_heads],
        any strides, written in place with each row's scale
        (``scales.quantize_per_token_head``).
    """

    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
