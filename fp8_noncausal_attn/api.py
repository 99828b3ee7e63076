"""The public one-shot API (SPEC §4): validate, plan (the backend, from the registry) and run,
the same objects :class:`fp8_noncausal_attn.PagedAttention` plans once and runs per layer.

Eagerly, a call goes straight to the backend (no ``torch.library`` dispatcher on the host path).
Under ``torch.compile`` tracing it becomes one of the opaque ops registered here
(``fp8_noncausal_attn::paged_attention``, ``::reshape_and_cache``), whose bodies choose the
backend when the graph runs: no extension loading, pointer or exception handling is traced.
Passing ``max_seqlen_q/k`` keeps a call free of device-to-host synchronisation, so it can be
captured in a CUDA graph. For many layers over one batch, :class:`fp8_noncausal_attn.PagedAttention`
plans once and runs per layer.
"""

import dataclasses

import torch

from . import registry
from .problem import AttentionProblem, Batch, CacheWrite
from .scales import FP8_DTYPES, ScaleArg, finite_max
from .validation import check_kv_tokens, validate_attention, validate_cache_write

__all__ = ["paged_attention", "reshape_and_cache", "compute_kv_scales", "available_backends"]

available_backends = registry.available_backends


def run_one_shot(
    problem: AttentionProblem, out: torch.Tensor, backend: str, lse: torch.Tensor | None = None
) -> None:
    """Plan ``problem.batch`` on ``backend`` without a kept workspace and run this layer
    (``lse``: float32 [num_tokens, num_q_heads] written too when given). Outside tracing only
    (it may load the extension and read pointers)."""
    chain, _ = registry.plan_batch(backend, problem.batch)
    registry.run(chain, problem, out, lse)


def new_lse(query: torch.Tensor) -> torch.Tensor:
    """The LSE output of a ``return_lse=True`` call: float32 ``[num_tokens, num_q_heads]``."""
    return torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)


def cache_writer(device: torch.device, per_token_head: bool = False, backend: str = "auto"):
    """The cache-write kernel of ``backend`` for ``device``: the named one's (RuntimeError with
    the reason when it cannot), or the one ``auto`` picks (the registry's order: the CUDA
    extension's when it runs here, else Triton's on a GPU; PyTorch on the CPU). A write that
    computes per-token-head scales (``per_token_head``) skips the extension's, which does not."""
    return registry.for_device(backend, device, per_token_head).reshape_and_cache


# The opaque op takes one call's records field by field, under their own names: the layer's
# tensors (AttentionProblem's fields but its batch), then its batch's (Batch's fields), each
# with the schema type of its annotation. The schema, the op's body and the traced call are
# derived from these two dataclasses; nothing else lists the op's arguments. Two travel in
# another form: the window as an int list, the device as its name (a Device argument fails
# torch.library.opcheck's schema test).
LAYER_FIELDS = tuple(f for f in dataclasses.fields(AttentionProblem) if f.name != "batch")
BATCH_FIELDS = dataclasses.fields(Batch)
SCHEMA_TYPES = {
    "torch.Tensor": "Tensor", "torch.Tensor | None": "Tensor?", "bool": "bool",
    "float": "float", "int": "SymInt", "str": "str", "torch.dtype": "ScalarType",
    "torch.device": "str", "tuple[int, int]": "SymInt[]",
}  # fmt: skip
_TO_OP = {"torch.device": str}
_FROM_OP = {"torch.device": torch.device, "tuple[int, int]": tuple}


def _same(value: object) -> object:
    return value


OP_SCHEMA = (
    "(Tensor(a0!) out, Tensor(a1!)? lse, str backend, "
    + ", ".join(f"{SCHEMA_TYPES[f.type]} {f.name}" for f in LAYER_FIELDS + BATCH_FIELDS)
    + ") -> ()"
)


def op_arguments(problem: AttentionProblem) -> tuple:
    """The values of ``problem``'s :data:`LAYER_FIELDS` and its batch's :data:`BATCH_FIELDS`,
    in order: what the op takes after ``out``, ``lse`` and ``backend``."""
    batch = problem.batch
    layer = (getattr(problem, f.name) for f in LAYER_FIELDS)
    return (*layer, *(_TO_OP.get(f.type, _same)(getattr(batch, f.name)) for f in BATCH_FIELDS))


