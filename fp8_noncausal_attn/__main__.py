"""Demo: a drafter-shaped call through every backend available here, checked against the reference.

``python -m fp8_noncausal_attn``: four sequences of 8 draft tokens over varied contexts,
32 q / 8 kv heads, head_dim 128, page size 16, an FP8 e4m3 cache written by
``reshape_and_cache`` with per-head scales from ``compute_kv_scales``; causal and bidirectional.
Without a GPU, Triton runs in its CPU interpreter (the process re-executes itself with
``TRITON_INTERPRET=1``, which must be set before the kernels are defined).
"""

import argparse
import os
import sys
import time

import torch

DRAFT_TOKENS = 8
CONTEXTS = [120, 517, 700, 64]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fp8_noncausal_attn",
        description=(
            f"Runs a drafter-shaped call ({len(CONTEXTS)} sequences x {DRAFT_TOKENS} draft "
            "tokens, FP8 e4m3 cache with per-head scales, causal and bidirectional) through "
            "every backend available here, checks each against the reference, and prints what "
            "ran, its error and its time. Takes no options."
        ),
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parse_args(argv)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "fp8_noncausal_attn", *sys.argv[1:]])

    import fp8_noncausal_attn as fna
    from fp8_noncausal_attn.synthetic import make_case, relative_error

    device = "cuda" if torch.cuda.is_available() else "cpu"
    backends = fna.available_backends()
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'CPU (no GPU)'}")
    names = [name for name in backends if name != "auto"]
    for name in names:
        state = "available  " if backends[name]["available"] else "unavailable"
        print(f"  {name:<9} {state} {backends[name]['reason']}")
    print(f"  auto -> {backends['auto']['choice']}: {backends['auto']['reason']}")
    print(
        f"\nproblem: {len(CONTEXTS)} sequences x {DRAFT_TOKENS} draft tokens, contexts {CONTEXTS}, "
        "32 q / 8 kv heads, head_dim 128, page 16, FP8 e4m3 cache, per-head scales, bf16 query"
    )
    print(f"\n{'backend':<10} {'mask':<14} {'rel err vs reference':>21} {'time ms':>10}")
    failures = 0
    runnable = [n for n in names if n != "reference" and backends[n]["available"]]
    for causal in (False, True):
        case = make_case(
            [DRAFT_TOKENS] * len(CONTEXTS), [c + DRAFT_TOKENS for c in CONTEXTS],
            num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
            cache_dtype=torch.float8_e4m3fn, query_dtype=torch.bfloat16, causal=causal,
            device=device, seed=2026,
        )  # fmt: skip
        start = time.perf_counter()
        reference = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
        elapsed_ms = (time.perf_counter() - start) * 1e3
        mask = "causal" if causal else "bidirectional"
        print(f"{'reference':<10} {mask:<14} {'(the oracle)':>21} {elapsed_ms:>10.1f}")
        for name in runnable:
            start = time.perf_counter()
            out = fna.paged_attention(*case.args(), **case.kwargs(), backend=name)
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed_ms = (time.perf_counter() - start) * 1e3
            error = relative_error(out, reference)
            ok = error <= 1e-2 and bool(torch.isfinite(out.float()).all())
            failures += not ok
            verdict = "ok" if ok else "FAIL (> 1e-2)"
            print(f"{name:<10} {mask:<14} {error:>21.2e} {elapsed_ms:>10.1f}  {verdict}")
    print()
    if device != "cuda":
        ran_on_cpu = "the PyTorch reference" + (
            " and Triton in its CPU interpreter" if "triton" in runnable else ""
        )
        print(f"times are CPU times of {ran_on_cpu}, not GPU timings")
    if failures:
        print(f"{failures} FAILED")
    elif runnable:
        verb = "agrees" if len(runnable) == 1 else "agree"
        print(f"{' and '.join(runnable)} {verb} with the reference (relative error <= 1e-2)")
    else:
        print("only the reference ran: no other backend is available here, nothing was compared")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
