"""vLLM attention backend ``FP8_NONCAUSAL`` (SPEC §8), tested on vLLM 0.32.x to 0.34.x: the plugin.

vLLM loads ``vllm.general_plugins`` entry points in every process (API server, engine core,
workers); ours calls :func:`register`, which adds ``FP8_NONCAUSAL`` to ``AttentionBackendEnum``.
A registered backend is never picked automatically: users name it. A drafter gets the backend
of ``speculative_config.attention_backend`` (``"attention_backend": "FP8_NONCAUSAL"`` inside
``--speculative-config``); on vLLM 0.32 and 0.33 (``_create_draft_vllm_config``) never the
top-level ``--attention-backend``, which sets the target's layers, while 0.34's drafters inherit
it when their own is unset. Every layer on this backend takes both.

Loading the plugin never raises. On a tested vLLM (:data:`TESTED_VLLM`) this module imports
nothing of vLLM but its version and its backend registry. On a newer minor, :func:`register`
first checks the part of vLLM's attention interface the backend uses
(:func:`interface_mismatches`): unchanged, it registers with one warning naming the tested
versions; changed, it registers nothing and names what changed. On a vLLM older than the oldest
tested, it logs one line and registers nothing. The backend's classes live in
:mod:`fp8_noncausal_attn.vllm_impl`, imported when vLLM resolves :data:`CLASS_PATH` (and
re-exported here under the same names).

Spawn safety: the member is added at run time, and an enum member pickles by value
(``AttentionBackendEnum(value)``), so a process spawned with a pickled ``VllmConfig`` (vLLM's
engine core, its tensor-parallel workers) could not unpickle it before loading plugins. The
member pickles as a call of :func:`backend_member` instead, which registers it in the new
process first.

``import fp8_noncausal_attn`` never imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging

from packaging.version import InvalidVersion, Version

from . import config

TESTED_VLLM = ("0.32", "0.33", "0.34")
"""The vLLM minor releases the backend is tested on, oldest first (one code path: the part of
their attention interface used here is the same)."""
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

# The part of vLLM's attention interface the backend uses, checked on a vLLM newer than
# TESTED_VLLM (importing fp8_noncausal_attn.vllm_impl checks every vLLM name it imports).
# Methods of vllm.v1.attention.backend's classes that ours override: vLLM's parameters must
# begin ours, in order.
_OVERRIDDEN = {
    "AttentionBackend": (
        "get_name", "customize_spec", "get_impl_cls", "get_builder_cls",
        "get_supported_kernel_block_sizes", "get_supported_head_sizes", "supports_non_causal",
        "supports_per_head_quant_scales", "supports_sink", "supports_sliding_window",
        "supports_compute_capability",
    ),
    "AttentionImpl": ("__init__", "forward"),
    "AttentionMetadataBuilder": ("__init__", "build", "update_draft_decode_metadata"),
}  # fmt: skip
# Class attributes that ours set and vLLM reads: forward_includes_kv_cache_update False is how
# vLLM knows to call the impl's do_kv_cache_update.
_SET = {
    "AttentionBackend": ("forward_includes_kv_cache_update",),
    "AttentionImplBase": (
        "can_return_lse_for_decode", "supports_dcp",
        "supports_mtp_with_cp_non_trivial_interleave_size",
    ),
    "AttentionMetadataBuilder": ("_cudagraph_support", "supports_draft_decode_metadata_update"),
}  # fmt: skip
# Dataclass fields read: (module, class) -> fields.
_READ_FIELDS = {
    ("vllm.v1.attention.backend", "CommonAttentionMetadata"): (
        "query_start_loc", "seq_lens", "block_table_tensor", "slot_mapping", "causal",
        "num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len",
    ),
    ("vllm.v1.kv_cache_interface", "AttentionSpec"): (
        "block_size", "num_kv_heads", "head_size", "head_size_v", "dtype", "kv_quant_mode",
        "state_content_bytes",
    ),
}  # fmt: skip
# Functions called: (module, name) -> the parameters passed, in order.
_CALLED = {
    ("vllm.v1.attention.backends.registry", "register_backend"): ("backend", "class_path"),
    ("vllm.config", "get_layers_from_vllm_config"): ("vllm_config", "layer_type", "layer_names"),
    ("vllm.v1.attention.backends.utils", "get_dcp_local_seq_lens"): (
        "seq_lens", "dcp_size", "dcp_rank", "cp_kv_cache_interleave_size",
    ),
    ("vllm.distributed.parallel_state", "get_dcp_group"): (),
}  # fmt: skip

logger = logging.getLogger(__name__)


def vllm_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a vLLM version string (dev and local builds included), or None
    when it is not a version."""
    try:
        release = Version(version).release
    except InvalidVersion:
        return None
    return (release + (0,))[:2]


