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

from types import ModuleType

import torch

from . import dispatch
from .api import new_lse, paged_attention, run_one_shot
from .masking import normalize_causal
from .problem import AttentionProblem
from .scales import CACHE_DTYPES, SIXTEEN_BIT_DTYPES, ScaleArg, check_score_scale, normalize_scale
from .validation import (
    check_batch_lengths,
    check_caches,
    check_index_tensors,
    check_out,
    check_query,
    check_sinks,
    check_softmax_scale,
    check_window,
    optional_host_int,
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

    ``part_out``: float32 ``[rows, head_dim]``; ``part_lse``: float32 ``[rows]``. A plan with
    ``num_splits`` splits over ``num_tokens`` query rows uses the first
    ``num_splits * num_tokens * num_q_heads`` rows, viewed by :meth:`partials`.
    """

    def __init__(self, rows: int, num_q_heads: int, head_dim: int, device: torch.device) -> None:
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.rows = rows
        self.part_out = torch.empty(rows, head_dim, dtype=torch.float32, device=device)
        self.part_lse = torch.empty(rows, dtype=torch.float32, device=device)

    def max_splits(self, num_tokens: int) -> int:
        """The most splits whose partials fit for ``num_tokens`` query rows (at least 1)."""
        return max(1, self.rows // max(num_tokens * self.num_q_heads, 1))

    def partials(self, num_splits: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``part_out [num_splits, num_tokens, num_q_heads, head_dim]`` and
        ``part_lse [num_splits, num_tokens, num_q_heads]`` of the buffers (no copy)."""
        used = num_splits * num_tokens * self.num_q_heads
        if used > self.rows:
            raise ValueError(
                f"the workspace holds {self.rows} split rows, a plan with {num_splits} splits x "
                f"{num_tokens} tokens x {self.num_q_heads} heads needs {used}"
            )
        shape = (num_splits, num_tokens, self.num_q_heads)
        return (
            self.part_out[:used].view(*shape, self.head_dim),
            self.part_lse[:used].view(shape),
        )


class BatchPlan:
    """What :meth:`PagedAttention.plan` decided for one batch (host values only); returned by
    ``plan()`` so that several batches planned ahead (micro-batches) can each be run. Plans of
    one :class:`PagedAttention` share its workspace: run them one after another on one stream.
    ``family``: the CUDA kernel family it runs (None off CUDA); ``family_reason``: why a family
    asked for (``family=`` / ``FP8NCA_CUDA_FAMILY``) is not the one that runs, else ``""``."""

    __slots__ = (
        "backend", "module", "backend_plan", "run_check", "block_table", "cu_seqlens_q",
        "seq_lens", "causal", "causal_per_seq", "causal_arg", "softmax_scale", "max_seqlen_q",
        "max_seqlen_k", "num_tokens", "max_page", "check_values", "traced", "requested", "window",
        "family", "family_reason",
    )  # fmt: skip


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
        query_dtype: bf16 or fp16. cache_dtype: float8_e4m3fn, float8_e5m2, bf16 or fp16.
        device: where every tensor lives.
        max_num_seqs, max_num_tokens: the largest batch :meth:`plan` accepts.
        workspace_rows: split-KV partial rows to allocate (default
            :data:`DEFAULT_WORKSPACE_ROWS`, never more than ``max_num_tokens x num_q_heads x``
            the backends' largest split count); plans take fewer splits when it is short.
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
        if cache_dtype not in CACHE_DTYPES:
            raise TypeError(f"cache_dtype must be one of {CACHE_DTYPES}, got {cache_dtype}")
        if workspace_rows is None:
            workspace_rows = min(
                DEFAULT_WORKSPACE_ROWS, max_num_tokens * num_q_heads * dispatch.max_splits()
            )
        else:
            optional_host_int(workspace_rows, "workspace_rows")
        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.block_size = head_dim, block_size
        self.query_dtype, self.cache_dtype = query_dtype, cache_dtype
        self.max_num_seqs, self.max_num_tokens = max_num_seqs, max_num_tokens
        # One element of each dtype on the device: plan-time stand-ins (see _plan_problem) and
        # the device with its index resolved ("cuda" -> "cuda:0"), which tensors report.
        self._query_base = torch.empty(1, dtype=query_dtype, device=device)
        self._cache_base = torch.empty(1, dtype=cache_dtype, device=device)
        self.device = self._query_base.device
        # One page, checked as a cache: head_dim and block_size get validation's own messages.
        page = torch.empty(
            (1, block_size, num_kv_heads, head_dim), dtype=cache_dtype, device=device
        )
        check_caches(page, page, self.device)
        self.workspace = Workspace(workspace_rows, num_q_heads, head_dim, self.device)
        self._unit_scale = torch.ones(num_kv_heads, dtype=torch.float32, device=self.device)
        self._plan: BatchPlan | None = None
        self._checked_caches: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        # id -> (tensor, softmax_scale it was checked with), one memo per role: k_scale's check
        # includes the score-scale product.
        self._checked_k_scales: dict[int, tuple[torch.Tensor, float]] = {}
        self._checked_v_scales: dict[int, tuple[torch.Tensor, float]] = {}

    def _stand_in_cache(self) -> torch.Tensor:
        shape = (1, self.block_size, self.num_kv_heads, self.head_dim)
        return self._cache_base.view(1, 1, 1, 1).expand(shape)

    def _plan_problem(self, plan: BatchPlan) -> AttentionProblem:
        """The problem a backend plans on: real index tensors and sizes; query, caches and
        scales are stand-ins (one element expanded to the real shape, dtype and device: plan
        steps read nothing else of them)."""
        query = self._query_base.view(1, 1, 1).expand(
            plan.num_tokens, self.num_q_heads, self.head_dim
        )
        cache = self._stand_in_cache()
        return AttentionProblem(
            query, cache, cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens,
            self._unit_scale, self._unit_scale, plan.causal, plan.causal_per_seq,
            plan.softmax_scale, plan.max_seqlen_q, plan.max_seqlen_k, plan.window,
        )  # fmt: skip

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
        backend: str = "auto",
        validate: bool = False,
        window: tuple[int, int] = (-1, -1),
        family: str | None = None,
        key_shard: bool = False,
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
            backend: ``"auto"``, ``"cuda"``, ``"triton"`` or ``"reference"``.
            family: the CUDA kernel family to ask for when the plan runs the CUDA backend:
                ``"mma_sync"`` (the default), or, opt-in, ``"wgmma"`` (sm_90) or ``"tcgen05"``
                (sm_100/sm_103): compiled and SASS-checked, NEVER RUN ON HARDWARE. None: the
                environment variable ``FP8NCA_CUDA_FAMILY``, else mma_sync. A family that cannot
                run the batch leaves mma_sync, with the reason in the plan's ``family_reason``
                (and a warning). The plan's ``family`` says which runs (None off CUDA).
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

        Returns:
            The plan, also kept as the current one that :meth:`run` uses by default.

        The index tensors are kept, not copied: the plan holds for as long as their contents
        describe the batch (a CUDA graph replays it after the caller updates them in place).
        """
        device = self.device
        num_seqs = check_index_tensors(block_table, cu_seqlens_q, seq_lens, device)
        if num_seqs > self.max_num_seqs:
            raise ValueError(
                f"num_seqs (seq_lens.shape[0]) must be <= max_num_seqs = {self.max_num_seqs}, "
                f"got {num_seqs}"
            )
        softmax_scale = check_softmax_scale(softmax_scale, self.head_dim)
        max_seqlen_q = optional_host_int(max_seqlen_q, "max_seqlen_q")
        max_seqlen_k = optional_host_int(max_seqlen_k, "max_seqlen_k")
        num_tokens = optional_host_int(num_tokens, "num_tokens")
        # Backend options (each named by the backend that takes it) pass through to its plan.
        options = {} if family is None else {"family": family}
        if options:
            if torch.compiler.is_compiling():
                raise ValueError(
                    "family= is not carried through torch.compile: set FP8NCA_CUDA_FAMILY"
                )
            dispatch.check_plan_options(options)  # an unknown value fails here, by name
        if backend != "auto" and backend not in dispatch.BACKENDS:
            raise ValueError(
                f"backend must be 'auto' or one of {dispatch.BACKEND_NAMES}, got {backend!r}"
            )
        causal_flag, causal_per_seq = normalize_causal(causal, num_seqs, device)
        window = check_window(window)
        if key_shard and (causal_per_seq is not None or causal_flag or window != (-1, -1)):
            raise ValueError(
                f"key_shard=True needs causal=False and window=(-1, -1), got causal={causal!r}, "
                f"window={window}"
            )
        compiling = torch.compiler.is_compiling()
        if compiling and (max_seqlen_q is None or max_seqlen_k is None):
            raise ValueError("max_seqlen_q and max_seqlen_k must be given under torch.compile")
        check_values = (validate or device.type == "cpu") and not compiling
        max_page = -1
        if check_values or max_seqlen_q is None or max_seqlen_k is None:
            bound = self.max_num_tokens if num_tokens is None else num_tokens
            true_max_q, true_max_k, max_page = check_batch_lengths(
                cu_seqlens_q, seq_lens, block_table, bound, None, self.block_size,
                max_seqlen_q, max_seqlen_k, key_shard,
            )  # fmt: skip
            max_seqlen_q = true_max_q if max_seqlen_q is None else max_seqlen_q
            max_seqlen_k = true_max_k if max_seqlen_k is None else max_seqlen_k
        if num_tokens is None:
            num_tokens = min(self.max_num_tokens, num_seqs * max_seqlen_q)
        elif num_tokens > self.max_num_tokens:
            raise ValueError(
                f"num_tokens must be <= max_num_tokens = {self.max_num_tokens}, got {num_tokens}"
            )

        plan = BatchPlan()
        plan.block_table, plan.cu_seqlens_q, plan.seq_lens = block_table, cu_seqlens_q, seq_lens
        plan.causal, plan.causal_per_seq, plan.causal_arg = causal_flag, causal_per_seq, causal
        plan.softmax_scale, plan.window = softmax_scale, window
        plan.max_seqlen_q, plan.max_seqlen_k = max_seqlen_q, max_seqlen_k
        plan.num_tokens, plan.max_page, plan.check_values = num_tokens, max_page, check_values
        plan.traced = compiling
        plan.requested = plan.backend = backend
        plan.family, plan.family_reason = None, ""
        plan.module = None
        if device.type == "meta":
            # Meta tensors carry shapes only: runs check them and launch nothing.
            plan.backend = "meta"
        elif not compiling:
            # Under tracing the op chooses and plans when the graph runs (nothing traced here
            # may load the extension or read a pointer).
            problem = self._plan_problem(plan)
            plan.backend = dispatch.resolve_backend(backend, problem)
            module: ModuleType = dispatch.backend_module(plan.backend)
            plan.module = module
            used, unused_why = dispatch.plan_options(plan.backend, options)
            plan.backend_plan = module.plan(problem, self.workspace, **used)
            plan.family = getattr(plan.backend_plan, "family", None)
            plan.family_reason = getattr(plan.backend_plan, "family_reason", "") or unused_why
            plan.run_check = getattr(module, "run_unsupported_reason", None)
        self._plan = plan
        return plan

    @property
    def backend(self) -> str:
        """The backend the current plan runs (``"auto"`` while a traced plan defers it)."""
        if self._plan is None:
            raise RuntimeError("PagedAttention has no plan yet: call plan() first")
        return self._plan.backend

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
                ``[num_kv_heads]`` float32 tensor (passed through as is, with no copy).
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
            return self._run_through_op(
                plan, query, key_cache, value_cache, k_scale, v_scale, out, sinks, return_lse
            )
        if not isinstance(query, torch.Tensor) or query.dtype is not self.query_dtype:
            self._query_error(query, plan)
        shape = query.shape
        if (
            len(shape) != 3
            or shape[1] != self.num_q_heads
            or shape[2] != self.head_dim
            or shape[0] > plan.num_tokens
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
        if k_scale is None:
            k_scale = self._unit_scale
        else:
            known = self._checked_k_scales.get(id(k_scale))
            if known is None or known[0] is not k_scale or known[1] != plan.softmax_scale:
                k_scale = self._scale(k_scale, "k_scale", plan, self._checked_k_scales)
        if v_scale is None:
            v_scale = self._unit_scale
        else:
            known = self._checked_v_scales.get(id(v_scale))
            if known is None or known[0] is not v_scale or known[1] != plan.softmax_scale:
                v_scale = self._scale(v_scale, "v_scale", plan, self._checked_v_scales)
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
        if plan.module is None:  # meta tensors
            return (out, lse) if return_lse else out
        problem = AttentionProblem(
            query, key_cache, value_cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens,
            k_scale, v_scale, plan.causal, plan.causal_per_seq, plan.softmax_scale,
            plan.max_seqlen_q, plan.max_seqlen_k, plan.window, sinks,
        )  # fmt: skip
        if plan.run_check is not None:
            why = plan.run_check(problem, out)
            if why is not None:
                self._run_elsewhere(plan, problem, out, why, lse)
                return (out, lse) if return_lse else out
        if lse is None:
            plan.module.run(problem, plan.backend_plan, out)
            return out
        plan.module.run(problem, plan.backend_plan, out, lse)
        return out, lse

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

    def _scale(self, scale: ScaleArg, name: str, plan: BatchPlan, memo: dict) -> torch.Tensor:
        """``scale`` (not None) as float32 [num_kv_heads]: a tensor of that form passes through
        and is remembered in ``memo`` (checked once per tensor object and softmax scale); other
        forms are converted on every run."""
        per_head = normalize_scale(scale, name, self.num_kv_heads, self.device, plan.check_values)
        if name == "k_scale":
            check_score_scale(
                plan.softmax_scale, scale, per_head, self.cache_dtype, plan.check_values
            )
        if per_head is scale:
            # Already the kernels' form: remember it (a 0-d scale is converted on every run,
            # so an in-place update by its owner is always seen).
            if len(memo) >= _MEMO_LIMIT:
                memo.clear()
            memo[id(scale)] = (scale, plan.softmax_scale)
        return per_head

    def _run_elsewhere(
        self,
        plan: BatchPlan,
        problem: AttentionProblem,
        out: torch.Tensor,
        why: str,
        lse: torch.Tensor | None,
    ) -> None:
        """The planned backend cannot take these particular tensors (e.g. their alignment):
        ``auto`` runs them one-shot on the backend that can, a named backend refuses."""
        if plan.requested != "auto":
            raise RuntimeError(f"backend {plan.backend!r} cannot run these tensors: {why}")
        run_one_shot(problem, out, "auto", lse)

    def _run_through_op(
        self, plan, query, key_cache, value_cache, k_scale, v_scale, out, sinks, return_lse
    ):
        return paged_attention(
            query, key_cache, value_cache, plan.block_table, plan.cu_seqlens_q, plan.seq_lens,
            causal=plan.causal_arg, k_scale=k_scale, v_scale=v_scale,
            softmax_scale=plan.softmax_scale, max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k, out=out, backend=plan.requested, window=plan.window,
            sinks=sinks, return_lse=return_lse,
        )  # fmt: skip
