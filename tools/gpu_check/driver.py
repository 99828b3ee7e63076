"""Runs the plan (plan.py) step by step and keeps every result.

Each step's jobs run side by side, each in its own process under ``timeout -k``, its output in
its own log. After every step the JSON summary is rewritten atomically (a temporary file, then
``os.replace``) and the logs are packed into one tarball the same way, so a kill at any moment
leaves the last complete summary and tarball in ``$OUT``. A step that fails, hangs or is skipped
is recorded with the reason and the next step runs; the exit status is 1 when any gating step
(smoke, sanitizers, correctness, the fallback build) did not pass.

``--dry-run`` runs the same driver on a CPU: ``nvidia-smi`` and ``compute-sanitizer`` are stubs
found first on ``PATH``, every GPU job's Python module is replaced by the stub runner, and every
time box is divided by ``DRY_RUN_SCALE``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .backends import CUDA_FAMILIES, DSL_FAMILIES, backend_request, runs_on
from .plan import (
    BUDGET_S,
    DRY_RUN_SCALE,
    KILL_AFTER_S,
    LOGS,
    MIN_STEP_S,
    PACK_RESERVE_S,
    PREPARED,
    REPO,
    STEPS,
    SUMMARY,
    StepSpec,
)

SCHEMA_VERSION = 1
STUBS = REPO / "tests" / "gpu_check_stubs"
# compute-sanitizer instruments only kernels whose mangled names hold one of these: the
# mma_sync attention and merge kernels, the cache write (CUDA and Triton alike) and the DSL
# families' classes (WgmmaPagedAttention, Tcgen05PagedAttention); torch's own kernels run
# uninstrumented.
KERNEL_SUBSTRINGS = (
    "paged_attention_kernel",
    "merge_splits_kernel",
    "reshape_and_cache_kernel",
    "PagedAttention",
)
SANITIZER_TOOLS = ("memcheck", "racecheck", "synccheck")
# The correctness step's tests: those marked gpu and those that run on the GPU when there is
# one (conftest's DEVICE); kernel builds, emulations and the engine are not GPU tests.
TEST_FILES = (
    "tests/test_gpu_matrix.py",
    "tests/test_cuda_gpu.py",
    "tests/test_triton_attention.py",
    "tests/test_triton_cache.py",
    "tests/test_lse_merge.py",
    "tests/test_plan.py",
    "tests/test_window_sinks.py",
    "tests/test_dsl_families.py",
    "tests/test_api.py",
)
TEST_SELECTION = "not (compile or emulation or engine or sass_model)"
# The CUDA tests again with a DSL family asked for (mma_sync runs what the family refuses).
FAMILY_TEST_FILES = ("tests/test_cuda_gpu.py", "tests/test_plan.py", "tests/test_lse_merge.py")
PYTEST_WORKERS = 8
FAMILY_PYTEST_WORKERS = 4
# A test that runs longer hangs: pytest-timeout ends it and the next test runs.
TEST_TIMEOUT_S = 60
MAX_FAILURES = 25
# The peers the benchmark runs besides ours (FlashInfer: over 560 MB, it cannot travel).
BENCHMARK_PEERS = ("vllm_triton_unified", "fa3_fp8_query", "torch_sdpa", "flashinfer")
# The benchmark's own budget inside its box: imports and its last shape fit in the rest.
BENCHMARK_SHARE = 0.8
FAILED_TEST = re.compile(r"\b(?:FAILED|ERROR) (tests/\S+)")


@dataclass
class Job:
    """One process of a step: ``argv`` with ``env`` added to the driver's environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class JobResult:
    name: str
    status: str  # passed, failed or timed_out
    rc: int
    seconds: float
    log: Path

    def fields(self) -> dict[str, object]:
        return {
            "name": self.name,
            "status": self.status,
            "rc": self.rc,
            "seconds": round(self.seconds, 2),
            "log": self.log.name,
        }


def job_status(rc: int) -> str:
    """``timeout`` exits 124 when its TERM ended the job, 137 when its KILL had to."""
    if rc == 0:
        return "passed"
    return "timed_out" if rc in (124, 137, -9) else "failed"


def atomic_write(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data)
    os.replace(temporary, path)


