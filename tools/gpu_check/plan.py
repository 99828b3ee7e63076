"""The GPU check's plan: its steps in order with their time boxes, what travels to the GPU
machine, and the ``run`` call that takes it there (no torch import).

The order puts the results most wanted first and the long tail last: a step cut by the budget
loses the least. Every step's jobs run in their own processes under ``timeout -k``; the boxes
plus each job's kill grace plus the packing reserve fit the lease's one command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# One command on the GPU machine, at most: its time limit is 10 minutes, but a 15-minute lease
# (the machine's start of 1-2 minutes included) must leave room for one rerun.
BUDGET_S = 420.0
# What the `run` call's own timeout gives the command: the budget and some slack.
RUN_TIMEOUT_S = 480
# Seconds between a time box's SIGTERM and its SIGKILL (`timeout -k`).
KILL_AFTER_S = 2.0
# Seconds kept back for the last summary and the tarball.
PACK_RESERVE_S = 6.0
# A step is skipped when less than this is left of its box: too short to finish anything.
MIN_STEP_S = 5.0
# The dry run on a CPU divides every box by this (its stubs sleep a fraction of a second).
DRY_RUN_SCALE = 20.0


@dataclass(frozen=True)
class StepSpec:
    """One step: ``name``, its time box in seconds, and whether a failure fails the check."""

    name: str
    box_s: float
    gating: bool
    what: str


# Steps in the order they run. `build` runs only where the carried extension is missing or
# does not load; its time comes out of the later steps' share (each box is cut to what is
# left of the budget).
STEPS = (
    StepSpec("environment", 10, False, "nvidia-smi, python, torch, triton, nvcc versions"),
    StepSpec("build", 150, True, "fallback only: build _C here when the carried one is missing"),
    StepSpec("smoke", 30, True, "one launch of each backend, each in its own process"),
    StepSpec(
        "sanitize",
        90,
        True,
        "compute-sanitizer memcheck, racecheck, synccheck on one launch of every kernel kind",
    ),
    StepSpec(
        "correctness",
        120,
        True,
        "pytest -n 8 -v over the GPU tests: every backend and family against the reference, "
        "LSE/merge, plan + CUDA-graph replay, windows and sinks",
    ),
    StepSpec("benchmark", 120, False, "the drafter grid, every family and the peers that travel"),
    StepSpec("accuracy", 30, False, "BF16 vs FP8 query against float64, if time is left"),
)
STEP_NAMES = tuple(step.name for step in STEPS)
# Steps planned on every run (the build is a fallback: its box is not in the plan's sum).
PLANNED = tuple(step for step in STEPS if step.name != "build")


def planned_seconds() -> float:
    """The planned steps' boxes, each job's kill grace and the packing reserve, in seconds.

    Jobs of one step run side by side, so a step costs its box plus one kill grace.
    """
    return sum(step.box_s + KILL_AFTER_S for step in PLANNED) + PACK_RESERVE_S


# What travels to the GPU machine besides the tracked files: ignored folders that
# scripts/prepare_gpu_check.sh fills. PREPARED holds the extension built for the device's
# Python and the CUTLASS headers for the fallback build.
PREPARED = ".gpu_check"
CARRY = (PREPARED, ".dsl/wgmma", ".peers")
# The device tool's limit on the working tree plus the carried paths.
CARRY_LIMIT_BYTES = 64 * 2**20
# At most this many files come back from $OUT.
MAX_OUT_FILES = 8
SUMMARY = "summary.json"
LOGS = "logs.tar.gz"


def run_call() -> dict[str, object]:
    """The device tool's ``run`` arguments for the whole check."""
    return {
        "carry": list(CARRY),
        "command": 'bash scripts/gpu_check.sh "$OUT"',
        "timeout_s": RUN_TIMEOUT_S,
    }
