"""The reference the backend is compared with: CPU_ATTN on a 16-bit cache holding K/V rounded
through the FP8 format ``FP8NCA_ENGINE_ROUND`` (saturating) with the layer's own scales, one per
KV head of this rank or one for all; each forward is recorded as the backend's are."""

from __future__ import annotations

import dataclasses
import os

import torch
from engine_test_plugin import (
    CAUSAL_ENV,
    ROUND_DTYPES,
    ROUND_ENV,
    batch_key,
    layer_name,
    metadata_causal,
    record,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


def _rounded(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [tokens, kv_heads, head] rounded through FP8 with a 0-d or per-KV-head scale."""
    fp8 = ROUND_DTYPES.get(os.environ.get(ROUND_ENV, ""))
    if fp8 is None:
        return x
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float()
    limit = torch.finfo(fp8).max  # saturating, as the backend's cache write
    return ((x.float() / scale).clamp(-limit, limit).to(fp8).float() * scale).to(x.dtype)


class RoundedCpuAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key = _rounded(key, layer._k_scale)
        value = _rounded(value, layer._v_scale)
        return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        if attn_metadata is not None and os.environ.get(CAUSAL_ENV) == "1":
            # A planted error: the reference attends causally.
            attn_metadata = dataclasses.replace(attn_metadata, causal=True)
        result = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 *args, **kw)  # fmt: skip
        if attn_metadata is not None:
            n = attn_metadata.num_actual_tokens
            record("forward", layer=layer_name(layer), causal=metadata_causal(attn_metadata),
                   output=output[:n], window=self.sliding_window, key=batch_key(attn_metadata),
                   k_scale=layer._k_scale, v_scale=layer._v_scale)  # fmt: skip
        return result


class RoundedCpuAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RoundedCpuAttentionImpl
