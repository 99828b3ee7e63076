"""Compile every shipped Triton kernel variant for a GPU target, as launched, with no GPU present.

Run in a subprocess without TRITON_INTERPRET (the interpreter replaces kernels with Python
functions), by ``test_triton_compile.py``: ``python tests/helpers/gpu_compile_check.py CC``.
Each variant's launch is captured from the launcher itself (``triton_attention``'s plan and run,
``triton_cache.reshape_and_cache`` on CPU tensors) and compiled with the specialisation Triton's
JIT applies at launch (16-byte divisibility of aligned pointers and of integer arguments that are
multiples of 16, the plan's constexprs, num_warps and num_stages): see
``tools/sass_model/triton_kernels.py``. A cubin with stack or local memory (register spills)
fails the check. Prints the compiler's version (``triton X.Y.Z``), then one ``... ok`` line per
compiled kernel.

The sliding-window and sink variants (the ``WINDOW`` / ``SINKS`` constexprs of the attention
kernel, ``SINKS`` of the merge) are compiled once per flag combination on the drafter's variant:
the other constexprs do not change with them, and each compile costs CI time. So are the
``RETURN_LSE`` variants (``return_lse=True``: the unsplit kernel with sinks, the split launch's
merge) and ``merge_attention_states``' use of the merge (float32 states of a head dim that is not a
power of two, bf16 ones). The ``PER_TOKEN_SCALES`` variants (per-token-head caches, scales inline
in vLLM's page) are compiled for each of their cache dtypes x query dtype, int8 at every head dim,
with a window and sinks, and with the LSE.
"""

from __future__ import annotations

import sys

import torch
import triton

from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.backends.triton import cache as triton_cache
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.scales import CACHE_DTYPES, PER_TOKEN_HEAD_DTYPES
from fp8_noncausal_attn.synthetic import make_case
from fp8_noncausal_attn.validation import validate_attention
from helpers.per_token_head_cases import make_token_head_case, token_head_problem
from tools.sass_model.triton_kernels import captured_launches, compile_launch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SIXTEEN = (torch.bfloat16, torch.float16)


def attention_variants():
    """(cache dtype, query dtype, head_dim, causal, split, tokens) covering every value of each,
    the IEEE fp32-dot variant (a 16-bit cache of the other dtype than the query) at every head
    dim, and every query tile (BLOCK_M 16 / 32 / 64 / 128: tokens x GQA group 4 rows).

    ``causal``: False / True, or a list (per-sequence flags, bool or int32 as vLLM passes them).
    """
    for cache_dtype in FP8 + SIXTEEN:
        for query_dtype in SIXTEEN:
            yield cache_dtype, query_dtype, 128, [True, False], True, 8
    for head_dim in (64, 256):
        yield torch.float8_e4m3fn, torch.bfloat16, head_dim, False, False, 8
        yield torch.bfloat16, torch.float16, head_dim, False, False, 8
        yield torch.float16, torch.bfloat16, head_dim, True, True, 8
    yield torch.float8_e4m3fn, torch.float16, 128, True, False, 8
    yield torch.float8_e5m2, torch.bfloat16, 128, [1, 0], False, 8
    for head_dim in (64, 128, 256):
        for tokens in (4, 16, 32):
            yield torch.float8_e4m3fn, torch.bfloat16, head_dim, False, False, tokens


# (window, sinks, split) on the drafter's variant (e4m3 cache, bf16 query, d128, 8 tokens):
# attention kernel WINDOW=1 SINKS=1 (unsplit: the sinks join there); WINDOW=1 SINKS=0 plus the
# merge with SINKS=1 (split: the sinks join in the merge); WINDOW=0 SINKS=1.
WINDOW_SINK_VARIANTS = (((64, 64), True, False), ((64, 64), True, True), ((-1, -1), True, False))