@torch.library.custom_op(
    "fp8_noncausal_attn::paged_attention", mutates_args=("out", "lse"), schema=OP_SCHEMA
)
def _paged_attention_op(
    out: torch.Tensor, lse: torch.Tensor | None, backend: str, *fields: object
) -> None:
    split = len(LAYER_FIELDS)
    values = zip(BATCH_FIELDS, fields[split:], strict=True)
    batch = Batch(*(_FROM_OP.get(f.type, _same)(value) for f, value in values))
    run_one_shot(AttentionProblem(batch, *fields[:split]), out, backend, lse)


@_paged_attention_op.register_fake
def _paged_attention_fake(out, *args) -> None:
    return None


# The scales are written too when they are per token and head.
@torch.library.custom_op(
    "fp8_noncausal_attn::reshape_and_cache",
    mutates_args=("key_cache", "value_cache", "k_scale", "v_scale"),
)
def _reshape_and_cache_op(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    backend: str = "auto",
) -> None:
    write = CacheWrite(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    cache_writer(key.device, k_scale.dim() == 3, backend)(write)


@_reshape_and_cache_op.register_fake
def _reshape_and_cache_fake(*args) -> None:
    return None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    causal: bool | torch.Tensor = True,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    softmax_scale: float | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
    validate: bool = False,
    window: tuple[int, int] = (-1, -1),
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Paged attention over a (possibly FP8) KV cache with per-KV-head scales.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]`` bf16/fp16, all sequences packed.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            float8_e4m3fn / float8_e5m2 / bf16 / fp16, or int8 with per-token-head scales, any
            strides with a contiguous last dim (see
            :func:`fp8_noncausal_attn.layouts.split_kv_cache` for combined layouts and
            :func:`~fp8_noncausal_attn.layouts.split_per_token_head_cache` for vLLM's
            per-token-head page).
        block_table: ``[num_seqs, max_blocks_per_seq]`` int32 page ids.
        cu_seqlens_q: ``[num_seqs + 1]`` int32 query offsets (vLLM's ``query_start_loc``);
            ``cu_seqlens_q[-1] <= num_tokens``, rows past it (padding) are written as zeros.
            The index tensors may have any strides.
        seq_lens: ``[num_seqs]`` int32 KV lengths, including each sequence's new tokens.
        causal: a bool for the whole call, or a ``[num_seqs]`` bool or int32 tensor per sequence
            (nonzero = causal; read in place, any stride).
        k_scale, v_scale: dequantisation multipliers (real K = stored K * k_scale[kv_head]):
            None, a float, a 0-d/1-element float32 tensor or a ``[num_kv_heads]`` float32 tensor;
            or, both, per token and head: float32 ``[num_blocks, block_size, num_kv_heads]``
            with any strides (real K = stored K * k_scale[block, slot, kv_head]; FP8 and int8
            caches), as :func:`reshape_and_cache` writes them. Passed through with no copy.
            Their values are read on the host only with ``validate=True`` (then every key's
            scale must be > 0 or NaN and pass the score-overflow rule); the backends whose
            ``plan()`` refuses them are in docs/backends.md
            (``available_backends()[name]["per_token_head"]``).
        softmax_scale: defaults to ``head_dim ** -0.5``.
        max_seqlen_q, max_seqlen_k: upper bounds of q_len / kv_len; give both to avoid any
            device-to-host sync (needed for CUDA-graph capture).
        out: written in place when given (``query``'s shape and dtype).
        backend: ``"auto"`` or one of ``"reference"``, ``"triton"``, ``"mma_sync"``,
            ``"wgmma"``, ``"tcgen05"`` (:func:`available_backends` says which run here; a named
            one that cannot serve the call raises with the reason).
        validate: also run the checks that need device values on the host (a sync).
        window: ``(left, right)`` sliding window, FlashAttention's convention (``-1`` =
            unbounded): token ``i`` at ``p = kv_len - q_len + i`` also sees only keys
            ``p - left <= j <= p + right`` (causal caps ``right`` at 0). Every backend runs it;
            Triton and the CUDA kernels read only the key tiles inside the window.
        sinks: float32 ``[num_q_heads]`` attention-sink logits (gpt-oss / vLLM ``sinks``): each
            joins its head's softmax denominator with no value,
            ``out = sum_j e^(s_j) v_j / (e^(sink_h) + sum_j e^(s_j))``. Backends as for window.
        return_lse: also return each row's log-sum-exp (FlashAttention's ``return_softmax_lse``;
            conventions in docs/api.md): float32 ``[num_tokens, num_q_heads]``, natural log of
            the softmax denominator, ``log(e^(sink_h) + sum_j e^(s_j))`` with
            ``s_j = softmax_scale * q . K_real[j]``; -inf for rows past ``cu_seqlens_q[-1]``.
            A backend whose ``plan()`` cannot return it refuses the call (docs/backends.md:
            the CUTLASS-DSL families' unsplit plans); see
            :func:`fp8_noncausal_attn.merge_attention_states` to merge such states.
    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``query``'s dtype (``out`` when given), or
        ``(out, lse)`` with ``return_lse=True``.
    """
    registry.check_name(backend)
    problem = validate_attention(
        query, key_cache, value_cache, block_table, cu_seqlens_q, seq_lens,
        causal=causal, k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, out=out, validate=validate,
        window=window, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
    if out is None:
        out = torch.empty_like(query)
    lse = new_lse(query) if return_lse else None
    if torch.compiler.is_compiling():
        # The op's body chooses the backend when the graph runs.
        if problem.num_tokens:
            _paged_attention_op(out, lse, backend, *op_arguments(problem))
    elif problem.batch.device.type == "meta":  # shapes only: checked above, nothing to launch
        pass
    else:  # with no query rows the plan still fails by name on an unusable backend
        run_one_shot(problem, out, backend, lse)
    return (out, lse) if return_lse else out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: ScaleArg = None,
    v_scale: ScaleArg = None,
    backend: str = "auto",
    validate: bool = False,
) -> None:
    """Write new K/V rows into the paged caches, quantising to the cache dtype.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` bf16/fp16.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (any strides,
            contiguous last dim), FP8 or 16-bit; written in place.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``; < 0 is skipped.
        k_scale, v_scale: as in :func:`paged_attention`; the stored value is
            ``x / scale[kv_head]``, saturated to the format's finite max, rounded to nearest even.
            Per token and head (float32 ``[num_blocks, block_size, num_kv_heads]``, any strides,
            both; FP8 or int8 caches): each row's scale is computed and written there, bit for
            bit as vLLM's per-token-head write (:func:`fp8_noncausal_attn.scales.
            quantize_per_token_head`: amax / the format's max, at least 1e-6; int8 rounds half
            away from zero as vLLM does). On CUDA that write is Triton's (the extension's takes
            per-head scales only).
        backend: ``"auto"`` or a backend name, as in :func:`paged_attention`: whose cache write
            runs (the CUDA kernel families share the extension's). A named one that cannot write
            these tensors (their device, per-token-head scales) raises with the reason.
        validate: also run the checks that need device values on the host (a sync).
    """
    registry.check_name(backend)
    k_scale_t, v_scale_t = validate_cache_write(
        key, value, key_cache, value_cache, slot_mapping,
        k_scale=k_scale, v_scale=v_scale, validate=validate,
    )  # fmt: skip
    if not key.shape[0]:
        return
    if torch.compiler.is_compiling():
        _reshape_and_cache_op(
            key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t, backend
        )
    else:
        write = CacheWrite(key, value, key_cache, value_cache, slot_mapping, k_scale_t, v_scale_t)
        cache_writer(key.device, k_scale_t.dim() == 3, backend)(write)


def compute_kv_scales(
    key: torch.Tensor, value: torch.Tensor, *, fp8_dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-KV-head scales that map each head's absolute maximum onto the FP8 format's maximum.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, bf16/fp16/fp32.
        fp8_dtype: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.
    Returns:
        ``(k_scale, v_scale)``, float32 ``[num_kv_heads]``; a head that is all zeros gets 1.0,
        so a scale is never zero.
    Raises:
        ValueError naming ``key`` or ``value`` when it holds NaN or inf (a scale made from them
        would be meaningless). This reads the per-head maxima on the host (a sync).
    """
    check_kv_tokens(key, value)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(f"fp8_dtype must be one of {FP8_DTYPES}, got {fp8_dtype}")
    fmax = finite_max(fp8_dtype)

    def per_head(x: torch.Tensor, name: str) -> torch.Tensor:
        amax = x.float().abs().amax(dim=(0, 2))
        # NaN propagates through amax, so one host check covers NaN and inf.
        bad = ~torch.isfinite(amax)
        if bool(bad.any()):
            heads = bad.nonzero().flatten().tolist()
            raise ValueError(
                f"{name} must be finite to compute scales, got NaN or inf in KV heads {heads}"
            )
        return torch.where(amax > 0, amax / fmax, torch.ones_like(amax))

    return per_head(key, "key"), per_head(value, "value")
