"""vLLM attention backend ``FP8_NONCAUSAL`` (SPEC §8) for vLLM 0.32.x and 0.33.x: the plugin.

vLLM loads ``vllm.general_plugins`` entry points in every process (API server, engine core,
workers); ours calls :func:`register`, which adds ``FP8_NONCAUSAL`` to ``AttentionBackendEnum``.
A registered backend is never picked automatically: users name it. vLLM gives the drafter only
the backend of ``speculative_config.attention_backend`` (``"attention_backend": "FP8_NONCAUSAL"``
inside ``--speculative-config``): its ``_create_draft_vllm_config`` never passes the top-level
``--attention-backend`` on, which sets the target's layers only. Every layer on this backend
takes both.

Loading the plugin never raises: this module imports nothing of vLLM but its version and (on a
supported vLLM) its backend registry; with any other vLLM, :func:`register` logs one warning and
registers nothing. The backend's classes live in :mod:`fp8_noncausal_attn.vllm_impl`, imported
when vLLM resolves :data:`CLASS_PATH` (and re-exported here under the same names).

Spawn safety: the member is added at run time, and an enum member pickles by value
(``AttentionBackendEnum(value)``), so a process spawned with a pickled ``VllmConfig`` (vLLM's
engine core, its tensor-parallel workers) could not unpickle it before loading plugins. The
member pickles as a call of :func:`backend_member` instead, which registers it in the new
process first.

``import fp8_noncausal_attn`` never imports this module.
"""

from __future__ import annotations

import logging

from packaging.version import InvalidVersion, Version

from . import config

SUPPORTED_VLLM = ("0.32", "0.33")
"""The vLLM minor releases the backend runs on (one code path: their attention interfaces used
here are the same)."""
BACKEND_NAME = config.BACKEND_NAME
CLASS_PATH = f"{__name__}.Fp8NoncausalAttentionBackend"
# The names of fp8_noncausal_attn.vllm_impl re-exported here.
_IMPL_NAMES = frozenset(
    {
        "Fp8NoncausalAttentionBackend",
        "Fp8NoncausalAttentionImpl",
        "Fp8NoncausalMetadata",
        "Fp8NoncausalMetadataBuilder",
        "symmetrize_window",
    }
)

logger = logging.getLogger(__name__)


def vllm_version_supported(version: str) -> bool:
    """True for a vLLM 0.32.x or 0.33.x version string (dev builds included)."""
    try:
        release = Version(version).release[:2]
    except InvalidVersion:
        return False
    return ".".join(str(part) for part in release) in SUPPORTED_VLLM


def register() -> None:
    """``vllm.general_plugins`` entry point: add ``FP8_NONCAUSAL`` to ``AttentionBackendEnum``.

    vLLM may load plugins more than once per process; registering again is a no-op. With a vLLM
    other than :data:`SUPPORTED_VLLM`, logs one warning and registers nothing.
    """
    import vllm

    if not vllm_version_supported(vllm.__version__):
        logger.warning(
            "fp8_noncausal_attn: the %s attention backend supports vLLM %s; vLLM %s is "
            "installed, so it is not registered",
            BACKEND_NAME, " and ".join(f"{minor}.x" for minor in SUPPORTED_VLLM), vllm.__version__,
        )  # fmt: skip
        return
    backend_member()


def backend_member():
    """``AttentionBackendEnum.FP8_NONCAUSAL``, registered first if this process lacks it.

    Also what the member unpickles through: it reduces to a call of this function.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    member = AttentionBackendEnum.__members__.get(BACKEND_NAME)
    if member is None:
        register_backend(BACKEND_NAME, CLASS_PATH)
        member = AttentionBackendEnum[BACKEND_NAME]
    if "__reduce_ex__" not in vars(member):
        # pickle looks __reduce_ex__ up on the object, so the member's own attribute wins over
        # Enum's (which pickles by value).
        member.__reduce_ex__ = _reduce_member
    return member


def _reduce_member(protocol: int):
    return backend_member, ()


def __getattr__(name: str):
    if name in _IMPL_NAMES:
        from . import vllm_impl

        return getattr(vllm_impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
