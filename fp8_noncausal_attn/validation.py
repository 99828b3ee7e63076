"""Checks on every public entry point (SPEC §5), run before anything launches.

Each failure raises TypeError (wrong type or dtype) or ValueError (wrong shape, value or device)
with a message that names the argument, the expected and the actual value. Checks that need the
values of device tensors (lengths, page ids) run when those values are on the host, when the call
needs them on the host anyway (``max_seqlen_q/k`` not given), or when ``validate=True``.
"""

from __future__ import annotations

import math
import operator

import numpy
import torch

from .launch_record import SCALE_MODES
from .masking import normalize_causal
from .problem import AttentionProblem, Batch
from .scales import (
    ALL_CACHE_DTYPES,
    PER_TOKEN_HEAD_MIN_SCALE,
    SIXTEEN_BIT_DTYPES,
    ScaleArg,
    check_host_float,
    check_score_range,
    check_score_scale,
    is_per_token_head,
    normalize_scales,
    scale_mode_of,
)

SUPPORTED_HEAD_DIMS = (64, 128, 256)
MIN_BLOCK_SIZE = 8
MAX_BLOCK_SIZE = 256
CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


def _require_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _require_device(x: torch.Tensor, name: str, device: torch.device) -> None:
    if x.device != device:
        raise ValueError(f"{name} must be on {device} like query, got {x.device}")


def _require_last_dim_contiguous(x: torch.Tensor, name: str) -> None:
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got {x.stride(-1)}")


def _check_tensor(
    x: object,
    name: str,
    dtypes: tuple[torch.dtype, ...],
    layout: str = "",
    rank: int | None = None,
    device: torch.device | None = None,
    contiguous_last: bool = False,
) -> torch.Tensor:
    """``x`` as a tensor of a dtype in ``dtypes``, of rank ``rank`` (unless None; ``layout``
    names its dims), on ``device`` (unless None), with a contiguous last dim when
    ``contiguous_last``; checked in that order. One function for all of a tensor's checks:
    every call pays for them."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        hint = ""
        if x.dtype == torch.uint8:
            hint = " (an FP8 cache stored as uint8 must be viewed as its FP8 dtype first)"
        raise TypeError(f"{name} must have dtype in {list(dtypes)}, got {x.dtype}{hint}")
    if rank is not None and x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank} {layout}, got shape {list(x.shape)}")
    if device is not None:
        _require_device(x, name, device)
    if contiguous_last:
        _require_last_dim_contiguous(x, name)
    return x


def optional_host_int(value: int | None, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def check_kv_tokens(key: torch.Tensor, value: torch.Tensor) -> None:
    """Check new K/V rows: ``[num_tokens, num_kv_heads, head_dim]``, floating, same shape."""
    for name, x in (("key", key), ("value", value)):
        _check_tensor(
            x, name, SIXTEEN_BIT_DTYPES + (torch.float32,), "[num_tokens, num_kv_heads, head_dim]",
            3, contiguous_last=True,
        )  # fmt: skip
    if value.shape != key.shape:
        raise ValueError(
            f"value must have the shape of key {list(key.shape)}, got {list(value.shape)}"
        )
    if value.device != key.device:
        raise ValueError(f"value must be on {key.device} like key, got {value.device}")


def check_caches(key_cache: object, value_cache: object, device: torch.device) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check_tensor(cache, name, ALL_CACHE_DTYPES, CACHE_LAYOUT, 4, device, contiguous_last=True)
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache must have the shape of key_cache {list(key_cache.shape)}, "
            f"got {list(value_cache.shape)}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(
            f"value_cache must have the dtype of key_cache {key_cache.dtype}, "
            f"got {value_cache.dtype}"
        )
    check_cache_sizes(key_cache.shape[3], key_cache.shape[1])


def check_cache_sizes(head_dim: int, block_size: int) -> None:
    """``head_dim`` one of :data:`SUPPORTED_HEAD_DIMS`; ``block_size`` a power of two in
    [:data:`MIN_BLOCK_SIZE`, :data:`MAX_BLOCK_SIZE`]."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {head_dim}")
    if not (MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE) or block_size & (block_size - 1):
        raise ValueError(
            f"block_size (key_cache.shape[1]) must be a power of two in "
            f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}"
        )


