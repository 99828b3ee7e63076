"""One adapter per benchmarked backend: ours through the public API, and the peers.

Every adapter turns a :class:`~benchmarks.inputs.Case` into a :class:`Prepared` call on the same
inputs (or raises :class:`Unsupported` with the reason), and says what it was given where that
differs from the problem (a BF16 copy, a scalar scale). Peers that cannot take per-KV-head
scales get one scalar, the largest per-head scale (what vLLM's checkpoint loader reduces
per-head scales to), and their ``rel_err`` is measured against the oracle with that scalar:
their timing is of the same bytes, their answer is of a different (scalar-scale) problem.
On a per-token-head cache (vLLM's inline page) every runner reads the same page: ours through
``layouts.split_per_token_head_cache``, vLLM's TRITON_ATTN as its ``forward`` views it; a peer
that cannot take per-token-head scales is skipped with the reason.

A sliding window and sinks are passed to every backend that can run them; a peer that cannot
express a shape's window (or sinks) is skipped on it with the reason, never run without it. A
peer whose window family is narrower (vLLM's symmetric non-causal window, FlashInfer's left-only
window) runs a shape only when the window it can express gives every query exactly the keys the
shape's window does (:func:`expressible_window`).
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tools.gpu_check.backends import CUDA_FAMILIES

from . import fa3_peer, vllm_peer
from .inputs import Case, gathered_kv
from .shapes import Shape

PEER_NAMES = ("vllm_triton_unified", "fa3_fp8_query", "torch_sdpa", "flex_attention", "flashinfer")


class Unsupported(Exception):
    """The backend cannot run this case; the message says why."""


def expressible_window(
    shape: Shape, peer: str, candidate: tuple[int, int], form: str
) -> tuple[int, int]:
    """``candidate``, the window ``peer`` can run in place of the shape's, when it gives every
    query the same keys (raises Unsupported naming ``form``, the windows the peer runs)."""
    if shape.visible_ranges(candidate) != shape.visible_ranges():
        raise Unsupported(
            f"{peer} runs only {form}; window {shape.window} "
            f"({'causal' if shape.causal else 'bidirectional'}) is not one of them for this shape"
        )
    return candidate


def _no_sinks(shape: Shape, peer: str) -> None:
    if shape.sinks:
        raise Unsupported(f"{peer} cannot add attention-sink logits to the softmax denominator")


def _no_per_token_head(shape: Shape, peer: str, takes: str) -> None:
    if shape.per_token_head:
        raise Unsupported(f"{peer} takes {takes}: per-token-head scales cannot be given")


def window_mask(shape: Shape, device: torch.device) -> torch.Tensor | None:
    """[q_len, keys_read] bool: query i sees key ``shape.first_key + j`` (the shape's mask and
    window over the gathered keys, :func:`~benchmarks.inputs.gathered_kv`); None if all see all."""
    ranges = shape.visible_ranges()
    if all(r == (0, shape.kv_len) for r in ranges):
        return None
    start, end = (torch.tensor(side, device=device)[:, None] for side in zip(*ranges, strict=True))
    keys = torch.arange(shape.first_key, shape.kv_len, device=device)[None, :]
    return (keys >= start) & (keys < end)


def failure_reason(error: BaseException) -> str:
    """A one-line reason for a backend's failure, for the skip lists."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"failed: {type(error).__name__}: {first_line[:300]}"


@dataclass
class Prepared:
    """A ready call: ``run()`` computes the attention, then ``result()`` returns it as
    [num_tokens, num_q_heads, head_dim] in the query dtype."""

    run: Callable[[], None]
    result: Callable[[], torch.Tensor]


