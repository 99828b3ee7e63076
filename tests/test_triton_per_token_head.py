"""Triton attention over per-token-head caches (real K = stored K * k_scale[block, slot, kv_head],
likewise V) against the reference on the same cache and an independent float64 computation."""

import dataclasses
import math

import pytest
import torch
from helpers import DEVICE, TOLERANCE
from helpers.far_offsets import far_apart_views
from helpers.lse import LSE_TOLERANCE, check_state, lse_error
from helpers.oracle import float64_attention
from helpers.per_token_head_cases import make_token_head_case, token_head_problem

from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.scales import PER_TOKEN_HEAD_DTYPES
from fp8_noncausal_attn.synthetic import relative_error

Q_LENS, KV_LENS, PADDED_ROWS = [8, 3, 1], [300, 70, 9], 2
NUM_TOKENS = sum(Q_LENS)
SINKS = [2.0, -30.0, 0.0, 4.0, 30.0, -1.0, 1.0, 0.5]


class Flags:
    """One launch's mask, window, sinks, forced split count and GQA shape."""

    def __init__(self, causal, window=(-1, -1), sinks=False, splits=1, heads=(8, 2)):
        self.causal, self.window, self.sinks, self.splits, self.heads = (
            causal, window, sinks, splits, heads,
        )  # fmt: skip

    def __repr__(self) -> str:
        sinks = "sinks-" if self.sinks else ""
        return f"{self.causal}-w{self.window}-{sinks}s{self.splits}-{self.heads}"


# Every mask (one launch flag, or per-sequence bool / int32 flags), windows spanning key tiles,
# sinks, unsplit and split (the window's tiles still split), MHA / GQA 4 / MQA.
FLAGS = [
    Flags(False),
    Flags(True, splits=3),
    Flags([False, True, False], window=(150, 17), sinks=True, splits=2),
    Flags([True, False, True], window=(-1, 0), sinks=True),
    Flags(False, window=(100, 100), splits=2, heads=(8, 1)),
    Flags(True, sinks=True, heads=(4, 4)),
]


def token_head_case(cache_dtype, query_dtype, flags, seed=0, **batch):
    num_q_heads, num_kv_heads = flags.heads
    causal_dtype = torch.int32 if isinstance(flags.causal, list) and flags.causal[0] else torch.bool
    return make_token_head_case(
        Q_LENS, KV_LENS, cache_dtype=cache_dtype, query_dtype=query_dtype,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, causal=flags.causal,
        causal_dtype=causal_dtype, padded_rows=PADDED_ROWS, device=DEVICE, seed=seed, **batch,
    )  # fmt: skip


def sinks_of(flags) -> list[float] | None:
    return SINKS[: flags.heads[0]] if flags.sinks else None


def run(problem, splits, plan=None):
    """Triton's (out, lse), both pre-filled with NaN; ``plan`` overrides the launch plan."""
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan, device=DEVICE)
    if plan is None:
        plan = triton_attention.launch_plan(problem.batch, splits)
        assert plan.num_splits == splits
    triton_attention.launch(problem, plan, out, lse=lse)
    return out, lse


def problem_of(case, flags, **scales):
    sinks = sinks_of(flags)
    sinks = None if sinks is None else torch.tensor(sinks, device=DEVICE)
    return token_head_problem(case, flags.window, sinks, **scales)


@pytest.mark.parametrize("flags", FLAGS, ids=repr)
@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_triton_reads_token_head_scales(query_dtype, cache_dtype, flags):
    """Within SPEC §7 of the reference and of float64 on the same cache, the LSE within the
    LSE tests' bound of float64's; padded rows zero with an empty (-inf) LSE."""
    case = token_head_case(cache_dtype, query_dtype, flags)
    problem = problem_of(case, flags)
    out, lse = run(problem, flags.splits)
    expected = torch.empty_like(out)
    reference.paged_attention(problem, expected)
    exact, exact_lse = float64_attention(case, window=flags.window, sinks=sinks_of(flags),
                                         return_lse=True)  # fmt: skip
    assert relative_error(out, expected) <= TOLERANCE[query_dtype]
    check_state(out, lse, exact, exact_lse, query_dtype)  # padded rows: -inf in exact_lse
    assert (out[NUM_TOKENS:] == 0).all()


