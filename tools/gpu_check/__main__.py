"""``python -m tools.gpu_check OUT [--dry-run]``: the GPU check into folder OUT."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .driver import Check
from .plan import BUDGET_S


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.gpu_check", description=__doc__)
    parser.add_argument("out", type=Path, help="folder for summary.json and logs.tar.gz")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on a CPU: stub nvidia-smi, compute-sanitizer and GPU jobs (tests/gpu_check_stubs), "
        "time boxes scaled down",
    )
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for all steps")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return Check(args.out, args.dry_run, args.budget).run()


if __name__ == "__main__":
    sys.exit(main())
