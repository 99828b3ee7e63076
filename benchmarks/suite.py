"""The benchmark run: the accuracy study, then every shape of a preset through every backend.

A backend that is unavailable, does not support a shape or fails on it is recorded with the
reason and the run goes on. Each measured row is checked against the float32 oracle on the
same inputs before it is timed (outputs start as NaN, so unwritten elements show).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import platform
import re
import sys
import time
from pathlib import Path

import torch

from fp8_noncausal_attn.scales import is_per_token_head
from fp8_noncausal_attn.synthetic import relative_error
from tools.sass_model.hardware import dense_16bit_peak

from . import report
from .accuracy import accuracy_shapes, run_accuracy
from .inputs import Case, make_case
from .oracle import attention_oracle
from .peers import Adapter, Unsupported, adapters, failure_reason
from .shapes import BYTES_NOTE, PRESETS, Shape
from .timing import copy_bandwidth, rotation_count, time_calls

# SPEC §7 tolerances against the float32 reference on the same cache.
TOLERANCE = {"bfloat16": 1e-2, "float16": 5e-3}
# Wall-clock seconds each peer may spend in a preset (FlexAttention compiles every shape anew,
# about as long as the rest of --quick): past it the peer is skipped on the remaining shapes,
# with that reason. Our backends are never cut.
PEER_BUDGET_S = {"quick": 40.0, "grid": 15.0}
# torch.compile recompiles FlexAttention for every shape; past its default limit it would
# silently fall back to the unfused eager implementation.
RECOMPILE_LIMIT = 1024
# Device memory the rotated input copies of one shape may take. A copy clones the whole cache,
# also the pages a window never reads, so a short window over a long context cannot be given
# as many copies as its bytes would ask for (fewer copies show in the row's rotated_copies).
MAX_ROTATION_BYTES = 32 * 2**30


def _scale_key(scale: torch.Tensor) -> tuple:
    """Which oracle a backend's scales ask for: per-head scales by value (a peer's scalar
    stand-in is a new tensor each time), per-token-head ones by the view they are (the case's
    own, far too many to compare by value)."""
    if is_per_token_head(scale):
        return (scale.data_ptr(), tuple(scale.shape), tuple(scale.stride()))
    return tuple(scale.tolist())


class ShapeRun:
    """One shape: its input copies, oracle outputs, and a row or a skip per backend."""

    def __init__(self, shape: Shape, device: torch.device, seed: int) -> None:
        self.shape = shape
        self.device = device
        case = make_case(shape, device, seed)
        copies = min(
            rotation_count(shape.bytes, device), max(1, MAX_ROTATION_BYTES // case.storage_bytes)
        )
        self.copies: list[Case] = [case] + [case.clone_storage() for _ in range(copies - 1)]
        self._oracles: dict[tuple, torch.Tensor] = {}

    def oracle(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
        key = (_scale_key(k_scale), _scale_key(v_scale))
        if key not in self._oracles:
            self._oracles[key] = attention_oracle(self.copies[0], torch.float32, k_scale, v_scale)
        return self._oracles[key]

    def measure(self, adapter: Adapter, copy_bw: float | None, tensor_peak: float | None) -> dict:
        """The row of ``adapter`` on this shape; raises the backend's error if it fails.
        ``copy_bw`` (GB/s) and ``tensor_peak`` (dense 16-bit FLOP/s) are the GPU's yardsticks,
        None where unknown."""
        shape = self.shape
        prepared = [adapter.prepare(case) for case in self.copies]
        # The output checked is the one the timed calls (graph replays on a GPU) wrote.
        timing = time_calls([call.run for call in prepared], self.device)
        rel_err = relative_error(
            prepared[0].result(), self.oracle(*adapter.given_scales(self.copies[0]))
        )
        finite = math.isfinite(rel_err)  # NaN: an element was left unwritten or overflowed
        seconds = timing.median_us * 1e-6
        gbps = shape.bytes / seconds / 1e9
        flops_per_s = shape.flops / seconds
        return {
            **shape.fields(),
            "backend": adapter.name,
            "median_us": timing.median_us,
            "bytes": shape.bytes,
            # What the call would move if it read the whole context (the window's comparison).
            "context_bytes": dataclasses.replace(shape, window=(-1, -1)).bytes,
            "gbps": gbps,
            "frac_of_copy_bw": None if copy_bw is None else gbps / copy_bw,
            "tflops": flops_per_s / 1e12,
            # The mask's FLOPs over the dense 16-bit tensor peak: a prefill's yardstick.
            "frac_of_tensor_peak": None if tensor_peak is None else flops_per_s / tensor_peak,
            "rel_err": rel_err if finite else None,
            "within_tolerance": finite and rel_err <= TOLERANCE[shape.query_dtype],
            "timing_method": timing.method,
            "timing_reps": timing.reps,
            "timing_spread": timing.spread,
            "rotated_copies": len(prepared),
            "speedup": {},
        }


def _add_speedups(rows: list[dict], ours: set[str]) -> None:
    """Our rows get ``speedup[peer] = peer time / our time`` for each peer on the same shape."""
    peers = {row["backend"]: row["median_us"] for row in rows if row["backend"] not in ours}
    for row in rows:
        if row["backend"] in ours:
            row["speedup"] = {name: us / row["median_us"] for name, us in sorted(peers.items())}


def _environment(device: torch.device) -> dict:
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            {
                "gpu_name": props.name,
                "compute_capability": f"{props.major}.{props.minor}",
                "sm_count": props.multi_processor_count,
                "l2_bytes": props.L2_cache_size,
                "cuda": torch.version.cuda,
            }
        )
    return env


def _timing_note(device: torch.device) -> str:
    if device.type != "cuda":
        return "CPU dry run: timings are CPU wall-clock and NOT meaningful."
    return (
        "Times: median per call of CUDA-graph replays (CUDA events), each graph one call per "
        "rotated input copy spanning 3x L2 (eager calls where the timing column says so)."
    )


def _print_summary(payload: dict, paths: list[Path]) -> None:
    copy_bw = payload["copy_bw_gbps"]
    print(
        f"\n{payload['gpu']}  copy bandwidth: {'-' if copy_bw is None else f'{copy_bw:.0f}'} GB/s"
    )
    print(payload["timing_note"])
    print(payload["bytes_note"])
    header = f"{'shape':<52} {'backend':<20} {'us':>9} {'GB/s':>7} {'%copy':>6} {'%peak':>6}"
    print(header + f" {'rel_err':>8}  speedups  (%peak: dense 16-bit tensor peak, prefill rows)")
    for row in payload["rows"]:
        copy_pct, peak_pct = report.yardstick_fractions(row)
        speedups = " ".join(f"{peer}={x:.2f}x" for peer, x in row["speedup"].items())
        print(
            f"{report.shape_label(row):<52} {row['backend']:<20} {row['median_us']:>9.1f} "
            f"{row['gbps']:>7.0f} {report.fmt(copy_pct):>6} {report.fmt(peak_pct):>6} "
            f"{report.fmt(row['rel_err']):>8}  {speedups}"
        )
    for entry in payload["accuracy"]:
        result = entry.get("error") or f"rel_err vs float64 {entry['rel_err']:.2e}"
        print(
            f"accuracy kv{entry['kv_len']:<7} {entry['route']:<20} {entry['backend']:<16} {result}"
        )
    for line in report.goals(payload):
        print(f"goal: {line}")
    print(f"skipped (backend, shape) pairs: {len(payload['skipped'])}")
    for path in paths:
        print(f"wrote {path}")


def _live_backends(device: torch.device, only: set[str] | None) -> tuple[dict, list[Adapter]]:
    """({name: {"status", "note"}} for every candidate, the adapters that can run here)."""
    backends, live = {}, []
    for adapter in adapters(device):
        if only is not None and adapter.name not in only:
            continue
        try:
            why_not = adapter.unavailable(device)
        except Exception as error:  # a peer's import may fail in any way
            why_not = failure_reason(error)
        backends[adapter.name] = {"status": why_not or "ok", "note": adapter.note}
        if why_not is None:
            live.append(adapter)
        print(f"backend {adapter.name}: {why_not or 'ok'}", flush=True)
    return backends, live


def _measure_shape(
    run: ShapeRun,
    live: list[Adapter],
    yardsticks: tuple[float | None, float | None],
    peer_allowance: dict[str, float],
) -> tuple[list[dict], list[dict]]:
    """(rows, skips) of one shape; ``yardsticks`` = (copy GB/s, dense 16-bit FLOP/s), each
    None where unknown; ``peer_allowance`` is each peer's time left (s), if limited."""
    shape = run.shape
    rows, skipped = [], []
    for adapter in live:
        skip = {**shape.fields(), "backend": adapter.name}
        if peer_allowance.get(adapter.name, 1.0) <= 0:
            skipped.append({**skip, "reason": "this peer's time allowance in the preset is spent"})
            continue
        started = time.perf_counter()
        try:
            row = run.measure(adapter, *yardsticks)
        except Unsupported as error:
            skipped.append({**skip, "reason": str(error)})
            continue
        except Exception as error:  # one failing backend must not end the run (ours either)
            skipped.append({**skip, "reason": failure_reason(error)})
            continue
        finally:
            if adapter.name in peer_allowance:
                peer_allowance[adapter.name] -= time.perf_counter() - started
        rows.append(row)
        print(
            f"{shape.label():<52} {adapter.name:<20} {row['median_us']:9.1f} us "
            f"rel_err {report.fmt(row['rel_err'])}",
            flush=True,
        )
    _add_speedups(rows, {a.name for a in live if a.ours})
    return rows, skipped