@pytest.mark.parametrize(
    "cache_dtype,query_dtype,head_dim,splits",
    [
        (torch.float8_e4m3fn, torch.bfloat16, 128, 3),
        (torch.int8, torch.float16, 256, 3),
        (torch.float8_e5m2, torch.bfloat16, 64, 1),
        (torch.int8, torch.bfloat16, 128, 1),
    ],
)
def test_production_tile_configuration(cache_dtype, query_dtype, head_dim, splits, monkeypatch):
    """The tiles a GPU gets (16-64 keys, several key tiles per split), fp32 dots (the
    interpreter's 16-bit dots are wrong)."""
    flags = Flags([True, False, True], window=(200, 40), sinks=True, splits=splits)
    case = token_head_case(cache_dtype, query_dtype, flags, seed=5, head_dim=head_dim)
    problem = problem_of(case, flags)
    with monkeypatch.context() as patch:
        patch.setattr(triton_attention, "interpreting", lambda: False)
        plan = triton_attention.launch_plan(problem.batch, splits)
    assert plan.block_n == {64: 64, 128: 32, 256: 32}[head_dim] and plan.num_splits == splits
    out, lse = run(problem, splits, dataclasses.replace(plan, dot_fp32=True))
    expected, expected_lse = torch.empty_like(out), torch.empty_like(lse)
    reference.paged_attention(problem, expected, expected_lse)
    assert relative_error(out, expected) <= TOLERANCE[query_dtype]
    assert lse_error(lse, expected_lse) < LSE_TOLERANCE


