"""Plan once per batch, run per layer (SPEC §4; FlashInfer's wrapper convention).

:class:`PagedAttention` is built once with the sizes that do not change between batches (heads,
head_dim, block_size, dtypes, device, the largest batch) and allocates the split-KV workspace
then, so a serving engine's memory profiling sees it. :meth:`PagedAttention.plan` takes one
batch's index tensors and decides, on the host and without reading device values (when
``max_seqlen_q/k`` are given), the backend, tiles and splits; :meth:`PagedAttention.run` is then
called for every layer of that batch and does the launch and little else: the layer tensors'
checks are a few attribute reads, and caches and per-head scales are checked in full once per
tensor object.

Outside ``torch.compile`` tracing, ``run`` calls the backend directly (no ``torch.library``
dispatcher on the hot path). Under tracing it goes through the opaque op
``fp8_noncausal_attn::paged_attention`` (see :mod:`fp8_noncausal_attn.api`), which plans and
launches when the graph runs, so nothing about backends or pointers is ever traced.
"""

from __future__ import annotations

import dataclasses

import torch

from . import registry
from .api import new_lse, paged_attention
from .problem import AttentionProblem
from .scales import (
    ALL_CACHE_DTYPES,
    SIXTEEN_BIT_DTYPES,
    ScaleArg,
    check_per_token_head_scales,
    check_score_scale,
    is_per_token_head,
    normalize_scale,
    scale_mode_of,
)
from .validation import (
    check_cache_sizes,
    check_caches,
    check_out,
    check_per_token_head_values,
    check_query,
    check_scale_mode,
    check_sinks,
    optional_host_int,
    validate_batch,
)

# Split-KV partial rows (one row = one split x query token x query head) the default workspace
# holds. The planners split only while (sequences x KV heads x query tiles) is below about twice
# the multiprocessor count, and a query tile holds at most 128 rows, so a split plan needs at
# most ~2 x SMs x 128 rows: 65536 covers GPUs up to 256 SMs. It costs
# 65536 x (head_dim + 1) x 4 bytes (34 MB at head_dim 128).
DEFAULT_WORKSPACE_ROWS = 1 << 16
# Tensor objects whose full checks are remembered (caches, scales); past this the memo restarts.
_MEMO_LIMIT = 256


