"""Every shipped kernel variant of the ``cuda`` backend's mma.sync family and of the Triton
backend against the reference on the same cache, in one GPU run.

mma.sync: the full product, every compiled kernel (head_dim x query dtype x cache dtype x the
row tile, :data:`MMA_KERNELS`) x mask (bidirectional, causal, mixed per sequence) x (no window,
sinks, a window, a window + sinks) x (unsplit, split) x page size: mask, window, sinks, splits
and page size are launch arguments, so each case costs a launch. Triton compiles one kernel per
constexpr variant (the tile, the mask mode, SPLIT, WINDOW, SINKS, FP32 dots, the page size), so
:data:`TRITON_CASES` covers, rather than multiplies, them: every head_dim x query x cache dtype,
every tile the launch plan picks, every (mask mode, split, window, sinks) combination, each page
size; per-token-head caches (int8 too) likewise, each axis on its own.

The tables are plain data: the CPU tests below check that they cover every kernel the C++ plan
can report and every variant the Triton launch can take, so a variant added without a case here
fails on the CPU. The ``gpu`` tests skip without a GPU.
"""

import inspect
import itertools
import math
from types import ModuleType
from typing import NamedTuple

import pytest
import torch
from helpers import DEVICE, NUM_ATTENTION_KERNELS, TOLERANCE, replaced
from helpers.per_token_head_cases import make_token_head_case, token_head_problem

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends import reference as reference_backend
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.scales import CACHE_DTYPES, PER_TOKEN_HEAD_DTYPES, SIXTEEN_BIT_DTYPES
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import SUPPORTED_HEAD_DIMS, validate_attention

BF16, FP16 = torch.bfloat16, torch.float16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2

NUM_Q_HEADS, NUM_KV_HEADS = 8, 2
GROUP = NUM_Q_HEADS // NUM_KV_HEADS
# Three sequences: the table's q_len over several 64-key tiles, a third of it, a single token.
KV_LENS = [333, 61, 9]
PADDED_ROWS = 3
MASKS = {"bidirectional": False, "causal": True, "mixed": [False, True, False]}
# (window, sinks): a window spanning pages and 64-key tiles (so whole splits miss it), with and
# without per-q-head sink logits, and the sinks alone.
WINDOWS = {
    "full": ((-1, -1), False),
    "sinks": ((-1, -1), True),
    "window": ((100, 17), False),
    "window_sinks": ((100, 17), True),
}
SPLITS = (1, 3)
PAGE_SIZES = (16, 64)

# Every compiled mma.sync kernel: (head_dim, query dtype, cache dtype, query rows per CTA). The
# 64-row tile at every head dim x query dtype x cache (e4m3, e5m2, the query's own 16-bit dtype);
# the 128-row tile at head_dim 128 on FP8 caches.
MMA_KERNELS = [
    *((d, q, kv, 64) for d in (64, 128, 256) for q in (BF16, FP16) for kv in (E4M3, E5M2, q)),
    *((128, q, kv, 128) for q in (BF16, FP16) for kv in (E4M3, E5M2)),
]


class TritonCase(NamedTuple):
    head_dim: int
    query_dtype: torch.dtype
    cache_dtype: torch.dtype
    q_len: int  # of the longest sequence: q_len x GROUP rows pick the launch's row tile
    mask: str
    window: str
    num_splits: int
    page_size: int
    return_lse: bool  # the unsplit kernel writes the LSE itself, a split launch's merge writes it
    token_head_scales: bool = False  # a per-token-head cache: scales [blocks, slots, kv heads]