@pytest.mark.parametrize("rows", [4, 16, 32, 64, 128, 512])
def test_per_token_head_query_tiles_at_head_dim_128_hold_the_per_head_rows(rows, monkeypatch):
    """The GPU's plan at head_dim 128 (rows = q_len x GQA group per KV head): a per-token-head
    batch's query tile holds at least the per-head tile's rows, so its KV is read no more often
    (a 64-row drafter step: once, not four times over 16-row tiles), with at least 32 keys per
    tile."""
    case = token_head_case(torch.float8_e4m3fn, torch.bfloat16, Flags(False), head_dim=128)
    batch = problem_of(case, Flags(False)).batch
    batch = dataclasses.replace(batch, max_seqlen_q=rows // batch.group_size)
    with monkeypatch.context() as patch:
        patch.setattr(triton_attention, "interpreting", lambda: False)
        per_head = triton_attention.launch_plan(dataclasses.replace(batch, scale_mode="per_head"))
        plan = triton_attention.launch_plan(batch)
    assert batch.per_token_head_scales and batch.max_seqlen_q * batch.group_size == rows
    assert per_head.block_m <= plan.block_m and plan.num_q_tiles <= per_head.num_q_tiles
    assert plan.block_n >= 32
    if rows == 64:
        assert plan.num_q_tiles == 1


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_every_page_layout_gives_the_same_bits(cache_dtype):
    """The same rows in vLLM's inline page, head- or slot-major (scales strided views), and in
    separate contiguous tensors: each scale is read at its own strides."""
    flags = Flags([False, True, False], splits=3)
    outs = []
    for page in ("hnd", "nhd", "separate"):
        case = token_head_case(cache_dtype, torch.bfloat16, flags, seed=7, page=page)
        outs.append(run(problem_of(case, flags), flags.splits))
    assert outs[0][1].isfinite()[:NUM_TOKENS].all()
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
@pytest.mark.parametrize("splits", [1, 3])
def test_wrong_scales_give_a_wrong_answer(cache_dtype, splits):
    """The comparisons above can fail: Triton given the scales dropped (ones), one scale per KV
    head (each head's token 0, broadcast) or V's scales for K is far from float64."""
    flags = Flags([False, True, False], splits=splits)
    case = token_head_case(cache_dtype, torch.bfloat16, flags, seed=9)
    exact = float64_attention(case)
    page = int(case.block_table[0, 0])
    wrong = {
        "dropped": {"k_scale": torch.ones_like(case.k_scale),
                    "v_scale": torch.ones_like(case.v_scale)},
        "per_head": {"k_scale": case.k_scale[page, :1].expand_as(case.k_scale),
                     "v_scale": case.v_scale[page, :1].expand_as(case.v_scale)},
        "v_for_k": {"k_scale": case.v_scale},
    }  # fmt: skip
    for name, scales in wrong.items():
        out, _ = run(problem_of(case, flags, **scales), splits)
        assert relative_error(out, exact) > 0.1, name


@pytest.mark.parametrize("splits", [1, 3])
def test_a_nan_key_scale_reaches_the_rows_that_read_it(splits):
    """A NaN K scale (what the write stores for a NaN row) makes the rows that see that key NaN,
    and only them: an unseen key's score column is masked after its scale is applied."""
    flags = Flags(True, splits=splits)
    case = token_head_case(torch.float8_e4m3fn, torch.bfloat16, flags, seed=11)
    key = KV_LENS[0] - 4  # sequence 0, kv head 1: causal rows 4..7 see it, rows 0..3 do not
    case.k_scale[int(case.block_table[0, key // 16]), key % 16, 1] = math.nan
    out, lse = run(problem_of(case, flags), splits)
    reads = torch.zeros(lse.shape, dtype=torch.bool)
    reads[4:8, 4:] = True
    assert torch.isnan(out[reads]).all() and torch.isnan(lse[reads]).all()
    assert not torch.isnan(out[~reads]).any() and not torch.isnan(lse[~reads]).any()


@pytest.mark.parametrize("splits", [1, 2])
def test_a_tile_whose_value_scales_are_all_zero_gives_zeros(splits):
    """Every value of KV head 0 scaled by 0 (its tiles' largest V scale is 0): its query heads'
    outputs are 0 as in the reference, not 0 / 0; the other heads and the LSE are untouched."""
    flags = Flags(False, splits=splits)
    case = token_head_case(torch.float8_e4m3fn, torch.bfloat16, flags, seed=3)
    problem = problem_of(case, flags)
    v_scale = problem.v_scale.clone()
    v_scale[..., 0] = 0.0
    problem = dataclasses.replace(problem, v_scale=v_scale)
    out, lse = run(problem, splits)
    expected, expected_lse = torch.empty_like(out), torch.empty_like(lse)
    reference.paged_attention(problem, expected, expected_lse)
    group = problem.group_size
    assert (expected[:NUM_TOKENS, :group] == 0).all() and (out[:NUM_TOKENS, :group] == 0).all()
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]
    assert lse_error(lse, expected_lse) < LSE_TOLERANCE


@pytest.mark.parametrize("splits", [1, 3])
def test_scale_offsets_past_int32_reach_the_right_scales(splits):
    """Per-token-head scales whose KV heads lie 2^30 elements apart (KV head 2 at 2^31) give
    the bits of a compact launch: kv_head x its stride is a 64-bit product (an int32 one
    wraps to another scale)."""
    flags = Flags(False, splits=splits, heads=(3, 3))
    case = token_head_case(torch.float8_e4m3fn, torch.bfloat16, flags, seed=6)
    problem = problem_of(case, flags)
    out, lse = run(problem, splits)
    far_k, far_v = far_apart_views([problem.k_scale, problem.v_scale], 2)
    far_out, far_lse = run(dataclasses.replace(problem, k_scale=far_k, v_scale=far_v), splits)
    assert torch.equal(far_out, out) and torch.equal(far_lse, lse)


@pytest.mark.parametrize("splits", [1, 2])
def test_value_scales_spread_a_million_fold_under_an_fp16_query(splits):
    """P's columns times each V scale over the tile's largest is the 16-bit dot's operand: with
    V scales 1e6 apart in a tile (one slot per page scaled 100, its values 0, the others 1e-4)
    and an fp16 query, the other keys' products lie below fp16's normal range (2^-14) unless
    lifted first."""
    flags = Flags(False, splits=splits)
    case = token_head_case(torch.float8_e4m3fn, torch.float16, flags, seed=8)
    problem = problem_of(case, flags)
    v_scale = torch.full_like(problem.v_scale, 1e-4)
    v_scale[:, 0] = 100.0
    value_cache = problem.value_cache.clone()
    value_cache.view(torch.uint8)[:, 0] = 0
    problem = dataclasses.replace(problem, v_scale=v_scale, value_cache=value_cache)
    out, lse = run(problem, splits)
    expected = torch.empty_like(out)
    reference.paged_attention(problem, expected)
    assert relative_error(out, expected) <= TOLERANCE[torch.float16]
