"""The classes of the vLLM attention backend ``FP8_NONCAUSAL`` (SPEC §8), vLLM 0.32.x to 0.34.x.

:mod:`fp8_noncausal_attn.vllm_backend` registers the backend and re-exports these classes; vLLM
imports this module when a layer selects the backend (through ``vllm_backend.CLASS_PATH``).

The backend runs paged attention over vLLM's per-layer cache, logical shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K and V side by side in the last dim,
FP8 stored as uint8), through :class:`fp8_noncausal_attn.PagedAttention`: the metadata builder
owns one (its split-KV workspace is allocated with the builder, which vLLM also builds inside its
CUDA-graph memory profiling) and plans each batch once in ``build()``; each layer's ``forward``
only runs the plan. Causal, bidirectional or mixed per request (``CommonAttentionMetadata.causal``,
a bool or vLLM's int32 per-request buffer, read in place), with the layer's
``_k_scale``/``_v_scale`` as dequantisation multipliers, 0-d or one per KV head of this
tensor-parallel rank. Rows past the last request (vLLM pads ``num_actual_tokens`` under CUDA
graphs) are written as zeros. A layer's ``sliding_window=w`` runs as the window ``(w - 1, 0)``,
made ``(w - 1, w - 1)`` when the batch is not all causal, exactly as vLLM's FLASH_ATTN does
(``_maybe_symmetrize_window``, the same in 0.32 to 0.34); a layer's ``sinks`` (one logit per
query head of this rank) join each row's softmax denominator. Window and sinks run on every
backend (the CUDA kernels, Triton, the reference on CPU).

Per-token-head caches (``fp8_per_token_head``, ``int8_per_token_head``): the page is vLLM
TRITON_ATTN's, ``[num_blocks, num_kv_heads, block_size, 2 * (head_size + 4)]`` bytes with each
token's and head's float32 scale inline after its K and after its V (``customize_spec`` packs
it as TRITON_ATTN's does, :func:`fp8_noncausal_attn.layouts.split_per_token_head_cache` views
it), so a page either backend writes reads the same in the other. The write computes each
scale (``reshape_and_cache`` with the scale views); the layer's ``_k_scale``/``_v_scale`` are not
used, as in TRITON_ATTN. Which of the library's backends read such scales:
``available_backends()[name]["per_token_head"]``; ``auto`` takes the first that does.

The interfaces used (``AttentionBackend.validate_configuration``,
``AttentionImpl.do_kv_cache_update``, ``CommonAttentionMetadata.causal``, the registry) are the
same in vLLM 0.32, 0.33 and 0.34 (what ``vllm_backend.interface_mismatches`` checks on a newer
one).

Unwritten slots: the backend writes exactly the slots of ``slot_mapping`` and fills, zeroes or
scans no other cache byte, so a cache that vLLM 0.34's growable KV cache backs only in part is
safe; what the kernels do with unwritten slots (NaN, garbage) is the library's (SPEC §5,
docs/vllm.md). A layer whose query
arrives already quantised (vLLM 0.34's ``Attention(query_pre_quantized=True)``) is refused by
name on its first forward: this backend keeps the query in 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.platforms.interface import DeviceCapability
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from . import config, registry, vllm_dcp
from .api import reshape_and_cache
from .layouts import split_kv_cache, split_per_token_head_cache
from .plan import PagedAttention
from .scales import SIXTEEN_BIT_DTYPES
from .validation import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, SUPPORTED_HEAD_DIMS

BACKEND_NAME = config.BACKEND_NAME

_FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
# The element type of a per-token-head cache's data (vLLM's fp8 on CUDA is e4m3fn).
_PER_TOKEN_HEAD_CACHE_DTYPES = {
    "fp8_per_token_head": torch.float8_e4m3fn,
    "int8_per_token_head": torch.int8,
}


@dataclass
class Fp8NoncausalMetadata:
    """Per-batch metadata: views of vLLM's persistent input buffers (never copies) and the
    batch's plan.

    query_start_loc: [num_reqs + 1] int32; seq_lens: [num_reqs] int32 (KV length including the
    new tokens); block_table: [num_reqs, max_blocks] int32; slot_mapping: [num_tokens] int64;
    causal: a bool, or a [num_reqs] int32/bool tensor (per request, nonzero = causal).
    max_query_len / max_seq_len are host-side upper bounds, so planning reads no device value.
    num_actual_tokens may exceed query_start_loc[-1] (CUDA-graph padding): those rows get zeros.
    attention / plan: the builder's :class:`PagedAttention` and this batch's plan of it for the
    group's first sliding window; plans: one plan per distinct layer window of the group (keyed
    by the layer's ``(w - 1, 0)`` or ``(-1, -1)``), ``plan`` among them; dcp: under decode
    context parallelism, the batch's :class:`vllm_dcp.DcpPlan` (else None).
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor
    attention: PagedAttention
    plan: object
    plans: dict[tuple[int, int], object]
    dcp: vllm_dcp.DcpPlan | None = None


