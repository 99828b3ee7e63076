"""Ahead-of-time build of the tcgen05 family (CUTLASS Python DSL -> export_to_c -> shared library).

NEVER RUN ON A GPU. Usage: ``python -m dsl.build --out build/tcgen05 [--arch sm_100a ...]
[--variant NAME ...]``. Needs ``nvidia-cutlass-dsl[cu13]==4.8.x``; no driver or GPU.
"""

import argparse
import os
import sys
import time
from pathlib import Path

from dsl.tcgen05.traits import ARCHS, Variant


def compile_variant(variant: Variant, arch: str, out_dir: Path):
    """Trace and compile one variant for ``arch`` with fake pointers; keep PTX and cubin in
    ``out_dir/<arch>/<variant.name>/``. Returns the compiled object (for export_to_c)."""
    keep = out_dir / arch / variant.name
    keep.mkdir(parents=True, exist_ok=True)
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(keep)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from dsl.tcgen05.kernel import _DTYPES, Tcgen05PagedAttention

    gmem = cute.AddressSpace.gmem
    qt = _DTYPES[variant.q_dtype]
    kvt = _DTYPES[variant.kv_dtype]

    def ptr(dtype, align=16):
        return make_ptr(dtype, 0, gmem, assumed_align=align)

    kernel = Tcgen05PagedAttention(variant)
    i64 = cutlass.Int64(0)
    i32 = cutlass.Int32(0)
    return cute.compile(
        kernel,
        ptr(qt),
        ptr(kvt),
        ptr(kvt),
        ptr(qt),
        ptr(cutlass.Int32, 4),
        ptr(cutlass.Int32, 4),
        ptr(cutlass.Int32, 4),
        ptr(cutlass.Float32, 4),
        ptr(cutlass.Float32, 4),
        ptr(cutlass.Uint8, 1),
        ptr(cutlass.Float32, 16),
        ptr(cutlass.Float32, 4),
        *([i64] * 13),
        *([i32] * 8),
        cutlass.Float32(1.0),
        make_fake_stream(),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arch", action="append", choices=ARCHS)
    args = parser.parse_args(argv)
    v = Variant(128, 32, 16, "bfloat16")
    for arch in args.arch or ARCHS[:1]:
        t0 = time.perf_counter()
        compile_variant(v, arch, args.out)
        print(f"{arch} {v.name}: {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
