"""The GPU check (tools/gpu_check): its plan fits one lease, and its driver, dry-run on the CPU
with stub nvidia-smi, compute-sanitizer and GPU jobs (tests/gpu_check_stubs), keeps every
step's result through a planted hang and a planted fault."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tools.gpu_check import backends, driver, plan, prepare

REPO = Path(__file__).resolve().parent.parent
ISSUE_ORDER = ["environment", "smoke", "sanitize", "correctness", "benchmark", "accuracy"]
STEP_FIELDS = {
    "step": str,
    "status": str,
    "gating": bool,
    "seconds": float,
    "box_s": float,
    "jobs": list,
    "figures": dict,
    "failing_tests": list,
    "reason": str,
}
STATUSES = {"passed", "failed", "timed_out", "skipped"}
# A test file with GPU tests: a decorated test or a module-wide mark.
GPU_MARK = re.compile(r"^(@pytest\.mark\.gpu|pytestmark = .*pytest\.mark\.gpu)", re.MULTILINE)


def dry_run(out: Path, **planted: str) -> tuple[int, dict]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPU_CHECK_")}
    env.update(planted)
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(out), "--dry-run"],
        cwd=REPO,
        env={**env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (out / plan.SUMMARY).is_file(), done.stderr[-3000:]
    return done.returncode, json.loads((out / plan.SUMMARY).read_text())


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("clean")
    rc, summary = dry_run(out)
    return rc, summary, out


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> tuple[int, dict, Path]:
    out = tmp_path_factory.mktemp("planted")
    rc, summary = dry_run(
        out, GPU_CHECK_STUB_HANG="tools.gpu_check.sanitize", GPU_CHECK_STUB_FAULT="triton"
    )
    return rc, summary, out


def test_the_plan_fits_one_command_of_the_lease():
    assert plan.planned_seconds() <= plan.BUDGET_S <= 420
    # The run call's own limit leaves the command its budget, within the tool's 600 s.
    assert plan.BUDGET_S < plan.RUN_TIMEOUT_S <= 600
    assert [step.name for step in plan.PLANNED] == ISSUE_ORDER
    boxes = {step.name: step.box_s for step in plan.STEPS}
    assert boxes["environment"] == 10 and boxes["smoke"] == 30 and boxes["sanitize"] == 90
    assert boxes["correctness"] == 120 and boxes["benchmark"] == 120
    gating = {step.name for step in plan.STEPS if step.gating}
    assert gating == {"build", "smoke", "sanitize", "correctness"}


def test_clean_dry_run_passes_every_step_in_order(clean):
    rc, summary, _ = clean
    assert rc == 0 and summary["exit_code"] == 0 and summary["complete"] is True
    assert summary["dry_run"] is True and summary["schema"] == driver.SCHEMA_VERSION
    steps = summary["steps"]
    assert [s["step"] for s in steps] == list(plan.STEP_NAMES)
    for step in steps:
        for name, kind in STEP_FIELDS.items():
            assert isinstance(step[name], kind), (name, step)
        assert step["status"] in STATUSES
        expected = "skipped" if step["step"] == "build" else "passed"
        assert step["status"] == expected, step
        for job in step["jobs"]:
            assert set(job) == {"name", "status", "rc", "seconds", "log"}
    assert summary["elapsed_s"] <= summary["budget_s"]
    assert summary["environment"]["capability"] == "9.0"
    assert summary["environment"]["gpu"] == "NVIDIA H200"


def test_each_backend_runs_in_its_own_process(clean):
    _, summary, _ = clean
    smoke = next(s for s in summary["steps"] if s["step"] == "smoke")
    assert [job["name"] for job in smoke["jobs"]] == ["reference", "triton", "mma_sync", "wgmma"]
    assert "tcgen05: skipped, needs an sm_100f GPU (this one is cc 9.0)" in smoke["reason"]
    sanitize = next(s for s in summary["steps"] if s["step"] == "sanitize")
    assert [job["name"] for job in sanitize["jobs"]] == ["memcheck", "racecheck", "synccheck"]
    correctness = next(s for s in summary["steps"] if s["step"] == "correctness")
    assert [job["name"] for job in correctness["jobs"]] == ["pytest", "pytest-wgmma"]


def test_at_most_eight_files_come_back_and_the_tarball_holds_every_log(clean):
    _, summary, out = clean
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= plan.MAX_OUT_FILES
    assert not [name for name in files if name.startswith(".")]  # no temporary file left
    assert {plan.SUMMARY, plan.LOGS} <= set(files)
    with tarfile.open(out / plan.LOGS) as tar:
        names = {Path(name).name for name in tar.getnames()}
        packed = json.load(tar.extractfile("gpu_check/summary.json"))
    logs = {job["log"] for step in summary["steps"] for job in step["jobs"]}
    assert logs <= names
    assert packed == summary


def test_benchmark_figures_are_fractions_of_the_copy_measured_in_the_run(clean):
    _, summary, _ = clean
    figures = next(s for s in summary["steps"] if s["step"] == "benchmark")["figures"]
    assert figures["copy_bw_gbps"] > 0
    from benchmarks import shapes

    # Every cache format of the grid has its own rows (the FP8 and per-token-head rows of a
    # shape do not overwrite each other).
    kv_cache_dtypes = {shape.kv_cache_dtype for shape in shapes.grid()}
    assert set(figures["rows"]) == {f"b32 q8 kv16384 {kv}" for kv in kv_cache_dtypes}
    for row in figures["rows"].values():
        assert set(row) == {"mma_sync", "wgmma", "triton", *driver.BENCHMARK_PEERS}
        assert all(0 < entry["frac_of_copy_bw"] <= 1 for entry in row.values())


def test_a_planted_hang_and_fault_leave_every_other_result(planted):
    rc, summary, out = planted
    assert rc == 1 and summary["complete"] is True
    status = {s["step"]: s for s in summary["steps"]}
    assert list(status) == list(plan.STEP_NAMES)
    # The hung step is ended by its box (the stub ignores SIGTERM: only -k's KILL ends it).
    assert status["sanitize"]["status"] == "timed_out"
    assert {job["status"] for job in status["sanitize"]["jobs"]} == {"timed_out"}
    assert status["sanitize"]["seconds"] < status["sanitize"]["box_s"] + 2 * plan.KILL_AFTER_S
    # The faulting backend fails alone; the others' launches pass.
    smoke = {job["name"]: job["status"] for job in status["smoke"]["jobs"]}
    assert smoke == {"reference": "passed", "triton": "failed", "mma_sync": "passed",
                     "wgmma": "passed"}  # fmt: skip
    assert status["correctness"]["status"] == "failed"
    assert "pytest: tests/test_plan.py::test_stub[triton]" in status["correctness"]["failing_tests"]
    figures = status["benchmark"]["figures"]
    assert status["benchmark"]["status"] == "passed"
    for kv_cache_dtype in ("fp8_e4m3", "fp8_per_token_head"):
        assert "triton" not in figures["rows"][f"b32 q8 kv16384 {kv_cache_dtype}"]
        assert figures["skipped"][f"triton {kv_cache_dtype}"].startswith("failed")
    assert status["accuracy"]["status"] == "passed"
    assert summary["failed_steps"] == ["smoke", "sanitize", "correctness"]
    assert len(list(out.iterdir())) <= plan.MAX_OUT_FILES


@pytest.mark.parametrize(
    "capability,families",
    [("9.0", ["wgmma"]), ("10.0", []), ("8.9", [])],
)
def test_each_dsl_family_runs_only_on_its_gpu(tmp_path, capability, families):
    rc, summary = dry_run(tmp_path, GPU_CHECK_STUB_CAPABILITY=capability)
    assert rc == 0
    smoke = next(s for s in summary["steps"] if s["step"] == "smoke")
    ran = [job["name"] for job in smoke["jobs"]]
    assert ran == ["reference", "triton", "mma_sync", *families]
    for family in ("wgmma", "tcgen05"):
        if family not in families:
            assert f"{family}: skipped" in smoke["reason"]


def test_a_hang_cut_to_the_budget_leaves_the_later_steps_skipped_with_the_reason(tmp_path):
    """With a budget below the plan's, the hanging sanitizers get what is left and end at the
    deadline; the steps after them are recorded as skipped, the run still ends cleanly."""
    env = {**os.environ, "GPU_CHECK_STUB_HANG": "tools.gpu_check.sanitize"}
    done = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", str(tmp_path), "--dry-run", "--budget", "100"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    summary = json.loads((tmp_path / plan.SUMMARY).read_text())
    assert done.returncode == 1 and summary["complete"] is True
    status = {s["step"]: s for s in summary["steps"]}
    assert status["sanitize"]["status"] == "timed_out"
    assert status["sanitize"]["box_s"] < 90 / plan.DRY_RUN_SCALE  # cut to the budget
    for name in ("correctness", "benchmark", "accuracy"):
        assert status[name]["status"] == "skipped"
        assert "of the budget left" in status[name]["reason"]


def test_every_gpu_test_file_is_in_the_correctness_step():
    marked = {
        f"tests/{path.name}"
        for path in (REPO / "tests").glob("test_*.py")
        if GPU_MARK.search(path.read_text())
    }
    assert marked and marked <= set(driver.TEST_FILES)
    for name in ("tests/test_lse_merge.py", "tests/test_plan.py", "tests/test_window_sinks.py"):
        assert name in driver.TEST_FILES
    assert all((REPO / name).is_file() for name in driver.TEST_FILES + driver.FAMILY_TEST_FILES)


def test_backend_requests_and_their_environment():
    """Each flat name is the API's backend= value and the test suite's FP8NCA_BACKEND; every
    one is a registered backend."""
    from fp8_noncausal_attn import registry

    assert backends.backend_request("triton") == ("triton", {"FP8NCA_BACKEND": "triton"})
    assert backends.backend_request("wgmma") == ("wgmma", {"FP8NCA_BACKEND": "wgmma"})
    with pytest.raises(ValueError, match="backend must be one of"):
        backends.backend_request("cuda")
    assert set(backends.OURS) == set(registry.BACKEND_NAMES)


def test_carry_report_counts_the_tree_and_the_carried_folders(tmp_path):
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    (tmp_path / "tracked.txt").write_bytes(b"x" * 1000)
    (tmp_path / ".gitignore").write_text("/.gpu_check/\n")
    (tmp_path / ".gpu_check").mkdir()
    (tmp_path / ".gpu_check" / "big.bin").write_bytes(b"y" * 5000)
    report = prepare.carry_report(tmp_path, (".gpu_check", ".absent"))
    assert report["carry_bytes"] == {".gpu_check": 5000}
    assert report["tree_bytes"] == 1000 + len("/.gpu_check/\n")
    assert (
        report["fits"] is True
        and ".gpu_check/_C.cpython-312-x86_64-linux-gnu.so" in report["missing"]
    )
    os.truncate(tmp_path / ".gpu_check" / "big.bin", plan.CARRY_LIMIT_BYTES)
    assert prepare.carry_report(tmp_path, (".gpu_check",))["fits"] is False


def test_the_printed_call_carries_what_the_preparation_makes():
    call = plan.run_call()
    assert call["carry"] == list(plan.CARRY) and len(call["carry"]) <= 8
    assert call["timeout_s"] == plan.RUN_TIMEOUT_S
    assert "scripts/gpu_check.sh" in call["command"] and len(call["command"]) <= 2000
    ignored = subprocess.run(
        ["git", "check-ignore", *[f"{path}/file" for path in call["carry"]]], cwd=REPO,
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert ignored == [f"{path}/file" for path in call["carry"]]
    for path in prepare.EXPECTED:
        assert any(path.startswith(folder + "/") for folder in plan.CARRY), path


def test_fa3_call_passes_what_vllm_passes(monkeypatch):
    """benchmarks/fa3_peer.fwd_call gives torch.ops._vllm_fa3_C.fwd the arguments, in order,
    that the installed vLLM's flash_attn_varlen_func(fa_version=3) gives it for the same paged
    call."""
    import importlib.util

    import torch

    from benchmarks import fa3_peer
    from benchmarks.vllm_peer import PagedCall

    spec = importlib.util.find_spec("vllm")
    if spec is None:
        pytest.skip("vllm is not installed (requirements-vllm.txt)")
    interface = Path(spec.origin).parent / "vllm_flash_attn" / "flash_attn_interface.py"
    loader = importlib.util.spec_from_file_location("_fa_interface_under_test", interface)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)  # its relative imports of the libraries fail: caught
    seen: list[tuple] = []
    monkeypatch.setattr(
        torch.ops._vllm_fa3_C, "fwd", lambda *a: seen.append(a) or (a[6], None, None, None),
        raising=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    query = torch.randn(6, 8, 64, generator=g).to(torch.float8_e4m3fn)
    key_cache = torch.randn(5, 16, 2, 64, generator=g).to(torch.float8_e4m3fn)
    value_cache = torch.randn(5, 16, 2, 64, generator=g).to(torch.float8_e4m3fn)
    out = torch.empty(6, 8, 64, dtype=torch.bfloat16)
    block_table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    cu_seqlens_q = torch.tensor([0, 4, 6], dtype=torch.int32)
    seq_lens = torch.tensor([20, 9], dtype=torch.int32)
    descales = [torch.rand(2, 2, generator=g) for _ in range(3)]
    sinks = torch.randn(8, generator=g)
    common = dict(max_seqlen_q=4, max_seqlen_k=20, causal=False, softmax_scale=0.3)
    call = PagedCall(query, key_cache, value_cache, out, block_table, cu_seqlens_q, seq_lens,
                     **common, window=(7, 5), sinks=sinks)  # fmt: skip
    fa3_peer.fwd_call(
        call, q_descale=descales[0], k_descale=descales[1], v_descale=descales[2]
    )()  # fmt: skip
    module.flash_attn_varlen_func(
        query, key_cache, value_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seq_lens,
        block_table=block_table, out=out, q_descale=descales[0], k_descale=descales[1],
        v_descale=descales[2], window_size=[7, 5], s_aux=sinks, fa_version=3, **common,
    )  # fmt: skip
    ours, theirs = seen
    assert len(ours) == len(theirs)
    for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert type(a) is type(b) and (a is b or a == b), (index, a, b)


def test_a_killed_run_leaves_the_finished_steps_in_out(tmp_path):
    """The whole command killed mid-step (as the device tool's limit would): the summary and
    the tarball in $OUT hold every step finished before (the hanging job's own `timeout` still
    ends it at its box)."""
    import time

    env = {**os.environ, "GPU_CHECK_STUB_HANG": "benchmarks.attention"}
    process = subprocess.Popen(
        [sys.executable, "-m", "tools.gpu_check", str(tmp_path), "--dry-run"],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    steps: list[str] = []
    deadline = time.monotonic() + 30
    while "correctness" not in steps and time.monotonic() < deadline:
        time.sleep(0.1)
        if (tmp_path / plan.SUMMARY).is_file():
            steps = [s["step"] for s in json.loads((tmp_path / plan.SUMMARY).read_text())["steps"]]
    process.kill()
    process.wait()
    summary = json.loads((tmp_path / plan.SUMMARY).read_text())
    assert [s["step"] for s in summary["steps"]] == list(plan.STEP_NAMES[:5])
    assert summary["complete"] is False
    with tarfile.open(tmp_path / plan.LOGS) as tar:
        assert "gpu_check/correctness-pytest.log" in tar.getnames()
