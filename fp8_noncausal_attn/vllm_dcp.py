"""Decode context parallelism for the vLLM backend ``FP8_NONCAUSAL`` (SPEC §8), as vLLM's
FLASH_ATTN runs it (``FlashAttentionImpl._forward_with_dcp``, vLLM 0.33), in one attention call
per layer when the batch is bidirectional.

Under ``decode_context_parallel_size = N > 1`` each rank of a DCP group holds every KV head of its
tensor-parallel rank for a shard of each request's tokens: position ``j`` lives on rank
``(j // I) % N``, ``I = cp_kv_cache_interleave_size`` (vLLM's ``get_dcp_local_seq_lens`` counts
them; the cache write puts each new token on its rank too). The ranks of a group share their KV
heads, so the layer's per-KV-head ``k_scale`` / ``v_scale`` (this TP rank's slice) are the right
ones for the local shard, and their query heads differ (per-token-head caches: the scales inline
in this rank's pages, the local shard's own). One layer's attention is then, per rank:

1. the shard: the query is all-gathered over the group's heads (``N x num_heads`` query heads
   against the same KV heads) and attends this rank's shard bidirectionally, with its LSE (a
   ``key_shard`` plan: a rank may hold fewer keys than a request has new tokens, or none);
2. the states of the N ranks are combined (:func:`combine_across_ranks`: all-gather of the LSEs,
   each rank's output weighted by its share, reduce-scatter back to this rank's heads).

A bidirectional batch (``causal`` False) is done then: the shard is every key of the request,
the new tokens' included, read from the cache as without DCP, and the sinks join the combined
state, once. A causal row sees a prefix of the shard that grows by one key every ``N I``
positions, which no mask of the kernels expresses, so a batch with causal requests attends only
the context (each request's keys before its new tokens) in step 1, and then:

3. the new tokens attend each other, causal or not as the batch says, from the layer's 16-bit
   ``key`` / ``value`` (FLASH_ATTN does the same: every rank has them, no communication), packed
   into pages of a small 16-bit cache; the attention sinks join here, once;
4. the two states are merged by :func:`fp8_noncausal_attn.merge_attention_states`.

Sliding windows are refused under DCP (the shard's positions are not the sequence's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .merge import merge_attention_states
from .plan import PagedAttention

# Keys per page of the new tokens' packed cache.
NEW_TOKEN_PAGE = 16


def dcp_world_size_and_rank(kv_cache_spec) -> tuple[int, int]:
    """``(size, rank)`` of this process in vLLM's DCP group for a KV-cache group; ``(1, 0)``
    without a DCP group or when the group's cache is not sharded (a replicated draft cache)."""
    if not getattr(kv_cache_spec, "dcp_sharded", True):
        return 1, 0
    from vllm.distributed.parallel_state import get_dcp_group

    try:
        group = get_dcp_group()
    except AssertionError:  # no distributed state: a single process
        return 1, 0
    return group.world_size, group.rank_in_group