def _triton_cases() -> list[TritonCase]:
    """Each head_dim x query x cache dtype once; along them the 24 (mask, window, splits)
    combinations, in steps of 7 (coprime to 24: each once, and every head dim sees every mask
    and both split settings), both page sizes for every cache dtype and independent of the
    split, 16 to 128 rows per KV head (64 at most at head_dim 256, where the plan caps the
    tile), and the LSE asked for on every other pair of dtype pairs (with and without a
    split). Then the per-token-head caches (e4m3, e5m2, int8) the same way, each head_dim x
    query x cache dtype once: 18 of the 24 flag combinations, covering every mask x split and
    window x sinks pair, each cache in both page sizes, the LSE on every other pair of cases."""
    dtypes = [(q, kv) for q in (BF16, FP16) for kv in (E4M3, E5M2, BF16, FP16)]
    token_head_dtypes = [(q, kv) for q in (BF16, FP16) for kv in PER_TOKEN_HEAD_DTYPES]
    flags = list(itertools.product(MASKS, WINDOWS, SPLITS))
    cases = []
    for d_index, head_dim in enumerate((64, 128, 256)):
        q_lens = (4, 8, 16, 32) if head_dim < 256 else (4, 8, 16)
        for i, (q, kv) in enumerate(dtypes):
            n = d_index * len(dtypes) + i
            mask, window, splits = flags[n * 7 % len(flags)]
            cases.append(TritonCase(head_dim, q, kv, q_lens[i % len(q_lens)], mask, window,
                                    splits, PAGE_SIZES[(i // 2 + d_index) % 2],
                                    return_lse=i // 2 % 2 == 1))  # fmt: skip
        for i, (q, kv) in enumerate(token_head_dtypes):
            n = d_index * len(token_head_dtypes) + i
            mask, window, splits = flags[n * 7 % len(flags)]
            page_size = PAGE_SIZES[(i // 3 + d_index) % 2]
            cases.append(TritonCase(head_dim, q, kv, q_lens[i % len(q_lens)], mask, window,
                                    splits, page_size, return_lse=n // 2 % 2 == 1,
                                    token_head_scales=True))  # fmt: skip
    return cases


TRITON_CASES = _triton_cases()


def build(head_dim, query_dtype, cache_dtype, q_len, mask, window, page_size, seed, device,
          token_head_scales=False):  # fmt: skip
    """A random case (make_case) of :data:`KV_LENS` with ``PADDED_ROWS`` padding rows, its problem
    with the window and sinks of ``WINDOWS[window]``, and the keywords that add them to a call.
    ``token_head_scales``: a per-token-head cache instead (make_token_head_case: vLLM's inline
    page, the scales strided views), its problem built as validation will."""
    q_lens = [q_len, max(1, q_len // 3), 1]
    batch = dict(
        num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
        block_size=page_size, cache_dtype=cache_dtype, query_dtype=query_dtype,
        causal=MASKS[mask], padded_rows=PADDED_ROWS, device=device, seed=seed,
    )  # fmt: skip
    window_sides, with_sinks = WINDOWS[window]
    sinks = None
    if with_sinks:  # one logit per q head, uniform in [-16, 16)
        gen = torch.Generator().manual_seed(seed)
        sinks = (torch.rand(NUM_Q_HEADS, generator=gen) * 32 - 16).to(device)
    extra = {"window": window_sides, "sinks": sinks}
    if token_head_scales:
        case = make_token_head_case(q_lens, KV_LENS, **batch)
        return case, token_head_problem(case, **extra), extra
    case = make_case(q_lens, KV_LENS, **batch)
    problem = validate_attention(
        *case.args(), **case.kwargs(), **extra, softmax_scale=None, out=None, validate=False
    )
    return case, problem, extra


def check_against(out, expected, query_dtype, what):
    """Finite, the padding rows zero, within the SPEC tolerance of the reference."""
    assert torch.isfinite(out.float()).all(), what
    assert torch.equal(out[-PADDED_ROWS:], torch.zeros_like(out[-PADDED_ROWS:])), what
    err = relative_error(out, expected)
    assert err <= TOLERANCE[query_dtype], (what, err)


def reference(case, extra):
    return fna.paged_attention(*case.args(), **case.kwargs(), **extra, backend="reference")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- mma.sync -------------------------------------------------------------------------------


def mma_q_len(plan_code: ModuleType, head_dim: int, cache_dtype: torch.dtype, block_m: int) -> int:
    """40 query tokens (160 rows per KV head: several 64-row tiles, or two 128-row ones) unless
    the plan (``plan_code``'s, a build of _C's host code) runs them on another tile than
    ``block_m``, else 16 (one 64-row tile)."""
    code = extension.DTYPE_CODES[cache_dtype]
    return next(q for q in (40, 16) if plan_code.block_m_for(head_dim, code, q * GROUP)
                == block_m)  # fmt: skip


def mma_kernel_of(problem, num_splits=None) -> tuple:
    """(head_dim, query dtype, cache dtype, kernel name, rows per CTA) the C++ plan reports."""
    report = mma_sync.kernel_plan(problem.batch, resident=264, num_splits=num_splits)
    q, kv = problem.query.dtype, problem.key_cache.dtype
    return (problem.head_dim, q, kv, report["kernel_name"], report["block_m"])


def compiled_mma_kernels() -> set[tuple]:
    """Every kernel the C++ plan reports for some batch the family takes: each supported head
    dim x query dtype x cache dtype that mma_sync does not refuse, at 1 to 64 query tokens."""
    kernels = set()
    for head_dim, q, kv in itertools.product(SUPPORTED_HEAD_DIMS, SIXTEEN_BIT_DTYPES, CACHE_DTYPES):
        _, problem, _ = build(head_dim, q, kv, 1, "bidirectional", "full", 16, 0, "cpu")
        if mma_sync.plan_refusal(problem.batch) is not None:
            continue
        for q_len in range(1, 65):
            kernels.add(mma_kernel_of(replaced(problem, max_seqlen_q=q_len)))
    return kernels


def mma_kernels_of_table(plan_code: ModuleType, table) -> dict[tuple, tuple]:
    """Table row -> the kernel the plan reports for its case (on the CPU: ``plan_code`` must be
    the build that plans CPU tensors)."""
    found = {}
    for head_dim, q, kv, block_m in table:
        q_len = mma_q_len(plan_code, head_dim, kv, block_m)
        _, problem, _ = build(head_dim, q, kv, q_len, "bidirectional", "full", 16, 0, "cpu")
        found[(head_dim, q, kv, block_m)] = mma_kernel_of(problem)
    return found


def test_mma_table_holds_every_kernel_the_plan_reports(host_code):
    """One row per compiled kernel (as many as _C holds, by cuobjdump in test_cuda_build), each
    planned on the tile it names; without any one row, that kernel is missing."""
    compiled = compiled_mma_kernels()
    assert len(compiled) == NUM_ATTENTION_KERNELS
    found = mma_kernels_of_table(host_code, MMA_KERNELS)
    for (head_dim, q, kv, block_m), kernel in found.items():
        assert kernel[4] == block_m, (head_dim, q, kv, block_m, kernel)
    assert set(found.values()) == compiled
    assert len(found) == len(MMA_KERNELS)  # no row twice
    for row, kernel in found.items():
        others = {k for r, k in found.items() if r != row}
        assert compiled - others == {kernel}


def mma_id(kernel) -> str:
    head_dim, q, kv, block_m = kernel
    return f"d{head_dim}-{dtype_name(q)}-{dtype_name(kv)}-m{block_m}"


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("kernel", MMA_KERNELS, ids=mma_id)
def test_every_mma_sync_kernel_matches_the_reference(kernel, mask, window, page_size):
    """Each compiled kernel on the tile its row names, unsplit and with 3 forced splits (the
    plan reports both), against the reference on the same cache."""
    runs, why = mma_sync.availability()
    if not runs:
        pytest.skip(why)
    head_dim, q, kv, block_m = kernel
    seed = head_dim + block_m + page_size
    q_len = mma_q_len(extension.loaded(), head_dim, kv, block_m)
    case, problem, extra = build(head_dim, q, kv, q_len, mask, window, page_size, seed, "cuda")
    expected = reference(case, extra)
    for num_splits in SPLITS:
        batch = problem.batch
        report = mma_sync.kernel_plan(batch, mma_sync.resident_ctas(batch), num_splits)
        assert (report["block_m"], report["num_splits"]) == (block_m, num_splits), report
        plan = mma_sync.plan(batch, None, num_splits)
        assert plan.num_splits == num_splits
        out = torch.full_like(problem.query, math.nan)
        mma_sync.run(problem, plan, out)
        torch.cuda.synchronize()  # a fault shows here, at this kernel
        check_against(out, expected, q, (report["kernel_name"], num_splits))


# ---- Triton ---------------------------------------------------------------------------------

# The kernels' constexpr parameters this table covers; a new one needs its axis here.
TRITON_CONSTEXPRS = {
    "attention": {"GROUP", "HEAD_DIM", "BLOCK_SIZE", "BLOCK_M", "BLOCK_N", "MASK_MODE", "SPLIT",
                  "DOT_FP32", "WINDOW", "SINKS", "RETURN_LSE", "PER_TOKEN_SCALES"},
    # HEAD_POW2 follows HEAD_DIM; RETURN_LSE is the "lse x split" axis.
    "merge": {"HEAD_DIM", "HEAD_POW2", "SPLITS_POW2", "SINKS", "RETURN_LSE"},
}  # fmt: skip


def triton_case(case: TritonCase, seed: int, device: str):
    return build(case.head_dim, case.query_dtype, case.cache_dtype, case.q_len, case.mask,
                 case.window, case.page_size, seed, device, case.token_head_scales)  # fmt: skip


class _Recorder:
    """Stands for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the keywords."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.name, kwargs))


def triton_launches(problem, num_splits, monkeypatch, return_lse=False) -> dict[str, dict]:
    """The keywords (constexprs, num_warps, num_stages) of the kernels one launch runs, as on a
    GPU (no interpreter tiles or fp32 dots), without running them."""
    calls: list = []
    with monkeypatch.context() as patch:
        patch.setattr(triton_attention, "interpreting", lambda: False)
        patch.setattr(triton_attention, "_paged_attention_kernel", _Recorder("attention", calls))
        patch.setattr(triton_attention, "_merge_splits_kernel", _Recorder("merge", calls))
        out = torch.empty_like(problem.query)
        lse = torch.empty(problem.query.shape[:2]) if return_lse else None
        # plan() refuses CPU tensors outside the interpreter: the launch plan the GPU would get.
        plan = triton_attention.TritonPlan(
            triton_attention.launch_plan(problem.batch, num_splits), None, None
        )
        triton_attention.run(problem, plan, out, lse)
    return dict(calls)


def triton_variant(problem, num_splits, monkeypatch, return_lse=False) -> dict[str, tuple]:
    """The variant axes one launch takes: its dtypes, tile, flags, page size and LSE output."""
    launches = triton_launches(problem, num_splits, monkeypatch, return_lse)
    attention, merge = launches["attention"], launches.get("merge")
    d = attention["HEAD_DIM"]
    variant = {
        "dtypes": (d, problem.query.dtype, problem.key_cache.dtype, attention["PER_TOKEN_SCALES"]),
        "tile": (d, attention["BLOCK_M"], attention["BLOCK_N"], attention["DOT_FP32"],
                 attention["num_warps"], attention["num_stages"]),
        # Sinks join the unsplit kernel's epilogue, or the merge's when split.
        "flags": (attention["MASK_MODE"], attention["SPLIT"], attention["WINDOW"],
                  attention["SINKS"] or bool(merge and merge["SINKS"])),
        "head_dim x mask x split": (d, attention["MASK_MODE"], attention["SPLIT"]),
        "cache x page": (problem.key_cache.dtype, attention["BLOCK_SIZE"]),
        # The LSE from the unsplit kernel, or from the split launch's merge.
        "lse x split": (attention["RETURN_LSE"] or bool(merge and merge["RETURN_LSE"]),
                        attention["SPLIT"]),
    }  # fmt: skip
    if attention["PER_TOKEN_SCALES"]:
        flags = variant["flags"]
        variant |= {
            "token-head tile": variant["tile"],
            "token-head mask x split": flags[:2],
            "token-head window x sinks": flags[2:],
            "token-head cache x page": variant["cache x page"],
            "token-head lse x split": variant["lse x split"],
        }
    return variant


def triton_variants_to_cover(monkeypatch) -> dict[str, set]:
    """Every value of each axis: every supported head dim x query x cache dtype; every tile the
    launch plan picks for 1 to 64 query tokens; every mask mode x split x window x sinks; every
    mask mode and split setting at each head dim; each cache dtype in pages of each size. For
    per-token-head caches (the PER_TOKEN_SCALES variant): each head dim x query x cache dtype,
    every tile, mask mode x split, window x sinks, cache x page size and LSE x split."""
    tiles, token_head_tiles = set(), set()
    for token_head, caches, found in (
        (False, CACHE_DTYPES, tiles),
        (True, PER_TOKEN_HEAD_DTYPES, token_head_tiles),
    ):
        for head_dim, q, kv in itertools.product(SUPPORTED_HEAD_DIMS, SIXTEEN_BIT_DTYPES, caches):
            _, problem, _ = build(head_dim, q, kv, 1, "bidirectional", "full", 16, 0, "cpu",
                                  token_head)  # fmt: skip
            for q_len in range(1, 65):
                variant = triton_variant(replaced(problem, max_seqlen_q=q_len), 1,
                                         monkeypatch)  # fmt: skip
                found.add(variant["tile"])
    both = (False, True)
    return {
        "dtypes": {
            *itertools.product(SUPPORTED_HEAD_DIMS, SIXTEEN_BIT_DTYPES, CACHE_DTYPES, [False]),
            *itertools.product(
                SUPPORTED_HEAD_DIMS, SIXTEEN_BIT_DTYPES, PER_TOKEN_HEAD_DTYPES, [True]
            ),
        },
        "tile": tiles,
        "flags": set(itertools.product(range(3), both, both, both)),
        "head_dim x mask x split": set(itertools.product(SUPPORTED_HEAD_DIMS, range(3), both)),
        "cache x page": set(itertools.product(CACHE_DTYPES, PAGE_SIZES)),
        "lse x split": set(itertools.product(both, both)),
        "token-head tile": token_head_tiles,
        "token-head mask x split": set(itertools.product(range(3), both)),
        "token-head window x sinks": set(itertools.product(both, both)),
        "token-head cache x page": set(itertools.product(PER_TOKEN_HEAD_DTYPES, PAGE_SIZES)),
        "token-head lse x split": set(itertools.product(both, both)),
    }


def missing_triton_variants(variants: list[dict], to_cover: dict[str, set]) -> dict[str, set]:
    covered = {axis: {v.get(axis) for v in variants} for axis in to_cover}
    return {
        axis: to_cover[axis] - covered[axis] for axis in to_cover if to_cover[axis] - covered[axis]
    }


def test_triton_table_covers_every_variant_the_launch_takes(monkeypatch):
    """The table's launches (as the GPU runs them) cover every value of every axis; each case
    takes its forced split; the kernels have no constexpr the table does not know; without any
    one case, a variant is missing."""
    for name, kernel in (("attention", triton_attention._paged_attention_kernel),
                         ("merge", triton_attention._merge_splits_kernel)):  # fmt: skip
        # kernel.fn: the Python function, jitted or interpreted; annotations are strings here.
        parameters = inspect.signature(kernel.fn).parameters.values()
        constexprs = {p.name for p in parameters if str(p.annotation).endswith("constexpr")}
        assert constexprs == TRITON_CONSTEXPRS[name], f"{name}: add an axis to this table"
    to_cover = triton_variants_to_cover(monkeypatch)
    variants = []
    for seed, case in enumerate(TRITON_CASES):
        _, problem, _ = triton_case(case, seed, "cpu")
        variant = triton_variant(problem, case.num_splits, monkeypatch, case.return_lse)
        assert variant["flags"][1] == (case.num_splits > 1), case
        variants.append(variant)
    assert missing_triton_variants(variants, to_cover) == {}
    for i, case in enumerate(TRITON_CASES):
        assert missing_triton_variants(variants[:i] + variants[i + 1 :], to_cover), case


def triton_id(case: TritonCase) -> str:
    dtypes = f"{dtype_name(case.query_dtype)}-{dtype_name(case.cache_dtype)}"
    if case.token_head_scales:
        dtypes += "-per_token_head"
    return (
        f"d{case.head_dim}-{dtypes}-q{case.q_len}-{case.mask}-{case.window}-"
        f"s{case.num_splits}-p{case.page_size}{'-lse' if case.return_lse else ''}"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("case", TRITON_CASES, ids=triton_id)
def test_every_triton_variant_matches_the_reference(case):
    """Each case's launch takes the split it names (the plan may take fewer splits than forced,
    never one), against the reference on the same cache."""
    seed = TRITON_CASES.index(case)
    paged, problem, extra = triton_case(case, seed, DEVICE)
    plan = triton_attention.plan(problem.batch, None, case.num_splits)
    assert (plan.launch.num_splits > 1) == (case.num_splits > 1), plan.launch
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan, device=DEVICE) if case.return_lse else None
    triton_attention.run(problem, plan, out, lse)
    torch.cuda.synchronize()
    if case.token_head_scales:  # the reference backend on the same problem
        expected = torch.empty_like(out)
        expected_lse = torch.empty(problem.query.shape[:2], device=DEVICE)
        reference_backend.paged_attention(problem, expected, expected_lse)
        if case.return_lse:
            expected = expected, expected_lse
    else:
        expected = fna.paged_attention(*paged.args(), **paged.kwargs(), **extra,
                                       backend="reference", return_lse=case.return_lse)  # fmt: skip
    if case.return_lse:
        expected, expected_lse = expected
        # Padded rows are empty states (-inf), as in the reference.
        torch.testing.assert_close(lse, expected_lse, rtol=0, atol=1e-3, equal_nan=False)
    check_against(out, expected, case.query_dtype, plan.launch)
