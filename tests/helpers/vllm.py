"""vLLM-facing test data shared by the backend and decode-context-parallel tests (imports
vLLM: only modules that need it import this)."""

import torch
from vllm.platforms.interface import DeviceCapability

HOPPER, BLACKWELL = DeviceCapability(9, 0), DeviceCapability(10, 0)


def drafter_config(**overrides):
    selector = {
        "head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "fp8", "block_size": 16,
        "use_mla": False, "has_sink": False, "use_sparse": False, "use_mm_prefix": False,
        "use_per_head_quant_scales": True, "device_capability": HOPPER,
        "attn_type": "decoder", "use_non_causal": True,
    }  # fmt: skip
    return selector | overrides
