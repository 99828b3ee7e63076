"""AOT build of the tcgen05 family's CI variants (skipped without ``nvidia-cutlass-dsl``):
compile for sm_100a and sm_103a, export, link, load the library on this CPU machine, and check
the kept cubins' SASS. NEVER RUN ON A GPU: nothing here launches a kernel."""

import json

import pytest
from dsl_helpers import check_library_names_every_variant

from dsl import build, sass_check
from dsl.tcgen05 import traits as T

pytest.importorskip("cutlass")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tcgen05")
    record = build.build(out, list(T.ARCHS), list(build.CI_VARIANTS))
    return out, record


def test_build_record_lists_every_variant_and_arch(built):
    out, record = built
    assert record == json.loads((out / "build.json").read_text())
    assert record["never_run_on_gpu"] is True
    pairs = {(e["arch"], e["variant"]) for e in record["variants"]}
    assert pairs == {(a, v.name) for a in T.ARCHS for v in build.CI_VARIANTS}
    for entry in record["variants"]:
        assert entry["compile_seconds"] > 0
        assert len(entry["cubins"]) == 1 and entry["cubins"][0].endswith(f".{entry['arch']}.cubin")
        assert (out / entry["header"]).exists()


def test_library_loads_without_a_gpu_and_names_every_variant(built):
    out, record = built
    check_library_names_every_variant(out / build.LIBRARY, "tcgen05", record)


def test_sass_has_tcgen05_tmem_cp_async_and_no_local_memory(built):
    out, record = built
    for entry in record["variants"]:
        cubin = out / entry["cubins"][0]
        variant = next(v for v in build.VARIANTS if v.name == entry["variant"])
        assert sass_check.problems(cubin, variant.kv_dtype) == [], entry["symbol"]
        ops = sass_check.opcodes(cubin)
        # Per 128-wide head-dim slice and GEMM: 128 x 128 fp16 in K steps of 16 -> 8 UTCHMMA.
        assert sass_check.count(ops, "UTCHMMA") == 2 * 8 * variant.d_tiles
        usage = sass_check.resource_usage(cubin)
        assert usage["REG"] <= T.REGISTERS_PER_THREAD
