"""vLLM 0.34's Triton unified attention, loaded from ``.peers/`` (``benchmarks/fetch_peers.sh``).

No vLLM code is committed: the script copies the kernel and its helper module out of the vLLM
wheel of :data:`VLLM_VERSION` (the release users install) into the ignored ``.peers/`` folder.
They import a handful of ``vllm`` modules that pull in the whole engine; while the two files are
imported, minimal stand-ins for those modules are put in ``sys.modules`` (the values vLLM has on
a CUDA machine with default settings) and taken out again afterwards, so an installed vLLM, if
any, is left untouched.

How vLLM's TRITON_ATTN backend calls the kernel is mirrored in :func:`unified_attention_call`,
with split-K (3D) scratch sized as its metadata builder does, and its ``forward``'s two ways of
handing over the KV scales in :class:`KvQuant`: an FP8 cache's as a per-tensor scalar
(``KVQuantMode.FP8_PER_TENSOR``; the kernel loads element 0 of ``k_descale``, so per-KV-head
scales cannot be expressed), and a per-token-head page's as its inline scale views with
``k_descale = v_descale = None`` (``FP8_PER_TOKEN_HEAD`` / ``INT8_PER_TOKEN_HEAD``).
"""

from __future__ import annotations

import enum
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

VLLM_VERSION = "0.34.0"
PEER_DIR = Path(__file__).resolve().parent.parent / ".peers" / f"vllm-{VLLM_VERSION}"
_OPS = "vllm/v1/attention/ops"
KERNEL_FILES = (f"{_OPS}/triton_attention_helpers.py", f"{_OPS}/triton_unified_attention.py")

# vllm/v1/attention/backends/triton_attn.py: 2D grid floor, split-K segments, 3D query cap.
MIN_LAUNCH_GRID_SIZE_2D = 128
NUM_PAR_SOFTMAX_SEGMENTS = 16
MAX_3D_QUERY_LEN = 8


class _KVQuantMode(enum.IntEnum):
    """The members of vllm.v1.kv_cache_interface.KVQuantMode that the kernel compares with."""

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    INT4_PER_TOKEN_HEAD = 4


class _Platform:
    """vllm.platforms.current_platform on a CUDA device, as far as the kernel asks."""

    @staticmethod
    def fp8_dtype() -> torch.dtype:
        return torch.float8_e4m3fn

    @staticmethod
    def is_rocm() -> bool:
        return False

    @staticmethod
    def is_device_capability_family(capability: int, device_id: int = 0) -> bool:
        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability(device_id)
        return (major * 10 + minor) // 10 == capability // 10


class _Logger(logging.LoggerAdapter):
    def debug_once(self, msg: str, *args: object) -> None:
        self.debug(msg, *args)