class Adapter:
    """A backend to time. Subclasses set ``name`` and ``note`` and implement ``prepare``."""

    name: str = ""
    note: str = ""
    ours: bool = False

    def unavailable(self, device: torch.device) -> str | None:
        """Why this backend cannot run on ``device`` at all, or None."""
        return None

    def prepare(self, case: Case) -> Prepared:
        """Build the call on ``case`` (raises Unsupported); its output starts as NaN."""
        raise NotImplementedError

    def given_scales(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        """The [num_kv_heads] scales the backend actually computes with (for ``rel_err``)."""
        return case.k_scale, case.v_scale


class Ours(Adapter):
    """``fp8_noncausal_attn.paged_attention`` on backend ``name`` (a flat name:
    tools.gpu_check.backends.OURS) with per-KV-head scales."""

    ours = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.note = (
            "per-KV-head scales, or per-token-head scales viewed from vLLM's page "
            "(split_per_token_head_cache), paged cache, CUDA-graph safe call "
            "(max_seqlen_q/k given); window and sinks passed as given"
        )

    def unavailable(self, device: torch.device) -> str | None:
        from fp8_noncausal_attn import available_backends

        report = available_backends()[self.name]
        return None if report["available"] else report["reason"]

    def prepare(self, case: Case) -> Prepared:
        from fp8_noncausal_attn import paged_attention, registry
        from fp8_noncausal_attn.validation import validate_attention

        shape = case.shape
        out = torch.full_like(case.query, float("nan"))  # unwritten elements show as NaN
        arguments = (
            case.query,
            case.key_cache,
            case.value_cache,
            case.block_table,
            case.cu_seqlens_q,
            case.seq_lens,
        )
        options = {
            "causal": shape.causal,
            "k_scale": case.k_scale if shape.quantized else None,
            "v_scale": case.v_scale if shape.quantized else None,
            "max_seqlen_q": shape.q_len,
            "max_seqlen_k": shape.kv_len,
            "softmax_scale": None,
            "out": out,
            "window": shape.window,
            "sinks": case.sinks,
        }
        problem = validate_attention(*arguments, **options, validate=False)
        try:  # a family that cannot plan the batch (its scale kind too) has no row here
            registry.plan_batch(self.name, problem.batch)
        except RuntimeError as refusal:
            raise Unsupported(str(refusal)) from None

        def run() -> None:
            paged_attention(*arguments, **options, backend=self.name)

        return Prepared(run=run, result=lambda: out)


def _paged_call(
    case: Case,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    window: tuple[int, int],
) -> vllm_peer.PagedCall:
    """``case``'s batch as vLLM hands it to a backend, with the tensors and window the peer
    runs (a requantised query, viewed caches, an equivalent window)."""
    shape = case.shape
    return vllm_peer.PagedCall(
        query,
        key_cache,
        value_cache,
        out,
        case.block_table,
        case.cu_seqlens_q,
        case.seq_lens,
        max_seqlen_q=shape.q_len,
        max_seqlen_k=shape.kv_len,
        causal=shape.causal,
        softmax_scale=case.softmax_scale,
        window=window,
        sinks=case.sinks,
    )


def _scalar_scales(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    return case.k_scale.max().reshape(1), case.v_scale.max().reshape(1)


class ScalarScaled(Adapter):
    """A peer that takes one KV scale per tensor: it computes with the max per-head scale."""

    def given_scales(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = _scalar_scales(case)
        heads = case.shape.num_kv_heads
        return k.expand(heads), v.expand(heads)


class VllmTritonUnified(ScalarScaled):
    name = "vllm_triton_unified"
    note = (
        f"vLLM {vllm_peer.VLLM_VERSION} triton_unified_attention as TRITON_ATTN calls it, same "
        "paged cache; an "
        "FP8 cache's KV scales per tensor only (given the max per-head scale; per-KV-head "
        "scales cannot be expressed), rel_err against that scalar-scale problem; a "
        "per-token-head page (fp8/int8_per_token_head, the caches TRITON_ATTN serves) read as "
        "its forward views it, with the page's own scales (kv_quant_mode, k/v_scale_cache); "
        "sinks passed; windows: causal (left, any) or bidirectional symmetric (w, w)"
    )

    def given_scales(self, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
        if case.shape.per_token_head:
            return case.k_scale, case.v_scale
        return super().given_scales(case)

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "CPU tensors need TRITON_INTERPRET=1"
        try:
            vllm_peer.load()
        except (FileNotFoundError, ImportError) as error:
            return str(error)
        return None

    def prepare(self, case: Case) -> Prepared:
        shape = case.shape
        # The kernel's SLIDING_WINDOW = left + 1 masks keys p - left .. p (causal) or
        # p - left .. p + left (bidirectional); it never reads window[1].
        left = shape.window[0]
        candidate = (left, 0 if shape.causal else left)
        window = expressible_window(
            shape, self.name, candidate, "causal (left, any) or bidirectional (w, w) windows"
        )
        out = torch.full_like(case.query, float("nan"))  # unwritten elements show as NaN
        if shape.per_token_head:
            key_cache, value_cache, quant = vllm_peer.per_token_head(
                case.page, shape.cache_dtype, case.k_scale, case.v_scale
            )
        else:
            key_cache, value_cache = case.key_cache, case.value_cache
            quant = vllm_peer.per_tensor(key_cache, shape.batch, *_scalar_scales(case))
        call = _paged_call(case, case.query, key_cache, value_cache, out, window)
        run = vllm_peer.unified_attention_call(call, quant)
        return Prepared(run=run, result=lambda: out)


class Fa3Fp8Query(Adapter):
    name = "fa3_fp8_query"
    note = (
        f"vLLM {vllm_peer.VLLM_VERSION}'s FlashAttention 3 (_vllm_fa3_C from its wheel, sm_90 "
        "only) as its "
        "FLASH_ATTN backend runs an FP8 cache on Hopper: the query quantised to e4m3 with one "
        "per-tensor scale (its amax over the e4m3 maximum), per-(sequence, KV head) K/V "
        "descales, the same paged cache; rel_err includes the FP8 query's rounding; windows "
        "and sinks (s_aux) passed"
    )

    def unavailable(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs a CUDA device"
        if torch.cuda.get_device_capability(device)[0] != 9:
            return "FA3 runs on Hopper (sm_90) only"
        try:
            fa3_peer.load()
        except (FileNotFoundError, OSError, RuntimeError) as error:
            return failure_reason(error)
        return None

    def prepare(self, case: Case) -> Prepared:
        from fp8_noncausal_attn.scales import finite_max

        shape = case.shape
        if not shape.quantized:
            raise Unsupported("this peer is FA3 over an FP8 cache with an FP8 query")
        _no_per_token_head(shape, self.name, "one K and one V descale per (sequence, KV head)")
        e4m3 = torch.float8_e4m3fn
        q_scale = case.query.float().abs().amax().clamp_min(1e-12) / finite_max(e4m3)
        query = (case.query.float() / q_scale).to(e4m3)
        per_sequence = (shape.batch, shape.num_kv_heads)
        out = torch.full_like(case.query, float("nan"))  # unwritten elements show as NaN
        run = fa3_peer.fwd_call(
            _paged_call(case, query, case.key_cache, case.value_cache, out, shape.window),
            q_descale=q_scale.reshape(1, 1).expand(per_sequence).contiguous(),
            k_descale=case.k_scale[None, :].expand(per_sequence).contiguous(),
            v_descale=case.v_scale[None, :].expand(per_sequence).contiguous(),
        )
        return Prepared(run=run, result=lambda: out)


def _to_packed(out: torch.Tensor) -> torch.Tensor:
    """[batch, heads, q_len, dim] -> [batch * q_len, heads, dim]."""
    return out.transpose(1, 2).flatten(0, 1)


def _padded_query(case: Case) -> torch.Tensor:
    shape = case.shape
    return case.query.view(shape.batch, shape.q_len, shape.num_q_heads, shape.head_dim).transpose(
        1, 2
    )


class TorchSdpa(Adapter):
    name = "torch_sdpa"
    note = (
        "F.scaled_dot_product_attention (enable_gqa) on a padded batch of the dequantised, "
        "gathered cache in the query dtype (with a window: the pages it touches, and a boolean "
        "mask); building that copy is not timed; no sinks"
    )

    def prepare(self, case: Case) -> Prepared:
        from torch.nn.attention.bias import causal_lower_right

        shape = case.shape
        _no_sinks(shape, self.name)
        key, value = gathered_kv(case, case.query.dtype)
        query = _padded_query(case)
        mask = None
        if shape.window != (-1, -1):
            mask = window_mask(shape, case.query.device)
        elif shape.causal and shape.q_len > 1:
            mask = causal_lower_right(shape.q_len, shape.kv_len)
        holder: list[torch.Tensor] = []

        def run() -> None:
            holder[:] = [
                torch.nn.functional.scaled_dot_product_attention(
                    query, key, value, attn_mask=mask, enable_gqa=True
                )
            ]

        return Prepared(run=run, result=lambda: _to_packed(holder[0]))


_compiled_flex: dict[str, Callable[..., torch.Tensor]] = {}


def _flex_function(device: torch.device) -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if "cuda" not in _compiled_flex:
        _compiled_flex["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex["cuda"]


class FlexAttention(Adapter):
    name = "flex_attention"
    note = (
        "torch.compile(flex_attention) (enable_gqa, lower-right causal block mask) on the same "
        "dequantised, gathered copy as torch_sdpa (it does not take a quantised cache; with a "
        "window, the pages it touches and a window block mask); the copy is not timed; eager and "
        "unfused on CPU; no sinks"
    )

    def __init__(self) -> None:
        # One block mask per shape, shared by its rotated copies (one compiled graph for all).
        self._mask: tuple[Shape, object] | None = None

    def _block_mask(self, shape: Shape, device: torch.device) -> object:
        from torch.nn.attention.flex_attention import create_block_mask

        if window_mask(shape, torch.device("cpu")) is None:
            return None
        if self._mask is None or self._mask[0] != shape:
            # Key k of the gathered copy is key first_key + k; query q sits at position + q.
            position = shape.kv_len - shape.q_len - shape.first_key
            left, right = shape.window
            left = shape.kv_len if left < 0 else left
            right = 0 if shape.causal else shape.kv_len if right < 0 else right

            def visible(b, h, q, k):
                return (k >= q + position - left) & (k <= q + position + right)

            mask = create_block_mask(
                visible, None, None, shape.q_len, shape.keys_read, device=device
            )
            self._mask = (shape, mask)
        return self._mask[1]

    def prepare(self, case: Case) -> Prepared:
        _no_sinks(case.shape, self.name)
        device = case.query.device
        key, value = gathered_kv(case, case.query.dtype)
        query = _padded_query(case).contiguous()
        block_mask = self._block_mask(case.shape, device)
        flex = _flex_function(device)
        holder: list[torch.Tensor] = []

        def run() -> None:
            with warnings.catch_warnings():
                # On CPU flex_attention warns that it runs unfused without torch.compile.
                warnings.simplefilter("ignore", UserWarning)
                holder[:] = [flex(query, key, value, block_mask=block_mask, enable_gqa=True)]

        return Prepared(run=run, result=lambda: _to_packed(holder[0]))


class FlashInfer(ScalarScaled):
    name = "flashinfer"
    note = (
        "BatchPrefillWithPagedKVCacheWrapper (NHD) on the same paged cache; scalar k/v scales "
        "only (given the max per-head scale), rel_err against that scalar-scale problem; "
        "windows: left only (window_left); no sinks"
    )

    def unavailable(self, device: torch.device) -> str | None:
        if importlib.util.find_spec("flashinfer") is None:
            return (
                "absent: flashinfer is not importable here (it cannot travel to the GPU "
                "machine: its wheels are over 560 MB, the carry limit 64 MiB)"
            )
        if device.type != "cuda":
            return "needs a CUDA device"
        return None

    def prepare(self, case: Case) -> Prepared:
        shape = case.shape
        _no_sinks(shape, self.name)
        _no_per_token_head(shape, self.name, "scalar k/v scales")
        # window_left bounds keys below p; nothing bounds them above but the causal mask.
        left, _ = expressible_window(
            shape,
            self.name,
            (shape.window[0], 0 if shape.causal else -1),
            "left-only windows (window_left)",
        )
        import flashinfer

        device = case.query.device
        workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        blocks = shape.blocks_per_seq
        kv_indptr = torch.arange(0, shape.batch + 1, device=device, dtype=torch.int32) * blocks
        last_page_len = torch.full(
            (shape.batch,), shape.kv_len - (blocks - 1) * shape.block_size, dtype=torch.int32
        )
        wrapper.plan(
            case.cu_seqlens_q,
            kv_indptr,
            case.block_table.flatten(),
            last_page_len.to(device),
            shape.num_q_heads,
            shape.num_kv_heads,
            shape.head_dim,
            shape.block_size,
            causal=shape.causal,
            window_left=left,
            sm_scale=case.softmax_scale,
            q_data_type=case.query.dtype,
            kv_data_type=case.key_cache.dtype,
        )
        k_scale, v_scale = (float(s) for s in _scalar_scales(case))
        out = torch.full_like(case.query, float("nan"))  # unwritten elements show as NaN

        def run() -> None:
            wrapper.run(
                case.query,
                (case.key_cache, case.value_cache),
                k_scale=k_scale,
                v_scale=v_scale,
                out=out,
            )

        return Prepared(run=run, result=lambda: out)


def adapters(device: torch.device) -> list[Adapter]:
    """Ours first (every compiled family and Triton; on CPU the reference also stands in for
    them, and the CUDA families are listed with the reason they do not run), then the peers."""
    ours = [*CUDA_FAMILIES, "triton"] + (["reference"] if device.type != "cuda" else [])
    peers: list[Adapter] = [
        VllmTritonUnified(),
        Fa3Fp8Query(),
        TorchSdpa(),
        FlexAttention(),
        FlashInfer(),
    ]
    return [Ours(name) for name in ours] + peers