def combine_across_ranks(
    out: torch.Tensor, lse: torch.Tensor, group, sinks: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``cp_lse_ag_out_rs`` in PyTorch ops: each rank's state over its key shard,
    ``out`` [tokens, N x heads, head_dim] and natural-log ``lse`` [tokens, N x heads], becomes the
    state over all ranks' keys for this rank's heads, ``([tokens, heads, head_dim],
    [tokens, heads])``. Empty shards (lse -inf) weigh nothing; a row no rank saw gets zeros and
    -inf. ``sinks`` (float32 [heads], this rank's): each head's sink logit joins the combined
    denominator (SPEC §3), once."""
    lses = group.all_gather(lse.contiguous(), dim=0).view(group.world_size, *lse.shape)
    top = lses.amax(dim=0)
    top = torch.where(top == float("-inf"), 0.0, top)
    total = torch.exp(lses - top).sum(dim=0)
    merged_lse = torch.where(total == 0, float("-inf"), top + torch.log(total))
    shift = torch.where(total == 0, 0.0, merged_lse)
    weight = torch.exp(lse - shift)
    # An empty shard's output is never read (it may hold anything): weight 0 masks it.
    weighted = torch.where(weight[..., None] != 0, out.float() * weight[..., None], 0.0)
    combined = group.reduce_scatter(weighted.to(out.dtype), dim=1)
    heads = lse.shape[1] // group.world_size
    rank = group.rank_in_group
    merged_lse = merged_lse[:, rank * heads : (rank + 1) * heads]
    if sinks is None:
        return combined, merged_lse
    with_sink = torch.logaddexp(merged_lse, sinks.float()[None, :])
    combined = (combined.float() * torch.exp(merged_lse - with_sink)[..., None]).to(out.dtype)
    return combined, with_sink


@dataclass
class DcpPlan:
    """One batch under DCP: the :class:`DcpAttention` that planned it, the shard plan
    (all-gathered heads, this rank's shard: of every key for a bidirectional batch, else of the
    context); for a batch with causal requests also the new tokens' plan and the row of the
    packed new-token cache each query row goes to (else None)."""

    owner: DcpAttention
    shard: object
    new_tokens: object | None
    slots: torch.Tensor | None  # [num_actual_tokens] int64


class DcpAttention:
    """The two :class:`PagedAttention` objects (the shard's, the new tokens') and buffers of one
    KV-cache group under DCP, built with the group's metadata builder (so vLLM's memory profiling
    sees them)."""

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        interleave: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        query_dtype: torch.dtype,
        cache_dtype: torch.dtype,
        device: torch.device | str,
        max_num_seqs: int,
        max_num_tokens: int,
        softmax_scale: float,
        backend: str,
        scale_mode: str,
    ) -> None:
        self.world_size, self.rank, self.interleave = world_size, rank, interleave
        self.softmax_scale, self.backend = softmax_scale, backend
        sizes = {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "query_dtype": query_dtype,
                 "device": device, "max_num_seqs": max_num_seqs,
                 "max_num_tokens": max_num_tokens}  # fmt: skip
        self.shard = PagedAttention(
            num_q_heads=num_heads * world_size, block_size=block_size, cache_dtype=cache_dtype,
            scale_mode=scale_mode, **sizes,
        )  # fmt: skip
        self.new_tokens = PagedAttention(
            num_q_heads=num_heads, block_size=NEW_TOKEN_PAGE, cache_dtype=query_dtype, **sizes
        )
        device = self.shard.device
        # Every request's new tokens start a page: at most tokens / page + requests pages, and
        # one more that padded rows (past the last request) are written to.
        pages = -(-max_num_tokens // NEW_TOKEN_PAGE) + max_num_seqs + 1
        shape = (pages, NEW_TOKEN_PAGE, num_kv_heads, head_dim)
        self.new_keys = torch.zeros(shape, dtype=query_dtype, device=device)
        self.new_values = torch.zeros(shape, dtype=query_dtype, device=device)
        self._scratch_slot = (pages - 1) * NEW_TOKEN_PAGE
        # What the plans read, in buffers of their own that build() rewrites in place: a CUDA
        # graph captured with one batch's plans replays with the next batch's values.
        self._shard_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self._new_lens = torch.zeros(max_num_seqs, dtype=torch.int32, device=device)
        self._slots = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self._new_table = torch.zeros(
            (max_num_seqs, -(-max_num_tokens // NEW_TOKEN_PAGE)), dtype=torch.int32, device=device
        )

    def plan(self, m) -> DcpPlan:
        """Plan one batch (vLLM's ``CommonAttentionMetadata``); device ops only, no sync."""
        from vllm.v1.attention.backends.utils import get_dcp_local_seq_lens

        num_reqs = m.num_reqs
        starts = m.query_start_loc[: num_reqs + 1]
        q_lens = starts[1:] - starts[:-1]
        # A per-request flag tensor counts as causal: reading it would sync the host.
        bidirectional = m.causal is False
        keys = m.seq_lens[:num_reqs] if bidirectional else m.seq_lens[:num_reqs] - q_lens
        self._shard_lens[:num_reqs] = get_dcp_local_seq_lens(
            keys, self.world_size, self.rank, self.interleave
        )
        # FLASH_ATTN's bound of a rank's keys: ceil(L / (N I)) I.
        span = self.world_size * self.interleave
        max_shard = -(-m.max_seq_len // span) * self.interleave
        # Both plans are made for the LSE that forward's runs ask for: a plan made without it
        # would be made again on the first run of each batch.
        shard_plan = self.shard.plan(
            starts, self._shard_lens[:num_reqs], m.block_table_tensor, causal=False,
            max_seqlen_q=m.max_query_len, max_seqlen_k=max(max_shard, 1),
            softmax_scale=self.softmax_scale, num_tokens=m.num_actual_tokens,
            backend=self.backend, key_shard=True, return_lse=True,
        )  # fmt: skip
        if bidirectional:
            return DcpPlan(self, shard_plan, None, None)
        self._new_lens[:num_reqs] = q_lens
        # The new tokens' pages: request r's start at first[r], in order.
        pages = (q_lens + NEW_TOKEN_PAGE - 1) // NEW_TOKEN_PAGE
        first = torch.cumsum(pages, 0) - pages
        width = max(-(-m.max_query_len // NEW_TOKEN_PAGE), 1)
        columns = torch.arange(width, device=first.device, dtype=torch.int32)
        self._new_table[:num_reqs, :width] = first[:, None].to(torch.int32) + columns[None, :]
        tokens = torch.arange(m.num_actual_tokens, device=first.device, dtype=starts.dtype)
        request = torch.searchsorted(starts[1:].contiguous(), tokens, right=True)
        real = request < num_reqs
        request = request.clamp(max=max(num_reqs - 1, 0))
        index = tokens - starts[request]
        page_start = (first[request] + index // NEW_TOKEN_PAGE) * NEW_TOKEN_PAGE
        slots = self._slots[: m.num_actual_tokens]
        slots.copy_(torch.where(real, page_start + index % NEW_TOKEN_PAGE, self._scratch_slot))
        new_plan = self.new_tokens.plan(
            starts, self._new_lens[:num_reqs], self._new_table[:num_reqs, :width], causal=m.causal,
            max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_query_len,
            softmax_scale=self.softmax_scale, num_tokens=m.num_actual_tokens,
            backend=self.backend, return_lse=True,
        )  # fmt: skip
        return DcpPlan(self, shard_plan, new_plan, slots)

    def forward(
        self,
        plan: DcpPlan,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        sinks: torch.Tensor | None,
        output: torch.Tensor,
    ) -> None:
        """One layer: ``query``/``output`` [num_actual_tokens, num_heads, head_dim], ``key``/
        ``value`` [num_actual_tokens, num_kv_heads, head_dim] (the new tokens, 16-bit), the
        layer's paged caches (this rank's shard) and scales; writes ``output`` in place."""
        from vllm.distributed.parallel_state import get_dcp_group

        group = get_dcp_group()
        every_head = group.all_gather(query.contiguous(), dim=1)
        shard_out, shard_lse = self.shard.run(
            every_head, key_cache, value_cache, k_scale, v_scale, plan=plan.shard,
            return_lse=True,
        )  # fmt: skip
        if plan.new_tokens is None:
            output.copy_(combine_across_ranks(shard_out, shard_lse, group, sinks)[0])
            return
        context_out, context_lse = combine_across_ranks(shard_out, shard_lse, group)
        flat = (-1, *self.new_keys.shape[2:])
        self.new_keys.view(flat).index_copy_(0, plan.slots, key.to(self.new_keys.dtype))
        self.new_values.view(flat).index_copy_(0, plan.slots, value.to(self.new_values.dtype))
        new_out, new_lse = self.new_tokens.run(
            query, self.new_keys, self.new_values, plan=plan.new_tokens, sinks=sinks,
            return_lse=True,
        )  # fmt: skip
        merge_attention_states([context_out, new_out], [context_lse, new_lse], out=output)
