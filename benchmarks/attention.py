"""Command line: ``python -m benchmarks.attention [--quick|--full|--dry-run] --out DIR``.

``--quick`` (the default) runs the drafter shapes within its time budget, the drafter
acceptance shape included (batch 32, q_len 8, 32 q / 8 kv heads, head_dim 128, 8k context, FP8,
bidirectional), and the windowed drafter (window 4k over a 128k context); ``--full``
is the whole sweep; ``--dry-run`` runs tiny shapes on the CPU (Triton through its interpreter)
to exercise every path and writer, with no timing claims.
Peers that need files (vLLM's kernel) read them from ``.peers/``: run
``benchmarks/fetch_peers.sh`` first.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

# --quick's default budget: imports and the last shape (up to about 30 s with
# FlexAttention's compilation) come on top.
QUICK_BUDGET_S = 140.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.attention",
        description="Paged attention over FP8, per-token-head FP8/INT8 and BF16 KV caches: "
        "ours against the peers.",
    )
    preset = parser.add_mutually_exclusive_group()
    presets = (
        (
            "--quick",
            "quick",
            "the default: the drafter shapes, including the drafter acceptance shape "
            "(batch 32, q_len 8, 32/8 heads, d128, 8k context, FP8, bidirectional), within "
            "--time-budget; needs a CUDA GPU",
        ),
        (
            "--grid",
            "grid",
            "the drafter grid of the GPU check (batch 32/64 x q_len 8/16 x context 4k-128k; "
            "e4m3 with per-head scales, then vLLM's fp8/int8 per-token-head pages); needs a "
            "CUDA GPU",
        ),
        ("--full", "full", "the whole sweep of shapes; needs a CUDA GPU"),
        (
            "--dry-run",
            "dry-run",
            "tiny shapes on the CPU (Triton in its interpreter) to exercise every path and "
            "writer; its times are not GPU timings and claim nothing",
        ),
    )
    for flag, name, help_text in presets:
        preset.add_argument(flag, dest="preset", action="store_const", const=name, help=help_text)
    parser.set_defaults(preset="quick")
    parser.add_argument("--out", type=Path, required=True, help="folder for the result files")
    parser.add_argument(
        "--backends",
        help="comma-separated subset of: mma_sync, wgmma, tcgen05, triton, reference, "
        "vllm_triton_unified, fa3_fp8_query, torch_sdpa, flex_attention, flashinfer",
    )
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy study")
    parser.add_argument(
        "--time-budget",
        type=float,
        help="seconds after which the remaining shapes are skipped (default: "
        f"{QUICK_BUDGET_S:.0f} for --quick; none else)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.preset == "dry-run":
        # Must be set before the first Triton kernel is decorated, i.e. before the imports below.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # The interpreter evaluates masked-off lanes too (0/0 in vLLM's padding rows): noise.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    import torch

    from .suite import run_suite

    if args.preset == "dry-run":
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print(f"--{args.preset} needs a CUDA GPU; use --dry-run on a CPU", file=sys.stderr)
        return 2
    only = set(args.backends.split(",")) if args.backends else None
    command = "python -m benchmarks.attention " + " ".join(sys.argv[1:] if argv is None else argv)
    budget = args.time_budget
    if budget is None and args.preset == "quick":
        budget = QUICK_BUDGET_S
    run_suite(
        args.preset,
        args.out,
        device,
        only=only,
        accuracy=not args.no_accuracy,
        time_budget_s=budget,
        command=command,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
