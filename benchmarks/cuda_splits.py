"""Split-KV sweep of the CUDA backend on drafter shapes: ``python -m benchmarks.cuda_splits OUT``.

Times the CUDA kernels (CUDA-graph replays over L2-rotated inputs, benchmarks/timing.py) at
several forced split counts and at the backend's own choice, and writes
``OUT/cuda_splits.json`` with the achieved KV bandwidth next to the device copy bandwidth, so the
split heuristic of fp8_noncausal_attn/backends/cuda/mma_sync.py can be checked against measurements.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from fp8_noncausal_attn.backends.cuda import mma_sync
from fp8_noncausal_attn.validation import validate_attention

from .inputs import make_case
from .shapes import _drafter
from .timing import copy_bandwidth, rotation_count, time_calls

SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, None]  # None: the backend's own choice
SHAPES = [_drafter(), _drafter(batch=8), _drafter(batch=4, kv_len=32768), _drafter(q_len=16)]


def sweep(out_dir: Path) -> list[dict[str, object]]:
    device = torch.device("cuda")
    copy_gbs = copy_bandwidth(device)
    rows = []
    for shape in SHAPES:
        base = make_case(shape, device)
        copies = [base] + [
            base.clone_storage() for _ in range(rotation_count(shape.bytes, device) - 1)
        ]
        problems = [
            validate_attention(
                c.query,
                c.key_cache,
                c.value_cache,
                c.block_table,
                c.cu_seqlens_q,
                c.seq_lens,
                causal=shape.causal,
                k_scale=c.k_scale,
                v_scale=c.v_scale,
                softmax_scale=None,
                max_seqlen_q=shape.q_len,
                max_seqlen_k=shape.kv_len,
                out=None,
                validate=False,
            )
            for c in copies
        ]
        outs = [torch.empty_like(c.query) for c in copies]
        batch = problems[0].batch
        chosen = mma_sync.num_splits_for(batch, mma_sync.resident_ctas(batch))
        for splits in SPLITS:
            calls = [
                lambda p=p, o=o, n=splits: mma_sync.paged_attention(p, o, num_splits=n)
                for p, o in zip(problems, outs, strict=True)
            ]
            timing = time_calls(calls, device)
            gbs = shape.bytes / (timing.median_us * 1e-6) / 1e9
            row = shape.fields() | {
                "num_splits": splits if splits is not None else f"auto={chosen}",
                "median_us": round(timing.median_us, 2),
                "gb_per_s": round(gbs, 1),
                "fraction_of_copy": round(gbs / copy_gbs, 3) if copy_gbs else None,
                "method": timing.method,
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
        del copies, problems, outs
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(device), "copy_gb_per_s": copy_gbs, "rows": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cuda_splits.json").write_text(json.dumps(result, indent=1))
    return rows


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.cuda_splits OUT_DIR", file=sys.stderr)
        return 2
    runs, why = mma_sync.availability()
    if not runs:
        print(f"mma_sync backend unavailable: {why}", file=sys.stderr)
        return 1
    sweep(Path(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
