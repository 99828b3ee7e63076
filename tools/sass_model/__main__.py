"""``python -m tools.sass_model --out DIR``: PREDICTED HBM-bandwidth fractions from SASS.

Models the attention kernels of the built extension (default: the package's ``_C``) and the
Triton drafter kernel compiled as launched for sm_90 and sm_100, for the drafter shapes (a
PREDICTED fraction of HBM bandwidth) and the non-causal prefill shapes q = kv = 4k / 8k / 16k
(a PREDICTED fraction of the dense 16-bit tensor peak; ``--prefill-len N`` picks lengths,
``--no-prefill`` none), and writes DIR/sass-model.json and DIR/sass-model.md. ``--build
LABEL=PATH`` models another build of ``_C`` under a label (e.g. ``before=/path/_C.so``; one
per run, merge runs with ``--include``: a process holds one module named ``_C``); labelled rows
carry ``[LABEL]`` in their ``kernel`` field. ``--dsl DIR`` models a wgmma / tcgen05 AOT build
(``python -m dsl.build``) role by role. ``--include JSON`` adds the rows of an earlier output.
Needs cuobjdump (pip ``nvidia-cuda-cuobjdump``), no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import report
from .dsl_families import dsl_rows
from .rows import (
    CACHE_DTYPES,
    HEAD_DIMS,
    PREFILL_LENS,
    QUERY_DTYPES,
    ROWS_PER_KV_HEAD,
    ShapeSet,
    cuda_rows,
    load_extension,
    triton_rows,
)
from .tiles import TileFactsError, cuda_tiles


def _key(label: str, what: str | Path) -> str:
    """How a modelled build is named in the assumptions' tile_facts: ``[label] path``."""
    return f"[{label}] {what}" if label else str(what)


def _window(text: str) -> tuple[int, int]:
    left, right = (int(side) for side in text.split(","))
    return left, right


def default_extension() -> Path | None:
    package = Path(__file__).resolve().parents[2] / "fp8_noncausal_attn"
    built = sorted(package.glob("_C*.so"))
    return built[0] if built else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sass_model", description=__doc__)
    parser.add_argument("--out", required=True, help="directory for sass-model.json / .md")
    parser.add_argument(
        "--build", action="append", default=[], metavar="LABEL=PATH",
        help="a built _C*.so to model under LABEL (one per run); default: the package's _C",
    )  # fmt: skip
    parser.add_argument("--triton-label", default="", help="label of the Triton rows")
    parser.add_argument("--no-triton", action="store_true", help="skip the Triton kernel")
    parser.add_argument(
        "--triton-window", type=_window, default=(-1, -1), metavar="LEFT,RIGHT",
        help="model the Triton kernel's sliding-window variant (label it with --triton-label)",
    )  # fmt: skip
    parser.add_argument(
        "--triton-sinks", action="store_true", help="model the Triton kernel's sink variant"
    )
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA extension")
    parser.add_argument(
        "--dsl", action="append", default=[], metavar="[LABEL=]DIR",
        help="a wgmma / tcgen05 build directory (python -m dsl.build) to model role by role",
    )  # fmt: skip
    parser.add_argument(
        "--include", action="append", default=[], metavar="JSON",
        help="add the rows of an earlier sass-model.json (e.g. Triton rows modelled before)",
    )  # fmt: skip
    parser.add_argument("--head-dim", type=int, action="append", choices=HEAD_DIMS)
    parser.add_argument("--q-dtype", action="append", choices=QUERY_DTYPES)
    parser.add_argument("--cache-dtype", action="append", choices=CACHE_DTYPES)
    parser.add_argument("--rows", type=int, action="append", choices=ROWS_PER_KV_HEAD)
    parser.add_argument(
        "--prefill-len", type=int, action="append", metavar="TOKENS",
        help=f"non-causal prefill length q = kv to model (default {PREFILL_LENS})",
    )  # fmt: skip
    parser.add_argument("--no-prefill", action="store_true", help="model no prefill shape")
    args = parser.parse_args(argv)
    shapes = ShapeSet(
        tuple(args.head_dim or HEAD_DIMS), tuple(args.q_dtype or QUERY_DTYPES),
        tuple(args.cache_dtype or CACHE_DTYPES), tuple(args.rows or ROWS_PER_KV_HEAD),
        () if args.no_prefill else tuple(args.prefill_len or PREFILL_LENS),
    )  # fmt: skip

    builds = [tuple(b.split("=", 1)) if "=" in b else ("", b) for b in args.build]
    if not builds and not args.no_cuda:
        built = default_extension()
        if built is None:
            print("no built fp8_noncausal_attn/_C*.so; pass --build PATH", file=sys.stderr)
            return 2
        builds = [("", str(built))]
    rows: list[dict] = []
    tile_facts: dict[str, str] = {}
    for label, path in builds:
        try:
            ext = load_extension(path)
            facts = cuda_tiles(ext, 128, "bfloat16", "float8_e4m3fn", 64)
            found = cuda_rows(path, label, shapes)
        except TileFactsError as error:
            print(f"cannot model {path}: {error}", file=sys.stderr)
            return 1
        tile_facts[_key(label, path)] = facts.source
        if not found:
            print(f"no attention kernel of {path} matched the tile facts", file=sys.stderr)
            return 1
        rows += found
    for entry in args.dsl:
        label, _, path = entry.rpartition("=")
        found = dsl_rows(path, label, shapes)
        tile_facts[_key(label, path)] = "dsl/<family>/traits.py and layouts.py (roles, tiles)"
        if not found:
            print(f"no DSL variant of {path} serves the shapes asked for", file=sys.stderr)
            return 1
        rows += found
    if not args.no_triton:
        rows += triton_rows(args.triton_label, shapes, args.triton_window, args.triton_sinks)
        tile_facts[_key(args.triton_label, "triton")] = (
            "triton_attention.launch_plan (captured launch)"
        )
    for earlier in args.include:
        document = json.loads(Path(earlier).read_text())
        rows += document["rows"]
        tile_facts.update(document["assumptions"].get("tile_facts", {}))
    json_path, md_path = report.write(args.out, rows, tile_facts)
    print(f"wrote {json_path} and {md_path} ({len(rows)} rows, PREDICTIONS)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