def _tested_minors() -> list[tuple[int, int]]:
    return [vllm_minor(minor) for minor in TESTED_VLLM]


def vllm_version_tested(version: str) -> bool:
    """True for a vLLM version of a minor in :data:`TESTED_VLLM`."""
    return vllm_minor(version) in _tested_minors()


def _parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def interface_mismatches() -> list[str]:
    """What of vLLM's attention interface the backend uses is missing or changed in the
    installed vLLM, one line per piece; empty when all of it is there as on the tested versions.

    Checked: every vLLM module and name :mod:`fp8_noncausal_attn.vllm_impl` imports; the methods
    of ``AttentionBackend``, ``AttentionImpl`` and ``AttentionMetadataBuilder`` that the
    backend's classes override (vLLM's parameters must begin ours, in order); the class
    attributes they set; the fields of ``CommonAttentionMetadata`` and ``AttentionSpec`` read;
    the parameters of the vLLM functions called.
    """
    try:
        from vllm.v1.attention import backend as attention

        from . import vllm_impl
    except Exception as error:  # a module or name gone; a base class that no longer subclasses
        return [f"importing the backend's classes fails: {type(error).__name__}: {error}"]
    ours = {
        "AttentionBackend": vllm_impl.Fp8NoncausalAttentionBackend,
        "AttentionImpl": vllm_impl.Fp8NoncausalAttentionImpl,
        "AttentionImplBase": vllm_impl.Fp8NoncausalAttentionImpl,
        "AttentionMetadataBuilder": vllm_impl.Fp8NoncausalMetadataBuilder,
    }
    problems = []
    for base_name, methods in _OVERRIDDEN.items():
        base = getattr(attention, base_name)
        for method in methods:
            theirs = getattr(base, method, None)
            if theirs is None:
                problems.append(f"{base_name}.{method} is gone")
                continue
            expected, accepted = _parameters(theirs), _parameters(getattr(ours[base_name], method))
            if accepted[: len(expected)] != expected:
                problems.append(
                    f"{base_name}.{method} takes ({', '.join(expected)}), the backend's "
                    f"({', '.join(accepted)})"
                )
    for base_name, names in _SET.items():
        base = getattr(attention, base_name)
        problems += [f"{base_name}.{name} is gone" for name in names if not hasattr(base, name)]
    for (module, name), fields in _READ_FIELDS.items():
        present = {field.name for field in dataclasses.fields(_find(module, name))}
        problems += [f"{name}.{field} is gone" for field in fields if field not in present]
    for (module, name), parameters in _CALLED.items():
        try:
            function = _find(module, name)
        except (ImportError, AttributeError):
            problems.append(f"{module}.{name} is gone")
            continue
        if _parameters(function)[: len(parameters)] != list(parameters):
            problems.append(
                f"{module}.{name} takes ({', '.join(_parameters(function))}), the backend "
                f"passes ({', '.join(parameters)})"
            )
    return problems


def _find(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def register() -> None:
    """``vllm.general_plugins`` entry point: add ``FP8_NONCAUSAL`` to ``AttentionBackendEnum``.

    vLLM may load plugins more than once per process; registering again is a no-op and logs
    nothing. On a vLLM of :data:`TESTED_VLLM`: registers. On a newer one: registers with one
    warning naming the tested versions when :func:`interface_mismatches` finds nothing, else
    logs one warning naming what changed and registers nothing. On an older one (or a version
    string that is none): one warning, nothing registered.
    """
    import vllm

    if _registers_on(vllm.__version__):
        backend_member()


@functools.cache
def _registers_on(version: str) -> bool:
    """Whether the backend registers on vLLM ``version``; logs its one warning (once per
    process) when that vLLM is not a tested one."""
    tested = ", ".join(f"{minor}.x" for minor in TESTED_VLLM)
    minor = vllm_minor(version)
    if minor in _tested_minors():
        return True
    if minor is None or minor < _tested_minors()[0]:
        logger.warning(
            "fp8_noncausal_attn: the %s attention backend needs vLLM %s or newer (tested on "
            "%s); vLLM %s is installed, so it is not registered",
            BACKEND_NAME, TESTED_VLLM[0], tested, version,
        )  # fmt: skip
        return False
    problems = interface_mismatches()
    if problems:
        logger.warning(
            "fp8_noncausal_attn: the %s attention backend is tested on vLLM %s; vLLM %s changed "
            "the attention interface it uses, so it is not registered: %s",
            BACKEND_NAME, tested, version, "; ".join(problems),
        )  # fmt: skip
        return False
    logger.warning(
        "fp8_noncausal_attn: the %s attention backend is tested on vLLM %s; vLLM %s is newer, "
        "with the attention interface it uses unchanged, so it is registered",
        BACKEND_NAME, tested, version,
    )  # fmt: skip
    return True


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
