"""Helpers the two CUTLASS-DSL families' tests share (tcgen05 and wgmma): the CPU emulation's
launch loop and split merge, and the AOT library's variant-name check."""

import ctypes
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from dsl.common import indexing as X


def flat_bytes(cache: torch.Tensor) -> np.ndarray:
    """The whole storage of an FP8 cache as bytes, indexed by element offset + storage offset."""
    raw = cache.view(torch.uint8)
    return torch.as_strided(raw, (raw.untyped_storage().nbytes(),), (1,), 0).numpy()


def emulate_launch(problem, variant, num_splits: int, emulate_cta: Callable) -> torch.Tensor:
    """The whole launch (grid = row tiles x KV heads x sequences x splits) and the merge.

    ``emulate_cta(problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes, vbytes)``
    returns {(token, head): (O row [head_dim] normalised and times v_scale, log2 LSE)} for the
    rows the CTA owns; the result is float64 [num_tokens, num_q_heads, head_dim].
    """
    group = problem.num_q_heads // problem.num_kv_heads
    row_tiles = X.ceil_div(problem.max_seqlen_q * group, variant.rows)
    kbytes, vbytes = flat_bytes(problem.key_cache), flat_bytes(problem.value_cache)
    states = {}
    for seq in range(problem.num_seqs):
        for row_tile in range(row_tiles):
            for kv_head in range(problem.num_kv_heads):
                for split in range(num_splits):
                    part = emulate_cta(
                        problem, variant, seq, row_tile, kv_head, split, num_splits, kbytes, vbytes
                    )
                    for key, state in part.items():
                        states.setdefault(key, []).append(state)
    out = torch.zeros(problem.query.shape, dtype=torch.float64)
    for (token, head), parts in states.items():
        if num_splits == 1:
            out[token, head] = torch.from_numpy(parts[0][0])
            continue
        # The loader's merge: weights 2^(lse - max), O already normalised; a sink (log2 units)
        # joins the denominator once, here and not in any split.
        lse = np.array([p[1] for p in parts])
        sink = -np.inf
        if getattr(problem, "sinks", None) is not None:
            sink = float(problem.sinks[head]) * np.log2(np.e)
        top = max(lse.max(), sink)
        top = top if np.isfinite(top) else 0.0
        w = np.exp2(lse - top)
        acc = sum(wi * p[0] for wi, p in zip(w, parts, strict=True))
        total = w.sum() + np.exp2(sink - top)
        out[token, head] = torch.from_numpy(acc / total if total > 0 else acc * 0)
    return out


def check_library_names_every_variant(library_path: Path, family: str, record: dict) -> None:
    """The AOT library loads without a GPU, counts and names every built variant
    (``variant@arch``), and refuses an unknown index before anything touches CUDA."""
    library = ctypes.CDLL(str(library_path))
    variant_name = getattr(library, f"fp8nca_{family}_variant_name")
    variant_name.restype = ctypes.c_char_p
    assert getattr(library, f"fp8nca_{family}_variant_count")() == len(record["variants"])
    for entry in record["variants"]:
        name = variant_name(entry["index"]).decode()
        assert name == f"{entry['variant']}@{entry['arch']}"
    assert variant_name(len(record["variants"])) is None
    run = getattr(library, f"fp8nca_{family}_run")
    run.restype = ctypes.c_int
    assert run(len(record["variants"])) == -1
