"""Checks what scripts/prepare_gpu_check.sh made and prints the device tool's ``run`` call:
``python -m tools.gpu_check.prepare``. Exits 1 when something the check needs is missing or
the working tree plus the carried folders exceed the device tool's limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import fa3_peer, vllm_peer

from .build import CUTLASS_ARCHIVE
from .plan import CARRY, CARRY_LIMIT_BYTES, PREPARED, REPO, run_call

# Python of the GPU machine's image (python3 there holds torch 2.11).
DEVICE_PYTHON_TAG = "cpython-312-x86_64-linux-gnu"
EXPECTED = (
    f"{PREPARED}/_C.{DEVICE_PYTHON_TAG}.so",
    f"{PREPARED}/{CUTLASS_ARCHIVE}",
    ".dsl/wgmma/libfp8nca_wgmma.so",
    *(str((vllm_peer.PEER_DIR / name).relative_to(REPO)) for name in vllm_peer.KERNEL_FILES),
    str(fa3_peer.ARCHIVE.relative_to(REPO)),
)


def folder_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def tree_bytes(root: Path = REPO) -> int:
    """Bytes of what travels without being named: tracked files and untracked ones git does
    not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum(
        (root / name.decode()).stat().st_size
        for name in listed
        if name and (root / name.decode()).is_file()
    )


def carry_report(root: Path = REPO, carry: tuple[str, ...] = CARRY) -> dict[str, object]:
    """Each carried path's bytes, the working tree's, the total and whether it fits."""
    sizes = {path: folder_bytes(root / path) for path in carry if (root / path).exists()}
    total = tree_bytes(root) + sum(sizes.values())
    return {
        "carry_bytes": sizes,
        "tree_bytes": total - sum(sizes.values()),
        "total_bytes": total,
        "limit_bytes": CARRY_LIMIT_BYTES,
        "fits": total < CARRY_LIMIT_BYTES,
        "missing": [path for path in EXPECTED if not (root / path).is_file()],
    }


def main() -> int:
    report = carry_report()
    mib = 2**20
    for path, size in report["carry_bytes"].items():
        print(f"carry {path}: {size / mib:.1f} MiB")
    print(f"working tree: {report['tree_bytes'] / mib:.1f} MiB")
    print(f"total: {report['total_bytes'] / mib:.1f} MiB of {CARRY_LIMIT_BYTES / mib:.0f} MiB")
    for path in report["missing"]:
        print(f"MISSING: {path} (the check skips what needs it)")
    print("\nThe device tool's run call:")
    print(json.dumps(run_call(), indent=1))
    return 0 if report["fits"] and not report["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
