"""AOT build of the wgmma family's CI variants (skipped without ``nvidia-cutlass-dsl``): compile
for sm_90a, export, link ``libfp8nca_wgmma.so``, load it on this CPU machine, and check the kept
cubins' SASS. NEVER RUN ON A GPU: nothing here launches a kernel."""

import ctypes

import pytest
import torch
from helpers.dsl import (
    PtxFlow,
    barrier_init_problems,
    cached_ci_build,
    check_ci_build_record,
    check_library_names_every_variant,
    empty_split_lse_problems,
)

from dsl import build, sass_check
from dsl.wgmma import sass
from dsl.wgmma import traits as T

# Compiles kernels or packages and reads what they hold (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_ci_build(build, "wgmma", tmp_path_factory.mktemp("wgmma"))


def test_build_record_lists_every_ci_variant(built):
    assert build.FAMILIES["wgmma"][0] == ("sm_90a",)
    assert build.FAMILIES["wgmma"][2]() == build.WGMMA_CI_VARIANTS
    check_ci_build_record(build, "wgmma", *built)


def test_library_loads_without_a_gpu_and_names_every_variant(built):
    out, record = built
    check_library_names_every_variant(out / build.library_name("wgmma"), "wgmma", record)


def test_load_entry_returns_the_cuda_error_of_each_variant_or_minus_one(built):
    """fp8nca_wgmma_load(i): -1 for an unknown index; without a GPU driver every variant's load
    returns the CUDA error (not 0, and not a crash)."""
    out, record = built
    load = ctypes.CDLL(str(out / build.library_name("wgmma"))).fp8nca_wgmma_load
    load.restype, load.argtypes = ctypes.c_int, [ctypes.c_int]
    count = len(record["variants"])
    assert load(count) == load(-1) == -1
    if not torch.cuda.is_available():
        assert all(load(i) > 0 for i in range(count))


def test_sass_has_hgmma_the_load_path_and_no_local_memory(built):
    out, record = built
    by_name = {v.name: v for v in build.WGMMA_CI_VARIANTS}
    for entry in record["variants"]:
        variant = by_name[entry["variant"]]
        cubin = out / entry["cubins"][0]
        assert sass.problems(cubin, variant) == [], entry["symbol"]
        assert sass_check.resource_usage(cubin)["REG"] <= variant.registers_per_thread["consumer"]


# Beyond the default table (e4m3), built on request (--cache-dtype): the e5m2 conversion at the
# register-tight 128-row producer (setmaxnreg 104). Compiled only (about 15 s), not linked. The
# page size is a run-time argument: every variant above runs pages of 16..256.
EXTRA = (T.Variant(128, 2, "bfloat16", "float8_e5m2"),)


@pytest.mark.parametrize("variant", EXTRA, ids=lambda v: v.name)
def test_e5m2_compiles_sass_clean(variant, tmp_path):
    build.compile_variant(variant, "sm_90a", tmp_path)
    (cubin,) = build.cubins(tmp_path, "sm_90a", variant)
    assert sass.problems(cubin, variant) == []


def test_sass_checker_reports_a_missing_instruction_and_a_wrong_count(built, monkeypatch):
    """The checker itself can fail: demand an instruction the kernel lacks, and a count off by
    one."""
    out, record = built
    entry = record["variants"][0]
    variant = {v.name: v for v in build.WGMMA_CI_VARIANTS}[entry["variant"]]
    monkeypatch.setattr(sass, "REQUIRED", sass.REQUIRED + ("UTCHMMA",))
    wrong = dict(sass.expected_counts(variant), HGMMA=sass.expected_counts(variant)["HGMMA"] + 1)
    monkeypatch.setattr(sass, "expected_counts", lambda v: wrong)
    found = sass.problems(out / entry["cubins"][0], variant)
    assert "missing UTCHMMA" in found
    assert any(p.endswith(f"HGMMA, expected {wrong['HGMMA']}") for p in found)


def test_sass_checker_reports_role_registers_above_their_setmaxnreg_limits(built, monkeypatch):
    """The 128-row variants hand registers from the producer to the consumers; code that
    touched more than its role keeps would lose them at run time. Lower the limit the checker
    holds each role to below what it uses: the checker must say so."""
    out, record = built
    by_name = {v.name: v for v in build.WGMMA_CI_VARIANTS}
    entries = [e for e in record["variants"] if by_name[e["variant"]].set_max_registers]
    assert entries
    for entry in entries:
        cubin = out / entry["cubins"][0]
        variant = by_name[entry["variant"]]
        used = sass.role_registers(cubin)
        limits = variant.registers_per_thread
        assert 0 < used["producer"] <= limits["producer"]
        assert 0 < used["consumer"] <= limits["consumer"]
        for role in ("producer", "consumer"):
            lowered = limits | {role: used[role] - 1}
            with monkeypatch.context() as patch:
                patch.setattr(
                    T.Variant, "registers_per_thread", property(lambda _, lim=lowered: lim)
                )
                found = sass.problems(cubin, variant)
            assert f"{role} touches {used[role]} registers > {used[role] - 1}" in found


def test_ptx_fences_the_barrier_inits_before_the_first_sync(built):
    """Every kernel's kept PTX: each mbarrier init reaches the CTA's first sync only through
    fence.mbarrier_init (the stage barriers are created with ``defer_sync``); without the fence
    the check fails."""
    out, record = built
    for entry in record["variants"]:
        (ptx,) = (out / entry["cubins"][0]).parent.glob("*.ptx")
        text = ptx.read_text()
        assert barrier_init_problems(PtxFlow(text)) == [], entry["symbol"]
        planted = text.replace("fence.mbarrier_init.release.cluster;", "", 1)
        assert planted != text and barrier_init_problems(PtxFlow(planted)) != [], entry["symbol"]


def test_ptx_keeps_a_nan_split_lse_for_the_merge(built):
    """Every kernel's kept PTX: the split LSE's -inf (an empty split) is selected by
    total != 0 (setp.neu), so a NaN row sum keeps its NaN LSE for the merge; with total > 0
    (setp.gt, false for NaN) the check fails."""
    out, record = built
    for entry in record["variants"]:
        (ptx,) = (out / entry["cubins"][0]).parent.glob("*.ptx")
        text = ptx.read_text()
        assert empty_split_lse_problems(PtxFlow(text)) == [], entry["symbol"]
        planted = text.replace("setp.neu.f32", "setp.gt.f32", 1)
        assert planted != text and empty_split_lse_problems(PtxFlow(planted)) != [], entry["symbol"]
