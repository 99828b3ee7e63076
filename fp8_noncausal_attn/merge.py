"""Merging partial attention states (SPEC §4): :func:`merge_attention_states`.

A state is what attention over one set of keys returns with ``return_lse=True``: the normalised
output ``O_s`` and the natural-log log-sum-exp ``L_s`` of its row. States over disjoint key sets
of the same rows (split-KV, a shared cascade prefix and each branch's suffix, decode-context-
parallel shards) merge exactly into the state over their union:
``L = log sum_s e^(L_s)``, ``O = sum_s e^(L_s - L) O_s`` (FlashInfer's ``merge_state``, vLLM's
``merge_attn_states``). Conventions are in docs/api.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import registry

__all__ = ["merge_attention_states"]

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _stacked(values: torch.Tensor | Sequence[torch.Tensor], name: str, rank: int) -> torch.Tensor:
    """``values`` as one tensor with the states first: a tensor of rank ``rank + 1`` as is, a
    sequence of rank-``rank`` tensors stacked (a copy)."""
    if isinstance(values, torch.Tensor):
        if values.dim() != rank + 1:
            raise ValueError(
                f"{name} as one tensor must have {rank + 1} dims [num_states, ...], got shape "
                f"{list(values.shape)}"
            )
        return values
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise TypeError(f"{name} must be a non-empty sequence of tensors, got {values!r}")
    first = values[0]
    for i, value in enumerate(values):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(value).__name__}")
        if value.dim() != rank or value.shape != first.shape:
            raise ValueError(
                f"{name}[{i}] must have the shape of {name}[0] ({list(first.shape)}, {rank} "
                f"dims), got {list(value.shape)}"
            )
        if value.dtype != first.dtype or value.device != first.device:
            raise ValueError(
                f"{name}[{i}] must be {first.dtype} on {first.device} like {name}[0], got "
                f"{value.dtype} on {value.device}"
            )
    return torch.stack(list(values))


@torch.library.custom_op("fp8_noncausal_attn::merge_attention_states", mutates_args=("out", "lse"))
def _merge_op(
    out: torch.Tensor, lse: torch.Tensor, outs: torch.Tensor, lses: torch.Tensor, backend: str
) -> None:
    registry.for_device(backend, out.device).merge_states(outs, lses, out, lse)


@_merge_op.register_fake
def _merge_fake(*args) -> None:
    return None


def merge_attention_states(
    outs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention states over disjoint key sets of the same query rows.

    Args:
        outs: each state's output, ``[num_tokens, num_heads, head_dim]`` bf16/fp16/fp32 (one
            dtype), a sequence of one or more, or one tensor ``[num_states, num_tokens,
            num_heads, head_dim]``; any strides with head dims contiguous.
        lses: each state's natural-log LSE, float32 ``[num_tokens, num_heads]`` (as
            ``return_lse=True`` gives it), a sequence or one ``[num_states, ...]`` tensor; any
            strides. A state with lse ``-inf`` saw no key: it contributes nothing, whatever
            its output holds; a row no state saw merges to zeros with lse ``-inf`` (never NaN).
            (FlashAttention 2 marks such rows ``+inf``: map them to ``-inf`` first.)
        out: written in place when given (``outs``' row shape and dtype).
        backend: ``"auto"`` (the registry's order: ``_C``'s merge kernel for CUDA tensors when it
            runs here, else Triton's; PyTorch on the CPU) or a backend name: ``"reference"``,
            ``"triton"``, or a CUDA family (``"mma_sync"``, ``"wgmma"``, ``"tcgen05"``, which
            all merge with ``_C``'s kernel); a named one that cannot run here raises.
    Returns:
        ``(out, lse)``: the merged output in ``outs``' dtype and float32 ``[num_tokens,
        num_heads]`` ``lse = log sum_s e^(lse_s)``, computed shifted by the largest ``lse_s``.
    """
    registry.check_name(backend)
    outs_t = _stacked(outs, "outs", 3)
    lses_t = _stacked(lses, "lses", 2)
    if outs_t.dtype not in OUT_DTYPES:
        raise TypeError(f"outs must be one of {OUT_DTYPES}, got {outs_t.dtype}")
    if lses_t.dtype != torch.float32:
        raise TypeError(f"lses must be float32, got {lses_t.dtype}")
    if lses_t.shape != outs_t.shape[:3]:
        raise ValueError(
            f"lses must be [num_states, num_tokens, num_heads] = {list(outs_t.shape[:3])} "
            f"(from outs), got {list(lses_t.shape)}"
        )
    if lses_t.device != outs_t.device:
        raise ValueError(f"lses must be on {outs_t.device} (outs' device), got {lses_t.device}")
    if outs_t.stride(-1) != 1:
        outs_t = outs_t.contiguous()
    if out is None:
        out = torch.empty(outs_t.shape[1:], dtype=outs_t.dtype, device=outs_t.device)
    elif (
        not isinstance(out, torch.Tensor)
        or out.shape != outs_t.shape[1:]
        or out.dtype != outs_t.dtype
        or out.device != outs_t.device
        or out.stride(-1) != 1
    ):
        raise ValueError(
            f"out must be {outs_t.dtype} {list(outs_t.shape[1:])} on {outs_t.device} with "
            f"head dims contiguous, got {out!r:.80}"
        )
    lse = torch.empty(outs_t.shape[1:3], dtype=torch.float32, device=outs_t.device)
    if torch.compiler.is_compiling():
        _merge_op(out, lse, outs_t, lses_t, backend)
    elif outs_t.device.type != "meta":
        registry.for_device(backend, outs_t.device).merge_states(outs_t, lses_t, out, lse)
    return out, lse
