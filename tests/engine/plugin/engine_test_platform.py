"""The engine tier's platform: vLLM's CPU platform, except that a layer asking for FP8_NONCAUSAL
gets it (or, in reference mode, the rounding CPU_ATTN of :mod:`engine_test_reference`)."""

from __future__ import annotations

import os

from engine_test_plugin import BACKEND, MODE_ENV, record
from vllm.platforms.cpu import CpuPlatform


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
        reference = os.environ.get(MODE_ENV) == "reference"
        record("select", selector=attn_selector_config._asdict(), reference=reference)
        if reference:
            return "engine_test_reference.RoundedCpuAttentionBackend"
        return selected_backend.get_path()
