"""Ahead-of-time build of one DSL family (wgmma or tcgen05): export_to_c -> one shared library.

NEVER RUN ON A GPU: the library this writes has been built and loaded on CPU machines only.

``python -m dsl.build --out DIR [--family F] [--arch ARCH] [--variant NAME] [--ci]`` compiles
the kernel of each variant for each architecture with fake pointers (no driver needed; a tcgen05
kernel serves the bf16 and the fp16 variant of its shape), keeps its PTX and cubin under
``DIR/<arch>/<kernel>/`` (for the SASS checks), exports a header and an object per kernel, and
links every object with the DSL's static runtime and cudart into ``DIR/libfp8nca_<family>.so``
(only libc and libdl needed at load time; the cubins ride inside as data and load on first
call). ``DIR/build.json`` records each variant's kernel and its compile time. Needs
``nvidia-cutlass-dsl[cu13]`` 4.8.x and a host C compiler; the CUDA toolkit only for
``libcudart_static.a``.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dsl.common import launch
from dsl.common.variant import Q_DTYPES
from dsl.tcgen05.traits import ARCHS, Variant
from dsl.tcgen05.traits import CACHE_DTYPES as TCGEN05_CACHE_DTYPES
from dsl.wgmma import traits as wgmma_traits

LIBRARY = "libfp8nca_tcgen05.so"
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))

# The tcgen05 variants built (the page size, 16..256, is a run-time argument): head_dim
# 64 and 128 with 32, 64 or 128 query rows per CTA (R = q_len x group: one CTA per KV head up to
# R = 128), head_dim 256 with 32 or 64; both query dtypes (one kernel for both: ``kernel_name``);
# e4m3 and e5m2 caches; for sm_100f (B200 and B300). CI compiles TCGEN05_CI_VARIANTS. See
# docs/tcgen05.md for what is left (head_dim 256 x 128 rows).
# head_dim 256 x 64 rows with an e5m2 cache spills 32-40 bytes at ptxas' 168-register cap: not
# built, so R > 32 there runs as several 32-row CTAs.
NOT_BUILT = {(256, 64, "float8_e5m2")}
VARIANTS = tuple(
    Variant(head_dim, rows, q, kv)
    for kv in TCGEN05_CACHE_DTYPES
    for head_dim, rows in (
        (128, 32), (128, 64), (128, 128), (256, 32), (256, 64), (64, 32), (64, 64), (64, 128)
    )
    if (head_dim, rows, kv) not in NOT_BUILT
    for q in Q_DTYPES
)  # fmt: skip


# The wgmma family (sm_90a, dsl/wgmma/, docs/wgmma.md; NEVER RUN ON A GPU): both query dtypes;
# head_dim 64, 128 and 256 with 64 or 128 query rows per CTA (one or two consumer warpgroups).
# The page size is a run-time argument
# (``block_shift``: one kernel for pages of 16..256); the cache dtype is a compile-time constant:
# the default table is e4m3, ``--cache-dtype float8_e5m2`` builds e5m2. Same C interface as
# tcgen05, in its own library (libfp8nca_wgmma.so, fp8nca_wgmma_* symbols).
def wgmma_variants(cache_dtypes: tuple[str, ...] = ("float8_e4m3fn",)) -> tuple:
    """Every wgmma shape and query dtype for the given cache dtypes."""
    return tuple(
        wgmma_traits.Variant(d, c, q, kv)
        for kv in cache_dtypes
        for d in wgmma_traits.HEAD_DIMS
        for c in (1, 2)
        for q in Q_DTYPES
    )


WGMMA_VARIANTS = wgmma_variants()
# CI's share (10 compiles, as before head_dim 256 x 128 rows joined): every shape in bf16 (it adds
# the query's row scaling to fp16), fp16 at 64 rows and at head_dim 128 (the drafter's).
WGMMA_CI_VARIANTS = tuple(
    v for v in WGMMA_VARIANTS if v.q_dtype == "bfloat16" or v.consumers == 1 or v.head_dim == 128
)  # fmt: skip
# CI's tcgen05 share (9 of the 15 kernels): every shape with an e4m3 cache, the default; e5m2,
# whose kernels differ from e4m3's only in the cache's conversion, at the drafter's shape
# (head_dim 128, 32 rows). The other six e5m2 kernels took 95 s of a cold CI build's 228 s.
TCGEN05_CI_VARIANTS = tuple(
    v for v in VARIANTS if v.cache_dtype == "float8_e4m3fn" or (v.head_dim, v.rows) == (128, 32)
)
FAMILIES = {
    "tcgen05": (ARCHS, lambda: VARIANTS, lambda: TCGEN05_CI_VARIANTS),
    "wgmma": (wgmma_traits.ARCHS, lambda: WGMMA_VARIANTS, lambda: WGMMA_CI_VARIANTS),
}


def kernel_name(variant) -> str:
    """The compiled kernel a variant runs: a tcgen05 kernel serves both query dtypes (the C
    entry passes ``q_is_bf16``), a wgmma kernel is one variant."""
    return variant.kernel_name if isinstance(variant, Variant) else variant.name


def symbol(variant, arch: str) -> str:
    """C symbol prefix of the exported kernel a variant runs."""
    return f"fp8nca_{kernel_name(variant)}_{arch}"


def compile_variant(variant: Variant, arch: str, out_dir: Path):
    """Trace and compile one variant for ``arch`` with fake pointers, keeping PTX and cubin in
    ``out_dir/<arch>/<variant.name>/``. Returns the DSL's compiled function object."""
    keep = out_dir / arch / kernel_name(variant)
    keep.mkdir(parents=True, exist_ok=True)
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    from dsl.tcgen05.kernel import _DTYPES, Tcgen05PagedAttention

    kernel_class = Tcgen05PagedAttention
    if isinstance(variant, wgmma_traits.Variant):
        from dsl.wgmma.kernel import DTYPES as _DTYPES
        from dsl.wgmma.kernel import WgmmaPagedAttention as kernel_class

    family = family_of(variant)
    # The tcgen05 kernel reads the query as 16-bit words and takes q_is_bf16 at run time.
    pointee = {
        "query": cutlass.Uint16 if family == "tcgen05" else _DTYPES[variant.q_dtype],
        "cache": _DTYPES[variant.cache_dtype],
        "int32": cutlass.Int32, "float32": cutlass.Float32, "flags": cutlass.Uint8,
    }  # fmt: skip
    fake = {"i64": cutlass.Int64(0), "i32": cutlass.Int32(0), "f32": cutlass.Float32(1.0)}

    def argument(field: launch.record.Field):
        if field.kind == "ptr":
            return make_ptr(pointee[field.element], 0, cute.AddressSpace.gmem,
                            assumed_align=field.align)  # fmt: skip
        return make_fake_stream() if field.kind == "stream" else fake[field.kind]

    return cute.compile(
        kernel_class(variant),
        *(argument(field) for field in launch.fields(family)),
        # Per-compile options (the CUTE_DSL_* environment is read once per process).
        options=f"--gpu-arch={arch} --keep-ptx --keep-cubin --dump-dir={keep}",
    )