def token_head_variants():
    """The PER_TOKEN_SCALES variants, as :func:`attention_variants` gives them with a window and
    sinks: every per-token-head cache dtype x query dtype on the drafter's shape (split, mixed
    flags), int8 at every head dim and query tile (the plan's warps differ), and int8 with a
    window and sinks (unsplit)."""
    for cache_dtype in PER_TOKEN_HEAD_DTYPES:
        for query_dtype in SIXTEEN:
            yield cache_dtype, query_dtype, 128, [True, False], True, 8, (-1, -1), False
    for head_dim in (64, 128, 256):
        for tokens in (4, 8, 16, 32):
            if (head_dim, tokens) != (128, 8):
                yield torch.int8, torch.bfloat16, head_dim, False, False, tokens, (-1, -1), False
    yield torch.int8, torch.float16, 128, True, False, 8, (64, 64), True


def drafter_variants():
    """Every variant: (cache dtype, query dtype, head_dim, causal, split, tokens, window, sinks,
    per-token-head scales)."""
    for variant in attention_variants():
        yield *variant, (-1, -1), False, False
    for window, sinks, split in WINDOW_SINK_VARIANTS:
        yield torch.float8_e4m3fn, torch.bfloat16, 128, False, split, 8, window, sinks, False
    for variant in token_head_variants():
        yield *variant, True


def drafter_problem(cache_dtype, query_dtype, head_dim, causal, tokens, window, sinks,
                    token_head):  # fmt: skip
    """The problem of one variant: 2 sequences of ``tokens`` over 40 and 300 keys, 32 / 8 heads.

    ``causal``: a bool, or a list (per-sequence flags, bool or int32 as vLLM passes them)."""
    flags = isinstance(causal, list)
    batch = dict(
        num_q_heads=32, num_kv_heads=8, head_dim=head_dim, query_dtype=query_dtype,
        causal=[bool(c) for c in causal] if flags else causal,
        causal_dtype=torch.int32 if flags and isinstance(causal[0], int) else torch.bool,
    )  # fmt: skip
    sinks = torch.randn(32) if sinks else None
    if token_head:
        case = make_token_head_case([tokens, tokens], [40, 300], cache_dtype=cache_dtype, **batch)
        return token_head_problem(case, window, sinks)
    case = make_case([tokens, tokens], [40, 300], cache_dtype=cache_dtype, scales="none", **batch)
    return validate_attention(*case.args(), **case.kwargs(), softmax_scale=None, out=None,
                              validate=False, window=window, sinks=sinks)  # fmt: skip


def attention_launches():
    """(label, launch) for every attention variant: the kernel and, when split, the merge."""
    for variant in drafter_variants():
        cache_dtype, query_dtype, head_dim, causal, split, tokens, window, sinks, token_head = (
            variant
        )
        problem = drafter_problem(cache_dtype, query_dtype, head_dim, causal, tokens, window,
                                  sinks, token_head)  # fmt: skip
        out = torch.empty_like(problem.query)
        names = ("_paged_attention_kernel", "_merge_splits_kernel")
        with captured_launches(triton_attention, *names) as launches:
            # The launch plan itself: plan() refuses CPU tensors outside the interpreter.
            plan = triton_attention.launch_plan(problem.batch, 4 if split else 1)
            triton_attention.launch(problem, plan, out)
        assert len(launches) == (2 if split else 1), launches
        label = (
            f"{cache_dtype} {query_dtype} d{head_dim} causal={causal} split={split} "
            f"block_m={launches[0].kwargs['BLOCK_M']} window={window} sinks={sinks}"
        )
        for launch in launches:
            # The flags as the kernel received them (the merge has no WINDOW).
            yield f"attention {launch.fn.__name__} {label} {kernel_flags(launch)}", launch


