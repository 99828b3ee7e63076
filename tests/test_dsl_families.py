"""The CUTLASS-DSL families (wgmma, tcgen05) in the package: the AOT library found and loaded with
ctypes, the variant picked for a batch (or refused by reason), the host preconditions, their
selection (by name only: ``auto`` never picks them, a named one that cannot serve a call raises),
the launch's C arguments, the split-KV merge, and the package build of a library (setup.py's
command).

NEVER RUN ON HARDWARE: on CPU the GPU, ``_C`` and the library's launch are mocked
(tests/helpers/gpu_mock.py); the ``gpu`` tests at the end run each family on its own GPU.
"""

import ctypes
import importlib.util
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, replaced
from helpers.backends import auto_takes_cpu_tensors
from helpers.gpu_mock import (
    DEFAULT_TABLES,
    FakeLibrary,
    attention,
    layer_args,
    merge_reference,
    mock_gpu,
    plan_case,
    problem_of,
)

import fp8_noncausal_attn as fna
from dsl import build
from dsl.common import launch
from dsl.tcgen05 import layouts as tcgen05_layouts
from dsl.tcgen05 import traits as tcgen05_traits
from dsl.wgmma import traits as wgmma_traits
from fp8_noncausal_attn import registry
from fp8_noncausal_attn.backends.cuda import dsl as dsl_families
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.backends.reference import gather_sequence_kv
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.plan import Workspace
from fp8_noncausal_attn.synthetic import make_case, relative_error

ROOT = Path(__file__).resolve().parent.parent
# The one variant per family the build test compiles (about 10-15 s each here).
SMALL_BUILDS = {
    "wgmma": ("sm_90a", "wgmma_d64_m64_bf16_e4m3"),
    "tcgen05": ("sm_100f", "tcgen05_d128_n32_bf16_e4m3"),
}


# ---- the library and its C interface ------------------------------------------------------


def test_every_built_variant_name_parses_to_its_fields():
    for arch in wgmma_traits.ARCHS:
        for v in build.wgmma_variants(wgmma_traits.CACHE_DTYPES):
            parsed = dsl_families.parse_variant(3, f"{v.name}@{arch}")
            fields = (parsed.head_dim, parsed.rows, parsed.arch)
            assert fields == (v.head_dim, v.rows, arch)
            assert parsed.q_dtype == getattr(torch, v.q_dtype)
            assert parsed.cache_dtype == getattr(torch, v.cache_dtype)
    for arch in tcgen05_traits.ARCHS:
        for v in build.VARIANTS:
            parsed = dsl_families.parse_variant(0, f"{v.name}@{arch}")
            fields = (parsed.head_dim, parsed.rows, parsed.arch)
            assert fields == (v.head_dim, v.rows, arch)
            assert parsed.cache_dtype == getattr(torch, v.cache_dtype)
    with pytest.raises(ValueError, match="not a DSL variant name"):
        dsl_families.parse_variant(0, "wgmma_d128_m64_bf16_e4m3")  # no arch
    with pytest.raises(ValueError, match="not a DSL variant name"):
        # A compile-time page size: built before the C interface took block_shift.
        dsl_families.parse_variant(0, "wgmma_d128_m64_p16_bf16_e4m3@sm_90a")


def test_key_tiles_are_the_families_own():
    """Split-KV ranges are whole key tiles: the loader's tile is each kernel's."""
    for v in build.wgmma_variants():
        assert dsl_families.FAMILIES["wgmma"].key_tile(v.head_dim) == v.key_tile
    for v in build.VARIANTS:
        assert dsl_families.FAMILIES["tcgen05"].key_tile(v.head_dim) == tcgen05_layouts.KEY_TILE


def test_library_search_order_and_a_broken_library(tmp_path, monkeypatch):
    first, second = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv(dsl_families.LIBRARY_DIR_ENV, os.pathsep.join(map(str, (first, second))))
    dirs = dsl_families.library_dirs("wgmma")
    assert dirs[:2] == [first, second]
    assert dirs[2] == ROOT / "fp8_noncausal_attn" / "_wgmma"
    second.mkdir()
    (second / "libfp8nca_wgmma.so").write_bytes(b"not an ELF file")
    dsl_families.load_library.cache_clear()
    try:
        library, why = dsl_families.load_library("wgmma")
        assert library is None and "does not load as the wgmma library" in why
        monkeypatch.setenv(dsl_families.LIBRARY_DIR_ENV, str(first))
        dsl_families.load_library.cache_clear()
        if not (dirs[2] / "libfp8nca_wgmma.so").exists():
            library, why = dsl_families.load_library("wgmma")
            assert library is None and "FP8NCA_BUILD_DSL=1" in why
    finally:
        dsl_families.load_library.cache_clear()


def test_an_environment_library_never_shadows_the_packages_own_silently(tmp_path, monkeypatch):
    """$FP8NCA_DSL_LIBRARY_DIR searched before the package's own folder: when both hold the
    library, a warning names both paths; with the package's own absent, none."""
    own, local = tmp_path / "package", tmp_path / "local"
    for folder in (own, local):
        folder.mkdir()
        (folder / "libfp8nca_wgmma.so").write_bytes(b"not an ELF file")
    monkeypatch.setattr(dsl_families, "package_library_dir", lambda family: own)
    monkeypatch.setenv(dsl_families.LIBRARY_DIR_ENV, str(local))
    dsl_families.load_library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning) as warned:
            library, why = dsl_families.load_library("wgmma")
        (message,) = [str(w.message) for w in warned]
        assert str(local / "libfp8nca_wgmma.so") in message
        assert str(own / "libfp8nca_wgmma.so") in message
        assert library is None and str(local) in why
        (own / "libfp8nca_wgmma.so").unlink()
        dsl_families.load_library.cache_clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            dsl_families.load_library("wgmma")
    finally:
        dsl_families.load_library.cache_clear()


