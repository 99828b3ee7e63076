"""AOT build of every tcgen05 variant (skipped without ``nvidia-cutlass-dsl``): compile each
kernel for sm_100f (B200 and B300; one kernel serves a shape's bf16 and fp16 variants), export,
link, load the library on this CPU machine, and check the kept cubins' SASS. NEVER RUN ON A GPU:
nothing here launches a kernel."""

import json

import pytest
from dsl_helpers import check_library_names_every_variant

from dsl import build, sass_check
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T

pytest.importorskip("cutlass")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("tcgen05")
    record = build.build(out, list(T.ARCHS), list(build.VARIANTS))
    return out, record


def test_build_record_lists_every_variant_and_arch(built):
    out, record = built
    assert record == json.loads((out / "build.json").read_text())
    assert record["never_run_on_gpu"] is True
    pairs = {(e["arch"], e["variant"]) for e in record["variants"]}
    assert pairs == {(a, v.name) for a in T.ARCHS for v in build.VARIANTS}
    for entry in record["variants"]:
        assert entry["compile_seconds"] > 0
        assert len(entry["cubins"]) == 1 and entry["cubins"][0].endswith(f".{entry['arch']}.cubin")
        assert (out / entry["header"]).exists()


def test_library_loads_without_a_gpu_and_names_every_variant(built):
    out, record = built
    check_library_names_every_variant(out / build.LIBRARY, "tcgen05", record)


def test_sass_has_tcgen05_tmem_cp_async_and_no_local_memory(built):
    out, record = built
    assert len({e["symbol"] for e in record["variants"]}) == len(build.VARIANTS) // 2
    for entry in record["variants"]:
        cubin = out / entry["cubins"][0]
        variant = next(v for v in build.VARIANTS if v.name == entry["variant"])
        assert sass_check.problems(cubin, variant.kv_dtype) == [], entry["symbol"]
        ops = sass_check.opcodes(cubin)
        # Per 128-wide head-dim slice: BMM2 is 128 x 128 fp16 in K steps of 16 -> 8 UTCHMMA,
        # BMM1 the k-steps covering the item's head dims (8, or 4 at head_dim 64; ptxas may
        # emit that loop body more than once: it peels it at head_dim 64).
        bmm2, bmm1 = 8 * variant.d_tiles, L.bmm1_k_blocks(variant.head_dim) * variant.d_tiles
        mmas = sass_check.count(ops, "UTCHMMA")
        assert mmas > bmm2 and (mmas - bmm2) % bmm1 == 0, (entry["symbol"], mmas)
        usage = sass_check.resource_usage(cubin)
        assert usage["REG"] <= T.REGISTERS_PER_THREAD


def test_sass_model_counts_one_copy_sequence_per_converter_item(built):
    """The SASS model's converter path (benchmarks/sass_model/dsl_families.py) follows the
    page-16 case of the copies' jump table, and only it. Hand count from the cubins (per warp
    and 128-key x 128-byte item; 128 bytes = 32 words per thread): 8 cp.async (LDGSTS) with 8
    page shuffles (SHFL.IDX: 8 pages of 16 keys per tile), 8 LDSM; e4m3: 2 words on the
    integer pipe (traits.INTEGER_CONVERTED_WORDS, 2 PRMT each), the rest by F2FP (2 per
    word: 46 conversion-pipe instructions with 9 integer words);
    e5m2: 2 PRMT per word = 64, none on the conversion pipe. Before, the model counted 16
    LDGSTS for e5m2 (the if-converted page-256 case laid out after the BRX)."""
    from benchmarks.sass_model import dsl_families, pipes
    from benchmarks.sass_model.cubins import read_cubin
    from benchmarks.sass_model.roles import role_counts

    out, _ = built
    # One variant per cache dtype: an item's copies and conversions do not depend on rows or
    # the query dtype, and each model run takes ~5 s of CI time.
    chosen = {}
    for b in dsl_families.read_build(out):
        if b.variant.head_dim == 128:
            chosen.setdefault(b.variant.kv_dtype, b)
    assert set(chosen) == {"float8_e4m3fn", "float8_e5m2"}
    for b in chosen.values():
        roles, _, _ = dsl_families.family_roles(b.family, b.variant)
        (convert,) = (r for r in roles if r.name == "convert")
        (kernel,) = read_cubin(b.cubin)
        text = dsl_families.one_page_specialisation(
            kernel.sass, convert, dsl_families.jump_table_words(b.cubin), 8, 8
        )
        counts = role_counts(text, (convert,))["convert"]
        ops = {}
        for op, n in counts.opcodes.items():
            ops[op.split(".", 1)[0]] = ops.get(op.split(".", 1)[0], 0) + n
        assert (ops["LDGSTS"], ops["SHFL"], ops["LDSM"]) == (8, 8, 8), b.variant.name
        if b.variant.kv_dtype == "float8_e5m2":
            assert ops["PRMT"] == 64 and counts.per_pipe[pipes.CONVERSION] == 0, b.variant.name
        else:
            f2fp, prmt = 2 * (32 - T.INTEGER_CONVERTED_WORDS), 2 * T.INTEGER_CONVERTED_WORDS
            assert counts.opcodes["F2FP.F16.E4M3.UNPACK_B"] == f2fp, b.variant.name
            assert counts.per_pipe[pipes.CONVERSION] == f2fp and ops["PRMT"] == prmt, b.variant.name
