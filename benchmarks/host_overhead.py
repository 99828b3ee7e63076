"""Host cost of the API: what a call costs the CPU before any kernel runs.

    python -m benchmarks.host_overhead --out DIR [--quick]

Prints a table and writes ``DIR/host-overhead.json`` = ``{"torch_add_us", "run_us",
"paged_attention_us"}``: the median host microseconds (CPU time of the calling thread) of

- ``torch_add_us``: ``torch.add`` on two small CPU tensors (the yardstick: one trivial op);
- ``run_us``: one :meth:`fp8_noncausal_attn.PagedAttention.run` (``out=`` given, as vLLM's
  forward calls it) on a planned drafter batch;
- ``paged_attention_us``: one one-shot :func:`fp8_noncausal_attn.paged_attention` on the same
  batch (``max_seqlen_q/k`` and ``out=`` given);

all in one process, with only the kernel launch (the chosen backend's ``run``) replaced by a
no-op, so the figures are the library's own host path. The drafter batch: 8 sequences x 8 query
tokens over 520 keys, 32 query / 8 KV heads, head_dim 128, FP8 e4m3 cache, per-head scales,
bidirectional. Goals: ``run_us <= 10 x torch_add_us``, ``paged_attention_us <= 40 x
torch_add_us``. Tensors live on the GPU when one is visible, else on the CPU (where ``auto`` is
the reference backend and a one-shot call also checks the lengths it can read on the host).
This is a benchmark, not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import registry
from fp8_noncausal_attn.synthetic import make_case

NUM_SEQS, Q_LEN, KV_LEN = 8, 8, 520
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GOALS = {"run_us": 10, "paged_attention_us": 40}


def median_us(calls: dict[str, Callable[[], object]], count: int, rounds: int) -> dict[str, float]:
    """Per call: the median over ``rounds`` of the mean host time of ``count`` back-to-back
    calls, in us. Host time is this thread's CPU time (``time.thread_time_ns``), so time spent
    descheduled while other processes run does not count; the calls also take turns within each
    round, so what remains of a change in the machine's load weighs on all of them alike."""
    for call in calls.values():  # warm-up: memos, first-call paths
        for _ in range(max(count // 10, 1)):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.thread_time_ns()
            for _ in range(count):
                call()
            samples[name].append((time.thread_time_ns() - start) / count / 1e3)
    return {name: statistics.median(times) for name, times in samples.items()}


def measure(quick: bool) -> tuple[dict[str, float], str, str]:
    """The three figures, the device and the backend that ``auto`` chose."""
    count, rounds = (200, 5) if quick else (1000, 31)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = make_case(
        [Q_LEN] * NUM_SEQS, [KV_LEN] * NUM_SEQS, num_q_heads=NUM_Q_HEADS,
        num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
        cache_dtype=torch.float8_e4m3fn, causal=False, device=device, seed=0,
    )  # fmt: skip
    attn = fna.PagedAttention(
        num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE, query_dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
        device=device, max_num_seqs=NUM_SEQS, max_num_tokens=NUM_SEQS * Q_LEN,
    )  # fmt: skip
    plan = attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=False,
                     max_seqlen_q=Q_LEN, max_seqlen_k=KV_LEN)  # fmt: skip
    kernels = registry.REGISTRY[plan.backend].kernels
    out = torch.empty_like(case.query)
    layer = (case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)

    args, kwargs = case.args(), case.kwargs()  # built once: the harness is not measured
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    calls = {
        "torch_add_us": lambda: torch.add(a, b),
        "run_us": lambda: attn.run(*layer, out=out),
        "paged_attention_us": lambda: fna.paged_attention(*args, **kwargs, out=out),
    }
    real_run = kernels.run
    kernels.run = lambda problem, plan, out: None  # only the kernel launch becomes a no-op
    try:
        figures = median_us(calls, count, rounds)
    finally:
        kernels.run = real_run
    return figures, device.type, plan.backend


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the JSON")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (CI)")
    args = parser.parse_args(argv)
    figures, device, backend = measure(args.quick)
    add = figures["torch_add_us"]
    print(f"host cost per call on {device} (backend {backend}, kernel launch a no-op)")
    print(f"{'call':<22}{'median us':>12}{'x torch.add':>14}{'goal':>10}")
    for name, value in figures.items():
        goal = f"<= {GOALS[name]}x" if name in GOALS else ""
        print(f"{name:<22}{value:>12.2f}{value / add:>14.1f}{goal:>10}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host-overhead.json").write_text(json.dumps(figures, indent=2) + "\n")
    return figures


if __name__ == "__main__":
    main()
