"""FlashAttention 3 as vLLM runs it on Hopper: ``_vllm_fa3_C`` from the vLLM wheel of
``vllm_peer.VLLM_VERSION`` (0.34.0), carried xz-compressed in ``.peers/``
(``benchmarks/fetch_peers.sh``; 170 MB unpacked, 12 MB packed) and unpacked into a temporary
folder on first use.

The library uses the torch stable ABI and registers ``torch.ops._vllm_fa3_C.fwd``; the call in
:func:`fwd_call` passes its arguments in the order vLLM's ``flash_attn_varlen_func`` passes
them with ``fa_version=3`` (the same in 0.33 and 0.34; tests/test_gpu_check.py compares the two
on the installed vLLM). vLLM's FLASH_ATTN backend feeds FA3 an FP8 cache with an FP8 query: the
query is quantised to e4m3 with a per-tensor scale and the descales are
``[num_seqs, num_kv_heads]``.
"""

from __future__ import annotations

import lzma
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .vllm_peer import PEER_DIR, PagedCall

LIBRARY = "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"
ARCHIVE = PEER_DIR / f"{LIBRARY}.xz"

_loaded: list[Path] = []


def load() -> None:
    """Unpack and load the library once per process (raises FileNotFoundError naming the fetch
    script, or the loader's OSError)."""
    if _loaded:
        return
    if not ARCHIVE.is_file():
        raise FileNotFoundError(
            f"{ARCHIVE} not found: run benchmarks/fetch_peers.sh (and carry .peers/)"
        )
    folder = Path(tempfile.mkdtemp(prefix="fa3-"))
    library = folder / Path(LIBRARY).name
    with lzma.open(ARCHIVE) as packed, library.open("wb") as unpacked:
        shutil.copyfileobj(packed, unpacked)
    torch.ops.load_library(str(library))
    _loaded.append(library)


def fwd_call(
    call: PagedCall,
    *,
    q_descale: torch.Tensor | None,
    k_descale: torch.Tensor | None,
    v_descale: torch.Tensor | None,
) -> Callable[[], None]:
    """A closure running FA3's paged forward on ``call`` (its query FP8 with ``q_descale``, or
    16-bit); descales float32 [num_seqs, num_kv_heads]; ``call.sinks`` is FA3's ``s_aux``."""
    fwd = torch.ops._vllm_fa3_C.fwd
    unused_cu_seqlens_k = None

    def run() -> None:
        fwd(
            call.query, call.key_cache, call.value_cache,
            None, None,  # k_new, v_new
            None,  # q_v
            call.out, call.cu_seqlens_q, unused_cu_seqlens_k,
            None,  # cu_seqlens_k_new
            None, call.seq_lens,  # seqused_q, seqused_k
            call.max_seqlen_q, call.max_seqlen_k, call.block_table,
            None, None,  # kv_batch_idx, leftpad_k
            None, None, None,  # rotary_cos, rotary_sin, seqlens_rotary
            q_descale, k_descale, v_descale, call.softmax_scale, call.causal, *call.window,
            0.0,  # softcap
            True,  # rotary_interleaved
            None,  # scheduler_metadata
            0,  # num_splits: FA3's own choice
            None,  # pack_gqa
            0,  # sm_margin
            call.sinks,  # s_aux
            1, 0, None,  # cp_world_size, cp_rank, cp_tot_seqused_k
        )  # fmt: skip

    return run