@pytest.fixture(scope="module")
def setup_py():
    """setup.py as a module (its build and install helpers; setup() itself does not run)."""
    spec = importlib.util.spec_from_file_location("fp8nca_setup", ROOT / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)
    return setup


@pytest.fixture(scope="module")
def dsl_builds(setup_py, tmp_path_factory):
    """family -> the build folder of one small variant of it, built by setup.py's own
    command."""
    pytest.importorskip("cutlass")
    import subprocess

    outs = {}
    for family, (arch, variant) in SMALL_BUILDS.items():
        out = tmp_path_factory.mktemp(family)
        command = setup_py.dsl_build_command(family, out) + ["--arch", arch, "--variant", variant]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outs[family] = out
    return outs


@pytest.fixture(scope="module")
def package_build(setup_py, dsl_builds, tmp_path_factory):
    """The :func:`dsl_builds` installed by setup.py's own install step into a package folder,
    as FP8NCA_BUILD_DSL=1 does with every variant."""
    package = tmp_path_factory.mktemp("package")
    for family, out in dsl_builds.items():
        arch, variant = SMALL_BUILDS[family]
        copied = setup_py.install_dsl_build(out, package, family)
        assert copied[:2] == [f"libfp8nca_{family}.so", "build.json"]
        built = next(v for v in (*build.VARIANTS, *build.WGMMA_VARIANTS) if v.name == variant)
        assert len(copied) == 3 and copied[2].startswith(f"{arch}/{build.kernel_name(built)}/")
    return package


@pytest.mark.parametrize("family", sorted(SMALL_BUILDS))
def test_the_exported_kernel_takes_the_records_parameters(dsl_builds, family):
    """The C wrapper ``export_to_c`` wrote for the variant takes the parameters of the
    signature the DSL traced (dsl/common/entry.py generates it from the record): each field's
    ``parameter`` name and C type, in order."""
    (header,) = dsl_builds[family].glob(f"fp8nca_{family}_*_sm_*.h")
    (prototype,) = re.findall(r"_wrapper\(\w+ \*module, ([^)]*)\)", header.read_text())
    expected = [f"{launch.C_TYPES[f.kind]} {f.parameter}" for f in launch.fields(family)]
    assert prototype.replace("*", "* ") == ", ".join(expected)


@pytest.mark.parametrize("family", sorted(SMALL_BUILDS))
def test_a_package_build_loads_and_lists_its_variants(package_build, family, monkeypatch):
    """The built library loads with ctypes on this CPU machine (libc only), names its variant,
    and refuses an unknown variant index without touching CUDA."""
    folder = package_build / f"_{family}"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["build.json", f"libfp8nca_{family}.so", SMALL_BUILDS[family][0]]
    )
    monkeypatch.setenv(dsl_families.LIBRARY_DIR_ENV, str(folder))
    dsl_families.load_library.cache_clear()
    try:
        library, why = dsl_families.load_library(family)
        assert library is not None, why
        arch, name = SMALL_BUILDS[family]
        assert [v.name for v in library.variants] == [f"{name}@{arch}"]
        assert library.path == folder / f"libfp8nca_{family}.so"
        # The library reports its C arguments (the launch record's): one value for each.
        assert library.argument_names == tuple(f.name for f in launch.c_arguments(family))
        zeros = dict.fromkeys(library.argument_names, 0)
        assert library.launch(len(library.variants), zeros) == -1
        assert library.load(len(library.variants)) == library.load(-1) == -1
        if not torch.cuda.is_available():
            # The load's CUDA error comes back (no driver here: 35, insufficient driver), the
            # same again (not retried), and a launch returns it without launching.
            status = library.load(0)
            assert status > 0 and library.load(0) == status
            assert library.launch(0, zeros) == status
        report = fna.available_backends()[family]
        assert f"{library.path}: 1 variant(s)" in report["reason"]
        assert report["available"] is False  # no GPU here
    finally:
        dsl_families.load_library.cache_clear()


# ---- which variant, and why not ------------------------------------------------------------


def choose(family, arch, head_dim=128, q=torch.bfloat16, kv=torch.float8_e4m3fn, page=16,
           rows=32):  # fmt: skip
    variants = FakeLibrary(DEFAULT_TABLES[family]).variants
    variant, why = dsl_families.choose_variant(variants, arch, head_dim, q, kv, page, rows)
    return (variant.name if variant else None), why


