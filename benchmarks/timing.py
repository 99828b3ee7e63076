"""Timing: medians of CUDA-event-timed CUDA-graph replays over rotated inputs.

One graph holds one call per rotated input copy, in sequence, so each call reads KV that the
previous calls have pushed out of L2 (the copies together span several times the L2 size), and
launch gaps shrink to graph-replay gaps. A backend whose call cannot be captured is timed eagerly
over the same copies; the row says which. On CPU the numbers are wall-clock and not meaningful.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Rotated copies should span this many L2 sizes; at most MAX_COPIES copies.
L2_MULTIPLE = 3
MAX_COPIES = 64
# Timed replays: enough for a stable median, about TARGET_MS of device time, within bounds.
TARGET_MS = 200.0
MIN_REPS, MAX_REPS = 10, 200
COPY_BYTES = 2**30
# Seconds of back-to-back work before sampling: the clocks of an idle GPU take a while to rise
# (an H200 idles at 345 MHz SM clock, 1980 MHz under load).
WARMUP_S = 0.05
COPY_WARMUP_S = 0.3


@dataclass(frozen=True)
class Timing:
    median_us: float  # per call
    method: str  # "cuda_graph", "cuda_events_eager" or "cpu_wall_clock"
    reps: int
    spread: float  # (p90 - p10) / median of the per-call times, 0 for a single rep


def rotation_count(bytes_per_copy: int, device: torch.device) -> int:
    """How many input copies make the rotation span ``L2_MULTIPLE`` times the L2 cache."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, min(MAX_COPIES, -(-L2_MULTIPLE * l2 // max(bytes_per_copy, 1))))


def _summarise(samples_ms: list[float], calls: int, method: str) -> Timing:
    per_call = sorted(1e3 * s / calls for s in samples_ms)
    median = statistics.median(per_call)
    if len(per_call) > 1:
        deciles = statistics.quantiles(per_call, n=10)
        spread = (deciles[-1] - deciles[0]) / median
    else:
        spread = 0.0
    return Timing(median_us=median, method=method, reps=len(per_call), spread=spread)


def _event_samples(step: Callable[[], None], reps: int) -> list[float]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]


def _warm_up(step: Callable[[], None], seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        step()
        torch.cuda.synchronize()


def _reps_for(step: Callable[[], None]) -> int:
    """Repetitions that take about TARGET_MS, from a three-run estimate."""
    estimate = statistics.median(_event_samples(step, 3))
    return int(min(MAX_REPS, max(MIN_REPS, TARGET_MS / max(estimate, 1e-3))))


def _capture(calls: Sequence[Callable[[], None]]) -> torch.cuda.CUDAGraph:
    # Warm-up on a side stream first, as torch.cuda.graphs asks, so lazy initialisation
    # (autotuning, workspace allocation) happens outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph


def time_calls(calls: Sequence[Callable[[], None]], device: torch.device) -> Timing:
    """Median time of one call, each call on its own input copy; warm-up included.

    On CPU each call runs once (the dry run's interpreter is slow) and the wall clock is kept.
    """
    if device.type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return _summarise([1e3 * (time.perf_counter() - start)], len(calls), "cpu_wall_clock")

    def eager() -> None:
        for call in calls:
            call()

    try:
        graph = _capture(calls)
        step, method = graph.replay, "cuda_graph"
    except Exception:  # whatever breaks the capture, the eager calls can still be timed
        torch.cuda.synchronize()
        step, method = eager, "cuda_events_eager"
    _warm_up(step, WARMUP_S)
    samples = _event_samples(step, _reps_for(step))
    return _summarise(samples, len(calls), method)


def copy_bandwidth(device: torch.device) -> float | None:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), or None off CUDA."""
    if device.type != "cuda":
        return None
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_()
    target = torch.empty_like(source)

    def step() -> None:
        target.copy_(source)

    _warm_up(step, COPY_WARMUP_S)
    timing = _summarise(_event_samples(step, 30), 1, "cuda_events_eager")
    return 2 * COPY_BYTES / (timing.median_us * 1e-6) / 1e9