def symmetrize_window(window: tuple[int, int], causal: bool | torch.Tensor) -> tuple[int, int]:
    """vLLM FLASH_ATTN's ``_maybe_symmetrize_window``: a causal window ``(w, 0)`` becomes
    ``(w, w)`` unless the whole batch is causal (``causal`` True); a per-request tensor counts as
    not causal, and its causal requests get ``right`` capped at 0 by their mask (SPEC §3)."""
    non_causal = isinstance(causal, torch.Tensor) or causal is False
    if window[0] >= 0 and window[1] == 0 and non_causal:
        return window[0], window[0]
    return window


class Fp8NoncausalMetadataBuilder(AttentionMetadataBuilder[Fp8NoncausalMetadata]):
    """Owns the :class:`PagedAttention` (and its workspace) of its layers; plans every batch.

    Sizes come from the KV-cache spec (KV heads, head size, block size), the layers' impls
    (query heads of this rank, softmax scale, cache dtype, scale mode: all layers of the group
    must agree), the model dtype, and the scheduler's largest batch. vLLM constructs builders in
    ``initialize_attn_backend``, also during its CUDA-graph memory profiling
    (``_init_minimal_kv_cache_for_profiling``), so the workspace is part of what it measures.

    CUDA graphs: UNIFORM_BATCH. The plan sizes grids from ``max_query_len`` and ``max_seq_len``;
    vLLM captures with ``max_seq_len = max_model_len`` and replays a uniform batch only with its
    captured query length, so both stay upper bounds at every replay, and the kernels derive
    each program's key range from the real ``seq_lens`` on the device. A mixed prefill/decode
    replay could exceed the captured ``max_query_len``, hence not ALWAYS.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # The plan references vLLM's persistent buffers and derives key ranges on the device, so a
    # draft step's in-place refresh of those buffers needs nothing from us.
    supports_draft_decode_metadata_update = True

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
        impls = [
            layer.impl
            for layer in layers.values()
            if isinstance(getattr(layer, "impl", None), Fp8NoncausalAttentionImpl)
        ]
        if not impls:
            raise ValueError(
                f"{BACKEND_NAME}: none of the layers {layer_names} is an attention layer of this "
                "backend in vLLM's static forward context"
            )
        shared = {
            (impl.num_heads, impl.scale, impl.cache_dtype(kv_cache_spec), impl.scale_mode())
            for impl in impls
        }
        if len(shared) != 1:
            raise ValueError(
                f"{BACKEND_NAME}: the layers {layer_names} share one plan, so they must agree on "
                f"(num_heads, softmax scale, cache dtype, scale mode); got "
                f"{sorted(shared, key=str)}"
            )
        # The scale mode is stated so that each batch is planned once, in build(), for the
        # kernels the layers' scales need (left to the first run, a per-token-head layer's
        # batch would be planned again there).
        num_heads, self.softmax_scale, cache_dtype, scale_mode = shared.pop()
        # The window is a layer property; a group normally shares one, but may hold windowed and
        # global layers (vLLM's FLASH_ATTN notes Gemma-3 without the hybrid KV-cache manager):
        # build() plans once per distinct window.
        self.layer_windows = sorted({impl.sliding_window for impl in impls})
        # vLLM builds the model with the activation dtype as torch's default dtype.
        model = vllm_config.model_config
        query_dtype = model.dtype if model is not None else torch.get_default_dtype()
        if query_dtype not in SIXTEEN_BIT_DTYPES:
            raise ValueError(
                f"{BACKEND_NAME} runs bfloat16/float16 activations, got model dtype {query_dtype}"
            )
        scheduler = vllm_config.scheduler_config
        # The most query rows a batch can hand us: a scheduler step, a padded CUDA-graph size,
        # or a drafter's step (every request with its block of draft tokens).
        speculative = vllm_config.speculative_config
        draft_rows = 1 + (getattr(speculative, "num_speculative_tokens", None) or 0)
        max_tokens = max(
            scheduler.max_num_batched_tokens,
            vllm_config.compilation_config.max_cudagraph_capture_size or 0,
            scheduler.max_num_seqs * draft_rows,
        )
        # vLLM passes no argument for it: the library's backend comes from FP8NCA_BACKEND.
        self.kernel_backend = registry.backend_from_env()
        self.dcp = None
        dcp_size, dcp_rank = vllm_dcp.dcp_world_size_and_rank(kv_cache_spec)
        if dcp_size > 1:
            if vllm_config.parallel_config.use_ubatching:
                # vLLM's micro-batch metadata (split_attn_metadata) drops the per-request causal
                # flags: bidirectional requests would run causal. vLLM's V2 runner refuses the
                # same combination.
                raise NotImplementedError(
                    f"{BACKEND_NAME} does not support dual batch overlap with context "
                    "parallelism (enable_dbo or ubatch_size > 1 with "
                    "decode_context_parallel_size > 1)"
                )
            if self.layer_windows != [(-1, -1)]:
                raise NotImplementedError(
                    f"{BACKEND_NAME} does not run sliding windows under decode context parallelism"
                )
            if kv_cache_spec.num_kv_heads != 1:
                # vLLM's DCP for GQA/MQA needs tp > the model's KV heads: each rank holds one,
                # shared by its DCP group (whose query heads are all-gathered against it).
                raise ValueError(
                    f"{BACKEND_NAME}: decode context parallelism needs one KV head per rank, "
                    f"got {kv_cache_spec.num_kv_heads}"
                )
            self.dcp = vllm_dcp.DcpAttention(
                world_size=dcp_size, rank=dcp_rank,
                interleave=vllm_config.parallel_config.cp_kv_cache_interleave_size,
                num_heads=num_heads, num_kv_heads=kv_cache_spec.num_kv_heads,
                head_dim=kv_cache_spec.head_size, block_size=kv_cache_spec.block_size,
                query_dtype=query_dtype, cache_dtype=cache_dtype, device=device,
                max_num_seqs=max(scheduler.max_num_seqs, 1), max_num_tokens=max_tokens,
                softmax_scale=self.softmax_scale, backend=self.kernel_backend,
                scale_mode=scale_mode,
            )  # fmt: skip
        self.attention = PagedAttention(
            num_q_heads=num_heads,
            num_kv_heads=kv_cache_spec.num_kv_heads,
            head_dim=kv_cache_spec.head_size,
            block_size=kv_cache_spec.block_size,
            query_dtype=query_dtype,
            cache_dtype=cache_dtype,
            device=device,
            max_num_seqs=max(scheduler.max_num_seqs, 1),
            max_num_tokens=max_tokens,
            backend=self.kernel_backend,
            scale_mode=scale_mode,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> Fp8NoncausalMetadata:
        m = common_attn_metadata
        if self.dcp is not None:
            return Fp8NoncausalMetadata(
                num_actual_tokens=m.num_actual_tokens, max_query_len=m.max_query_len,
                max_seq_len=m.max_seq_len, query_start_loc=m.query_start_loc,
                seq_lens=m.seq_lens, block_table=m.block_table_tensor,
                slot_mapping=m.slot_mapping, causal=m.causal, attention=self.attention,
                plan=None, plans={}, dcp=self.dcp.plan(m),
            )  # fmt: skip
        plans = {
            window: self._plan(m, symmetrize_window(window, m.causal))
            for window in self.layer_windows
        }
        return Fp8NoncausalMetadata(
            num_actual_tokens=m.num_actual_tokens,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            causal=m.causal,
            attention=self.attention,
            plan=plans[self.layer_windows[0]],
            plans=plans,
        )

    def _plan(self, m: CommonAttentionMetadata, window: tuple[int, int]):
        return self.attention.plan(
            m.query_start_loc, m.seq_lens, m.block_table_tensor, causal=m.causal,
            max_seqlen_q=m.max_query_len, max_seqlen_k=m.max_seq_len,
            softmax_scale=self.softmax_scale, num_tokens=m.num_actual_tokens, window=window,
        )  # fmt: skip

    def update_draft_decode_metadata(self, metadata: Fp8NoncausalMetadata) -> None:
        return None


class Fp8NoncausalAttentionImpl(AttentionImpl[Fp8NoncausalMetadata]):
    """Cache write and paged attention through ``fp8_noncausal_attn``'s kernels; under decode
    context parallelism as vLLM's FLASH_ATTN (:mod:`fp8_noncausal_attn.vllm_dcp`)."""

    # The kernels return each row's natural-log LSE (lse_base_on_e, vLLM's default).
    can_return_lse_for_decode: bool = True
    supports_dcp: bool = True
    # Multi-token queries (draft blocks, verification) under any cp_kv_cache_interleave_size:
    # a rank's context shard is counted by vLLM's own get_dcp_local_seq_lens, the new tokens
    # attend each other from the layer's K/V (tests/test_vllm_dcp.py, interleave 1 and 16).
    supports_mtp_with_cp_non_trivial_interleave_size: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes is not None,
            "logits_soft_cap": bool(logits_soft_cap),
        }
        for feature, used in unsupported.items():
            if used:
                raise NotImplementedError(f"{BACKEND_NAME} does not support {feature}")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"{BACKEND_NAME} supports decoder attention only, got attn_type={attn_type!r}"
            )
        if kv_cache_dtype not in config.SUPPORTED_KV_CACHE_DTYPES:
            raise ValueError(
                f"{BACKEND_NAME} supports kv_cache_dtype in {config.SUPPORTED_KV_CACHE_DTYPES}, "
                f"got {kv_cache_dtype!r}"
            )
        if head_size not in SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"{BACKEND_NAME} supports head sizes {SUPPORTED_HEAD_DIMS}, got {head_size}"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        if sliding_window is not None and (
            isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
            or sliding_window < 1
        ):  # fmt: skip
            raise ValueError(
                f"{BACKEND_NAME}: sliding_window must be None or an int >= 1, "
                f"got {sliding_window!r}"
            )
        # vLLM FLASH_ATTN's convention: a decoder's window of w keys is (w - 1, 0); forward
        # makes it symmetric when the batch is not all causal (symmetrize_window).
        self.sliding_window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        if sinks is not None and (
            not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (num_heads,)
        ):
            raise ValueError(
                f"{BACKEND_NAME}: sinks must be a tensor [num_heads] = [{num_heads}] (this rank's "
                f"query heads), got {getattr(sinks, 'shape', type(sinks).__name__)}"
            )
        # The layer's parameter itself: its values are loaded after construction, in place.
        self.sinks = sinks
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        # None keeps the tensor's own dtype (16-bit caches); FP8 caches arrive as uint8.
        self._cache_view_dtype = _FP8_CACHE_DTYPES.get(kv_cache_dtype)
        # Per-token-head caches: their data's dtype (pages of bytes with the scales inline).
        self._per_token_head_dtype = _PER_TOKEN_HEAD_CACHE_DTYPES.get(kv_cache_dtype)
        registry.backend_from_env()  # a bad FP8NCA_BACKEND fails when the layer is built
        # The layer's cache as (tensor, key view, value view, k_scale view, v_scale view; the
        # scale views None but for per-token-head caches): views are made once per tensor.
        self._cache_views: tuple | None = None

    def cache_dtype(self, kv_cache_spec) -> torch.dtype:
        """The dtype the kernels read: the FP8 format for FP8 caches, the data's (e4m3fn, int8)
        for per-token-head ones, else the spec's dtype."""
        return self._per_token_head_dtype or self._cache_view_dtype or kv_cache_spec.dtype

    def scale_mode(self) -> str:
        """The scales forward passes (``PagedAttention``'s ``scale_mode``): ``"per_token_head"``
        (views of the page) for per-token-head caches, else ``"per_head"`` (the layer's)."""
        return "per_token_head" if self._per_token_head_dtype is not None else "per_head"

    def _caches_and_scales(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> tuple:
        """``(key_cache, value_cache, k_scale, v_scale)`` of this layer: views of ``kv_cache``
        and, for per-token-head caches, of its inline scales; else the layer's scales."""
        views = self._cache_views
        if views is None or views[0] is not kv_cache:
            if self._per_token_head_dtype is None:
                split = split_kv_cache(kv_cache, "vllm", self._cache_view_dtype)
                views = (kv_cache, *split, None, None)
            else:
                # Views only: no slot is touched before a token is written to it (vLLM's growable
                # KV cache backs a prefix of the blocks; TRITON_ATTN initialises nothing either).
                views = (
                    kv_cache,
                    *split_per_token_head_cache(kv_cache, self._per_token_head_dtype),
                )
            self._cache_views = views
        if self._per_token_head_dtype is not None:
            return views[1:]
        return (views[1], views[2], *self._scales(layer))

    def _scales(self, layer: AttentionLayer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's K/V dequantisation multipliers, checked against this rank's KV heads.

        16-bit caches take no scales, as in vLLM's own backends: a per-head checkpoint served
        with a bfloat16 cache keeps its scales on the layer, but they must not be applied.
        """
        if self._cache_view_dtype is None:
            return None, None
        scales = (layer._k_scale, layer._v_scale)
        for name, scale in zip(("_k_scale", "_v_scale"), scales, strict=True):
            if scale.numel() != 1 and tuple(scale.shape) != (self.num_kv_heads,):
                raise ValueError(
                    f"{BACKEND_NAME}: layer.{name} has shape {list(scale.shape)}, but this "
                    f"rank's attention has {self.num_kv_heads} KV heads. Per-head scales must "
                    "be this tensor-parallel rank's slice ([num_kv_heads // tp_size] entries), "
                    "or one scale for all heads."
                )
        return scales

    def do_kv_cache_update(
        self,
        layer: AttentionLayer,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write new K/V into the cache, quantised with the layer's scales (per-token-head caches:
        with each token's and head's own, computed and written inline).

        key, value: [num_tokens, num_kv_heads, head_size] (may be padded past slot_mapping);
        kv_cache: [num_blocks, num_kv_heads, block_size, 2 * head_size] (per-token-head:
        ``2 * (head_size + 4)`` bytes); slot_mapping: [num_actual_tokens] int64, negative
        entries skipped.
        """
        key_cache, value_cache, k_scale, v_scale = self._caches_and_scales(layer, kv_cache)
        num_tokens = slot_mapping.shape[0]
        reshape_and_cache(
            key[:num_tokens], value[:num_tokens], key_cache, value_cache, slot_mapping,
            k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Fp8NoncausalMetadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Paged attention over the cache (already updated by :meth:`do_kv_cache_update`): runs
        the batch's plan, made once by the builder.

        query, output: [num_tokens, num_heads, head_size]; the first ``num_actual_tokens`` rows
        are written, those past the last request as zeros. No device-to-host synchronisation.
        A query that is not 16-bit (a layer built with ``query_pre_quantized=True``) is refused
        on the layer's first call.
        """
        if query.dtype not in SIXTEEN_BIT_DTYPES:
            raise TypeError(_quantized_query_message(layer, query.dtype))
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not fuse output quantization")
        if attn_metadata is None:
            # vLLM's memory-profiling run passes no metadata.
            return output.fill_(0)
        key_cache, value_cache, k_scale, v_scale = self._caches_and_scales(layer, kv_cache)
        num_tokens = attn_metadata.num_actual_tokens
        sinks = self.sinks
        if sinks is not None and sinks.dtype != torch.float32:
            sinks = sinks.float()  # gpt-oss keeps them in the model dtype; the kernels read fp32
        if attn_metadata.dcp is not None:
            dcp = attn_metadata.dcp
            dcp.owner.forward(
                dcp, query[:num_tokens], key[:num_tokens], value[:num_tokens],
                key_cache, value_cache, k_scale, v_scale, sinks, output[:num_tokens],
            )  # fmt: skip
            return output
        attn_metadata.attention.run(
            query[:num_tokens], key_cache, value_cache, k_scale, v_scale,
            out=output[:num_tokens], plan=attn_metadata.plans[self.sliding_window], sinks=sinks,
        )  # fmt: skip
        return output


def _quantized_query_message(layer: AttentionLayer, dtype: torch.dtype) -> str:
    name = getattr(layer, "layer_name", None) or type(layer).__name__
    return (
        f"{BACKEND_NAME}: layer {name!r} hands its attention a query already quantised to "
        f"{dtype} (vLLM's Attention(query_pre_quantized=True), as MiniMax-M3's DSpark drafter "
        "builds its layers whenever its draft cache is FP8). This backend keeps the query in "
        "16 bits (bfloat16/float16) and does not read FP8 query bits. Give the drafter a 16-bit "
        'draft cache ("kv_cache_dtype": "bfloat16" in --speculative-config), which this '
        'backend serves, or serve it with FLASH_ATTN ("attention_backend": "FLASH_ATTN").'
    )


class Fp8NoncausalAttentionBackend(AttentionBackend):
    """``FP8_NONCAUSAL``: what ``fp8_noncausal_attn``'s kernels run, declared to vLLM's selector.

    Accepted (``validate_configuration`` returns no reason): decoder attention, bf16/fp16
    activations, kv-cache dtypes auto/bfloat16/float16/fp8/fp8_e4m3/fp8_e5m2 and
    fp8_per_token_head/int8_per_token_head (``customize_spec``: TRITON_ATTN's page), head sizes
    64/128/256, kernel block sizes 8..256 (powers of two), causal and non-causal, per-head
    scales, compute capability >= 8.9 (the mma_sync kernels, Triton where they do not run) or
    none (vLLM's CPU platform: the reference kernels), sliding windows and attention sinks
    (every backend runs them), decode context parallelism
    (``decode_context_parallel_size > 1``, :mod:`fp8_noncausal_attn.vllm_dcp`; without windows).
    Refused with vLLM's own reasons: MLA, sparse attention, multimodal prefix attention, batch
    invariance, PCP, other attention types, int4_per_token_head; vLLM's Attention layer refuses
    ALiBi-sqrt for it, and the impl refuses ALiBi and logit soft-capping.
    """

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(config.SUPPORTED_KV_CACHE_DTYPES)
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def customize_spec(cls, spec):
        """Per-token-head caches: each (head, slot) cell holds K, its float32 scale, V, its
        float32 scale, as vLLM's TRITON_ATTN packs it (its ``customize_spec``, 0.32 to 0.34),
        so that either backend reads the other's pages."""
        if spec.state_content_bytes is not None or not spec.kv_quant_mode.is_per_token_head:
            return spec
        scale_bytes = get_dtype_size(torch.float32)
        content = (spec.head_size + spec.head_size_v) * get_dtype_size(spec.dtype)
        return replace(spec, state_content_bytes=content + 2 * scale_bytes)

    @staticmethod
    def get_impl_cls() -> type[Fp8NoncausalAttentionImpl]:
        return Fp8NoncausalAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[Fp8NoncausalMetadataBuilder]:
        return Fp8NoncausalMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return [
            size
            for size in (1 << shift for shift in range(MAX_BLOCK_SIZE.bit_length()))
            if size >= MIN_BLOCK_SIZE
        ]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_DIMS)

    @classmethod
    def supports_non_causal(cls) -> bool:
        return True

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability | None) -> bool:
        """CUDA: sm_89 and newer. None (a platform without a compute capability, such as vLLM's
        CPU platform): True, the reference kernels run there."""
        if capability is None:
            return True
        return capability >= DeviceCapability(*config.MIN_DEVICE_CAPABILITY)