def _stub_modules() -> dict[str, types.ModuleType]:
    import triton
    import triton.language as tl

    def module(name: str, **attrs: object) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__path__ = []  # a package, so that dotted imports below it resolve
        return mod

    stubs = {
        "vllm": module("vllm"),
        "vllm.envs": module("vllm.envs", VLLM_BATCH_INVARIANT=False),
        "vllm.logger": module(
            "vllm.logger", init_logger=lambda name: _Logger(logging.getLogger(name), {})
        ),
        "vllm.platforms": module("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": module("vllm.triton_utils", triton=triton, tl=tl),
        "vllm.v1": module("vllm.v1"),
        "vllm.v1.attention": module("vllm.v1.attention"),
        "vllm.v1.attention.ops": module("vllm.v1.attention.ops"),
        "vllm.v1.kv_cache_interface": module(
            "vllm.v1.kv_cache_interface", KVQuantMode=_KVQuantMode
        ),
    }
    return stubs


def _import_file(name: str, path: Path) -> types.ModuleType:
    # Imported from the file on disk: Triton's JIT reads each kernel's source through inspect.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_loaded: types.ModuleType | None = None


def load() -> types.ModuleType:
    """Import vLLM's ``triton_unified_attention`` module (:data:`VLLM_VERSION`) from ``.peers/``.

    Raises FileNotFoundError naming the fetch script when the files are not there.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    missing = [f for f in KERNEL_FILES if not (PEER_DIR / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{PEER_DIR / missing[0]} not found: run benchmarks/fetch_peers.sh (and carry .peers/)"
        )
    stubs = _stub_modules()
    helper_name = "vllm.v1.attention.ops.triton_attention_helpers"
    saved = {name: sys.modules.get(name) for name in [*stubs, helper_name]}
    sys.modules.update(stubs)
    try:
        _import_file(helper_name, PEER_DIR / KERNEL_FILES[0])
        _loaded = _import_file("_vllm_peer_triton_unified_attention", PEER_DIR / KERNEL_FILES[1])
    finally:
        for name, previous in saved.items():
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous
    return _loaded


@dataclass(frozen=True)
class PagedCall:
    """One paged varlen batch as vLLM's attention backends hand it to their kernel.

    query/out [num_tokens, num_q_heads, head_dim] (``out`` bf16/fp16); caches [num_blocks,
    block_size, num_kv_heads, head_dim]; block_table [num_seqs, pages] int32; cu_seqlens_q
    [num_seqs + 1] int32; seq_lens [num_seqs] int32, the keys of each sequence; ``window``
    (left, right) as FlashAttention counts it, -1 unbounded; ``sinks`` float32
    ``[num_q_heads]`` or None."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    out: torch.Tensor
    block_table: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool
    softmax_scale: float
    window: tuple[int, int] = (-1, -1)
    sinks: torch.Tensor | None = None


@dataclass(frozen=True)
class KvQuant:
    """The KV-scale arguments TRITON_ATTN's ``forward`` passes to ``unified_attention``:
    ``mode`` (its ``kv_quant_mode``), per-tensor ``k_descale``/``v_descale`` [num_seqs,
    num_kv_heads] (broadcast scalars) or None, per-token-head ``k_scale_cache``/
    ``v_scale_cache`` float32 [num_blocks, block_size, num_kv_heads] or None."""

    mode: _KVQuantMode
    k_descale: torch.Tensor | None = None
    v_descale: torch.Tensor | None = None
    k_scale_cache: torch.Tensor | None = None
    v_scale_cache: torch.Tensor | None = None


def per_tensor(
    key_cache: torch.Tensor,
    num_seqs: int,
    scalar_k_scale: torch.Tensor,
    scalar_v_scale: torch.Tensor,
) -> KvQuant:
    """``forward``'s FP8 per-tensor (or unquantised) branch: the layer's scalar ``_k_scale`` /
    ``_v_scale`` (1-element float32) expanded to [num_seqs, num_kv_heads]."""
    descale_shape = (num_seqs, key_cache.shape[2])
    quantized = key_cache.dtype.itemsize == 1
    return KvQuant(
        mode=_KVQuantMode.FP8_PER_TENSOR if quantized else _KVQuantMode.NONE,
        k_descale=scalar_k_scale.reshape(()).expand(descale_shape),
        v_descale=scalar_v_scale.reshape(()).expand(descale_shape),
    )


def per_token_head(
    kv_cache: torch.Tensor,
    cache_dtype: torch.dtype,
    k_scale_cache: torch.Tensor,
    v_scale_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, KvQuant]:
    """``forward``'s per-token-head branch on one layer's page: (key_cache, value_cache, quant).

    ``kv_cache``: vLLM's page [num_blocks, num_kv_heads, block_size, 2 * (head_dim + 4)] (uint8
    for FP8, int8 for int8); ``cache_dtype``: float8_e4m3fn or int8. The data views are
    ``_pth_key_value_caches``' [num_blocks, block_size, num_kv_heads, head_dim + 4] (each scale's
    four bytes ride along at the end, past the kernel's head_dim), FP8 retyped to e4m3;
    ``k_scale_cache``/``v_scale_cache`` must be the float32 views of the inline scales that
    ``_ensure_scale_caches`` builds (``layouts.split_per_token_head_cache``'s are the same
    views). No per-tensor descales."""
    padded_head_dim = kv_cache.shape[-1] // 2
    key_cache, value_cache = kv_cache.transpose(1, 2).split(padded_head_dim, dim=-1)
    if cache_dtype == torch.int8:
        mode = _KVQuantMode.INT8_PER_TOKEN_HEAD
    else:
        mode = _KVQuantMode.FP8_PER_TOKEN_HEAD
        key_cache, value_cache = key_cache.view(cache_dtype), value_cache.view(cache_dtype)
    quant = KvQuant(mode=mode, k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
    return key_cache, value_cache, quant


def unified_attention_call(call: PagedCall, quant: KvQuant) -> Callable[[], None]:
    """A closure that runs the kernel on ``call`` as vLLM's TRITON_ATTN ``forward`` does.

    The caches are FP8 or the query's dtype (from :func:`per_token_head`, its views);
    ``quant``: the scales as :func:`per_tensor` or :func:`per_token_head` hands them over. The
    kernel reads ``call.window[0]`` only: keys ``p - window[0] .. p``, or ``.. p + window[0]``
    when not causal.
    """
    kernel = load()
    num_seqs = call.seq_lens.shape[0]
    num_q_heads = call.query.shape[1]
    num_kv_heads = call.key_cache.shape[2]
    head_dim_padded = 1 << (call.query.shape[2] - 1).bit_length()
    seq_threshold_3d = MIN_LAUNCH_GRID_SIZE_2D // num_kv_heads
    # The builder sizes split-K scratch for speculative decoding's query length, capped.
    rows_3d = min(seq_threshold_3d, num_seqs) * min(call.max_seqlen_q, MAX_3D_QUERY_LEN)
    segm_output = torch.empty(
        (rows_3d, num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS, head_dim_padded),
        dtype=torch.float32,
        device=call.query.device,
    )
    segm_max = torch.empty(
        (rows_3d, num_q_heads, NUM_PAR_SOFTMAX_SEGMENTS),
        dtype=torch.float32,
        device=call.query.device,
    )
    segm_expsum = torch.empty_like(segm_max)

    def run() -> None:
        kernel.unified_attention(
            q=call.query,
            k=call.key_cache,
            v=call.value_cache,
            out=call.out,
            cu_seqlens_q=call.cu_seqlens_q,
            max_seqlen_q=call.max_seqlen_q,
            seqused_k=call.seq_lens,
            max_seqlen_k=call.max_seqlen_k,
            softmax_scale=call.softmax_scale,
            causal=call.causal,
            window_size=call.window,
            block_table=call.block_table,
            softcap=0,
            q_descale=None,
            k_descale=quant.k_descale,
            v_descale=quant.v_descale,
            seq_threshold_3D=seq_threshold_3d,
            num_par_softmax_segments=NUM_PAR_SOFTMAX_SEGMENTS,
            softmax_segm_output=segm_output,
            softmax_segm_max=segm_max,
            softmax_segm_expsum=segm_expsum,
            kv_quant_mode=quant.mode,
            k_scale_cache=quant.k_scale_cache,
            v_scale_cache=quant.v_scale_cache,
            sinks=call.sinks,
        )

    return run