def lse_launches():
    """(label, launch) of the RETURN_LSE variants on the drafter's variant, unsplit (the kernel
    writes the LSE, sinks inside) and split (the merge writes it), the unsplit one over an e4m3
    per-token-head cache too, and of merge_states."""
    for split, token_head in ((False, False), (True, False), (False, True)):
        problem = drafter_problem(torch.float8_e4m3fn, torch.bfloat16, 128, False, 8, (-1, -1),
                                  True, token_head)  # fmt: skip
        out = torch.empty_like(problem.query)
        lse = torch.empty(problem.query.shape[:2])
        names = ("_paged_attention_kernel", "_merge_splits_kernel")
        with captured_launches(triton_attention, *names) as launches:
            plan = triton_attention.launch_plan(problem.batch, 4 if split else 1)
            triton_attention.launch(problem, plan, out, lse=lse)
        for launch in launches:
            yield f"lse {launch.fn.__name__} split={split} {kernel_flags(launch)}", launch
    for dtype, head_dim in ((torch.float32, 80), (torch.bfloat16, 128)):
        outs, lses = torch.randn(3, 9, 4, head_dim).to(dtype), torch.randn(3, 9, 4)
        with captured_launches(triton_attention, "_merge_splits_kernel") as launches:
            triton_attention.merge_states(outs, lses, torch.empty_like(outs[0]), lses[0].clone())
        (launch,) = launches
        yield (
            f"merge_states {launch.fn.__name__} {dtype} d{head_dim} {kernel_flags(launch)}",
            launch,
        )


def kernel_flags(launch) -> str:
    """The flags as the kernel received them (the merge has no WINDOW or PER_TOKEN_SCALES)."""
    names = ("WINDOW", "SINKS", "RETURN_LSE", "PER_TOKEN_SCALES")
    return " ".join(f"{n}={int(launch.kwargs[n])}" for n in names if n in launch.kwargs)


def cache_write_launches():
    """(label, launch) of the cache write for every cache format and 16-bit input dtype, with
    per-head scales, and with per-token-head scales (inline in vLLM's page) for the formats that
    take them."""
    num_tokens, num_kv_heads, head_dim, block_size = 5, 2, 128, 16
    cases = [(dtype, "per-head") for dtype in CACHE_DTYPES]
    cases += [(dtype, "per-token-head") for dtype in PER_TOKEN_HEAD_DTYPES]
    for cache_dtype, scaling in cases:
        for input_dtype in SIXTEEN:
            key = torch.randn(num_tokens, num_kv_heads, head_dim).to(input_dtype)
            value = torch.randn(num_tokens, num_kv_heads, head_dim).to(input_dtype)
            if scaling == "per-head":
                caches = [
                    torch.zeros(4, block_size, num_kv_heads, head_dim, dtype=cache_dtype)
                    for _ in range(2)
                ]
                scales = [torch.rand(num_kv_heads) + 0.5 for _ in range(2)]
            else:
                page = torch.zeros(
                    4, num_kv_heads, block_size, 2 * (head_dim + 4), dtype=torch.uint8
                )
                *caches, k_scale, v_scale = split_per_token_head_cache(page, cache_dtype)
                scales = [k_scale, v_scale]
            slots = torch.randperm(4 * block_size)[:num_tokens]
            with captured_launches(triton_cache, "_reshape_and_cache_kernel") as launches:
                triton_cache.reshape_and_cache(CacheWrite(key, value, *caches, slots, *scales))
            (launch,) = launches
            yield f"cache write {scaling} {cache_dtype} from {input_dtype}", launch


def all_launches():
    yield from attention_launches()
    yield from lse_launches()
    yield from cache_write_launches()


def main(cc: int) -> int:
    print(f"triton {triton.__version__}", flush=True)
    failures = 0
    for label, launch in all_launches():
        compiled = compile_launch(launch, cc)
        kernel = compiled.resources()
        spill = kernel.stack > 0 or kernel.local > 0
        # Arguments the JIT marked 16-byte divisible (aligned pointers, strides of 16k).
        divisible = sum(["tt.divisibility", 16] in attr for attr in compiled.attrs.values())
        verdict = "SPILLS" if spill else "ok"
        print(
            f"cc{cc} {label}: {kernel.arch} regs={kernel.regs} stack={kernel.stack} "
            f"local={kernel.local} div16={divisible} {verdict}",
            flush=True,
        )
        failures += spill
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
