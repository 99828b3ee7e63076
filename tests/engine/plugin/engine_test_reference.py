"""The reference the backend is compared with: CPU_ATTN on a 16-bit cache holding K/V rounded
through the format ``FP8NCA_ENGINE_ROUND`` names (``engine_test_plugin.round_trip``): an FP8
format (saturating) with the layer's own scales, one per KV head of this rank or one for all, or
a per-token-head format with one scale per token and KV head computed as vLLM's per-token-head
write does, in float32 on every host (:class:`Float32CpuAttentionMetadataBuilder`). Each forward
is recorded as the backend's are."""

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
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

# CPU_ATTN's kernel on AMX hosts (vLLM takes it for bf16 with block sizes divisible by 32)
# multiplies bf16 tiles, so the softmax weights meet V rounded to bf16: against float64 attention
# over the same rounded K/V it misses the correctly rounded bf16 result on ~12% of the outputs,
# where the backend's float32 math misses ~0.01%, and the comparison would measure CPU_ATTN's
# rounding, not the backend. Its float32 x86 kernel ("vec", the same block sizes) is the
# reference on every host.
FLOAT32_ISA_FOR = {"amx": "vec"}


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


class Float32CpuAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's builder with its kernel choice (``isa``, also set on its layers) moved off the
    bf16 AMX kernel to the float32 one (:data:`FLOAT32_ISA_FOR`)."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa in FLOAT32_ISA_FOR:
            self.isa = FLOAT32_ISA_FOR[self.isa]
            self._set_isa_to_layers(layer_names)


class RoundedCpuAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return RoundedCpuAttentionImpl

    @staticmethod
    def get_builder_cls():
        return Float32CpuAttentionMetadataBuilder