class Workspace:
    """The split-KV workspace: partial outputs and log-sum-exps, allocated once.

    ``ws_o``: float32 ``[rows, head_dim]``; ``ws_lse``: float32 ``[rows]``. A plan with
    ``num_splits`` splits over ``num_tokens`` query rows uses the first
    ``num_splits * num_tokens * num_q_heads`` rows, viewed by :meth:`partials`.
    """

    def __init__(self, rows: int, num_q_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.rows = rows
        self.ws_o = torch.empty(rows, head_dim, dtype=torch.float32, device=device)
        self.ws_lse = torch.empty(rows, dtype=torch.float32, device=device)

    def max_splits(self, num_tokens: int) -> int:
        """The most splits whose partials fit for ``num_tokens`` query rows (at least 1)."""
        return max(1, self.rows // max(num_tokens * self.num_q_heads, 1))

    def partials(self, num_splits: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``ws_o [num_splits, num_tokens, num_q_heads, head_dim]`` and
        ``ws_lse [num_splits, num_tokens, num_q_heads]`` of the buffers (no copy)."""
        used = num_splits * num_tokens * self.num_q_heads
        if used > self.rows:
            raise ValueError(
                f"the workspace holds {self.rows} split rows, a plan with {num_splits} splits x "
                f"{num_tokens} tokens x {self.num_q_heads} heads needs {used}"
            )
        shape = (num_splits, num_tokens, self.num_q_heads)
        return (
            self.ws_o[:used].view(*shape, self.head_dim),
            self.ws_lse[:used].view(shape),
        )


class BatchPlan:
    """What :meth:`PagedAttention.plan` decided for one batch (host values only); returned by
    ``plan()`` so that several batches planned ahead (micro-batches) can each be run. Plans of
    one :class:`PagedAttention` share its workspace: run them one after another on one stream.

    ``batch``: the checked :class:`~fp8_noncausal_attn.problem.Batch`; ``requested``: the
    ``backend`` asked for; ``backend``: the one that runs (``"meta"`` for meta tensors, the
    request while a traced plan defers the choice to the op); ``chain``: the backends' plans a
    run tries in order (``registry.Chain``: one for a named backend; for ``auto``, the next
    one is planned for a layer whose tensors the first cannot take); ``passed_over``: why
    ``auto`` did not take the backends before it; ``variants``: ``(scale_mode, return_lse) ->
    (batch, chain)`` planned by a run whose needs the plan did not state (see
    :meth:`PagedAttention.run`)."""

    __slots__ = (
        "batch", "requested", "backend", "chain", "passed_over", "causal_arg", "max_page",
        "check_values", "validate", "traced", "variants",
    )  # fmt: skip

    @property
    def num_tokens(self) -> int:
        """The most query rows a run of this plan takes."""
        return self.batch.num_tokens


class PagedAttention:
    """Paged attention over a (possibly FP8) KV cache, planned once per batch, run per layer.

    Example (a drafter step, the same plan for every layer)::

        attn = PagedAttention(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                              query_dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                              device="cuda", max_num_seqs=256, max_num_tokens=4096)
        attn.plan(cu_seqlens_q, seq_lens, block_table, causal=False,
                  max_seqlen_q=8, max_seqlen_k=4096)
        for layer in layers:
            out = attn.run(query[layer], key_cache[layer], value_cache[layer],
                           k_scale[layer], v_scale[layer])

    Args:
        num_q_heads, num_kv_heads, head_dim, block_size: the fixed sizes (``num_q_heads`` a
            multiple of ``num_kv_heads``; head_dim 64/128/256; block_size a power of two in
            [8, 256]).
        query_dtype: bf16 or fp16. cache_dtype: float8_e4m3fn, float8_e5m2, bf16, fp16, or int8
            (whose runs take per-token-head scales only).
        scale_mode: the layers' scale kind, ``"per_head"`` (float32 ``[num_kv_heads]``) or
            ``"per_token_head"`` (float32 ``[num_blocks, block_size, num_kv_heads]``; FP8 and
            int8 caches): every plan is made for it, and a run with the other kind raises
            (vLLM knows it from ``kv_cache_dtype``). None (default): per-token-head for an int8
            cache, else per-head, and a run with per-token-head scales plans its batch for them
            on its first run (host only).
        device: where every tensor lives.
        max_num_seqs, max_num_tokens: the largest batch :meth:`plan` accepts.
        workspace_rows: split-KV partial rows to allocate (default
            :data:`DEFAULT_WORKSPACE_ROWS`, never more than ``max_num_tokens x num_q_heads x``
            the backends' largest split count); plans take fewer splits when it is short.
        backend: the backend every :meth:`plan` asks for unless it names another: ``"auto"``
            or one of ``fp8_noncausal_attn.registry.BACKEND_NAMES`` (see
            :func:`fp8_noncausal_attn.paged_attention`).
    """

    def __init__(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        query_dtype: torch.dtype = torch.bfloat16,
        cache_dtype: torch.dtype = torch.float8_e4m3fn,
        device: torch.device | str = "cuda",
        max_num_seqs: int,
        max_num_tokens: int,
        workspace_rows: int | None = None,
        backend: str = "auto",
        scale_mode: str | None = None,
    ) -> None:
        sizes = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads,
                 "max_num_seqs": max_num_seqs, "max_num_tokens": max_num_tokens}  # fmt: skip
        for name, value in sizes.items():
            if optional_host_int(value, name) is None or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if query_dtype not in SIXTEEN_BIT_DTYPES:
            raise TypeError(f"query_dtype must be one of {SIXTEEN_BIT_DTYPES}, got {query_dtype}")
        if cache_dtype not in ALL_CACHE_DTYPES:
            raise TypeError(f"cache_dtype must be one of {ALL_CACHE_DTYPES}, got {cache_dtype}")
        if workspace_rows is None:
            workspace_rows = min(
                DEFAULT_WORKSPACE_ROWS, max_num_tokens * num_q_heads * registry.max_splits()
            )
        else:
            optional_host_int(workspace_rows, "workspace_rows")
        check_cache_sizes(head_dim, block_size)
        self.scale_mode = check_scale_mode(scale_mode, cache_dtype)
        self.backend = registry.check_name(backend)
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.block_size = head_dim, block_size
        self.query_dtype, self.cache_dtype = query_dtype, cache_dtype
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        self._unit_scale = torch.ones(num_kv_heads, dtype=torch.float32, device=device)
        # An int8 cache has per-token-head scales only.
        self._per_token_head_cache = cache_dtype == torch.int8
        # The scale kind plans are made for.
        self._planned_mode = scale_mode or scale_mode_of(None, None, cache_dtype)
        # The device with its index resolved ("cuda" -> "cuda:0"), as tensors report it.
        self.device = self._unit_scale.device
        self.workspace = Workspace(workspace_rows, num_q_heads, head_dim, self.device)
        self._plan: BatchPlan | None = None
        self._checked_caches: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # id -> (tensor, softmax_scale it was checked with), one memo per role: k_scale's check
        # includes the score-scale product.
        self._checked_k_scales: dict[int, tuple[torch.Tensor, float]] = {}
        self._checked_v_scales: dict[int, tuple[torch.Tensor, float]] = {}

    def plan(
        self,
        cu_seqlens_q: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        *,
        causal: bool | torch.Tensor = True,
        max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None,
        softmax_scale: float | None = None,
        num_tokens: int | None = None,
        backend: str | None = None,
        validate: bool = False,
        window: tuple[int, int] = (-1, -1),
        key_shard: bool = False,
        return_lse: bool = False,
    ) -> BatchPlan:
        """Plan one batch: backend, tiles, splits. Once per batch, before :meth:`run`.

        Args:
            cu_seqlens_q: ``[num_seqs + 1]`` int32 query offsets (vLLM's ``query_start_loc``).
            seq_lens: ``[num_seqs]`` int32 KV lengths including the new tokens.
            block_table: ``[num_seqs, max_blocks_per_seq]`` int32 page ids.
            causal: a bool, or a ``[num_seqs]`` bool/int32 tensor (nonzero = causal).
            max_seqlen_q, max_seqlen_k: upper bounds of q_len / kv_len. Give both and nothing
                is read from the device (CUDA graphs); otherwise they are read (a sync).
            softmax_scale: defaults to ``head_dim ** -0.5``.
            num_tokens: rows of the ``query`` that :meth:`run` will get (rows past
                ``cu_seqlens_q[-1]`` are padding, written as zeros); default
                ``min(max_num_tokens, num_seqs * max_seqlen_q)``.
            backend: ``"auto"`` or a backend name (default: this object's ``backend``). A
                named backend that cannot serve the batch raises with the reason, at plan
                time, and so does one that cannot take a layer's tensors, at run time; ``auto``
                takes the first backend of its order that plans the batch and, for a layer
                whose tensors (pointers, strides) that one cannot take, the next that can:
                both decided here (``BatchPlan.chain``).
            validate: also run the checks that need device values on the host (a sync).
            window: ``(left, right)`` sliding window (FlashAttention's convention, ``-1`` =
                unbounded; see :func:`fp8_noncausal_attn.paged_attention`). A plan property, as
                in vLLM where it is a layer property and layers of one KV-cache group share it:
                layers with different windows take one plan each. Every backend runs it.
            key_shard: the keys are a shard of each sequence's (a decode-context-parallel rank's
                local keys, a cascade prefix), attended bidirectionally and merged later by
                :func:`fp8_noncausal_attn.merge_attention_states`: ``seq_lens`` may then be
                below a sequence's query rows, or 0, whose rows get the empty state (zeros, LSE
                -inf). Needs ``causal=False`` and no window (shard positions are not the
                sequence's).
            return_lse: the runs ask for each row's LSE (``run(return_lse=True)``), so the
                backend is chosen and planned for it now (a named one that cannot return it
                raises here). A run that asks for it under a plan made without plans the
                batch for it on its first run (host only).

        Returns:
            The plan, also kept as the current one that :meth:`run` uses by default.

        The index tensors are kept, not copied: the plan holds for as long as their contents
        describe the batch (a CUDA graph replays it after the caller updates them in place).
        """
        requested = self.backend if backend is None else registry.check_name(backend)
        batch, max_page, check_values = validate_batch(
            block_table, cu_seqlens_q, seq_lens, causal=causal, softmax_scale=softmax_scale,
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=window,
            num_tokens=num_tokens, num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, block_size=self.block_size, query_dtype=self.query_dtype,
            cache_dtype=self.cache_dtype, device=self.device, validate=validate,
            max_num_seqs=self.max_num_seqs, max_num_tokens=self.max_num_tokens,
            key_shard=key_shard, scale_mode=self._planned_mode, return_lse=return_lse,
        )  # fmt: skip
        plan = BatchPlan()
        plan.batch, plan.causal_arg, plan.max_page = batch, causal, max_page
        plan.check_values = check_values
        plan.validate = validate and not torch.compiler.is_compiling()
        plan.traced = torch.compiler.is_compiling()
        plan.requested = plan.backend = requested
        plan.chain, plan.passed_over, plan.variants = (), (), {}
        if self.device.type == "meta":
            # Meta tensors carry shapes only: runs check them and launch nothing.
            plan.backend = "meta"
        elif not plan.traced:
            # Under tracing the op chooses and plans when the graph runs (nothing traced here
            # may load the extension or read a pointer).
            plan.chain, plan.passed_over = registry.plan_batch(requested, batch, self.workspace)
            plan.backend = plan.chain[0].name
        self._plan = plan
        return plan

    def run(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        k_scale: ScaleArg = None,
        v_scale: ScaleArg = None,
        out: torch.Tensor | None = None,
        *,
        plan: BatchPlan | None = None,
        sinks: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attention for one layer of the planned batch.

        Args:
            query: ``[num_tokens, num_q_heads, head_dim]`` in ``query_dtype``, ``num_tokens``
                at most the plan's; rows past ``cu_seqlens_q[-1]`` get zeros.
            key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
                ``cache_dtype``, any strides with a contiguous last dim.
            k_scale, v_scale: dequantisation multipliers: None, a float, a 0-d/1-element or a
                ``[num_kv_heads]`` float32 tensor; or, both, per token and head, float32
                ``[num_blocks, block_size, num_kv_heads]`` with any strides (FP8 and int8
                caches; their values are read only under a plan made with ``validate=True``).
                Tensors of these forms are passed through as they are, with no copy.
            out: written in place when given (``query``'s shape and dtype).
            plan: a plan this object returned; default the latest.
            sinks: float32 ``[num_q_heads]`` attention-sink logits of this layer (a layer
                property, hence here and not in :meth:`plan`), or None. Every backend runs
                them.
            return_lse: also return each row's log-sum-exp, float32 ``[num_tokens,
                num_q_heads]``, as :func:`fp8_noncausal_attn.paged_attention` does.
        Returns:
            ``out``, or a new tensor like ``query``; ``(out, lse)`` with ``return_lse=True``.
        """
        # The hot path: each check is one comparison of an attribute; any failure goes to the
        # slow path, which raises the named error. Caches and per-head scales are checked in
        # full once per tensor object (see _check_caches, _scale).
        if plan is None:
            plan = self._plan
            if plan is None:
                raise RuntimeError("PagedAttention.run() needs a plan: call plan() once per batch")
        if plan.traced or torch.compiler.is_compiling():
            # Through the opaque op, which plans and launches when the graph runs.
            batch = plan.batch
            return paged_attention(
                query, key_cache, value_cache, batch.block_table, batch.cu_seqlens_q,
                batch.seq_lens, causal=plan.causal_arg, k_scale=k_scale, v_scale=v_scale,
                softmax_scale=batch.softmax_scale, max_seqlen_q=batch.max_seqlen_q,
                max_seqlen_k=batch.max_seqlen_k, out=out, backend=plan.requested,
                window=batch.window, sinks=sinks, return_lse=return_lse,
            )  # fmt: skip
        if not isinstance(query, torch.Tensor) or query.dtype is not self.query_dtype:
            self._query_error(query, plan)
        batch = plan.batch
        shape = query.shape
        if (
            len(shape) != 3
            or shape[1] != self.num_q_heads
            or shape[2] != self.head_dim
            or shape[0] > batch.num_tokens
            or query.stride(2) != 1
            or query.device != self.device
        ):
            self._query_error(query, plan)
        seen = self._checked_caches.get(id(key_cache))
        if seen is None or seen[0] is not key_cache or seen[1] is not value_cache:
            seen = self._check_caches(key_cache, value_cache)
        if plan.max_page >= seen[2]:
            raise ValueError(
                f"block_table entries for used pages must be in [0, {seen[2]}), got "
                f"a page id of {plan.max_page}"
            )
        per_token_head = (
            self._per_token_head_cache or is_per_token_head(k_scale) or is_per_token_head(v_scale)
        )
        chain = plan.chain
        if per_token_head != batch.per_token_head_scales or (return_lse and not batch.return_lse):
            batch, chain = self._variant(plan, per_token_head, return_lse)
        if per_token_head:
            # A layer's own scales, rewritten by every cache write: checked on every run.
            check_per_token_head_scales(k_scale, v_scale, key_cache, self.device)
            check_per_token_head_values(k_scale, v_scale, batch, plan.validate)
        else:
            k_scale = self._per_head_scale(k_scale, "k_scale", plan, self._checked_k_scales)
            v_scale = self._per_head_scale(v_scale, "v_scale", plan, self._checked_v_scales)
        if out is None:
            out = torch.empty_like(query)
        elif (
            out.dtype is not query.dtype
            or out.shape != shape
            or out.stride(2) != 1
            or out.device != query.device
        ):
            check_out(out, query)
        if sinks is not None:
            sinks = check_sinks(sinks, self.num_q_heads, self.device, plan.check_values)
        lse = new_lse(query) if return_lse else None
        if chain:  # empty for meta tensors: nothing to launch
            problem = AttentionProblem(
                batch, query, key_cache, value_cache, k_scale, v_scale, sinks
            )
            registry.run(chain, problem, out, lse)
        return (out, lse) if return_lse else out

    def _variant(self, plan: BatchPlan, per_token_head: bool, return_lse: bool):
        """``(batch, chain)`` of ``plan``'s batch for a run whose needs it did not state: its
        scale kind (refused when this object's ``scale_mode`` states the other) and the LSE.
        Planned on the first such run, kept in ``plan.variants``."""
        scale_mode = "per_token_head" if per_token_head else "per_head"
        if self.scale_mode is not None and scale_mode != self.scale_mode:
            raise ValueError(
                f"this PagedAttention was built with scale_mode={self.scale_mode!r}, got "
                f"{scale_mode.replace('_', '-')} scales (k_scale of rank "
                f"{3 if per_token_head else 1})"
            )
        key = (scale_mode, return_lse or plan.batch.return_lse)
        known = plan.variants.get(key)
        if known is None:
            batch = dataclasses.replace(plan.batch, scale_mode=key[0], return_lse=key[1])
            chain = ()
            if plan.chain:
                chain, _ = registry.plan_batch(plan.requested, batch, self.workspace)
            known = plan.variants[key] = (batch, chain)
        return known

    def _query_error(self, query: object, plan: BatchPlan) -> None:
        """Raise the named error for a query the hot path refused."""
        query = check_query(query)  # type, dtype, rank, contiguity
        if query.dtype is not self.query_dtype:
            raise TypeError(
                f"query must have the planned dtype {self.query_dtype}, got {query.dtype}"
            )
        num_tokens, num_q_heads, head_dim = query.shape
        if num_q_heads != self.num_q_heads or head_dim != self.head_dim:
            raise ValueError(
                f"query must have shape [num_tokens, {self.num_q_heads}, {self.head_dim}] "
                f"(num_q_heads, head_dim of this PagedAttention), got {list(query.shape)}"
            )
        if num_tokens > plan.num_tokens:
            raise ValueError(
                f"query has {num_tokens} rows, but the plan was made for at most "
                f"{plan.num_tokens} (pass num_tokens= to plan())"
            )
        raise ValueError(f"query must be on {self.device}, got {query.device}")

    def _check_caches(
        self, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Full checks of a pair of caches; remembered as (key_cache, value_cache, num_blocks).

        The memo holds the tensors themselves, so an id cannot be reused by another tensor
        while its entry lives; a cache whose shape or strides are changed in place
        (``set_``, ``resize_``, ``as_strided_``) after its first run is not checked again.
        """
        check_caches(key_cache, value_cache, self.device)
        expected = (self.block_size, self.num_kv_heads, self.head_dim)
        if key_cache.dtype is not self.cache_dtype or tuple(key_cache.shape[1:]) != expected:
            raise ValueError(
                f"key_cache must be [num_blocks, {', '.join(map(str, expected))}] "
                f"{self.cache_dtype} (this PagedAttention's block_size, num_kv_heads, "
                f"head_dim, cache_dtype), got {list(key_cache.shape)} {key_cache.dtype}"
            )
        if len(self._checked_caches) >= _MEMO_LIMIT:
            self._checked_caches.clear()
        seen = (key_cache, value_cache, key_cache.shape[0])
        self._checked_caches[id(key_cache)] = seen
        return seen

    def _per_head_scale(
        self, scale: ScaleArg, name: str, plan: BatchPlan, memo: dict
    ) -> torch.Tensor:
        """``scale`` as float32 [num_kv_heads]: None is all ones; a tensor of that form passes
        through and is remembered in ``memo`` (checked once per tensor object and softmax
        scale); other forms are converted on every run."""
        if scale is None:
            return self._unit_scale
        known = memo.get(id(scale))
        if known is not None and known[0] is scale and known[1] == plan.batch.softmax_scale:
            return scale
        per_head = normalize_scale(scale, name, self.num_kv_heads, self.device, plan.check_values)
        softmax_scale = plan.batch.softmax_scale
        if name == "k_scale":
            check_score_scale(softmax_scale, scale, per_head, self.cache_dtype, plan.check_values)
        if per_head is scale:
            # Already the kernels' form: remember it (a 0-d scale is converted on every run,
            # so an in-place update by its owner is always seen).
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            memo[id(scale)] = (scale, softmax_scale)
        return per_head
