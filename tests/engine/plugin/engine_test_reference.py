"""The reference the backend is compared with: CPU_ATTN on a 16-bit cache holding K/V rounded
through the format ``FP8NCA_ENGINE_ROUND`` names (``engine_test_plugin.round_trip``): an FP8
format (saturating) with the layer's own scales, one per KV head of this rank or one for all, or
a per-token-head format with one scale per token and KV head computed as vLLM's per-token-head
write does, in float32 on every host (:class:`Float32CpuAttentionMetadataBuilder`), on every
x86 host vLLM's CPU build runs on (AVX2 is the floor: the kernels are chosen for the 16-bit
cache, never for the run's quantised one). Each forward is recorded as the backend's are, with
the vLLM kernel library that ran it (:func:`vllm_cpu_kernels`)."""

from __future__ import annotations

import copy
import dataclasses
import os
import re

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


def vllm_cpu_kernels() -> str:
    """The file name of the vLLM CPU kernel library this process loaded (vLLM picks it by the
    CPU: ``_C`` where AVX512-BF16 is, else ``_C_AVX512`` or ``_C_AVX2``), "" if none yet."""
    with open("/proc/self/maps") as maps:
        found = re.search(r"/vllm/(_C(?:_AVX2|_AVX512)?)\.abi3\.so$", maps.read(), re.MULTILINE)
    return found.group(1) if found else ""


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
                   k_scale=layer._k_scale, v_scale=layer._v_scale,
                   isa=layer.isa, vllm_kernels=vllm_cpu_kernels())  # fmt: skip
        return result


class Float32CpuAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's builder for the reference's 16-bit cache, with its kernel choice (``isa``,
    also set on its layers) moved off the bf16 AMX kernel to the float32 one
    (:data:`FLOAT32_ISA_FOR`).

    CPU_ATTN's builder takes its cache dtype from the run's ``cache_config``: ``fp8`` or a
    per-token-head name where the run gives the other layers a quantised cache, which asks for
    vLLM's FP8 kernels (AVX-512 or AMX only) for a cache that is 16-bit. It is given the
    layers' own, as their impl has it."""

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        sixteen_bit = str(kv_cache_spec.dtype).removeprefix("torch.")
        vllm_config = copy.copy(vllm_config)
        vllm_config.cache_config = dataclasses.replace(vllm_config.cache_config,
                                                       cache_dtype=sixteen_bit)  # fmt: skip
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
