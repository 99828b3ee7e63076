"""Packaging: the sdist, the build hook in setup.py, the version and the metadata.

The sdist is built from a copy of the source tree (never in it), and wheels are built from that
sdist, so these tests also show that the sdist is complete. The CUDA wheel itself (built once,
for one arch, then repaired by auditwheel) is checked by ``scripts/build_wheel.sh`` and
``scripts/smoke_test_wheel.sh`` in CI, which take minutes, not here.
"""

from __future__ import annotations

import email
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib

import fp8_noncausal_attn

# Compiles kernels or packages and reads what they hold (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.compile

ROOT = Path(__file__).resolve().parent.parent
SKIP_MESSAGE = "WARNING: fp8-noncausal-attn is being built WITHOUT its CUDA kernels (_C)"
# Folders a wheel build or the test suite reads, and must therefore travel in the sdist.
SDIST_FOLDERS = ("csrc", "python", "tests", "docs", "benchmarks", "scripts", "dsl", "tools")
SDIST_FILES = (
    "CMakeLists.txt", "setup.py", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md",
    "fp8_noncausal_attn/py.typed", "requirements-test.txt", "requirements-vllm.txt",
)  # fmt: skip


def load_setup_module():
    """setup.py as a module: its helpers, without running setup() (guarded by __main__)."""
    spec = importlib.util.spec_from_file_location("fp8nca_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source_files() -> list[Path]:
    """The tree's source files (git's list in a checkout, else everything but build output)."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        return [Path(name) for name in listed if (ROOT / name).is_file()]
    skipped = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".ruff_cache"}
    return [
        path.relative_to(ROOT)
        for path in ROOT.rglob("*")
        if path.is_file()
        and not skipped.intersection(path.relative_to(ROOT).parts)
        and path.suffix not in (".so", ".pyc")
        and not any(part.endswith(".egg-info") for part in path.relative_to(ROOT).parts)
    ]


def environment_without_nvcc() -> dict[str, str]:
    """This environment with no CUDA_HOME/CUDA_PATH and no PATH entry holding nvcc."""
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.pop("FP8NCA_BUILD_CUDA", None)
    entries = os.environ.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(e for e in entries if e and not (Path(e) / "nvcc").exists())
    return env


def run_build(args: list[str], cwd: Path, env: dict[str, str], timeout: int = 600):
    return subprocess.run(
        [sys.executable, "-m", "build", *args], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """An sdist built (setuptools, no isolation: quick) from a copy of the source tree."""
    source = tmp_path_factory.mktemp("source")
    # Asked in the copy: the repository's own build/ folder would pass for the package.
    probe = subprocess.run([sys.executable, "-m", "build", "--version"], cwd=source, check=False)
    if probe.returncode != 0:
        pytest.skip("the build package is missing: pip install -r requirements-test.txt")
    for name in source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("sdist")
    result = run_build(
        ["--sdist", "--no-isolation", "--skip-dependency-check", "-o", str(out), "."],
        source,
        dict(os.environ),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    (archive,) = out.glob("fp8_noncausal_attn-*.tar.gz")
    return archive


@pytest.fixture(scope="module")
def unpacked_sdist(sdist, tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as tar:
        tar.extractall(where, filter="data")
    (top,) = where.iterdir()
    return top


def sdist_names(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as tar:
        return {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}


def test_sdist_holds_everything_a_build_and_the_tests_need(sdist):
    names = sdist_names(sdist)
    expected = set(SDIST_FILES)
    for path in source_files():
        if path.parts[0] in SDIST_FOLDERS or path.parts[0] == "fp8_noncausal_attn":
            expected.add(path.as_posix())
    assert "tests/conftest.py" in expected
    assert [n for n in expected if n.startswith("csrc/") and n.endswith(".cu")]
    assert expected <= names, sorted(expected - names)
    assert not [n for n in names if n.endswith((".so", ".pyc")) or "/build/" in f"/{n}"]


def test_sdist_metadata(sdist):
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        info = email.message_from_bytes(tar.extractfile(f"{top}/PKG-INFO").read())
    assert info["Name"] == "fp8-noncausal-attn"
    assert info["Version"] == fp8_noncausal_attn.__version__
    assert info["License-Expression"] == "Apache-2.0"
    assert info.get_all("License-File") == ["LICENSE"]
    assert info["Requires-Python"] == ">=3.10"
    classifiers = info.get_all("Classifier")
    assert "Typing :: Typed" in classifiers and "Environment :: GPU :: NVIDIA CUDA" in classifiers
    assert "fp8" in info["Keywords"].split(",")
    # No invented addresses: a Project-URL, if any, is a real https address without placeholders.
    for url in info.get_all("Project-URL") or []:
        assert re.fullmatch(r"[^,]+, https://[^<>\s]+", url) and "example" not in url, url


def test_version_has_one_source():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert "version" in pyproject["project"]["dynamic"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "fp8_noncausal_attn.__version__"}
    assert re.fullmatch(
        r"\d+\.\d+\.\d+(?:(?:a|b|rc)\d+)?(?:\.dev\d+)?", fp8_noncausal_attn.__version__
    )
    assert "__version__" in fp8_noncausal_attn.__all__


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_build_requires_carry_the_extension_build():
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    names = {re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0].lower() for r in requires}
    assert {"setuptools", "pybind11", "nvidia-cutlass", "cmake"} <= names, requires
    assert "nvidia-cutlass==4.2.0.0" in requires


def test_wheel_from_sdist_without_nvcc_is_pure_and_says_why(unpacked_sdist, tmp_path):
    """pip's default path (build isolation): no nvcc -> a pure wheel and one warning line."""
    out = tmp_path / "wheel"
    result = run_build(["--wheel", "-o", str(out), "."], unpacked_sdist, environment_without_nvcc())
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith(SKIP_MESSAGE)]
    assert len(warnings) == 1, result.stderr[-4000:]
    assert "nvcc not found: set CUDA_HOME or put nvcc on PATH" in warnings[0]
    (wheel,) = out.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = archive.read(
            next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
    assert "fp8_noncausal_attn/py.typed" in names
    assert not [n for n in names if "/_C." in n], names
    assert "fp8_noncausal_attn = fp8_noncausal_attn.vllm_backend:register" in entry_points


def test_required_cuda_build_without_nvcc_fails_by_name(unpacked_sdist, tmp_path):
    env = environment_without_nvcc() | {"FP8NCA_BUILD_CUDA": "1"}
    result = run_build(
        ["--wheel", "--no-isolation", "--skip-dependency-check", "-o", str(tmp_path), "."],
        unpacked_sdist,
        env,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "cannot build the CUDA extension _C: nvcc not found (set CUDA_HOME" in output, output
    assert not list(tmp_path.glob("*.whl"))


def fake_tool(folder: Path, name: str, stdout: str, executable: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tool = folder / name
    tool.write_text(f"#!/bin/sh\necho '{stdout}'\n")
    tool.chmod(stat.S_IRWXU if executable else stat.S_IRUSR | stat.S_IWUSR)
    return tool


def test_nvcc_comes_from_cuda_home_or_path_only(tmp_path):
    setup = load_setup_module()
    home_nvcc = fake_tool(tmp_path / "toolkit" / "bin", "nvcc", "Cuda compilation tools")
    path_nvcc = fake_tool(tmp_path / "elsewhere", "nvcc", "Cuda compilation tools")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert setup.find_nvcc({"CUDA_HOME": str(tmp_path / "toolkit"), "PATH": str(empty)}) == str(
        home_nvcc
    )
    assert setup.find_nvcc({"CUDA_PATH": str(tmp_path / "toolkit"), "PATH": ""}) == str(home_nvcc)
    assert setup.find_nvcc({"PATH": str(path_nvcc.parent)}) == str(path_nvcc)
    # Not /usr/local/cuda (present on the CI machine), nor any other guess.
    assert setup.find_nvcc({"PATH": str(empty)}) is None
    assert setup.find_nvcc({"CUDA_HOME": str(empty), "PATH": str(empty)}) is None


def test_build_plan(tmp_path):
    setup = load_setup_module()
    fake_tool(tmp_path / "bin", "nvcc", "Cuda compilation tools")
    no_nvcc = {"PATH": str(tmp_path)}
    assert setup.build_plan(no_nvcc) == (False, "nvcc not found: set CUDA_HOME or put nvcc on PATH")
    assert setup.build_plan({"PATH": str(tmp_path / "bin")}) == (True, "")
    assert setup.build_plan(no_nvcc | {"FP8NCA_BUILD_CUDA": "1"}) == (True, "")
    assert setup.build_plan({"PATH": str(tmp_path / "bin"), "FP8NCA_BUILD_CUDA": "0"}) == (
        False,
        "FP8NCA_BUILD_CUDA=0",
    )
    with pytest.raises(ValueError, match="FP8NCA_BUILD_CUDA must be 0, 1 or unset, got 'yes'"):
        setup.build_plan(no_nvcc | {"FP8NCA_BUILD_CUDA": "yes"})


def fake_gpus(folder: Path, *capabilities: str) -> Path:
    """An nvidia-smi in ``folder`` that reports GPUs of ``capabilities`` ("9.0", ...)."""
    folder.mkdir(parents=True, exist_ok=True)
    smi = folder / "nvidia-smi"
    smi.write_text("#!/bin/sh\nprintf '" + "".join(f"{c}\\n" for c in capabilities) + "'\n")
    smi.chmod(stat.S_IRWXU)
    return folder


def test_an_editable_install_builds_cuda_code_only_for_a_gpu_it_sees(tmp_path):
    """A development set-up (the demo's, the test command's) on a machine without a GPU builds
    no CUDA code unless asked; a wheel (pip install .) builds it wherever nvcc is."""
    setup = load_setup_module()
    nvcc = fake_tool(tmp_path / "bin", "nvcc", "Cuda compilation tools").parent
    hopper, ampere = fake_gpus(tmp_path / "hopper", "9.0"), fake_gpus(tmp_path / "ampere", "8.0")
    no_gpu = {"PATH": str(nvcc)}
    planned, reason = setup.build_plan(no_gpu, editable=True)
    assert not planned and reason.startswith("no GPU visible, so nothing here could run it")
    assert setup.build_plan(no_gpu) == (True, "")
    assert setup.build_plan(no_gpu | {"FP8NCA_CUDA_ARCHS": "90"}, editable=True) == (True, "")
    assert setup.build_plan(no_gpu | {"FP8NCA_BUILD_CUDA": "1"}, editable=True) == (True, "")
    seen = {"PATH": os.pathsep.join([str(nvcc), str(hopper)])}
    assert setup.build_plan(seen, editable=True) == (True, "")
    planned, reason = setup.build_plan(seen | {"CUDA_VISIBLE_DEVICES": ""}, editable=True)
    assert not planned and reason.startswith("no GPU visible")
    old = {"PATH": os.pathsep.join([str(nvcc), str(ampere)])}
    planned, reason = setup.build_plan(old, editable=True)
    assert not planned and reason.startswith("no supported GPU visible (sm_80)")
    assert setup.is_editable_install(["setup.py", "editable_wheel", "--dist-dir", "x"])
    assert not setup.is_editable_install(["setup.py", "bdist_wheel", "--dist-dir", "x"])


def test_cuda_archs_are_the_setting_else_the_visible_gpus_else_every_supported_one(tmp_path):
    setup = load_setup_module()
    every = list(setup.supported_archs())
    assert every == ["89", "90", "100f", "120"]  # CMakeLists.txt's FP8NCA_DEFAULT_ARCHS
    assert setup.cuda_archs({}, [(9, 0)]) == (["90"], "the visible GPU's")
    # B300 and B200 share the family cubin; an RTX 5090 (12.0) and a DGX Spark (12.1) sm_120's.
    assert setup.cuda_archs({}, [(10, 3), (12, 1), (10, 0)])[0] == ["100f", "120"]
    assert setup.cuda_archs({}, [(8, 9), (8, 0)])[0] == ["89"]
    assert setup.cuda_archs({}, []) == (every, "no GPU visible")
    assert setup.cuda_archs({}, [(8, 0)]) == (every, "no supported GPU visible (sm_80)")
    assert setup.cuda_archs({"FP8NCA_CUDA_ARCHS": "all"}, [(9, 0)]) == (
        every,
        "FP8NCA_CUDA_ARCHS=all",
    )
    assert setup.cuda_archs({"FP8NCA_CUDA_ARCHS": "90;100a"}, [(8, 9)])[0] == ["90", "100a"]
    assert setup.cuda_archs({"FP8NCA_CUDA_ARCHS": "89,120"}, [])[0] == ["89", "120"]
    gpus = {"PATH": str(fake_gpus(tmp_path / "two", "9.0", "12.0"))}
    assert setup.visible_gpu_capabilities(gpus) == [(9, 0), (12, 0)]
    assert setup.cuda_archs(gpus) == (["90", "120"], "the visible GPU's")
    assert setup.visible_gpu_capabilities(gpus | {"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert setup.visible_gpu_capabilities({"PATH": str(tmp_path / "no-driver")}) == []


def test_the_arch_built_for_a_gpu_is_one_the_extension_accepts_on_it():
    """setup.py's choice per GPU and the extension's availability rule agree on every GPU."""
    from fp8_noncausal_attn.backends.cuda import extension

    setup = load_setup_module()
    supported = setup.supported_archs()
    for capability in [(major, minor) for major in range(7, 14) for minor in range(10)]:
        arch = setup.arch_for(capability, supported)
        if arch is None:
            assert not extension.runs_on(capability, list(supported), None), capability
        else:
            assert extension.runs_on(capability, [arch], None), (capability, arch)


def test_the_build_names_each_translation_unit_as_it_starts():
    setup = load_setup_module()
    units = setup.translation_units()
    assert len(set(units)) == len(units) and "python/bindings.cpp" in units
    assert all((ROOT / unit).is_file() for unit in units), units
    make = (
        "[ 7%] Building CUDA object CMakeFiles/fp8nca_kernels.dir/csrc/cache/reshape_and_cache.cu.o"
    )
    ninja = "[3/16] Building CXX object CMakeFiles/_C.dir/python/bindings.cpp.o"
    assert setup.compiled_source(make) == "csrc/cache/reshape_and_cache.cu"
    assert setup.compiled_source(ninja) == "python/bindings.cpp"
    assert setup.compiled_source("[100%] Linking CXX shared module _C.so") is None
    assert setup.minutes(754.4) == "12 min 34 s"


def test_tool_checks_say_what_is_wrong(tmp_path):
    setup = load_setup_module()
    old = fake_tool(tmp_path / "old", "cmake", "cmake version 3.20.1")
    assert setup.tool_version(str(old)) == ((3, 20, 1), "")
    nvcc = fake_tool(tmp_path / "nvcc", "nvcc", "Cuda compilation tools, release 13.0, V13.0.88")
    assert setup.tool_version(str(nvcc)) == ((13, 0), "")
    locked = fake_tool(tmp_path / "locked", "cmake", "cmake version 3.30.0", executable=False)
    assert setup.tool_version(str(locked)) == (None, f"{locked} is not executable")
    assert "does not run" in setup.tool_version(str(tmp_path / "missing"))[1]


def test_toolchain_problems_name_every_missing_piece(tmp_path, monkeypatch):
    setup = load_setup_module()
    fake_tool(tmp_path / "bin", "cmake", "cmake version 3.20.1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for var in ("CUDA_HOME", "CUDA_PATH", "CXX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FP8NCA_CUTLASS_INCLUDE", str(tmp_path / "cutlass"))
    monkeypatch.setattr(setup, "find_cutlass_include", lambda: None)
    monkeypatch.setattr(setup, "find_pybind11_cmake_dir", lambda: None)
    problems = setup.toolchain_problems()
    assert problems == [
        "nvcc not found (set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH)",
        f"{tmp_path / 'bin' / 'cmake'} is version 3.20.1; CMakeLists.txt needs 3.24 or newer",
        "no C++ compiler (set CXX, or put c++/g++ on PATH)",
        "CUTLASS headers not found (pip install nvidia-cutlass==4.2.0.0, or set "
        "FP8NCA_CUTLASS_INCLUDE)",
        "pybind11 not importable (pip install pybind11)",
    ]


def test_a_build_without_cuda_does_not_silently_replace_an_installed_one(tmp_path):
    setup = load_setup_module()
    installed = tmp_path / "_C.cpython-311-x86_64-linux-gnu.so"
    reason = "nvcc not found: set CUDA_HOME or put nvcc on PATH"
    problem = setup.replacing_extension_problem(reason, installed, {})
    assert problem is not None and str(installed) in problem and reason in problem
    assert "FP8NCA_BUILD_CUDA=0" in problem
    assert setup.replacing_extension_problem(reason, installed, {"FP8NCA_BUILD_CUDA": "0"}) is None
    assert setup.replacing_extension_problem(reason, None, {}) is None


def test_installed_extension_is_found_outside_this_tree_only(tmp_path, monkeypatch):
    setup = load_setup_module()
    package = tmp_path / "site-packages" / "fp8_noncausal_attn"
    package.mkdir(parents=True)
    monkeypatch.setattr(setup, "_package_dir_outside", lambda name: package)
    assert setup.installed_extension(tmp_path / "tree") is None
    built = package / "_C.cpython-311-x86_64-linux-gnu.so"
    built.write_bytes(b"\x7fELF")
    assert setup.installed_extension(tmp_path / "tree") == built
    # An editable install of this very tree is not replaced by building it.
    assert setup.installed_extension(tmp_path / "site-packages") is None


def test_a_changed_arch_list_reaches_a_configured_build_dir(tmp_path, monkeypatch):
    """The arch list of a later configure of the same build folder decides it, not the first."""
    setup = load_setup_module()
    problems = setup.toolchain_problems()
    if problems:
        pytest.skip("; ".join(problems))
    build_dir = tmp_path / "cmake"

    def configure(archs: list[str], folder: Path = build_dir) -> str:
        args = setup.cmake_configure_args(setup.find_cmake(), folder, tmp_path / "out", archs)
        result = subprocess.run(args, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
        flags = (folder / "CMakeFiles" / "fp8nca_kernels.dir" / "flags.make").read_text()
        return "\n".join(line for line in flags.splitlines() if line.startswith("CUDA_FLAGS"))

    first = configure(["90", "100a"])
    assert "sm_90" in first and "sm_100a" in first and "sm_89" not in first
    second = configure(["89"])
    assert "sm_89" in second and "sm_90" not in second and "sm_100a" not in second
    # Every supported one again, exactly as a fresh build folder gets it.
    every = list(setup.supported_archs())
    assert configure(every) == configure(every, tmp_path / "fresh") != second


def test_dsl_build_plan_is_off_unless_asked():
    setup = load_setup_module()
    assert setup.dsl_build_plan({}) == () == setup.dsl_build_plan({"FP8NCA_BUILD_DSL": "0"})
    assert setup.dsl_build_plan({"FP8NCA_BUILD_DSL": "1"}) == ("wgmma", "tcgen05")
    assert setup.dsl_build_plan({"FP8NCA_BUILD_DSL": "tcgen05"}) == ("tcgen05",)
    assert setup.dsl_build_plan({"FP8NCA_BUILD_DSL": " wgmma, tcgen05 "}) == ("wgmma", "tcgen05")
    with pytest.raises(ValueError, match="FP8NCA_BUILD_DSL must be 0, 1 or a comma-separated"):
        setup.dsl_build_plan({"FP8NCA_BUILD_DSL": "wgmma,hopper"})


@pytest.mark.parametrize("editable", [False, True])
def test_build_py_compiles_the_asked_dsl_families_into_the_package(tmp_path, monkeypatch, editable):
    """Where the build puts them: the wheel's build_lib, or the tree's package when editable."""
    from setuptools.dist import Distribution

    setup = load_setup_module()
    built = []
    monkeypatch.setattr(setup.build_py, "run", lambda self: None)
    monkeypatch.setattr(setup, "build_dsl_families", lambda *args: built.append(args))
    monkeypatch.setenv("FP8NCA_BUILD_CUDA", "1")
    monkeypatch.setenv("FP8NCA_BUILD_DSL", "wgmma")
    command = setup.BuildPyWarnsWithoutCuda(Distribution())
    command.build_lib, command.editable_mode = str(tmp_path), editable
    command.run()
    ((families, package_dir, _temp),) = built
    assert families == ("wgmma",)
    assert package_dir == (ROOT if editable else tmp_path) / "fp8_noncausal_attn"
    monkeypatch.setenv("FP8NCA_BUILD_DSL", "0")
    command.run()
    assert len(built) == 1


def test_a_dsl_build_installs_only_what_the_package_needs(tmp_path):
    setup = load_setup_module()
    build = tmp_path / "build"
    cubin = "sm_90a/wgmma_d64_m64_p16_bf16_e4m3/kernel.sm_90a.cubin"
    record = {"library": "libfp8nca_wgmma.so", "variants": [{"cubins": [cubin]}]}
    for name in ("libfp8nca_wgmma.so", cubin, "x.o", "x.h", "entry.c", "sm_90a/v/kernel.ptx"):
        (build / name).parent.mkdir(parents=True, exist_ok=True)
        (build / name).write_text(name)
    (build / "build.json").write_text(json.dumps(record))
    package = tmp_path / "fp8_noncausal_attn"
    (package / "_wgmma").mkdir(parents=True)
    (package / "_wgmma" / "stale.cubin").write_text("an older build")
    assert setup.install_dsl_build(build, package, "wgmma") == [
        "libfp8nca_wgmma.so", "build.json", cubin,
    ]  # fmt: skip
    installed = sorted(p.relative_to(package / "_wgmma").as_posix()
                       for p in (package / "_wgmma").rglob("*") if p.is_file())  # fmt: skip
    assert installed == sorted(["libfp8nca_wgmma.so", "build.json", cubin])


def test_a_failed_dsl_build_fails_the_install_by_name(tmp_path, monkeypatch):
    setup = load_setup_module()
    monkeypatch.setattr(setup, "dsl_build_command", lambda family, out: [
        sys.executable, "-c", "raise SystemExit('No module named cutlass')"])  # fmt: skip
    with pytest.raises(RuntimeError, match="FP8NCA_BUILD_DSL: building the wgmma family failed"):
        setup.build_dsl_families(("wgmma",), tmp_path / "package", tmp_path)
    assert not (tmp_path / "package").exists()


def test_a_wheel_with_dsl_libraries_is_platform_tagged():
    """The DSL libraries are x86-64 machine code: with them and no _C the wheel still gets a
    platform tag (bdist_wheel's root_is_pure), never py3-none-any."""
    from setuptools import Distribution
    from setuptools.command.bdist_wheel import bdist_wheel

    setup = load_setup_module()
    for distclass, pure in ((setup.PlatformDistribution, False), (Distribution, True)):
        command = bdist_wheel(distclass({"name": "fp8-noncausal-attn", "packages": []}))
        command.finalize_options()
        assert command.root_is_pure is pure


def test_the_build_cache_keys_an_extension_by_what_it_is_compiled_from(tmp_path):
    setup = load_setup_module()
    tree = tmp_path / "tree"
    sources = ("CMakeLists.txt", "setup.py", "pyproject.toml", "csrc/a/kernel.cu",
               "csrc/a/kernel.cuh", "csrc/b/plan.cpp", "python/bindings.cpp")  # fmt: skip
    for name in sources:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text(f"// {name}\n")
    key = setup.extension_key(["90"], tree)
    assert len(key) == 64 and setup.extension_key(["90"], tree) == key
    (tree / "csrc" / "a" / "notes.md").write_text("not compiled")
    (tree / "docs").mkdir()
    (tree / "docs" / "x.cu").write_text("not in the build's folders")
    assert setup.extension_key(["90"], tree) == key
    assert setup.extension_key(["89"], tree) != key
    assert setup.extension_key(["90", "120"], tree) != key
    for name in sources:
        before = (tree / name).read_text()
        (tree / name).write_text(before + "// changed\n")
        assert setup.extension_key(["90"], tree) != key, name
        (tree / name).write_text(before)
    assert setup.extension_key(["90"], tree) == key


def test_a_cached_extension_is_copied_instead_of_compiled(tmp_path, monkeypatch):
    from setuptools.dist import Distribution

    setup = load_setup_module()
    name = "_C.cpython-311-x86_64-linux-gnu.so"
    monkeypatch.setattr(setup, "toolchain_problems", lambda: [])
    monkeypatch.setattr(setup, "cuda_archs", lambda: (["90"], "FP8NCA_CUDA_ARCHS=90"))
    monkeypatch.setattr(setup, "extension_key", lambda archs: "-".join(archs) + "-key")

    def no_compiling(*args, **kwargs):
        raise AssertionError(f"compiled: {args}")

    monkeypatch.setattr(setup.subprocess, "run", no_compiling)
    monkeypatch.setattr(setup.subprocess, "Popen", no_compiling)
    monkeypatch.setenv("FP8NCA_BUILD_CACHE", str(tmp_path / "cache"))
    cached = setup.cached_extension(["90"], name)
    assert cached == tmp_path / "cache" / "90-key" / name
    (tmp_path / "built.so").write_bytes(b"\x7fELF built once")
    setup.store_in_cache(tmp_path / "built.so", cached)
    assert [p.name for p in cached.parent.iterdir()] == [name]  # no partial copy left
    command = setup.CMakeBuild(Distribution())
    monkeypatch.setattr(command, "get_ext_fullpath", lambda ext: str(tmp_path / "lib" / name))
    command.build_extension(setup.Extension("fp8_noncausal_attn._C", sources=[]))
    assert (tmp_path / "lib" / name).read_bytes() == b"\x7fELF built once"
    monkeypatch.delenv("FP8NCA_BUILD_CACHE")
    assert setup.cached_extension(["90"], name) is None