@pytest.mark.parametrize(
    "family,arch,head_dim,rows,expected",
    [
        ("wgmma", "sm_90a", 128, 8, "wgmma_d128_m64"),
        ("wgmma", "sm_90a", 128, 64, "wgmma_d128_m64"),
        ("wgmma", "sm_90a", 128, 65, "wgmma_d128_m128"),
        ("wgmma", "sm_90a", 64, 4096, "wgmma_d64_m128"),  # prefill: several 128-row CTAs
        ("wgmma", "sm_90a", 256, 64, "wgmma_d256_m64"),
        ("wgmma", "sm_90a", 256, 128, "wgmma_d256_m128"),
        ("wgmma", "sm_90a", 256, 4096, "wgmma_d256_m128"),
        ("tcgen05", "sm_100f", 128, 32, "tcgen05_d128_n32"),
        ("tcgen05", "sm_100f", 128, 33, "tcgen05_d128_n64"),
        ("tcgen05", "sm_100f", 128, 100, "tcgen05_d128_n128"),
        ("tcgen05", "sm_100f", 128, 500, "tcgen05_d128_n128"),
        ("tcgen05", "sm_100f", 256, 64, "tcgen05_d256_n64"),
        ("tcgen05", "sm_100f", 256, 32, "tcgen05_d256_n32"),
        ("tcgen05", "sm_100f", 64, 32, "tcgen05_d64_n32"),
        ("tcgen05", "sm_100f", 64, 64, "tcgen05_d64_n64"),
        ("tcgen05", "sm_100f", 64, 65, "tcgen05_d64_n128"),
        ("tcgen05", "sm_100f", 64, 4096, "tcgen05_d64_n128"),  # several 128-row CTAs
    ],
)
def test_variant_is_the_fewest_rows_holding_every_row_of_a_kv_head(
    family, arch, head_dim, rows, expected
):
    name, why = choose(family, arch, head_dim=head_dim, rows=rows)
    assert why == "" and name == f"{expected}_bf16_e4m3@{arch}"
    name, _ = choose(family, arch, head_dim=head_dim, q=torch.float16, rows=rows)
    assert name == f"{expected}_f16_e4m3@{arch}"


def test_tcgen05_e5m2_head_dim_256_runs_32_row_ctas_where_64_rows_are_not_built():
    """d256 x 64 rows spills with an e5m2 cache (build.NOT_BUILT): R = 64 takes two 32-row
    CTAs there, and the 64-row kernel with an e4m3 cache."""
    name, why = choose("tcgen05", "sm_100f", head_dim=256, kv=torch.float8_e5m2, rows=64)
    assert (name, why) == ("tcgen05_d256_n32_bf16_e5m2@sm_100f", "")
    name, why = choose("tcgen05", "sm_100f", head_dim=256, rows=64)
    assert (name, why) == ("tcgen05_d256_n64_bf16_e4m3@sm_100f", "")


@pytest.mark.parametrize("page", [16, 32, 64, 128, 256])
def test_every_variant_serves_every_page_size(page):
    name, why = choose("wgmma", "sm_90a", page=page)
    assert (name, why) == ("wgmma_d128_m64_bf16_e4m3@sm_90a", "")
    name, why = choose("tcgen05", "sm_100f", page=page)
    assert (name, why) == ("tcgen05_d128_n32_bf16_e4m3@sm_100f", "")


@pytest.mark.parametrize(
    "family,change,reason",
    [
        ("wgmma", {"head_dim": 96}, "no built variant for head_dim 96 (built: 128, 256, 64)"),
        ("tcgen05", {"head_dim": 96}, "no built variant for head_dim 96 (built: 128, 256, 64)"),
        ("wgmma", {"kv": torch.float8_e5m2}, "cache_dtype float8_e5m2 (built: float8_e4m3fn)"),
        ("wgmma", {"kv": torch.bfloat16}, "cache_dtype bfloat16 (built: float8_e4m3fn)"),
        ("tcgen05", {"page": 8}, "no built variant for page_size 8 (built: 16..256)"),
        ("wgmma", {"page": 8}, "no built variant for page_size 8 (built: 16..256)"),
        ("wgmma", {"page": 512}, "no built variant for page_size 512 (built: 16..256)"),
        ("wgmma", {"page": 48}, "no built variant for page_size 48 (built: 16..256)"),
        ("wgmma", {"arch": "sm_100f"}, "no built variant for arch sm_100f (built: sm_90a)"),
    ],
)
def test_no_built_variant_is_refused_with_the_field(family, change, reason):
    arch = change.pop("arch", "sm_90a" if family == "wgmma" else "sm_100f")
    name, why = choose(family, arch, **change)
    assert name is None and reason in why


@pytest.mark.parametrize("family,capability", [("wgmma", (9, 0)), ("tcgen05", (10, 0))])
def test_split_count_comes_from_the_one_planner_with_the_variants_tiles(
    monkeypatch, family, capability
):
    """The DSL plan asks _C's split planner (the mma.sync plan's rule, tests/test_cuda_build.py)
    with the chosen variant's rows per CTA and its family's key tile, and the batch's sizes."""
    calls = []
    library = FakeLibrary(DEFAULT_TABLES[family])
    mock_gpu(monkeypatch, capability, libraries={family: library}, split_calls=calls)
    case = make_case([3, 5], [300, 21], seed=4, head_dim=128)
    problem = problem_of(case, window=(64, 0))
    plan = dsl_families.plan(dsl_families.FAMILIES[family], problem.batch, None, None)
    (call,) = calls
    assert call["block_m"] == plan.variant.rows
    assert call["block_n"] == dsl_families.FAMILIES[family].key_tile(128)
    assert call["resident_ctas"] == 132
    assert (call["window_left"], call["window_right"]) == (64, 0)
    assert (call["num_seqs"], call["max_seqlen_q"], call["max_seqlen_k"]) == (2, 5, 300)


# ---- host preconditions ------------------------------------------------------------------


