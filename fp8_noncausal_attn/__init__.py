"""Paged attention over an FP8 KV cache with per-KV-head scales (or FP8/int8 with a scale per
token and KV head, vLLM's per-token-head caches), causal and bidirectional.

Public API (SPEC §4): :func:`paged_attention`, :func:`reshape_and_cache`,
:func:`compute_kv_scales`, :func:`available_backends`, :func:`merge_attention_states`, and
:class:`PagedAttention` (plan once per batch, run per layer). The vLLM backend lives in
``fp8_noncausal_attn.vllm_backend`` and is imported only by vLLM's plugin loader.
"""

from .api import available_backends, compute_kv_scales, paged_attention, reshape_and_cache
from .layouts import split_kv_cache, split_per_token_head_cache
from .merge import merge_attention_states
from .plan import PagedAttention

__version__ = "0.1.0"  # the one place: pyproject.toml reads it from here

__all__ = [
    "__version__",
    "PagedAttention",
    "available_backends",
    "compute_kv_scales",
    "merge_attention_states",
    "paged_attention",
    "reshape_and_cache",
    "split_kv_cache",
    "split_per_token_head_cache",
]