def check_batch_lengths(
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    num_blocks: int | None,
    block_size: int,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    key_shard: bool = False,
) -> tuple[int, int, int]:
    """Value checks on lengths and page ids (read on the host); returns the true
    (max_q_len, max_kv_len) and the largest page id (-1 if none): exactly the largest used one
    when ``num_blocks=None`` (a plan, before any cache is seen, which leaves the upper bound to
    the caller), else at least it. ``key_shard`` (a plan over a shard of each sequence's keys,
    see ``PagedAttention.plan``) admits fewer keys than query rows."""
    # Python lists: a batch has few sequences, and a handful of list operations costs far less
    # host time than the equivalent small tensor ops (this runs on every CPU call).
    cu = cu_seqlens_q.tolist()
    kv = seq_lens.tolist()
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens_q[0] must be 0, got {cu[0]}")
    q_lens = list(map(operator.sub, cu[1:], cu[:-1]))
    if min(q_lens, default=0) < 0:
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got {cu}")
    if cu[-1] > num_tokens:
        # Fewer is fine: vLLM pads the batch under CUDA graphs; rows past it are written as zeros.
        raise ValueError(
            f"cu_seqlens_q[-1] must be <= num_tokens (query.shape[0]) = {num_tokens}, got {cu[-1]}"
        )
    if min(kv, default=0) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {kv}")
    if not key_shard and any(map(operator.gt, q_lens, kv)):
        s, (q_len, kv_len) = next(
            (s, pair) for s, pair in enumerate(zip(q_lens, kv, strict=True)) if pair[0] > pair[1]
        )
        raise ValueError(
            f"q_len must be <= kv_len: sequence {s} has q_len {q_len} "
            f"(from cu_seqlens_q) > seq_lens[{s}] = {kv_len}"
        )
    true_max_q = max(q_lens, default=0)
    true_max_k = max(kv, default=0)
    columns = block_table.shape[1]
    if true_max_k > columns * block_size:  # the longest sequence needs more pages than columns
        s = next(s for s, kv_len in enumerate(kv) if kv_len > columns * block_size)
        raise ValueError(
            f"block_table is too short: sequence {s} has seq_lens {kv[s]}, needing "
            f"{-(-kv[s] // block_size)} pages, but block_table has {columns} columns"
        )
    needed = -(-true_max_k // block_size)
    max_page = -1
    if needed:
        # First the whole used width at C speed: when even that is in range (the usual case,
        # num_blocks known), every used page is. Otherwise (or at plan time) row by row, so
        # that entries past a sequence's pages, which are ignored, cannot fail the call.
        if block_table.device.type == "cpu":
            dense = block_table.numpy()[:, :needed]  # a view, sliced on numpy's cheaper path
            # Read as uint32, a negative id is above any page count: one reduction checks both
            # bounds, and when they hold it is the largest id.
            low, top = 0, int(numpy.maximum.reduce(dense.view(numpy.uint32), axis=None))
        else:
            dense = block_table[:, :needed]
            low, top = torch.stack(torch.aminmax(dense)).tolist()
        if num_blocks is not None and low >= 0 and top < num_blocks:
            max_page = top
        else:
            rows = [
                row[: -(-kv_len // block_size)]
                for row, kv_len in zip(dense.tolist(), kv, strict=True)
                if kv_len
            ]
            max_page, min_page = max(map(max, rows)), min(map(min, rows))
            bound = num_blocks if num_blocks is not None else max_page + 1
            if min_page < 0 or max_page >= bound:
                raise ValueError(
                    f"block_table entries for used pages must be in "
                    f"[0, {'num_blocks' if num_blocks is None else num_blocks}), got range "
                    f"[{min_page}, {max_page}]"
                )
    for name, given, true in (
        ("max_seqlen_q", max_seqlen_q, true_max_q),
        ("max_seqlen_k", max_seqlen_k, true_max_k),
    ):
        if given is not None and given < true:
            raise ValueError(f"{name} must be >= the longest sequence {true}, got {given}")
    return true_max_q, true_max_k, max_page


def check_query(query: object) -> torch.Tensor:
    """``query``: bf16/fp16 ``[num_tokens, num_q_heads, head_dim]``, last dim contiguous."""
    return _check_tensor(
        query, "query", SIXTEEN_BIT_DTYPES, "[num_tokens, num_q_heads, head_dim]", 3,
        contiguous_last=True,
    )  # fmt: skip


def check_index_tensors(
    block_table: object, cu_seqlens_q: object, seq_lens: object, device: torch.device
) -> int:
    """Types, dtypes, ranks, devices and matching sizes of the index tensors; returns num_seqs."""
    int32 = (torch.int32,)
    _check_tensor(block_table, "block_table", int32, "[num_seqs, max_blocks_per_seq]", 2, device)
    _check_tensor(seq_lens, "seq_lens", int32, "[num_seqs]", 1, device)
    _check_tensor(cu_seqlens_q, "cu_seqlens_q", int32, "[num_seqs + 1]", 1, device)
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(
            f"cu_seqlens_q must have shape [num_seqs + 1] = [{num_seqs + 1}], "
            f"got {list(cu_seqlens_q.shape)}"
        )
    if block_table.shape[0] != num_seqs:
        raise ValueError(
            f"block_table must have num_seqs = {num_seqs} rows (from seq_lens), "
            f"got {block_table.shape[0]}"
        )
    return num_seqs


def check_out(out: object, query: torch.Tensor) -> None:
    """``out``: a tensor of ``query``'s dtype, shape and device, last dim contiguous."""
    _require_tensor(out, "out")
    if out.dtype != query.dtype:
        raise TypeError(f"out must have the dtype of query {query.dtype}, got {out.dtype}")
    if out.shape != query.shape:
        raise ValueError(
            f"out must have the shape of query {list(query.shape)}, got {list(out.shape)}"
        )
    _require_device(out, "out", query.device)
    _require_last_dim_contiguous(out, "out")


def check_softmax_scale(softmax_scale: object, head_dim: int) -> float:
    """The softmax scale as a float: ``head_dim ** -0.5`` for None, else checked."""
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (float, int)):
        raise TypeError(
            f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}"
        )
    return check_host_float(softmax_scale, "softmax_scale")


def check_window(window: object) -> tuple[int, int]:
    """``window``: ``(left, right)`` ints, each ``-1`` (unbounded) or ``>= 0``; returned as a
    tuple of Python ints (a list is accepted)."""
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(
            f"window must be a (left, right) tuple of two ints (-1 = unbounded), got {window!r}"
        )
    left, right = window
    if type(left) is int and type(right) is int and left >= -1 and right >= -1:
        return left, right  # the usual case, in one test (this runs on every call)
    for name, value in zip(("window[0] (left)", "window[1] (right)"), window, strict=True):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < -1:
            raise ValueError(f"{name} must be -1 (unbounded) or >= 0, got {value}")
    return int(window[0]), int(window[1])


def check_scale_mode(scale_mode: object, cache_dtype: torch.dtype) -> str | None:
    """``scale_mode``: None (not stated), or a key of ``launch_record.SCALE_MODES`` that the
    cache dtype has: an int8 cache has per-token-head scales only, a 16-bit one per-head only."""
    if scale_mode is None:
        return None
    if scale_mode not in SCALE_MODES:
        raise ValueError(
            f"scale_mode must be None or one of {tuple(SCALE_MODES)}, got {scale_mode!r}"
        )
    if scale_mode == "per_head" and cache_dtype == torch.int8:
        raise ValueError(
            "scale_mode='per_head' needs an FP8 or 16-bit cache: int8 has per-token-head "
            "scales only"
        )
    if scale_mode == "per_token_head" and cache_dtype.itemsize == 2:
        raise ValueError(
            f"scale_mode='per_token_head' needs an FP8 or int8 cache, got {cache_dtype}"
        )
    return scale_mode


def check_sinks(
    sinks: object, num_q_heads: int, device: torch.device, check_values: bool
) -> torch.Tensor | None:
    """``sinks``: None, or float32 ``[num_q_heads]`` on ``device`` (any stride: it is made
    contiguous when it is not); its values must be finite (read only when ``check_values``)."""
    if sinks is None:
        return None
    _check_tensor(sinks, "sinks", (torch.float32,))
    if sinks.shape != (num_q_heads,):
        raise ValueError(
            f"sinks must have shape [num_q_heads] = [{num_q_heads}], got {list(sinks.shape)}"
        )
    if sinks.device != device:
        raise ValueError(f"sinks must be on {device} like query, got {sinks.device}")
    if check_values and sinks.device.type != "meta":
        values = sinks.tolist()
        bad = [v for v in values if not math.isfinite(v)]
        if bad:
            raise ValueError(f"sinks must be finite, got {bad[0]} in {values}")
    return sinks if sinks.stride(0) == 1 else sinks.contiguous()


def validate_batch(
    block_table: object,
    cu_seqlens_q: object,
    seq_lens: object,
    *,
    causal: bool | torch.Tensor,
    softmax_scale: float | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    window: object,
    num_tokens: int | None,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    query_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    device: torch.device,
    validate: bool,
    num_blocks: int | None = None,
    max_num_seqs: int | None = None,
    max_num_tokens: int | None = None,
    key_shard: bool = False,
    scale_mode: str = "per_head",
    return_lse: bool = False,
) -> tuple[Batch, int, bool]:
    """Check one batch (the index tensors and host values every layer of it shares) and return
    its :class:`Batch`, the largest used page id (-1 when not read) and whether device values
    are read on the host (``validate``, or CPU tensors, outside tracing).

    The sizes, dtypes and device are the layers' (already checked). ``num_tokens``: the query
    rows a run brings, or None for ``min(max_num_tokens, num_seqs * max_seqlen_q)`` (a plan made
    before its queries exist). ``num_blocks``: the caches' page count when known (a one-shot
    call), else page ids are checked against the caches at run time. ``max_num_seqs`` /
    ``max_num_tokens``: the bounds of a :class:`fp8_noncausal_attn.PagedAttention`. ``key_shard``:
    the keys are a shard of each sequence's (see ``PagedAttention.plan``). ``scale_mode``,
    ``return_lse``: what the runs need (:class:`Batch`), already checked.

    Lengths and page ids are read on the host (a sync) only when ``max_seqlen_q/k`` are not
    both given or values are checked; under ``torch.compile`` tracing they must be given.
    """
    num_seqs = check_index_tensors(block_table, cu_seqlens_q, seq_lens, device)
    if max_num_seqs is not None and num_seqs > max_num_seqs:
        raise ValueError(
            f"num_seqs (seq_lens.shape[0]) must be <= max_num_seqs = {max_num_seqs}, got {num_seqs}"
        )
    softmax_scale = check_softmax_scale(softmax_scale, head_dim)
    max_seqlen_q = optional_host_int(max_seqlen_q, "max_seqlen_q")
    max_seqlen_k = optional_host_int(max_seqlen_k, "max_seqlen_k")
    num_tokens = optional_host_int(num_tokens, "num_tokens")
    if num_tokens is not None and max_num_tokens is not None and num_tokens > max_num_tokens:
        raise ValueError(
            f"num_tokens must be <= max_num_tokens = {max_num_tokens}, got {num_tokens}"
        )
    causal_flag, causal_per_seq = normalize_causal(causal, num_seqs, device)
    window = check_window(window)
    if key_shard and (causal_per_seq is not None or causal_flag or window != (-1, -1)):
        raise ValueError(
            f"key_shard=True needs causal=False and window=(-1, -1), got causal={causal!r}, "
            f"window={window}"
        )
    # Under torch.compile, values are symbolic: reading them would break the graph.
    compiling = torch.compiler.is_compiling()
    if compiling and (max_seqlen_q is None or max_seqlen_k is None):
        raise ValueError("max_seqlen_q and max_seqlen_k must be given under torch.compile")
    check_values = (validate or device.type == "cpu") and not compiling
    max_page = -1
    if check_values or max_seqlen_q is None or max_seqlen_k is None:
        bound = num_tokens if num_tokens is not None else max_num_tokens
        true_max_q, true_max_k, max_page = check_batch_lengths(
            cu_seqlens_q, seq_lens, block_table, bound, num_blocks, block_size,
            max_seqlen_q, max_seqlen_k, key_shard,
        )  # fmt: skip
        max_seqlen_q = true_max_q if max_seqlen_q is None else max_seqlen_q
        max_seqlen_k = true_max_k if max_seqlen_k is None else max_seqlen_k
    if num_tokens is None:
        num_tokens = num_seqs * max_seqlen_q
        if max_num_tokens is not None:
            num_tokens = min(max_num_tokens, num_tokens)
    batch = Batch(
        block_table=block_table, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens, causal=causal_flag,
        causal_per_seq=causal_per_seq, softmax_scale=float(softmax_scale),
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=window,
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, query_dtype=query_dtype,
        cache_dtype=cache_dtype, device=device, scale_mode=scale_mode, return_lse=return_lse,
    )  # fmt: skip
    return batch, max_page, check_values


def read_slots(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, offsets)``, int64 ``[keys]``: the page and slot of every key the batch reads
    (keys ``j < seq_lens[s]`` of each sequence, through its block table). Reads ``seq_lens`` on
    the host (a sync)."""
    block_size = batch.block_size
    pages = -(-max(batch.seq_lens.tolist(), default=0) // block_size)
    positions = torch.arange(pages * block_size, device=batch.device)
    used = positions[None, :] < batch.seq_lens[:, None]
    blocks = batch.block_table[:, :pages].long().repeat_interleave(block_size, dim=1)
    return blocks[used], (positions % block_size).expand_as(used)[used]


def check_per_token_head_values(
    k_scale: torch.Tensor, v_scale: torch.Tensor, batch: Batch, read_values: bool
) -> None:
    """The score-scale rule (:func:`scales.check_score_range`) for per-token-head scales.

    Their values are the cache write's output (``amax / the format's max``, never below
    :data:`scales.PER_TOKEN_HEAD_MIN_SCALE`, NaN for a row holding NaN, which then reads as
    NaN) and change with every write, so they are read on the host only when ``read_values``
    (``validate=True``): then the scales of every key the batch reads must be > 0 or NaN, and
    k_scale's smallest and largest must pass the rule. Otherwise only the floor is checked (no
    sync): ``softmax_scale * PER_TOKEN_HEAD_MIN_SCALE * log2(e)`` must be a normal float32.
    """
    floor = PER_TOKEN_HEAD_MIN_SCALE
    if not read_values:
        check_score_range(batch.softmax_scale, floor, floor, batch.cache_dtype)
        return
    blocks, offsets = read_slots(batch)
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        values = scale[blocks, offsets]  # [keys, num_kv_heads]
        bad = (values <= 0).nonzero()
        if bad.shape[0]:
            key, head = bad[0].tolist()
            block, slot = int(blocks[key]), int(offsets[key])
            raise ValueError(
                f"{name} must be > 0 (or NaN, a poisoned row) for every key read: "
                f"{name}[{block}, {slot}, {head}] = {values[key, head].item()}"
            )
        known = values[~values.isnan()]
        if name == "k_scale" and known.numel():
            low, high = torch.aminmax(known)
            check_score_range(batch.softmax_scale, low.item(), high.item(), batch.cache_dtype)


def validate_attention(
    query: object,
    key_cache: object,
    value_cache: object,
    block_table: object,
    cu_seqlens_q: object,
    seq_lens: object,
    *,
    causal: bool | torch.Tensor,
    k_scale: ScaleArg,
    v_scale: ScaleArg,
    softmax_scale: float | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    out: torch.Tensor | None,
    validate: bool,
    window: object = (-1, -1),
    sinks: object = None,
    return_lse: bool = False,
) -> AttentionProblem:
    """Check a ``paged_attention`` call: its layer tensors here, its batch by
    :func:`validate_batch`; return the :class:`AttentionProblem` (``problem.batch`` its batch,
    whose scale mode is the scales' kind)."""
    query = check_query(query)
    device = query.device
    check_caches(key_cache, value_cache, device)
    num_tokens, num_q_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(
            f"key_cache head_dim (shape[3]) must equal query head_dim {head_dim}, "
            f"got {cache_head_dim}"
        )
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads (query.shape[1] = {num_q_heads}) must be a multiple of num_kv_heads "
            f"(key_cache.shape[2] = {num_kv_heads})"
        )
    if out is not None:
        check_out(out, query)
    batch, _, check_values = validate_batch(
        block_table, cu_seqlens_q, seq_lens, causal=causal, softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, window=window,
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, query_dtype=query.dtype,
        cache_dtype=key_cache.dtype, device=device, validate=validate, num_blocks=num_blocks,
        scale_mode=scale_mode_of(k_scale, v_scale, key_cache.dtype),
        return_lse=return_lse,
    )  # fmt: skip
    k_scale_t, v_scale_t = normalize_scales(k_scale, v_scale, key_cache, device, check_values)
    if is_per_token_head(k_scale_t):
        check_per_token_head_values(k_scale_t, v_scale_t, batch, validate and check_values)
    else:
        check_score_scale(batch.softmax_scale, k_scale, k_scale_t, key_cache.dtype, check_values)
    sinks = check_sinks(sinks, num_q_heads, device, check_values)
    return AttentionProblem(batch, query, key_cache, value_cache, k_scale_t, v_scale_t, sinks)