def test_layer_tensors_the_kernels_cannot_take_are_refused_by_reason():
    case = make_case([3, 5], [40, 21], seed=1)
    problem = problem_of(case)
    out = torch.empty_like(case.query)
    assert dsl_families.run_unsupported_reason(problem, out) is None

    def reason(o=out, **changes):
        fields = {f: getattr(problem, f) for f in problem.__dataclass_fields__} | changes
        return dsl_families.run_unsupported_reason(type(problem)(**fields), o)

    shifted = torch.empty(case.key_cache.numel() + 1, dtype=torch.uint8)[1:]
    misaligned = shifted.view(case.key_cache.dtype).view(case.key_cache.shape)
    assert "key_cache needs a 16-byte aligned base" in reason(key_cache=misaligned)
    wide = torch.empty(*case.value_cache.shape[:3], 72, dtype=case.value_cache.dtype)[..., :64]
    assert "value_cache needs a 16-byte aligned base and strides multiples of 16" in reason(
        value_cache=wide
    )
    huge = torch.empty_strided(case.key_cache.shape, (2**31, 128, 64, 1), device="meta",
                               dtype=case.key_cache.dtype)  # fmt: skip
    assert "page stride of 2^31 elements or more" in reason(key_cache=huge)
    query = torch.empty(case.query.numel() + 1, dtype=case.query.dtype)[1:].view(case.query.shape)
    assert "query needs a 16-byte aligned base" in reason(query=query)
    assert "out needs a 16-byte aligned base" in reason(
        o=torch.empty(out.numel() + 1, dtype=out.dtype)[1:].view(out.shape)
    )
    assert reason(sinks=torch.zeros(8)) is None  # the plan decides (a family without them)


def test_batches_the_families_cannot_take_are_refused_by_reason(monkeypatch):
    """A batch's device, index tensors, sizes and scale kind (sinks are a layer's: no plan
    refuses them)."""
    monkeypatch.setattr(extension, "device_reason", lambda device: None)
    monkeypatch.setattr(dsl_families, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(dsl_families, "load_library",
                        lambda family: (FakeLibrary(DEFAULT_TABLES[family]), ""))  # fmt: skip
    wgmma, tcgen05 = dsl_families.FAMILIES["wgmma"], dsl_families.FAMILIES["tcgen05"]
    case = make_case([3, 5], [40, 21], seed=2)

    def reason(family, of=case, **overrides):
        return dsl_families.plan_refusal(family, problem_of(of, **overrides).batch)

    assert reason(wgmma) is None
    assert reason(wgmma, window=(8, 0)) is None
    per_token = torch.rand(case.key_cache.shape[:3]) + 0.5
    assert reason(wgmma, k_scale=per_token, v_scale=per_token) == dsl_families.PER_HEAD_ONLY
    # Every index tensor is read through its strides (the launch passes them).
    assert reason(wgmma, make_case([3, 5], [40, 21], index_step=2, seed=2)) is None
    assert reason(tcgen05) == "needs an sm_100/sm_103 (B200, B300) GPU, this one is sm_90"
    monkeypatch.setattr(dsl_families, "device_capability", lambda device: (10, 0))
    assert reason(tcgen05) is None
    assert reason(tcgen05, window=(8, -1)) is None
    monkeypatch.setattr(dsl_families, "device_capability", lambda device: None)
    assert "need CUDA tensors" in reason(wgmma)


# ---- selection: by name only, refused by reason ------------------------------------------


def test_auto_never_picks_a_dsl_family(monkeypatch):
    """On a GPU where wgmma's library is built and loads, auto still picks mma_sync (the
    families have never run on hardware); nothing of wgmma is loaded or launched."""
    wgmma = FakeLibrary(DEFAULT_TABLES["wgmma"])
    mock_gpu(monkeypatch, libraries={"wgmma": wgmma})
    case = make_case([3, 5], [40, 21], seed=3)
    auto_takes_cpu_tensors(monkeypatch, "mma_sync")
    assert fna.available_backends()["wgmma"]["available"]
    wgmma.loads.clear()  # available_backends() planned its probe batches
    attn = attention(case)
    plan = plan_case(attn, case, backend="auto")
    assert plan.backend == "mma_sync"
    # only the first is planned (a layer mma_sync cannot take plans the next: not a family)
    assert [planned.name for planned in plan.chain] == ["mma_sync"]
    attn.run(*layer_args(case), plan=plan)
    assert not wgmma.calls and not wgmma.loads


@pytest.mark.parametrize("how", ["constructor", "plan"])
def test_naming_a_family_plans_it(monkeypatch, how):
    wgmma = FakeLibrary(DEFAULT_TABLES["wgmma"])
    mock_gpu(monkeypatch, libraries={"wgmma": wgmma})
    case = make_case([3, 5], [40, 21], seed=4)  # R = 5 x 4 = 20 rows per KV head
    if how == "constructor":
        attn = attention(case, backend="wgmma")
        plan = attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=case.causal)
    else:
        plan = plan_case(attention(case), case, backend="wgmma")
    assert plan.backend == "wgmma" and len(plan.chain) == 1
    dsl = plan.chain[0].plan
    assert dsl.variant.name == "wgmma_d64_m64_bf16_e4m3@sm_90a"
    assert (dsl.row_tiles, dsl.num_splits) == (1, 1)
    assert wgmma.loads == [dsl.variant.index]  # loaded at plan time, before any launch
    assert wgmma.calls == []


def test_a_variant_that_does_not_load_is_refused_at_plan_time_with_the_cuda_error(monkeypatch):
    """A cubin the driver refuses (here: CUDA error 209, no kernel image for the device) is
    reported when the plan is made; nothing is launched."""
    wgmma = FakeLibrary(DEFAULT_TABLES["wgmma"], load_status=209)
    mock_gpu(monkeypatch, libraries={"wgmma": wgmma})
    case = make_case([3, 5], [40, 21], seed=4)
    reason = (
        "backend 'wgmma' does not support this call: wgmma_d64_m64_bf16_e4m3@sm_90a did not "
        "load (CUDA error 209)"
    )
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        plan_case(attention(case), case, backend="wgmma")
    assert len(wgmma.loads) == 1 and wgmma.calls == []