def run_suite(
    preset: str,
    out_dir: Path,
    device: torch.device,
    *,
    only: set[str] | None = None,
    accuracy: bool = True,
    time_budget_s: float | None = None,
    command: str = "",
) -> list[Path]:
    """Run ``preset`` on ``device``; write JSON, Markdown and PNGs into ``out_dir``.

    The accuracy study runs first (it is short), then the shapes in the preset's order (the
    most important first). The JSON and Markdown are rewritten after every shape, so a run cut
    off from outside still leaves its rows; past ``time_budget_s`` the remaining shapes are
    skipped with that reason and the run ends normally.
    """
    started = time.perf_counter()
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    backends, live = _live_backends(device, only)
    ours = [a for a in live if a.ours]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    peak = dense_16bit_peak(gpu)
    payload = {
        "gpu": gpu,
        "copy_bw_gbps": copy_bandwidth(device),
        # The datasheet's dense BF16/FP16 tensor peak of this GPU (None if not on record).
        "dense_16bit_tflops": None if peak is None else peak[0] / 1e12,
        "dense_16bit_source": None if peak is None else peak[1],
        "date": date,
        "preset": preset,
        "command": command or " ".join(sys.argv),
        "complete": False,
        "timings_meaningful": device.type == "cuda",
        "timing_note": _timing_note(device),
        "bytes_note": BYTES_NOTE,
        "environment": _environment(device),
        "backends": backends,
        "rows": [],
        "skipped": [],
        "accuracy": [],
    }
    stem = f"{date}-{re.sub(r'[^a-z0-9]+', '-', gpu.lower()).strip('-')}"
    if accuracy:
        payload["accuracy"] = run_accuracy(accuracy_shapes(preset), ours, device)
    budget = PEER_BUDGET_S.get(preset)
    peer_allowance = {a.name: budget for a in live if not a.ours and budget is not None}
    for index, shape in enumerate(PRESETS[preset]()):
        elapsed = time.perf_counter() - started
        if time_budget_s is not None and elapsed > time_budget_s:
            reason = f"the run's time budget ({time_budget_s:.0f} s) was spent"
            payload["skipped"] += [
                {**shape.fields(), "backend": a.name, "reason": reason} for a in live
            ]
            continue
        run = ShapeRun(shape, device, seed=index)
        yardsticks = (payload["copy_bw_gbps"], None if peak is None else peak[0])
        rows, skipped = _measure_shape(run, live, yardsticks, peer_allowance)
        payload["rows"] += rows
        payload["skipped"] += skipped
        del run
        if device.type == "cuda":
            torch.cuda.empty_cache()
        report.write_tables(out_dir, stem, payload)
    payload["complete"] = True
    paths = report.write_all(out_dir, stem, payload)
    _print_summary(payload, paths)
    return paths
