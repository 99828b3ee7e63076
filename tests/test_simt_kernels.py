"""csrc/'s kernels run on CPU tensors by the SIMT executor (``backend="mma_sync"``), against the
float64 oracle: every attention kernel (head dims x query dtypes x caches, both row tiles, the
LSE from their epilogue, the per-token-head kernels on e4m3 / e5m2 / int8), causal,
bidirectional and mixed, sliding windows and sinks, split-KV with the merge kernel; the cache
write and the merge entry against the reference. Sizes are small: every CTA runs as fibers with
every access checked."""

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import TOLERANCE, replaced
from helpers.backends import plan_and_run
from helpers.lse import LAYOUTS, lse_case, run_backend, shard_problem
from helpers.oracle import float64_attention
from helpers.token_heads import token_head_problem

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

pytestmark = pytest.mark.simt

QUERY_DTYPES = [torch.bfloat16, torch.float16]
# The per-head kernels' caches under each query dtype: FP8, and the query's own 16-bit dtype.
PER_HEAD_PAIRS = [
    (cache, query)
    for query in QUERY_DTYPES
    for cache in (torch.float8_e4m3fn, torch.float8_e5m2, query)
]
SINKS = [6.0, -30.0, 0.5, 2.0]
# The LSE's tolerance (natural log units) against the float64 oracle.
LSE_ATOL = 2e-3


def oracle(problem, num_tokens: int | None = None):
    """float64 (out, lse) of an AttentionProblem, for its first ``num_tokens`` rows."""
    batch = problem.batch
    causal = batch.causal if batch.causal_per_seq is None else batch.causal_per_seq.tolist()
    case = SimpleNamespace(
        query=problem.query[:num_tokens], key_cache=problem.key_cache,
        value_cache=problem.value_cache, k_scale=problem.k_scale, v_scale=problem.v_scale,
        block_table=batch.block_table, cu_seqlens_q=batch.cu_seqlens_q,
        kv_lens=batch.seq_lens.tolist(), causal=causal,
    )  # fmt: skip
    sinks = None if problem.sinks is None else problem.sinks.tolist()
    return float64_attention(case, batch.softmax_scale, batch.window, sinks, return_lse=True)


def run(problem, num_splits=None):
    """(out, lse) of the mma.sync kernels on the executor, both pre-filled with NaN."""
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan)
    plan_and_run(mma_sync, problem, out, num_splits=num_splits, lse=lse)
    return out, lse


def check(problem, num_splits=None, padded_rows=0):
    out, lse = run(problem, num_splits)
    tokens = problem.query.shape[0] - padded_rows
    want, want_lse = oracle(problem, tokens)
    dtype = problem.query.dtype
    assert relative_error(out[:tokens], want.to(dtype)) <= TOLERANCE[dtype]
    assert torch.allclose(lse[:tokens].double(), want_lse, rtol=0, atol=LSE_ATOL)
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))
    assert (lse[tokens:] == -math.inf).all()


def per_head_problem(cache_dtype, query_dtype, head_dim, q_lens, kv_lens, causal, seed,
                     window=(-1, -1), sinks=False, padded_rows=0, num_q_heads=4):  # fmt: skip
    case = make_case(
        q_lens, kv_lens, num_q_heads=num_q_heads, num_kv_heads=2, head_dim=head_dim,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=causal,
        padded_rows=padded_rows, seed=seed,
    )  # fmt: skip
    return validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=True,
        window=window, sinks=torch.tensor(SINKS[:num_q_heads]) if sinks else None,
    )  # fmt: skip


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype,query_dtype", PER_HEAD_PAIRS, ids=str)
def test_every_per_head_kernel_matches_the_oracle(cache_dtype, query_dtype, head_dim):
    """Mixed causal and bidirectional sequences (a decode row, a whole block with no context,
    keys past one 64-key tile), GQA 2, padded rows; the LSE from the same kernel."""
    problem = per_head_problem(cache_dtype, query_dtype, head_dim, [3, 1, 5], [70, 33, 5],
                               [True, False, True], seed=head_dim, padded_rows=2)  # fmt: skip
    check(problem, padded_rows=2)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize(
    "window,sinks", [((-1, -1), False), ((20, 3), True), ((-1, 0), True)], ids=str
)
def test_split_kv_with_windows_and_sinks_matches_the_oracle(window, sinks, num_splits):
    """Split over the windowed tile range, merged by the merge kernel (which adds the sink
    once and writes the LSE)."""
    problem = per_head_problem(torch.float8_e4m3fn, torch.bfloat16, 128, [4, 2], [150, 40],
                               [False, True], seed=num_splits, window=window, sinks=sinks,
                               padded_rows=1)  # fmt: skip
    check(problem, num_splits, padded_rows=1)