@pytest.mark.parametrize(
    "capability,family,libraries,reason",
    [
        ((10, 0), "wgmma", ("wgmma",), "backend 'wgmma' is not available here: "
                                       "/fake/libfp8nca.so: 12 variant(s); needs an sm_90 "
                                       "(H100, H200) GPU, this one is sm_100"),
        ((10, 3), "tcgen05", (), "backend 'tcgen05' is not available here: not built"),
        ((10, 0), "tcgen05", ("tcgen05",), "backend 'tcgen05' does not support this call: no "
                                           "built variant for page_size 8 (built: 16..256)"),
    ],
)  # fmt: skip
def test_a_named_family_that_cannot_serve_the_batch_raises_the_reason(
    monkeypatch, capability, family, libraries, reason
):
    """A named backend never leaves for another: the reason is the error, at plan time."""
    tables = {name: FakeLibrary(DEFAULT_TABLES[name]) for name in libraries}
    mock_gpu(monkeypatch, capability=capability, libraries=tables)
    # a page size the family builds, unless the reason is the page size (head_dim 64: both)
    block_size = 8 if "page_size" in reason else 16
    case = make_case([3, 5], [40, 21], head_dim=64, block_size=block_size, seed=5)
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        plan_case(attention(case), case, backend=family)
    with pytest.raises(RuntimeError, match=re.escape(reason)):
        fna.paged_attention(*case.args(), **case.kwargs(), backend=family)


def test_unknown_backend_names_fail_by_name(monkeypatch):
    case = make_case([3, 5], [40, 21], seed=6)
    expected = r"backend must be 'auto' or one of \('mma_sync', 'triton', 'reference', 'wgmma'"
    with pytest.raises(ValueError, match=expected):
        plan_case(attention(case), case, backend="hopper")
    with pytest.raises(ValueError, match=expected):
        attention(case, backend="cuda")
    monkeypatch.setenv(registry.BACKEND_ENV, "wgmma2")
    with pytest.raises(ValueError, match="FP8NCA_BACKEND must be 'auto' or one of .* got 'wgmma2'"):
        registry.backend_from_env()


def test_available_backends_lists_every_name_with_its_status():
    report = fna.available_backends()
    assert set(report) == {"reference", "triton", "mma_sync", "wgmma", "tcgen05", "auto"}
    for name in ("wgmma", "tcgen05"):
        assert "compiled and SASS-checked, NEVER RUN ON HARDWARE" in report[name]["status"]
        assert "auto never picks it" in report[name]["status"]
        assert report[name]["reason"] and report[name]["auto"] is False
    assert report["auto"]["order"] == ["mma_sync", "triton", "reference"]


# ---- the launch ------------------------------------------------------------------------------