def cubins(out_dir: Path, arch: str, variant) -> list[Path]:
    """The kept cubins of the kernel a variant runs."""
    return sorted((out_dir / arch / kernel_name(variant)).glob("*.cubin"))


# The library's stable C interface (one entry for every variant; index from the name table):
#   int fp8nca_<family>_variant_count(void);
#   const char *fp8nca_<family>_variant_name(int i);   "<variant name>@<arch>"
#   const char *fp8nca_<family>_arguments(void);   the C parameters of run after i
#   const char *fp8nca_<family>_launch_record(void);   the launch record's hash it was built from
#   int fp8nca_<family>_load(int i);   0, the first CUDA error of loading it, -1: unknown i
#   int fp8nca_<family>_run(int i, <launch.c_prototype(family)>);
# ``load`` loads the cubin of variant i on every visible device, once per process (thread-safe;
# a failed load is not retried and every later load / run returns its error); ``run`` loads it
# first if nothing has. Calling load at plan time keeps the load out of a first launch that may
# be inside a CUDA-graph capture, and reports a failure there. A tcgen05 kernel takes
# ``q_is_bf16``, which the entry of each variant fixes (launch.FIELDS marks it): the bf16 and
# fp16 variants of a shape run one compiled kernel. The package refuses a library whose
# launch-record hash is not its own when it loads it (before any plan or launch).