def validate_cache_write(
    key: object,
    value: object,
    key_cache: object,
    value_cache: object,
    slot_mapping: object,
    *,
    k_scale: ScaleArg,
    v_scale: ScaleArg,
    validate: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check a ``reshape_and_cache`` call; return the normalised ``(k_scale, v_scale)``."""
    check_kv_tokens(key, value)
    for name, x in (("key", key), ("value", value)):
        if x.dtype == torch.float32:
            raise TypeError(f"{name} must have dtype bfloat16 or float16, got torch.float32")
    device = key.device
    check_caches(key_cache, value_cache, device)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"key_cache [num_blocks, block_size, num_kv_heads, head_dim] must match key's "
            f"(num_kv_heads, head_dim) = {(num_kv_heads, head_dim)}, "
            f"got {tuple(key_cache.shape[2:])}"
        )
    _check_tensor(slot_mapping, "slot_mapping", (torch.int64,), "[num_tokens]", 1, device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(
            f"slot_mapping must have shape [num_tokens] = [{num_tokens}], "
            f"got {list(slot_mapping.shape)}"
        )
    check_values = (validate or device.type == "cpu") and not torch.compiler.is_compiling()
    if check_values and num_tokens:
        num_slots = key_cache.shape[0] * key_cache.shape[1]
        top = int(slot_mapping.max())
        if top >= num_slots:
            raise ValueError(
                f"slot_mapping entries must be < num_blocks * block_size = {num_slots}, got {top}"
            )
    # Per-token-head scales are this write's output: only their form is checked.
    return normalize_scales(k_scale, v_scale, key_cache, device, check_values)