def split_partials(problem, num_splits, key_tile):
    """Each split's (O normalised and times v_scale, log2 LSE) in float64, as the kernels write
    them: split s owns contiguous whole key tiles (dsl/common/indexing.split_tiles)."""
    shape = (num_splits, problem.num_tokens, problem.num_q_heads)
    ws_o = torch.full(shape + (problem.head_dim,), math.nan, dtype=torch.float64)
    ws_lse = torch.full(shape, math.nan, dtype=torch.float64)  # padding rows: never written
    cu, group = problem.cu_seqlens_q.tolist(), problem.group_size
    for seq, kv_len in enumerate(problem.seq_lens.tolist()):
        q_len = cu[seq + 1] - cu[seq]
        if not q_len:
            continue
        keys, values = (t.double() for t in gather_sequence_kv(problem, seq, kv_len))
        causal = problem.causal if problem.causal_per_seq is None else problem.causal_per_seq[seq]
        start, end = visible_range(torch.arange(q_len), q_len, kv_len, causal, problem.window)
        tiles = -(-kv_len // key_tile)
        per_split = -(-tiles // num_splits)
        for t in range(q_len):
            q = problem.query[cu[seq] + t].double()
            for h in range(problem.num_q_heads):
                scores = keys[:, h // group] @ q[h] * problem.softmax_scale
                for s in range(num_splits):
                    lo = max(s * per_split * key_tile, int(start[t]))
                    hi = min((s + 1) * per_split * key_tile, int(end[t]))
                    if lo >= hi:
                        ws_o[s, cu[seq] + t, h], ws_lse[s, cu[seq] + t, h] = 0.0, -math.inf
                        continue
                    part = scores[lo:hi]
                    top = part.max()
                    p = torch.exp(part - top)
                    ws_o[s, cu[seq] + t, h] = p @ values[lo:hi, h // group] / p.sum()
                    ws_lse[s, cu[seq] + t, h] = (top + torch.log(p.sum())) / math.log(2)
    return ws_o, ws_lse


def emulated_launch(problem, out, buffers, case=None, extra=None):
    """A stand-in for the library's launch on CPU tensors: checks the pointers it gets and
    writes what the kernel would: ``out`` unsplit (the reference of ``case`` with ``extra``
    keyword arguments: window, sinks), else the partials into ``buffers`` (the tensors the
    launch must point at), in this layer's [splits, tokens, heads] layout, without the sinks."""
    case = SPLIT_CASE if case is None else case
    extra = extra or {}

    def launch(index, arguments):
        assert arguments["q"] == problem.query.data_ptr()
        assert arguments["out"] == out.data_ptr()
        assert arguments["k_stride_b"] == problem.key_cache.stride(0)
        assert arguments["k_scale"] == problem.k_scale.data_ptr()
        assert 1 << arguments["block_shift"] == problem.block_size
        splits = arguments["num_splits"]
        if splits == 1:
            assert arguments["ws_o"] == 0
            rows = int(problem.cu_seqlens_q[-1])
            out[:rows] = fna.paged_attention(
                *case.args(), **case.kwargs(), **extra, backend="reference"
            )[:rows]
            return 0
        ws_o, ws_lse = split_partials(problem, splits, 128)
        written = ~torch.isnan(ws_lse)
        for name, values, mask in (
            ("ws_o", ws_o, written.unsqueeze(-1).expand_as(ws_o)),
            ("ws_lse", ws_lse, written),
        ):
            target = buffers[name]
            assert arguments[name] == target.data_ptr() and target.shape == values.shape
            target[mask] = values[mask].float()
            if name == "ws_o":
                target[~mask] = math.nan  # what an unwritten partial may hold
        return 0

    return launch


SPLIT_CASE = make_case([3, 1, 0, 4], [300, 260, 50, 4], causal=[True, False, True, False],
                       causal_dtype=torch.int32, padded_rows=3, seed=8)  # fmt: skip


@pytest.mark.parametrize(
    "family,capability,variant",
    [
        ("wgmma", (9, 0), "wgmma_d64_m64_bf16_e4m3@sm_90a"),
        ("tcgen05", (10, 0), "tcgen05_d64_n32_bf16_e4m3@sm_100f"),
    ],
)
@pytest.mark.parametrize("num_splits,kept", [(1, False), (3, False), (3, True)])
def test_run_launches_the_variant_zeroes_padding_and_merges_splits(
    monkeypatch, num_splits, kept, family, capability, variant
):
    """A wgmma or tcgen05 plan's run (head_dim 64): one launch with the batch's
    pointers, strides and sizes; padding rows zero (out starts as NaN); with 3 splits (one empty
    for the 4-key sequence) the partials merge to the reference, whether allocated per launch or
    views of a kept workspace planned for more rows than the layer has."""
    problem = problem_of(SPLIT_CASE)
    out = torch.full_like(SPLIT_CASE.query, math.nan)
    buffers: dict[str, torch.Tensor] = {}
    library = FakeLibrary(DEFAULT_TABLES[family], emulated_launch(problem, out, buffers))
    mock_gpu(monkeypatch, capability, libraries={family: library})
    planned, workspace = problem, None
    if kept:
        workspace = Workspace(4096, 8, 64, torch.device("cpu"))
        planned = replaced(problem, num_tokens=16)
        rows = (num_splits, problem.num_tokens, 8)
        buffers["ws_lse"] = workspace.ws_lse[: math.prod(rows)].view(rows)
        buffers["ws_o"] = workspace.ws_o[: math.prod(rows)].view(*rows, 64)
    else:
        real_empty = torch.empty

        def empty(*shape, **kwargs):  # the one-shot path allocates the partials per launch
            tensor = real_empty(*shape, **kwargs)
            buffers.setdefault("ws_o" if tensor.dim() == 4 else "ws_lse", tensor)
            return tensor

        monkeypatch.setattr(torch, "empty", empty)
    kernels = dsl_families.FAMILIES[family]
    plan = kernels.plan(planned.batch, workspace, num_splits)
    assert plan.family == family and plan.num_splits == num_splits
    kernels.run(problem, plan, out)
    ((index, arguments),) = library.calls
    assert library.variants[index].name == variant
    assert (arguments["row_tiles"], arguments["num_splits"]) == (1, num_splits)  # R = 4 x 4
    assert (arguments["causal_bytes"], arguments["causal_stride"]) == (4, 1)
    assert arguments["causal_per_seq"] == SPLIT_CASE.causal.data_ptr()
    assert arguments["num_tokens"] == SPLIT_CASE.query.shape[0]
    expected = fna.paged_attention(*SPLIT_CASE.args(), **SPLIT_CASE.kwargs(), backend="reference")
    assert torch.all(out[8:] == 0)  # 3 padding rows
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("page", [16, 32, 128, 256])
@pytest.mark.parametrize("family,capability", [("wgmma", (9, 0)), ("tcgen05", (10, 0))])
def test_run_passes_the_caches_block_shift(monkeypatch, page, family, capability):
    """One kernel per shape runs every page size: the launch carries log2(block_size)."""
    case = make_case([3, 5], [40, 300], block_size=page, head_dim=128, seed=9)
    problem = problem_of(case)
    out = torch.full_like(case.query, math.nan)
    library = FakeLibrary(DEFAULT_TABLES[family], emulated_launch(problem, out, {}, case))
    mock_gpu(monkeypatch, capability=capability, libraries={family: library})
    kernels = dsl_families.FAMILIES[family]
    kernels.run(problem, kernels.plan(problem.batch, None, 1), out)
    ((_, arguments),) = library.calls
    assert arguments["block_shift"] == {16: 4, 32: 5, 128: 7, 256: 8}[page]


# head_dim 128: a shape both families build
WINDOW_CASE = make_case([3, 1, 0, 4], [300, 260, 50, 4], causal=[True, False, True, False],
                        causal_dtype=torch.bool, padded_rows=2, head_dim=128, seed=12)  # fmt: skip


@pytest.mark.parametrize("family,capability", [("wgmma", (9, 0)), ("tcgen05", (10, 0))])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("window,with_sinks", [((70, 5), True), ((-1, 20), False), ((9, -1), True)])
def test_run_passes_the_window_and_sinks_and_merges_the_sink_once(
    monkeypatch, family, capability, num_splits, window, with_sinks
):
    """A wgmma or tcgen05 plan takes a window and sinks: the launch gets the window's sides and
    a sinks pointer (-inf per head when there are none); with splits the merge adds each head's
    sink exactly once and matches the reference."""
    sinks = torch.tensor([6.0, -20.0, 0.5, 2.0, -1.0, 9.0, 0.0, -3.0]) if with_sinks else None
    extra = {"window": window, "sinks": sinks}
    problem = problem_of(WINDOW_CASE, **extra)
    out = torch.full_like(WINDOW_CASE.query, math.nan)
    buffers: dict[str, torch.Tensor] = {}
    launch = emulated_launch(problem, out, buffers, WINDOW_CASE, extra)
    seen = {}

    def checked(index, arguments):
        # CPU tensors stand for device ones: read the 8 floats the pointer points at.
        held = (ctypes.c_float * 8).from_address(arguments["sinks"])
        seen["sinks"] = torch.tensor(list(held), dtype=torch.float32)
        seen["window"] = (arguments["window_left"], arguments["window_right"])
        return launch(index, arguments)

    real_empty = torch.empty

    def empty(*shape, **kwargs):
        tensor = real_empty(*shape, **kwargs)
        buffers.setdefault("ws_o" if tensor.dim() == 4 else "ws_lse", tensor)
        return tensor

    monkeypatch.setattr(torch, "empty", empty)
    library = FakeLibrary(DEFAULT_TABLES[family], checked)
    mock_gpu(monkeypatch, capability, libraries={family: library})
    kernels = dsl_families.FAMILIES[family]
    plan = kernels.plan(problem.batch, None, num_splits)
    assert plan.family == family and plan.num_splits == num_splits
    kernels.run(problem, plan, out)
    assert seen["window"] == window
    expected_sinks = sinks if with_sinks else torch.full((8,), -math.inf)
    assert torch.equal(seen["sinks"], expected_sinks)
    expected = fna.paged_attention(
        *WINDOW_CASE.args(), **WINDOW_CASE.kwargs(), **extra, backend="reference"
    )
    assert torch.all(out[8:] == 0)  # padding rows
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]
    if with_sinks and num_splits > 1:  # the sink counts: leaving it out of the merge is wrong
        unsunk = torch.empty_like(out)
        merge_reference(buffers["ws_o"], buffers["ws_lse"], unsunk)
        assert not relative_error(unsunk[:8], expected[:8]) <= TOLERANCE[torch.bfloat16]


def test_a_layer_the_named_family_cannot_take_raises_the_reason(monkeypatch):
    mma_calls = []
    library = FakeLibrary(DEFAULT_TABLES["wgmma"])
    mock_gpu(monkeypatch, libraries={"wgmma": library}, mma_calls=mma_calls)
    case = make_case([3, 5], [40, 21], seed=9)
    attn = attention(case)
    plan = plan_case(attn, case, backend="wgmma")
    attn.run(*layer_args(case), plan=plan)
    assert len(library.calls) == 1 and not mma_calls
    numel = case.query.numel()
    query = torch.empty(numel + 8, dtype=case.query.dtype)[4 : 4 + numel].view(
        case.query.shape
    )  # 8-byte aligned: mma_sync takes it, the DSL kernels do not
    query.copy_(case.query)
    with pytest.raises(RuntimeError, match="can run this layer's tensors: wgmma: query needs"):
        attn.run(query, *layer_args(case)[1:], plan=plan)
    assert len(library.calls) == 1 and not mma_calls


# ---- on the GPU (skipped without one) ------------------------------------------------------

GPU_FAMILIES = {"wgmma": ((9, 0),), "tcgen05": ((10, 0), (10, 3))}


def gpu_family_or_skip(family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    capability = torch.cuda.get_device_capability()
    if capability not in GPU_FAMILIES[family]:
        pytest.skip(f"{family}: needs an {dsl_families.FAMILIES[family].gpus} GPU")
    library, why = dsl_families.load_library(family)
    if library is None:
        pytest.skip(why)
    runs, why = mma_sync.availability()
    if not runs:
        pytest.skip(why)


GPU_CASES = [
    dict(q_lens=[4, 1, 6], kv_lens=[300, 17, 1000], causal=False),
    dict(q_lens=[8, 8], kv_lens=[40, 2000], causal=[True, False], causal_dtype=torch.int32),
    dict(q_lens=[16, 3], kv_lens=[600, 9], causal=True, num_q_heads=32, num_kv_heads=4,
         padded_rows=5),  # R = 128 rows per KV head
    dict(q_lens=[130], kv_lens=[130], causal=True, num_q_heads=4, num_kv_heads=1),  # prefill
]  # fmt: skip


def _run_on_the_family(problem, family: str, num_splits: int | None) -> torch.Tensor:
    """Plan ``problem`` on ``family`` and run it into a NaN-filled output."""
    kernels = dsl_families.FAMILIES[family]
    out = torch.full_like(problem.query, math.nan)
    kernels.run(problem, kernels.plan(problem.batch, None, num_splits), out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", range(len(GPU_CASES)))
@pytest.mark.parametrize("num_splits", [None, 3])
def test_family_matches_the_reference_on_its_gpu(family, query_dtype, index, num_splits):
    """The family really runs (its plan, no fallback) and agrees with the reference."""
    gpu_family_or_skip(family)
    head_dim = 128
    case = make_case(**GPU_CASES[index], head_dim=head_dim, query_dtype=query_dtype,
                     device="cuda", seed=index)  # fmt: skip
    problem = problem_of(case)
    out = _run_on_the_family(problem, family, num_splits)
    expected = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, expected) <= TOLERANCE[query_dtype]


WINDOW_GPU_CASES = [
    dict(q_lens=[4, 1, 6], kv_lens=[300, 17, 1000], causal=False, window=(40, 12)),
    dict(q_lens=[8, 8], kv_lens=[40, 2000], causal=[True, False], causal_dtype=torch.int32,
         window=(300, -1)),
    dict(q_lens=[16, 3], kv_lens=[600, 9], causal=True, num_q_heads=32, num_kv_heads=4,
         window=(5, 0), padded_rows=5),  # R = 128, a window below a page
    dict(q_lens=[130], kv_lens=[130], causal=True, num_q_heads=4, num_kv_heads=1,
         window=(-1, 7)),  # causal caps the right side
    dict(q_lens=[3, 5], kv_lens=[500, 90], causal=False, window=(4000, 4000)),  # > context
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("index", range(len(WINDOW_GPU_CASES)))
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("sink_scale", [None, 8.0, -30.0])
def test_family_window_and_sinks_match_the_reference_on_its_gpu(
    family, query_dtype, index, num_splits, sink_scale
):
    """Both families run sliding windows and sinks (unsplit: in the kernel's epilogue; split:
    in the merge)."""
    gpu_family_or_skip(family)
    spec = dict(WINDOW_GPU_CASES[index])
    window = spec.pop("window")
    case = make_case(**spec, head_dim=128, query_dtype=query_dtype, device="cuda", seed=index)
    heads = case.query.shape[1]
    sinks = None
    if sink_scale is not None:
        sinks = (torch.rand(heads, device="cuda") + 0.5) * sink_scale
    problem = problem_of(case, window=window, sinks=sinks)
    out = _run_on_the_family(problem, family, num_splits)
    expected = fna.paged_attention(
        *case.args(), **case.kwargs(), window=window, sinks=sinks, backend="reference"
    )
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, expected) <= TOLERANCE[query_dtype]


# Every variant either family builds (wgmma's e5m2 table too, which `dsl.build --cache-dtype` adds):
# the GPU tests run each one the family's library holds.
BUILT_VARIANTS = [pytest.param("tcgen05", v, id=v.name) for v in build.VARIANTS] + [
    pytest.param("wgmma", v, id=v.name) for v in build.wgmma_variants(wgmma_traits.CACHE_DTYPES)
]
ARCH_OF = {"tcgen05": tcgen05_traits.ARCHS[0], "wgmma": wgmma_traits.ARCHS[0]}


@pytest.mark.gpu
@pytest.mark.parametrize("family,variant", BUILT_VARIANTS)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("window", [(-1, -1), (20, 0)])
def test_every_built_variant_matches_the_reference_on_its_gpu(family, variant, num_splits, window):
    """Each variant in the family's library (head_dim 64/128/256, every row count, e4m3/e5m2,
    bf16/fp16 query) is the one its plan picks, and it agrees with the reference on a batch of:
    a sequence whose R = q_len x group fills the variant's rows over several key tiles; one with
    fewer rows, causal, and one with a single key tile (with 3 splits the CTAs of the later
    splits have no key tile: they write zeros or an empty split's state, and free TMEM); padding
    rows. The window (20, 0) makes every CTA's key range one or two tiles, so whole splits miss
    it."""
    gpu_family_or_skip(family)
    library, _ = dsl_families.load_library(family)
    name = f"{variant.name}@{ARCH_OF[family]}"
    if name not in {v.name for v in library.variants}:
        pytest.skip(f"{name} is not in {library.path}")
    group = 4  # 8 query heads over 2 KV heads
    q_len = variant.rows // group
    case = make_case(
        [q_len, max(1, q_len // 3), 2], [700, 37, 5], causal=[False, True, False],
        head_dim=variant.head_dim, query_dtype=getattr(torch, variant.q_dtype),
        cache_dtype=getattr(torch, variant.cache_dtype), padded_rows=3, device="cuda",
        seed=variant.rows + variant.head_dim,
    )  # fmt: skip
    problem = problem_of(case, window=window)
    kernels = dsl_families.FAMILIES[family]
    plan = kernels.plan(problem.batch, None, num_splits)
    assert plan.variant.name == name
    out = torch.full_like(problem.query, math.nan)
    kernels.run(problem, plan, out)
    torch.cuda.synchronize()  # a hang or a fault shows here, at this variant
    expected = fna.paged_attention(*case.args(), **case.kwargs(), window=window,
                                   backend="reference")  # fmt: skip
    assert torch.isfinite(out.float()).all()
    assert torch.all(out[-3:] == 0)  # padding rows
    assert relative_error(out, expected) <= TOLERANCE[getattr(torch, variant.q_dtype)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(GPU_FAMILIES))
def test_family_plan_runs_every_layer_and_replays_in_a_cuda_graph(family):
    gpu_family_or_skip(family)
    case = make_case([4, 2], [500, 70], head_dim=128, num_q_heads=16, num_kv_heads=2,
                     device="cuda", seed=11)  # fmt: skip
    attn = fna.PagedAttention(num_q_heads=16, num_kv_heads=2, head_dim=128, block_size=16,
                              device="cuda", max_num_seqs=4, max_num_tokens=16)  # fmt: skip
    plan = attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=False,
                     max_seqlen_q=4, max_seqlen_k=500, num_tokens=6,
                     backend=family)  # fmt: skip
    assert plan.backend == family
    expected = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    out = torch.empty_like(case.query)
    attn.run(*layer_args(case), out=out)  # warm-up: loads the cubin outside the capture
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]
    eager = out.clone()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(*layer_args(case), out=out)
    graph.replay()
    torch.cuda.synchronize()
    # The replay launches the same kernels on the same inputs: bit for bit the eager answer.
    assert torch.equal(out, eager)
