"""The engine tier's platform: vLLM's CPU platform, except that a layer asking for FP8_NONCAUSAL
gets it (or, in reference mode and on a 16-bit cache, the rounding CPU_ATTN of
:mod:`engine_test_reference`)."""

from __future__ import annotations

import os

from engine_test_plugin import BACKEND, MODE_ENV, record
from vllm.platforms.cpu import CpuPlatform

SIXTEEN_BIT_CACHES = ("bfloat16", "float16")


class EngineTestPlatform(CpuPlatform):
    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        if selected_backend is None or selected_backend.name != BACKEND:
            return super().get_attn_backend_cls(
                selected_backend, attn_selector_config, *args, **kwargs
            )
        reasons = selected_backend.get_class().validate_configuration(
            device_capability=cls.get_device_capability(), **attn_selector_config._asdict()
        )
        if reasons:
            raise ValueError(f"{BACKEND} refused {attn_selector_config}: {reasons}")
        # The reference stands in for the layers the run gives a 16-bit cache (all of them, or
        # a drafter's alone: the target then runs on the backend as in the run it emulates).
        reference = os.environ.get(MODE_ENV) == "reference" and (
            attn_selector_config.kv_cache_dtype in SIXTEEN_BIT_CACHES
        )
        record("select", selector=attn_selector_config._asdict(), reference=reference)
        if reference:
            return "engine_test_reference.RoundedCpuAttentionBackend"
        return selected_backend.get_path()