@pytest.mark.parametrize("window", [(3, 2), (40, -1), (-1, 5)], ids=str)
def test_unsplit_windows_and_sinks_match_the_oracle(window):
    problem = per_head_problem(torch.float8_e5m2, torch.float16, 64, [6, 1], [90, 70],
                               [True, False], seed=7, window=window, sinks=True)  # fmt: skip
    check(problem, 1)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str
)
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
def test_every_per_token_head_kernel_matches_the_oracle(query_dtype, cache_dtype, head_dim):
    """Per-token-head scales (inline in 16-byte aligned pages), causal and bidirectional, split
    at head_dim 128, with the LSE; the 128-row tile at head_dim 128."""
    q_len = 40 if head_dim == 128 else 3
    problem = token_head_problem(
        cache_dtype, query_dtype, [q_len, 2], [80, 30], head_dim=head_dim,
        causal=[True, False], padded_rows=1, seed=head_dim,
    )  # fmt: skip
    assert mma_sync.run_unsupported_reason(problem, None) is None
    check(problem, 2 if head_dim == 128 else None, padded_rows=1)


@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16],
    ids=str,
)  # fmt: skip
def test_cache_write_matches_the_reference_bytes(cache_dtype):
    """The cache write kernel on the executor: the reference's bytes (values past the format's
    max saturate), into strided caches, skipping slots < 0."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, dim, blocks, block_size = 9, 2, 64, 4, 8
    key = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dim, generator=gen).to(torch.bfloat16)
    key[0, 0, :2] = torch.tensor([1e30, -3e38])
    k_scale, v_scale = torch.rand(heads, generator=gen) + 0.05, torch.rand(heads, generator=gen)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[::4] = -1
    kv = torch.zeros(blocks, heads, block_size, 2 * dim, dtype=cache_dtype)
    expected = kv.clone()
    for cache, write in ((kv, extension.reshape_and_cache),
                         (expected, reference.reshape_and_cache)):  # fmt: skip
        k_cache, v_cache = cache[..., :dim].transpose(1, 2), cache[..., dim:].transpose(1, 2)
        write(CacheWrite(key, value, k_cache, v_cache, slots, k_scale, v_scale.add(0.05)))
    storage = torch.uint8 if cache_dtype.itemsize == 1 else torch.int16
    assert torch.equal(kv.view(storage), expected.view(storage))
    assert kv.view(storage).any()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_merge_entry_matches_the_reference(out_dtype):
    """extension.merge_states (the merge kernel) on random states, one of them empty."""
    gen = torch.Generator().manual_seed(5)
    outs = torch.randn(3, 5, 4, 64, generator=gen)
    lses = torch.randn(3, 5, 4, generator=gen) * 4
    lses[1, 2] = -math.inf
    got = torch.full((5, 4, 64), math.nan, dtype=out_dtype)
    got_lse = torch.full((5, 4), math.nan)
    extension.merge_states(outs, lses, got, got_lse)
    want = torch.empty_like(got)
    want_lse = torch.empty_like(got_lse)
    reference.merge_states(outs, lses, want, want_lse)
    assert relative_error(got, want) <= TOLERANCE[torch.bfloat16]
    assert torch.allclose(got_lse, want_lse, rtol=0, atol=1e-4)


# Named per-head cases: (make_case's arguments, splits).
CASES = {
    # head_dim 64, FP8, GQA 4, mixed mask, pages of 128 keys (two key tiles in one page), a
    # partial last page
    "d64_e4m3_mixed": (dict(
        q_lens=[3, 8], kv_lens=[70, 9], num_q_heads=8, num_kv_heads=2, head_dim=64,
        cache_dtype=torch.float8_e4m3fn, causal=[True, False], block_size=128), 1),
    # head_dim 128, e5m2 in vLLM's combined layout, MQA 6, split-KV with an empty split
    "d128_e5m2_vllm_split": (dict(
        q_lens=[5, 1], kv_lens=[130, 40], num_q_heads=6, num_kv_heads=1, head_dim=128,
        cache_dtype=torch.float8_e5m2, causal=[True, True], layout="vllm"), 3),
    # head_dim 128, bf16 cache, 40 and 64 rows (3 and 4 row warps: no key groups), causal
    "d128_bf16_rows": (dict(
        q_lens=[16, 10], kv_lens=[40, 75], num_q_heads=8, num_kv_heads=2, head_dim=128,
        cache_dtype=torch.bfloat16, causal=True, block_size=32), 1),
    # head_dim 256, fp16 cache, page size 8, bidirectional block with q_len == kv_len and a
    # sequence with no query, split
    "d256_fp16_split": (dict(
        q_lens=[7, 0], kv_lens=[7, 3], num_q_heads=4, num_kv_heads=2, head_dim=256,
        cache_dtype=torch.float16, query_dtype=torch.float16, causal=False, block_size=8), 2),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_named_cases_match_the_oracle(name):
    spec, splits = CASES[name]
    spec = dict(spec)
    case = make_case(spec.pop("q_lens"), spec.pop("kv_lens"), seed=3, padded_rows=2, **spec)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    check(problem, splits, padded_rows=2)


# The 128-row tile (head_dim 128; R = q_len x group in 65..128 per CTA): sequences of 160 rows
# (two M tiles, the second of 32 rows) and 68 rows (GQA 4): (cache, query, causal, window,
# sinks, splits).
WIDE_CASES = [
    (torch.float8_e4m3fn, torch.bfloat16, [True, False], (-1, -1), False, 1),
    (torch.float8_e5m2, torch.float16, True, (40, 17), True, 3),
    (torch.float8_e5m2, torch.bfloat16, False, (3, 2), True, 2),
    (torch.float8_e4m3fn, torch.float16, [False, True], (-1, 5), False, 1),
]


@pytest.mark.parametrize("cache,query,causal,window,sinks,splits", WIDE_CASES, ids=str)
def test_the_128_row_tile_matches_the_oracle(cache, query, causal, window, sinks, splits):
    """More than 64 rows per KV head on an FP8 cache: the plan launches the 8-warp tile; causal
    per sequence, windows, sinks, split-KV and padded rows as for the 64-row tile."""
    case = make_case(
        [40, 17], [120, 75], num_q_heads=8, num_kv_heads=2, head_dim=128, cache_dtype=cache,
        query_dtype=query, causal=causal, block_size=16, seed=17, padded_rows=2,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=window, sinks=torch.tensor(SINKS * 2) if sinks else None,
    )  # fmt: skip
    plan = mma_sync.kernel_plan(problem.batch, resident=1, num_splits=splits)
    assert (plan["block_m"], plan["threads"], plan["m_tiles"]) == (128, 256, 2)
    check(problem, splits, padded_rows=2)


# Per-token-head caches with windows and sinks: sequences [q 3 / kv 70, q 8 / kv 40] (GQA 4),
# two padded rows: (cache, query, causal, window, sinks, splits).
TOKEN_SCALE_CASES = [
    (torch.float8_e5m2, torch.float16, False, (-1, -1), True, 3),
    (torch.int8, torch.bfloat16, [False, True], (5, 3), False, 2),
    (torch.int8, torch.float16, True, (-1, -1), True, 1),
]


def token_scale_problem(cache, query, causal, window=(-1, -1), sinks=False):
    return token_head_problem(
        cache, query, [3, 8], [70, 40], causal=causal, window=window, padded_rows=2, seed=21,
        sinks=torch.tensor(SINKS * 2) if sinks else None,
    )  # fmt: skip


@pytest.mark.parametrize("cache,query,causal,window,sinks,splits", TOKEN_SCALE_CASES, ids=str)
def test_token_scales_with_windows_and_sinks_match_the_oracle(cache, query, causal, window,
                                                                sinks, splits):  # fmt: skip
    problem = token_scale_problem(cache, query, causal, window, sinks)
    assert problem.per_token_head_scales and problem.k_scale.stride()[1] != 1
    check(problem, splits, padded_rows=2)


@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.int8], ids=str)
def test_token_scales_dropped_or_per_head_are_caught(cache):
    """The comparison above bites: the kernels run over one scale per KV head (each head's first
    key's, broadcast to every token) or with the V scales dropped (all ones) miss the oracle
    by far more than the tolerance."""
    problem = token_scale_problem(cache, torch.bfloat16, [True, False])
    want, _ = oracle(problem, int(problem.cu_seqlens_q[-1]))
    first_page = int(problem.block_table[0, 0])
    per_head = {name: getattr(problem, name).clone() for name in ("k_scale", "v_scale")}
    for name, scale in per_head.items():
        scale[:] = getattr(problem, name)[first_page, 0]
    for wrong in (replaced(problem, **per_head),
                  replaced(problem, v_scale=torch.ones_like(problem.v_scale))):  # fmt: skip
        out, _ = run(wrong, 1)
        got = out[: want.shape[0]]
        assert relative_error(got, want.to(got.dtype)) > 10 * TOLERANCE[torch.bfloat16]


# (causal, window, sinks, splits) on sequences [q 3 / kv 21, q 24 / kv 300] with 16-key pages
# and 64-key tiles: a window inside one page, one spanning pages and tiles (most tiles of the
# long sequence lie outside it), one past the context, one-sided ones, sinks alone.
WINDOW_CASES = [
    (False, (3, 2), False, 1),
    (True, (3, 2), True, 3),
    ([True, False], (40, 17), True, 1),
    ([False, True], (40, 17), False, 3),
    (False, (1000, 1000), True, 2),
    (True, (-1, -1), True, 2),
    ([False, True], (-1, 0), False, 1),
    (False, (70, -1), True, 3),
    (False, (-1, 5), True, 1),
]


@pytest.mark.parametrize("causal,window,sinks,splits", WINDOW_CASES, ids=str)
def test_windows_and_sinks_match_the_oracle(causal, window, sinks, splits):
    """The window bounds, the tiles it skips, the split of the windowed tile range, the sink in
    the unsplit epilogue or once in the merge; two padded rows past the last sequence."""
    case = make_case(
        [3, 24], [21, 300], num_q_heads=4, num_kv_heads=2, head_dim=64, causal=causal, seed=13,
        padded_rows=2,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=window, sinks=torch.tensor(SINKS) if sinks else None,
    )  # fmt: skip
    check(problem, splits, padded_rows=2)


@pytest.mark.parametrize("splits", [1, 3])
def test_windowed_launch_loads_only_the_windows_tiles(splits):
    """The pages of every key tile that no query's window touches hold FP8 NaN bytes (K and V):
    a kernel that loads one, even masked out afterwards (0 * NaN = NaN in P V), gives NaN."""
    q_len, kv_len, block_size, window = 4, 1000, 16, (40, 3)
    case = make_case(
        [q_len], [kv_len], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size,
        seed=5,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=window, sinks=torch.tensor(SINKS),
    )  # fmt: skip
    block_n = mma_sync.kernel_plan(problem.batch, 1)["block_n"]
    start, end = visible_range(torch.arange(q_len), q_len, kv_len, False, window)
    first_tile, end_tile = int(start.min()) // block_n, -(-int(end.max()) // block_n)
    pages = case.block_table[0].tolist()
    poisoned = [
        pages[n]
        for n in range(-(-kv_len // block_size))
        if not first_tile <= n * block_size // block_n < end_tile
    ]
    assert len(poisoned) >= 50  # most of the context lies outside the window
    want, _ = oracle(problem)
    for cache in (case.key_cache, case.value_cache):
        cache.view(torch.uint8)[poisoned] = 0x7F  # e4m3 NaN
    out, _ = run(problem, splits)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, want.to(out.dtype)) <= TOLERANCE[out.dtype]
    # Without the window the poisoned pages are read: the check bites.
    unwindowed, _ = run(replaced(problem, window=(-1, -1)), splits)
    assert not torch.isfinite(unwindowed.float()).all()


@pytest.mark.parametrize("splits", [1, 2])
def test_key_shards_give_the_reference_states(splits):
    """Decode-context-parallel shards (dcp4_interleave8): fewer keys than query rows, and a
    sequence with none, on a bidirectional launch; rows with no key: zeros, LSE -inf."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    for keys in LAYOUTS["dcp4_interleave8"]:
        problem = shard_problem(case, keys)
        out, lse = run(problem, splits)
        ref_out, ref_lse = run_backend("reference", problem)
        assert relative_error(out, ref_out) <= TOLERANCE[torch.bfloat16]
        empty = torch.isinf(ref_lse)
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        assert torch.equal(torch.isinf(lse), empty)
        assert (lse[~empty] - ref_lse[~empty]).abs().max() < LSE_ATOL


def strided(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of 1-D ``t`` (as ``dtype``) in a view with stride 3 into a larger buffer whose
    other elements are garbage, like vLLM's slices of persistent buffers."""
    buffer = torch.full((t.numel(), 3), 7, dtype=dtype or t.dtype)
    buffer[:, 0] = t.to(buffer.dtype)
    return buffer[:, 0]


@pytest.mark.parametrize("causal_dtype", [torch.int32, torch.bool])
@pytest.mark.parametrize("splits", [1, 2])
def test_vllm_index_tensors_are_read_in_place(causal_dtype, splits):
    """Strided cu_seqlens_q / seq_lens / causal (int32 or bool) read where they lie, and padded
    rows past cu_seqlens_q[-1] (vLLM under CUDA graphs) written as zeros."""
    causal = [True, False, True]
    case = make_case(
        [4, 8, 2], [40, 70, 9], num_q_heads=8, num_kv_heads=2, head_dim=64, causal=causal,
        seed=5,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    padding = torch.randn(5, *case.query.shape[1:]).to(case.query.dtype)
    flags = torch.tensor([7 if c else 0 for c in causal], dtype=torch.int32)  # nonzero = causal
    vllm_like = replaced(
        problem,
        query=torch.cat([problem.query, padding]),
        cu_seqlens_q=strided(problem.cu_seqlens_q),
        seq_lens=strided(problem.seq_lens),
        causal_per_seq=strided(flags, causal_dtype),
    )
    check(vllm_like, splits, padded_rows=5)


def test_the_api_runs_the_executor_on_cpu_tensors():
    """``backend="mma_sync"`` through the public API (plan, launch, LSE) on CPU tensors."""
    case = make_case([2, 5], [30, 5], num_q_heads=4, num_kv_heads=2, causal=[False, True],
                     seed=9)  # fmt: skip
    out, lse = fna.paged_attention(*case.args(), **case.kwargs(), backend="mma_sync",
                                   return_lse=True)  # fmt: skip
    want, want_lse = float64_attention(case, return_lse=True)
    assert relative_error(out, want.to(out.dtype)) <= TOLERANCE[out.dtype]
    assert torch.allclose(lse.double(), want_lse, rtol=0, atol=LSE_ATOL)


# A NaN in each 1-byte cache format (e4m3 has one exponent-and-mantissa NaN, 0x7f / 0xff; e5m2
# 0xff is a NaN too). int8 data is never NaN: its slots hold 0x7f (127) under a NaN scale.
NAN_BYTE = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0xFF, torch.int8: 0x7F}


def poison_outside_windows(problem) -> int:
    """What vLLM's sliding-window manager leaves in the cache, made NaN: block-table entries of
    every page wholly before a sequence's first visible key point at one spare (null) page, and
    that page, the slots of the window's first page before its first key and the slots past the
    sequence's length hold NaN (NAN_BYTE in K and V, NaN per-token-head scales). Returns the
    null page; the cases below also leave NaN in the key tile of each window's first key."""
    batch = problem.batch
    block_size = problem.key_cache.shape[1]
    kv_lens = batch.seq_lens.tolist()
    cu = batch.cu_seqlens_q.tolist()
    pages_used = [-(-kv // block_size) for kv in kv_lens]
    owned = {p for seq, n in enumerate(pages_used) for p in batch.block_table[seq, :n].tolist()}
    null_page = min(set(range(problem.key_cache.shape[0])) - owned)
    nan_byte = NAN_BYTE[problem.key_cache.dtype]
    token_scales = (problem.k_scale, problem.v_scale) if problem.per_token_head_scales else ()

    def poison(page, slots):
        for cache in (problem.key_cache, problem.value_cache):
            cache.view(torch.uint8)[page, slots] = nan_byte
        for scale in token_scales:
            scale[page, slots] = math.nan

    poison(null_page, slice(None))
    for seq, kv_len in enumerate(kv_lens):
        q_len = cu[seq + 1] - cu[seq]
        start, _ = visible_range(torch.arange(q_len), q_len, kv_len, batch.causal, batch.window)
        first = int(start.min())
        batch.block_table[seq, : first // block_size] = null_page
        poison(int(batch.block_table[seq, first // block_size]), slice(0, first % block_size))
        poison(
            int(batch.block_table[seq, pages_used[seq] - 1]),
            slice((kv_len - 1) % block_size + 1, None),
        )
    return null_page


# Unwritten-slot cases: (cache dtype, per-token-head scales). Sequences [q 3 / kv 150, q 2 / kv
# 100], causal, window (40, -1), 16-key pages: the first visible keys 107 and 58 lie 43 and 58
# keys into their 64-key tiles (two and three whole null pages, then a partial page, before them).
UNWRITTEN_CASES = [
    (torch.float8_e4m3fn, False),
    (torch.float8_e5m2, False),
    (torch.float8_e4m3fn, True),
    (torch.float8_e5m2, True),
    (torch.int8, True),
]
UNWRITTEN_BACKENDS = {"mma_sync": mma_sync, "triton": triton_attention, "reference": reference}


@pytest.mark.parametrize("backend", sorted(UNWRITTEN_BACKENDS))
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("cache,token_scales", UNWRITTEN_CASES, ids=str)
def test_nan_before_the_window_in_its_first_tile_stays_out(cache, token_scales, splits, backend):
    """SPEC §5: an unwritten slot holds anything and reaches no row's result. NaN pages and
    slots before each window's first key, in the same key tile, and past each sequence's length:
    a backend that loads them and masks only the scores gives 0 * NaN = NaN in P V."""
    q_lens, kv_lens, window = [3, 2], [150, 100], (40, -1)
    if token_scales:
        problem = token_head_problem(cache, torch.bfloat16, q_lens, kv_lens, causal=True,
                                     window=window, seed=8, num_q_heads=4)  # fmt: skip
    else:
        case = make_case(q_lens, kv_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                         cache_dtype=cache, causal=True, seed=8)  # fmt: skip
        problem = validate_attention(*case.args(), **case.kwargs(), softmax_scale=None,
                                     out=None, validate=False, window=window)  # fmt: skip
    block_n = mma_sync.kernel_plan(problem.batch, 1)["block_n"]
    assert [(kv - q - 40) % block_n for q, kv in zip(q_lens, kv_lens, strict=True)] == [43, 58]
    null_page = poison_outside_windows(problem)
    # The poison is NaN as the kernels read it (data, or int8 data times its scale).
    values = problem.value_cache[null_page].float()
    if token_scales:
        values = values * problem.v_scale[null_page][..., None]
    assert values.isnan().all()
    want, want_lse = oracle(problem)
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan)
    plan_and_run(UNWRITTEN_BACKENDS[backend], problem, out, num_splits=splits, lse=lse)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
    assert relative_error(out, want.to(out.dtype)) <= TOLERANCE[out.dtype]
    assert torch.allclose(lse.double(), want_lse, rtol=0, atol=LSE_ATOL)