def family_of(variant) -> str:
    """The family of a variant."""
    return "tcgen05" if isinstance(variant, Variant) else "wgmma"


def forward(variant) -> str:
    """The arguments one variant's entry passes to its kernel's wrapper."""
    q_is_bf16 = int(variant.q_dtype == "bfloat16")
    return launch.forwarded(family_of(variant), {"q_is_bf16": str(q_is_bf16)})


def entry_source(entries: list[tuple[str, str, str]], family: str = "tcgen05") -> str:
    """C source of the library's entry points for ``[(symbol, "<variant>@<arch>", forwarded
    arguments), ...]``; variants that run the same kernel (symbol) share its module."""
    symbols = list(dict.fromkeys(sym for sym, _, _ in entries))
    module = {sym: m for m, sym in enumerate(symbols)}
    lines = [
        "// Generated by dsl/build.py. NEVER RUN ON A GPU.",
        "#include <pthread.h>",
        "#include <cuda_runtime.h>",
        # The DSL's headers report a CUDA error of a module load through this macro (a printf
        # unless defined first): keep the first one of the load running in this thread instead,
        # so that fp8nca_<family>_load can return it.
        "static _Thread_local cudaError_t load_error;",
        "#define CUTE_DSL_CUDA_ERROR_CHECK(err) { cudaError_t e_ = (err); "
        "if (e_ != cudaSuccess && load_error == cudaSuccess) load_error = e_; }",
    ]
    lines += [f'#include "{sym}.h"' for sym in symbols]
    quoted = ", ".join(f'"{name}"' for _, name, _ in entries)
    lines += [f"static const char *names[] = {{{quoted}}};"]
    lines += [
        f"static {sym}_Kernel_Module_t module_{m};\n"
        f"static pthread_once_t once_{m} = PTHREAD_ONCE_INIT;\n"
        f"static int status_{m};\n"
        f"static void load_{m}(void) {{\n"
        f"  load_error = cudaSuccess;\n"
        f"  {sym}_Kernel_Module_Load(&module_{m});\n"
        f"  status_{m} = (int)load_error;\n"
        "}"
        for m, sym in enumerate(symbols)
    ]
    lines += [
        f"int fp8nca_{family}_variant_count(void) {{ return sizeof(names) / sizeof(names[0]); }}",
        f'const char *fp8nca_{family}_arguments(void) {{ return "{launch.c_prototype(family)}"; }}',
        f"const char *fp8nca_{family}_launch_record(void) "
        f'{{ return "{launch.record.record_hash(family)}"; }}',
        f"const char *fp8nca_{family}_variant_name(int i) {{",
        f"  return i >= 0 && i < fp8nca_{family}_variant_count() ? names[i] : 0;",
        "}",
        f"int fp8nca_{family}_load(int i) {{",
        "  switch (i) {",
    ]
    for i, (sym, _, _) in enumerate(entries):
        m = module[sym]
        lines += [f"    case {i}:", f"      pthread_once(&once_{m}, load_{m});",
                  f"      return status_{m};"]  # fmt: skip
    lines += ["    default:", "      return -1;", "  }", "}"]
    lines += [
        f"int fp8nca_{family}_run(int i, {launch.c_prototype(family)}) {{",
        f"  int status = fp8nca_{family}_load(i);",
        "  if (status != 0) return status;",
        "  switch (i) {",
    ]
    for i, (sym, _, args) in enumerate(entries):
        call = f"cute_dsl_{sym}_wrapper(&module_{module[sym]}, {args})"
        lines += [f"    case {i}:", f"      return {call};"]
    lines += ["    default:", "      return -1;", "  }", "}", ""]
    return "\n".join(lines)


