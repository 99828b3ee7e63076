"""The target/drafter KV-cache dtype split (SPEC §6), resolved the way vLLM 0.33 resolves it.

vLLM 0.33 lets a speculative drafter keep its own KV-cache dtype through
``speculative_config.kv_cache_dtype`` (CLI: ``--speculative-config.kv-cache-dtype``). Its rule,
read from ``vllm/config/speculative.py`` (``apply_draft_overrides``) and the DFlash/DSpark
loaders (``vllm/v1/worker/gpu/spec_decode/*/utils.py``):

* ``None`` (not given): the drafter inherits the target's ``--kv-cache-dtype``;
* any string, ``"auto"`` included, replaces it for the drafter's layers only. ``"auto"`` there
  means what it means everywhere in vLLM: the model's own dtype (unquantised), which is how
  vLLM itself keeps a drafter off a target's FP8 cache (``model_executor/models/config.py``).

:func:`resolve_drafter_kv_cache` applies that rule and then says which attention backend runs
the drafter: ``FP8_NONCAUSAL`` (this library) where its kernels support the dtype on the device,
else the model-dtype fallback with vLLM's own backend choice. The module never imports vLLM.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

BACKEND_NAME = "FP8_NONCAUSAL"
AUTO_BACKEND = "auto"

FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
SIXTEEN_BIT_KV_CACHE_DTYPES = ("bfloat16", "float16")
# vLLM's caches with one scale per token and KV head, computed as each token is written and kept
# inline in the page (as its TRITON_ATTN packs them): no checkpoint scales needed. vLLM's
# int4_per_token_head is not among them (no kernel here reads packed int4).
PER_TOKEN_HEAD_KV_CACHE_DTYPES = ("fp8_per_token_head", "int8_per_token_head")
# What FP8_NONCAUSAL declares to vLLM (vllm_backend.Fp8NoncausalAttentionBackend).
SUPPORTED_KV_CACHE_DTYPES = (
    ("auto",) + SIXTEEN_BIT_KV_CACHE_DTYPES + FP8_KV_CACHE_DTYPES + PER_TOKEN_HEAD_KV_CACHE_DTYPES
)
MODEL_DTYPES = SIXTEEN_BIT_KV_CACHE_DTYPES
# The oldest GPU any of our kernels runs on: Triton's FP8 conversions and the mma_sync kernels
# (built for sm_89, sm_90, the sm_100 family and sm_120, PTX for newer) both need sm_89.
MIN_DEVICE_CAPABILITY = (8, 9)

_SPECULATIVE_KV_KEY = "speculative_config.kv_cache_dtype"


@dataclass(frozen=True)
class DrafterKVCachePlan:
    """How the drafter's KV cache is kept and which vLLM attention backend runs it.

    Attributes:
        kv_cache_dtype: the vLLM cache-dtype string of the drafter's layers (``"fp8"``,
            ``"bfloat16"``, ``"auto"``, ...), i.e. what ``speculative_config.kv_cache_dtype``
            resolves to.
        backend: ``"FP8_NONCAUSAL"`` when this library runs it, else ``"auto"`` (vLLM picks a
            backend that supports the drafter, e.g. FLASH_ATTN for a 16-bit cache).
        reason: one sentence saying why.
        speculative_config: the keys to put in ``--speculative-config`` to get this plan.
    """

    kv_cache_dtype: str
    backend: str
    reason: str
    speculative_config: dict[str, str]


def normalize_cli_key(key: str) -> str:
    """Canonical form of a (possibly dotted) vLLM CLI key.

    ``--speculative-config.kv-cache-dtype``, ``speculative-config.kv_cache_dtype`` and
    ``speculative_config.kv_cache_dtype`` all become ``speculative_config.kv_cache_dtype``.
    """
    return ".".join(part.replace("-", "_") for part in key.lstrip("-").split("."))


def normalize_cli_options(options: Mapping[str, object]) -> dict[str, object]:
    """Flatten CLI-style options into canonical dotted keys.

    Accepts dotted keys with ``-`` or ``_`` (``--speculative-config.kv-cache-dtype``) and a
    ``speculative_config`` given whole, as a dict or a JSON string (``--speculative-config
    '{"kv_cache_dtype": "bfloat16"}'``). A dotted key wins over the same field inside the whole
    config, as on vLLM's command line. Raises ValueError for a key given twice with different
    values under two spellings.
    """
    flat: dict[str, object] = {}
    dotted: dict[str, object] = {}
    for raw_key, value in options.items():
        key = normalize_cli_key(raw_key)
        if "." in key:
            target = dotted
        else:
            target = flat
            if isinstance(value, str) and key.endswith("_config") and value.lstrip()[:1] == "{":
                value = json.loads(value)
            if isinstance(value, Mapping):
                for sub_key, sub_value in normalize_cli_options(value).items():
                    _put(flat, f"{key}.{sub_key}", sub_value)
                continue
        _put(target, key, value)
    flat.update(dotted)
    return flat


def _put(target: dict[str, object], key: str, value: object) -> None:
    if key in target and target[key] != value:
        raise ValueError(f"option {key} given twice: {target[key]!r} and {value!r}")
    target[key] = value


def resolve_drafter_kv_cache(
    target_kv_cache_dtype: str,
    drafter_kv_cache_dtype: str | None = None,
    *,
    drafter_non_causal: bool,
    device_capability: tuple[int, int],
    model_dtype: str = "bfloat16",
) -> DrafterKVCachePlan:
    """Resolve the drafter's KV-cache dtype and backend (SPEC §6).

    Args:
        target_kv_cache_dtype: the target's ``--kv-cache-dtype`` (``"auto"``, ``"fp8"``, ...).
        drafter_kv_cache_dtype: ``speculative_config.kv_cache_dtype``; None inherits the
            target's, any string (``"auto"`` = the model dtype) replaces it, as in vLLM 0.33.
        drafter_non_causal: whether a drafter layer attends bidirectionally (DFlash/DSpark).
        device_capability: ``(major, minor)`` of the GPU, e.g. ``(9, 0)`` for H100/H200.
        model_dtype: the drafter's activation dtype, ``"bfloat16"`` or ``"float16"``; the dtype
            of the fallback cache.
    Returns:
        A :class:`DrafterKVCachePlan`.
    Raises:
        ValueError: for an empty dtype string or a ``model_dtype`` that is not 16-bit.
    """
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {MODEL_DTYPES}, got {model_dtype!r}")
    for name, value, optional in (
        ("target_kv_cache_dtype", target_kv_cache_dtype, False),
        ("drafter_kv_cache_dtype", drafter_kv_cache_dtype, True),
    ):
        if not (isinstance(value, str) and value) and not (optional and value is None):
            raise ValueError(f"{name} must be a vLLM cache-dtype string, got {value!r}")
    if drafter_kv_cache_dtype is None:
        requested = target_kv_cache_dtype
        origin = f"inherited from the target's --kv-cache-dtype {target_kv_cache_dtype!r}"
    else:
        requested = drafter_kv_cache_dtype
        origin = f"set by speculative_config.kv_cache_dtype={drafter_kv_cache_dtype!r}"
    attention = "non-causal" if drafter_non_causal else "causal"
    device = f"sm_{device_capability[0]}{device_capability[1]}"

    why_not = _why_unsupported(requested, device_capability)
    if why_not is None:
        reason = f"{requested!r} ({origin}): {BACKEND_NAME} runs {attention} attention on {device}"
        if requested in PER_TOKEN_HEAD_KV_CACHE_DTYPES:
            reason += (
                ", with a scale per token and KV head computed as each token is written (no "
                "checkpoint scales needed), in vLLM's TRITON_ATTN page layout"
            )
        return _plan(requested, BACKEND_NAME, reason)
    if requested in FP8_KV_CACHE_DTYPES:
        reason = (
            f"{requested!r} ({origin}) cannot run through {BACKEND_NAME} ({why_not}); the drafter "
            f"falls back to a {model_dtype} cache and vLLM's own choice of backend"
        )
        return _plan(model_dtype, AUTO_BACKEND, reason)
    reason = f"{requested!r} ({origin}) is left to vLLM's own backends: {why_not}"
    return _plan(requested, AUTO_BACKEND, reason)


def resolve_drafter_kv_cache_from_cli(
    options: Mapping[str, object],
    *,
    drafter_non_causal: bool,
    device_capability: tuple[int, int],
    model_dtype: str = "bfloat16",
) -> DrafterKVCachePlan:
    """:func:`resolve_drafter_kv_cache` from vLLM CLI-style options.

    ``options`` holds ``kv_cache_dtype`` (the target's; ``"auto"`` when absent) and optionally
    the drafter override under any spelling :func:`normalize_cli_options` accepts.
    """
    flat = normalize_cli_options(options)
    drafter = flat.get(_SPECULATIVE_KV_KEY)
    return resolve_drafter_kv_cache(
        str(flat.get("kv_cache_dtype", "auto")),
        None if drafter is None else str(drafter),
        drafter_non_causal=drafter_non_causal,
        device_capability=device_capability,
        model_dtype=model_dtype,
    )


def _why_unsupported(kv_cache_dtype: str, device_capability: tuple[int, int]) -> str | None:
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        return f"{BACKEND_NAME} supports kv-cache dtypes {SUPPORTED_KV_CACHE_DTYPES}"
    if tuple(device_capability) < MIN_DEVICE_CAPABILITY:
        major, minor = MIN_DEVICE_CAPABILITY
        return f"{BACKEND_NAME} needs compute capability >= {major}.{minor}"
    return None


def _plan(kv_cache_dtype: str, backend: str, reason: str) -> DrafterKVCachePlan:
    speculative_config = {"kv_cache_dtype": kv_cache_dtype}
    if backend != AUTO_BACKEND:
        speculative_config["attention_backend"] = backend
    return DrafterKVCachePlan(kv_cache_dtype, backend, reason, speculative_config)
