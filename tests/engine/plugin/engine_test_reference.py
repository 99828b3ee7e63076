"""The reference the backend is compared with: CPU_ATTN on a 16-bit cache holding K/V rounded
through the format ``FP8NCA_ENGINE_ROUND`` names (``engine_test_plugin.round_trip``): an FP8
format (saturating) with the layer's own scales, one per KV head of this rank or one for all, or
a per-token-head format with one scale per token and KV head computed as vLLM's per-token-head
write does. Each forward is recorded as the backend's are."""

from __future__ import annotations

import dataclasses
import os

from engine_test_plugin import (
    CAUSAL_ENV,
    ROUND_ENV,
    batch_key,
    layer_name,
    metadata_causal,
    record,
    round_trip,
)
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl


class RoundedCpuAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        fmt = os.environ.get(ROUND_ENV, "")
        key = round_trip(key, fmt, layer._k_scale).to(key.dtype)
        value = round_trip(value, fmt, layer._v_scale).to(value.dtype)
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