class Check:
    """One run of the plan into ``out``."""

    def __init__(self, out: Path, dry_run: bool, budget_s: float = BUDGET_S) -> None:
        self.out = out
        self.dry_run = dry_run
        self.scale = 1 / DRY_RUN_SCALE if dry_run else 1.0
        self.started = time.monotonic()
        self.deadline = self.started + (budget_s - PACK_RESERVE_S) * self.scale
        self.work = Path(tempfile.mkdtemp(prefix="gpu_check-"))
        self.logs = self.work / "logs"
        self.logs.mkdir()
        self.env = dict(os.environ)
        self.env["PYTHONUNBUFFERED"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        dsl_dirs = [str(REPO / ".dsl" / family) for family in DSL_FAMILIES]
        self.env["FP8NCA_DSL_LIBRARY_DIR"] = os.pathsep.join(dsl_dirs)
        if dry_run:
            self.env["PATH"] = os.pathsep.join([str(STUBS), self.env.get("PATH", "")])
        self.environment: dict[str, object] = {}
        self.summary: dict[str, object] = {
            "schema": SCHEMA_VERSION,
            "dry_run": dry_run,
            "budget_s": budget_s * self.scale,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "complete": False,
            "elapsed_s": 0.0,
            "environment": self.environment,
            "steps": [],
            "exit_code": None,
        }

    # ---- running jobs
    def python(self, module: str, *args: str) -> list[str]:
        """A Python job's argv; in the dry run the stub runner stands in for ``module``."""
        if self.dry_run:
            return [sys.executable, str(STUBS / "gpu_step.py"), module, *args]
        return [sys.executable, "-m", module, *args]

    def box(self, spec: StepSpec) -> float:
        """The step's box, cut to what is left of the budget (each job's kill grace too)."""
        left = self.deadline - time.monotonic() - KILL_AFTER_S * self.scale
        return min(spec.box_s * self.scale, left)

    def run_jobs(self, step: str, jobs: list[Job], box_s: float) -> list[JobResult]:
        """Start every job under ``timeout -k``, wait for all; results in the jobs' order."""
        running = []
        for job in jobs:
            log = self.logs / f"{step}-{job.name}.log"
            handle = log.open("wb")
            argv = [
                "timeout", "-k", f"{KILL_AFTER_S * self.scale:.3f}", "-s", "TERM",
                f"{box_s:.3f}", *job.argv,
            ]  # fmt: skip
            handle.write(("+ " + " ".join(job.argv) + "\n").encode())
            handle.flush()
            started = time.monotonic()
            process = subprocess.Popen(
                argv, cwd=REPO, env={**self.env, **job.env}, stdout=handle, stderr=subprocess.STDOUT
            )
            running.append((job, process, handle, log, started))
        results = []
        for job, process, handle, log, started in running:
            rc = process.wait()
            handle.close()
            seconds = time.monotonic() - started
            results.append(JobResult(job.name, job_status(rc), rc, seconds, log))
        return results

    # ---- recording
    def record(self, spec: StepSpec, status: str, seconds: float, **extra: object) -> dict:
        entry = {
            "step": spec.name,
            "status": status,
            "gating": spec.gating,
            "seconds": round(seconds, 2),
            "box_s": round(spec.box_s * self.scale, 3),
            "jobs": [],
            "figures": {},
            "failing_tests": [],
            "reason": "",
            **extra,
        }
        self.summary["steps"].append(entry)
        self.flush()
        return entry

    def flush(self) -> None:
        """Rewrite the summary and the log tarball (each atomically)."""
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 2)
        summary = json.dumps(self.summary, indent=1) + "\n"
        (self.logs / SUMMARY).write_text(summary)
        temporary = self.out / f".{LOGS}.tmp"
        with tarfile.open(temporary, "w:gz") as tar:
            tar.add(self.logs, arcname="gpu_check")
        os.replace(temporary, self.out / LOGS)
        atomic_write(self.out / SUMMARY, summary.encode())

    def run_step(self, spec: StepSpec, jobs: list[Job], skip_reason: str = "") -> dict:
        """Run ``jobs`` as step ``spec`` (or record it skipped) and record the outcome."""
        if skip_reason or not jobs:
            return self.record(spec, "skipped", 0.0, reason=skip_reason or "nothing to run")
        box = self.box(spec)
        if box < MIN_STEP_S * self.scale:
            return self.record(
                spec, "skipped", 0.0, reason=f"{max(box, 0):.0f} s of the budget left"
            )
        started = time.monotonic()
        results = self.run_jobs(spec.name, jobs, box)
        statuses = {result.status for result in results}
        status = next(s for s in ("timed_out", "failed", "passed") if s in statuses)
        return self.record(
            spec,
            status,
            time.monotonic() - started,
            box_s=round(box, 3),
            jobs=[result.fields() for result in results],
            failing_tests=failing_tests(results),
        )

    # ---- the steps
    def run(self) -> int:
        install_prepared_extension()
        steps = {spec.name: spec for spec in STEPS}
        self.step_environment(steps["environment"])
        self.step_build(steps["build"])
        self.step_smoke(steps["smoke"])
        self.step_sanitize(steps["sanitize"])
        self.step_correctness(steps["correctness"])
        self.step_benchmark(steps["benchmark"])
        self.step_accuracy(steps["accuracy"])
        failed = [
            s["step"] for s in self.summary["steps"] if s["gating"] and s["status"] != "passed"
            and s["status"] != "skipped"
        ]  # fmt: skip
        self.summary["complete"] = True
        self.summary["failed_steps"] = failed
        self.summary["exit_code"] = 1 if failed else 0
        self.flush()
        shutil.rmtree(self.work, ignore_errors=True)
        return self.summary["exit_code"]

    def step_environment(self, spec: StepSpec) -> None:
        query = "name,compute_cap,driver_version,memory.total,clocks.max.sm"
        jobs = [
            Job("nvidia-smi", ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"]),
            Job("versions", self.python("tools.gpu_check.environment")),
        ]
        entry = self.run_step(spec, jobs)
        smi = (self.logs / "environment-nvidia-smi.log").read_text().splitlines()[1:]
        fields = [part.strip() for part in smi[0].split(",")] if smi else []
        if len(fields) >= 2:
            self.environment.update(gpu=fields[0], capability=fields[1], nvidia_smi=smi[0])
        self.environment.update(last_json(self.logs / "environment-versions.log"))
        entry["figures"] = dict(self.environment)
        self.flush()

    @property
    def capability(self) -> str:
        return str(self.environment.get("capability", "unknown"))

    @property
    def extension_loads(self) -> bool:
        return self.environment.get("c_extension") == "loads"

    def step_build(self, spec: StepSpec) -> None:
        if self.extension_loads:
            self.run_step(spec, [], "the carried _C loads")
            return
        why = self.environment.get("c_extension", "the environment step did not say")
        out = str(REPO / "fp8_noncausal_attn")
        entry = self.run_step(
            spec, [Job("cmake", self.python("tools.gpu_check.build", "--out", out))]
        )
        entry["reason"] = f"the carried _C does not load: {why}"
        if entry["status"] == "passed":
            self.environment["c_extension"] = "loads"
        self.flush()

    def backends(self) -> tuple[list[str], list[str]]:
        """(our backends that can run here, the reasons of those that cannot)."""
        live, reasons = [], []
        for name in ("reference", "triton", *CUDA_FAMILIES):
            why = runs_on(name, self.capability)
            if why is None and name in CUDA_FAMILIES and not self.extension_loads:
                why = f"{name}: skipped, _C does not load"
            if why is None and name in DSL_FAMILIES and not self.environment.get(f"{name}_library"):
                why = f"{name}: skipped, no library at .dsl/{name} (scripts/prepare_gpu_check.sh)"
            if why is None:
                live.append(name)
            else:
                reasons.append(why)
        return live, reasons

    def backend_env(self, name: str) -> dict[str, str]:
        return backend_request(name)[1]

    def step_smoke(self, spec: StepSpec) -> None:
        live, reasons = self.backends()
        jobs = [Job(name, self.python("tools.gpu_check.smoke", name)) for name in live]
        entry = self.run_step(spec, jobs)
        entry["reason"] = "; ".join(reasons)
        entry["figures"] = {job["name"]: last_json(self.logs / job["log"]) for job in entry["jobs"]}
        self.flush()

    def step_sanitize(self, spec: StepSpec) -> None:
        live, _ = self.backends()
        filters = [arg for s in KERNEL_SUBSTRINGS for arg in ("--kernel-name", f"kns={s}")]
        launches = self.python("tools.gpu_check.sanitize", *[b for b in live if b != "reference"])
        jobs = [
            Job(
                tool,
                ["compute-sanitizer", "--tool", tool, "--error-exitcode", "3",
                 "--print-limit", "20", *filters, *launches],
                {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
            )
            for tool in SANITIZER_TOOLS
        ]  # fmt: skip
        self.run_step(spec, jobs)

    def step_correctness(self, spec: StepSpec) -> None:
        live, _ = self.backends()
        common = ["-v", "-p", "no:cacheprovider", "--timeout", str(TEST_TIMEOUT_S),
                  "--maxfail", str(MAX_FAILURES)]  # fmt: skip
        files = list(TEST_FILES) if self.extension_loads else [
            f for f in TEST_FILES if "cuda" not in f and "dsl" not in f and "matrix" not in f
        ]  # fmt: skip
        deselect = [] if self.extension_loads else ["-k", "not cuda"]
        jobs = [
            Job("pytest", self.python("pytest", "-n", str(PYTEST_WORKERS), *common,
                                      "-m", TEST_SELECTION, *deselect, *files)),
        ]  # fmt: skip
        for family in DSL_FAMILIES:
            if family in live:
                argv = self.python("pytest", "-n", str(FAMILY_PYTEST_WORKERS), *common, "-m",
                                   "gpu", *FAMILY_TEST_FILES)  # fmt: skip
                jobs.append(Job(f"pytest-{family}", argv, self.backend_env(family)))
        self.run_step(spec, jobs)

    def step_benchmark(self, spec: StepSpec) -> None:
        live, _ = self.backends()
        ours = [b for b in live if b != "reference"]
        result_dir = self.work / "benchmark"
        budget = max(1.0, self.box(spec) * BENCHMARK_SHARE)
        argv = self.python(
            "benchmarks.attention", "--grid", "--no-accuracy", "--time-budget", f"{budget:.0f}",
            "--backends", ",".join([*ours, *BENCHMARK_PEERS]), "--out", str(result_dir),
        )  # fmt: skip
        entry = self.run_step(spec, [Job("grid", argv)])
        entry["figures"] = benchmark_figures(result_dir)
        self.keep_results(result_dir, "benchmark")
        self.flush()

    def step_accuracy(self, spec: StepSpec) -> None:
        result_dir = self.work / "accuracy"
        argv = self.python("benchmarks.accuracy", "--preset", "quick", "--out", str(result_dir))
        self.run_step(spec, [Job("study", argv)])
        self.keep_results(result_dir, "accuracy")
        self.flush()

    def keep_results(self, folder: Path, stem: str) -> None:
        """The step's JSON and Markdown into the logs and, renamed, into ``$OUT``."""
        for suffix in (".json", ".md"):
            for path in sorted(folder.glob(f"*{suffix}"))[:1]:
                shutil.copy(path, self.logs / path.name)
                atomic_write(self.out / f"{stem}{suffix}", path.read_bytes())


def install_prepared_extension() -> None:
    """Copy the carried ``_C`` for this interpreter into the package (if not there yet)."""
    name = f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    carried = REPO / PREPARED / name
    target = REPO / "fp8_noncausal_attn" / name
    if carried.is_file() and not target.is_file():
        shutil.copy(carried, target)


def last_json(log: Path) -> dict:
    """The last line of ``log`` that parses as a JSON object ({} if none)."""
    if not log.is_file():
        return {}
    for line in reversed(log.read_text(errors="replace").splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return {}


def failing_tests(results: list[JobResult]) -> list[str]:
    """Test ids that pytest -v printed as FAILED or ERROR, in order, once each."""
    found: dict[str, None] = {}
    for result in results:
        if result.log.is_file():
            for match in FAILED_TEST.finditer(result.log.read_text(errors="replace")):
                found[f"{result.name}: {match.group(1)}"] = None
    return list(found)


def benchmark_figures(folder: Path) -> dict[str, object]:
    """Each row's fraction of the copy bandwidth measured in the same run, by shape (with its
    cache format) and backend, and the skipped pairs' reasons by backend and cache format."""
    files = sorted(folder.glob("*.json"))
    if not files:
        return {}
    payload = json.loads(files[0].read_text())
    rows = {}
    for row in payload.get("rows", []):
        label = f"b{row['batch']} q{row['q_len']} kv{row['kv_len']} {row['kv_cache_dtype']}"
        rows.setdefault(label, {})[row["backend"]] = {
            "frac_of_copy_bw": row.get("frac_of_copy_bw"),
            "median_us": row.get("median_us"),
            "rel_err": row.get("rel_err"),
        }
    reasons = {
        f"{s['backend']} {s['kv_cache_dtype']}": s["reason"] for s in payload.get("skipped", [])
    }
    return {
        "copy_bw_gbps": payload.get("copy_bw_gbps"),
        "complete": payload.get("complete"),
        "rows": rows,
        "skipped": reasons,
        "backends": {name: info["status"] for name, info in payload.get("backends", {}).items()},
    }
