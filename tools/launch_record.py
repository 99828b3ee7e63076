"""Writes the mma.sync form of the launch record: ``python -m tools.launch_record`` regenerates
``csrc/common/launch_record.h`` from ``fp8_noncausal_attn/launch_record.py`` (``--check``: exit 1
when the committed header differs). The header is committed rather than generated at build time
so that every compile of csrc/ (CMake from setup.py or an sdist, the tests' host hooks, a bare
nvcc) reads it without running Python first; tests/test_launch_record.py checks that it is what
this writes, byte for byte."""

from __future__ import annotations

import sys
from pathlib import Path

from fp8_noncausal_attn import launch_record as R

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "common" / "launch_record.h"


def header() -> str:
    """The text of ``csrc/common/launch_record.h``."""

    rows = [
        f"  X({f.cpp_type}, {f.name}, {'Given' if f.source == 'given' else 'Derived'})"
        f" /* {f.doc} */"
        for f in R.fields(R.MMA_SYNC)
    ]

    lines = [
        "// Generated from fp8_noncausal_attn/launch_record.py by `python -m tools.launch_record`:",
        "// edit the record, never this file (tests/test_launch_record.py checks the two agree).",
        "#pragma once",
        "",
        "// The record's hash for mma.sync, exported as _C.LAUNCH_RECORD_HASH: the package",
        "// refuses a _C built from another record when it loads it.",
        f'#define FP8NCA_LAUNCH_RECORD_HASH "{R.record_hash(R.MMA_SYNC)}"',
        "",
        "// X(type, name, source) for each field of AttnParams, in order (csrc/common/params.h);",
        "// source: Given (the caller passes it by name, _C.ATTN_FIELDS) or Derived",
        "// (python/bindings.cpp computes it).",
        "#define FP8NCA_ATTN_FIELDS(X) \\",
        *(f"{row} \\" for row in rows[:-1]),
        rows[-1],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = header()
    if argv == ["--check"]:
        if HEADER.read_text() != text:
            print(f"{HEADER} is not the launch record's: run python -m tools.launch_record")
            return 1
        return 0
    if argv:
        print("usage: python -m tools.launch_record [--check]")
        return 2
    HEADER.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