def link(
    objects: list[Path], entries: list[tuple[str, str, str]], out_dir: Path, family: str = "tcgen05"
) -> Path:
    """Compile the entry points and link them with the exported objects, the DSL runtime and
    static cudart into one shared library."""
    import nvidia_cutlass_dsl

    entry = out_dir / f"fp8nca_{family}_entry.c"
    entry.write_text(entry_source(entries, family))
    entry_object = out_dir / f"fp8nca_{family}_entry.o"
    cc = os.environ.get("CC", "cc")
    include = str(CUDA_HOME / "include")
    subprocess.run(
        [cc, "-O2", "-fPIC", "-c", str(entry), "-I", include, "-I", str(out_dir), "-o",
         str(entry_object)],
        check=True,
    )  # fmt: skip
    runtime = Path(list(nvidia_cutlass_dsl.__path__)[0]) / "cu13" / "lib"
    library = out_dir / library_name(family)
    cmd = [
        os.environ.get("CXX", "c++"),
        "-shared",
        "-o",
        str(library),
        str(entry_object),
        *map(str, objects),
        str(runtime / "libcuda_dialect_runtime_static.a"),
        str(CUDA_HOME / "lib64" / "libcudart_static.a"),
        "-ldl",
        "-lrt",
        "-lpthread",
    ]
    subprocess.run(cmd, check=True)
    return library


def load_dsl_runtime_globally() -> None:
    """With nvidia-cutlass-dsl 4.8.1, ``export_to_c`` of an sm_90a kernel resolves the host
    launcher's CUDA symbols in this process and fails ("Failed to dump object file with PIC
    relocation") unless the DSL's runtime library is loaded with RTLD_GLOBAL (sm_100a exports do
    not need it). Loading it needs no GPU or driver."""
    import ctypes

    import nvidia_cutlass_dsl

    runtime = Path(list(nvidia_cutlass_dsl.__path__)[0]) / "cu13" / "lib" / "libcute_dsl_runtime.so"
    ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)


def library_name(family: str) -> str:
    """The shared library one family's variants link into."""
    return f"libfp8nca_{family}.so"


def build(
    out_dir: Path, archs: list[str], variants: list[Variant], family: str = "tcgen05"
) -> dict:
    """Compile, export and link; returns the build record written to ``build.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"library": library_name(family), "never_run_on_gpu": True, "variants": []}
    objects, entries, seconds_of = [], [], {}
    for arch in archs:
        for variant in variants:
            name = symbol(variant, arch)
            if name not in seconds_of:  # a kernel another variant runs is compiled once
                start = time.perf_counter()
                compiled = compile_variant(variant, arch, out_dir)
                if arch.startswith("sm_90"):
                    load_dsl_runtime_globally()
                compiled.export_to_c(str(out_dir), name, name)
                seconds_of[name] = time.perf_counter() - start
                objects.append(out_dir / f"{name}.o")
                print(f"{arch} {kernel_name(variant)}: {seconds_of[name]:.1f} s", flush=True)
            seconds = seconds_of[name]
            entries.append((name, f"{variant.name}@{arch}", forward(variant)))
            record["variants"].append(
                {
                    "arch": arch,
                    "variant": variant.name,
                    "index": len(entries) - 1,
                    "symbol": name,
                    "header": f"{name}.h",
                    "cubins": [str(p.relative_to(out_dir)) for p in cubins(out_dir, arch, variant)],
                    "compile_seconds": round(seconds, 1),
                }
            )
    link(objects, entries, out_dir, family)
    (out_dir / "build.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="build directory")
    parser.add_argument("--family", choices=sorted(FAMILIES), default="tcgen05")
    parser.add_argument("--arch", action="append", help="default: all of the family's")
    parser.add_argument("--variant", action="append", help="variant name; default: all")
    parser.add_argument("--ci", action="store_true", help="only the CI variants")
    parser.add_argument(
        "--cache-dtype",
        action="append",
        choices=wgmma_traits.CACHE_DTYPES,
        help="wgmma: cache dtypes to build (default float8_e4m3fn)",
    )
    args = parser.parse_args(argv)
    archs, all_variants, ci_variants = FAMILIES[args.family]
    if args.arch and not set(args.arch) <= set(archs):
        parser.error(f"--arch {args.arch}: the {args.family} family builds {list(archs)}")
    pool = ci_variants() if args.ci else all_variants()
    if args.cache_dtype:
        if args.family != "wgmma" or args.ci:
            parser.error("--cache-dtype: only for the full wgmma table")
        pool = wgmma_variants(tuple(args.cache_dtype))
    variants = [v for v in pool if not args.variant or v.name in args.variant]
    if not variants:
        parser.error(f"no variant named {args.variant}; known: {[v.name for v in pool]}")
    build(args.out, args.arch or list(archs), variants, args.family)
    return 0


if __name__ == "__main__":
    sys.exit(main())
