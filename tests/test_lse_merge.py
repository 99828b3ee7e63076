"""Log-sum-exp outputs (``return_lse=True``) and :func:`merge_attention_states` (SPEC §4), against
float64: every backend's LSE, and the states of a sequence's keys split into shards (uneven,
empty, interleaved as vLLM's decode context parallelism lays them out, a cascade prefix) merged
back into the whole. Planted wrong merges show the comparisons fail.

Triton runs in its CPU interpreter here; the CUDA kernels' tests are marked ``gpu``. The CUDA
merge's row arithmetic is checked on the CPU through the test extension
(test_cuda_kernel_emulation.py).
"""

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import DEVICE, TOLERANCE
from helpers.backends import plan_and_run
from helpers.gpu_mock import (
    DEFAULT_TABLES,
    FakeLibrary,
    attention,
    layer_args,
    mock_gpu,
    plan_case,
    problem_of,
)
from helpers.lse import (
    KV_LENS,
    LAYOUTS,
    LSE_TOLERANCE,
    check_state,
    interleaved_shards,
    lse_case,
    lse_error,
    run_backend,
    shard_problem,
)
from helpers.oracle import float64_attention

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.cuda import dsl, extension, mma_sync
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.synthetic import make_case, relative_error

SINKS = [25.0, -40.0, 0.5, 3.0]  # per q head: one outweighs every key, one changes nothing


# ---------------------------------------------------------------- return_lse on every backend

LSE_CASES = [
    # (cache dtype, query dtype, causal, window, sinks)
    (torch.float8_e4m3fn, torch.bfloat16, False, (-1, -1), False),
    (torch.float8_e5m2, torch.float16, True, (-1, -1), True),
    (torch.float8_e4m3fn, torch.bfloat16, [True, False], (6, 3), True),
    (torch.bfloat16, torch.bfloat16, [False, True], (20, -1), False),
]


def lse_launch(cache_dtype, query_dtype, causal, window, sinks, validate=False):
    """The case, its validated problem (window, and the sinks when ``sinks``) and NaN-filled
    ``out`` / ``lse`` buffers for a backend's own launch entry."""
    case = lse_case(cache_dtype, query_dtype, causal)
    sinks_t = torch.tensor(SINKS, device=DEVICE) if sinks else None
    problem = fna.validation.validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=validate,
        window=window, sinks=sinks_t,
    )  # fmt: skip
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan, device=DEVICE)
    return case, problem, out, lse


def backends_here():
    return [name for name, info in fna.available_backends().items()
            if name != "auto" and info["available"]]  # fmt: skip


@pytest.mark.parametrize("cache_dtype,query_dtype,causal,window,sinks", LSE_CASES, ids=str)
def test_reference_lse_matches_float64(cache_dtype, query_dtype, causal, window, sinks):
    case = lse_case(cache_dtype, query_dtype, causal)
    sinks_list = SINKS if sinks else None
    sinks_t = torch.tensor(SINKS, device=DEVICE) if sinks else None
    out, lse = fna.paged_attention(
        *case.args(), **case.kwargs(), window=window, sinks=sinks_t, backend="reference",
        return_lse=True,
    )  # fmt: skip
    exact_out, exact_lse = float64_attention(case, window=window, sinks=sinks_list, return_lse=True)
    check_state(out, lse, exact_out, exact_lse, query_dtype)
    # Padded rows are empty states; the sink is inside the LSE (negative control: without it).
    assert torch.all(lse[-2:] == -math.inf)
    if sinks:
        _, plain = float64_attention(case, window=window, return_lse=True)
        assert lse_error(lse, plain) > 1.0


# A window of 6 + 3 keys spans one key tile: that case runs unsplit only.
TRITON_CASES = [(*LSE_CASES[1], 1), (*LSE_CASES[1], 3), (*LSE_CASES[2], 1)]
TRITON_CASES += [(*LSE_CASES[3], 1), (*LSE_CASES[3], 3)]


@pytest.mark.parametrize(
    "cache_dtype,query_dtype,causal,window,sinks,splits", TRITON_CASES, ids=str
)
def test_triton_lse_matches_float64(cache_dtype, query_dtype, causal, window, sinks, splits):
    """The unsplit kernel writes the LSE itself, the split launch's merge writes it."""
    case, problem, out, lse = lse_launch(cache_dtype, query_dtype, causal, window, sinks)
    plan = triton_attention.launch_plan(problem.batch, splits)
    assert plan.num_splits == splits
    triton_attention.launch(problem, plan, out, lse=lse)
    exact_out, exact_lse = float64_attention(
        case, window=window, sinks=SINKS if sinks else None, return_lse=True
    )
    check_state(out, lse, exact_out, exact_lse, query_dtype)


# Sequence 1's key in the last of three splits (keys 256..299); causal rows 1..3 see it, row 0
# does not.
NAN_KEY = 297


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("poisoned", ["key", "query"])
@pytest.mark.parametrize("backend,splits", [("reference", None), ("triton", 1), ("triton", 3)])
def test_a_nan_reaches_the_rows_that_read_it(backend, splits, poisoned, causal):
    """SPEC §5: a NaN key in one split's keys, or a NaN query element, makes exactly the rows
    that read it NaN, output and LSE, on every split (a NaN row sum is no empty split, and the
    merge passes it on); the other rows stay right. A bf16 cache: Triton's interpreter reads FP8
    NaN bytes as finite."""
    case, problem, out, lse = lse_launch(torch.bfloat16, torch.bfloat16, causal, (-1, -1), False)
    exact_out, exact_lse = float64_attention(case, return_lse=True)
    reads = torch.zeros(exact_lse.shape, dtype=torch.bool)
    if poisoned == "key":
        page = case.block_table[1, NAN_KEY // 16]
        problem.key_cache[page, NAN_KEY % 16, 1, 5] = math.nan
        start, end = visible_range(torch.arange(4), 4, KV_LENS[1], causal)
        reads[3:7, 2:] = ((start <= NAN_KEY) & (NAN_KEY < end))[:, None]  # kv head 1's q heads
    else:
        problem.query[4, 2, 7] = math.nan
        reads[4, 2] = True
    if backend == "reference":
        reference.paged_attention(problem, out, lse)
    else:
        plan = triton_attention.launch_plan(problem.batch, splits)
        assert plan.num_splits == splits
        triton_attention.launch(problem, plan, out, lse=lse)
    assert torch.isnan(out[reads]).all() and torch.isnan(lse[reads]).all()
    assert relative_error(exact_out[~reads], out[~reads]) < TOLERANCE[torch.bfloat16]
    assert lse_error(lse[~reads], exact_lse[~reads]) < LSE_TOLERANCE


def test_plan_run_and_one_shot_return_the_same_lse():
    """PagedAttention.run(return_lse=True) on the kept workspace, and the one-shot call, give the
    reference's LSE (the backend auto picks here); without return_lse, only out comes back."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, [True, False])
    kw = case.kwargs()
    attn = fna.PagedAttention(
        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE,
        max_num_seqs=4, max_num_tokens=16,
    )  # fmt: skip
    attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=kw["causal"],
              max_seqlen_q=kw["max_seqlen_q"], max_seqlen_k=kw["max_seqlen_k"],
              num_tokens=case.query.shape[0])  # fmt: skip
    sinks = torch.tensor(SINKS, device=DEVICE)
    out, lse = attn.run(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale,
                        sinks=sinks, return_lse=True)  # fmt: skip
    assert isinstance(attn.run(case.query, case.key_cache, case.value_cache), torch.Tensor)
    exact_out, exact_lse = float64_attention(case, sinks=SINKS, return_lse=True)
    check_state(out, lse, exact_out, exact_lse, torch.bfloat16)
    one_out, one_lse = fna.paged_attention(*case.args(), **kw, sinks=sinks, return_lse=True)
    check_state(one_out, one_lse, exact_out, exact_lse, torch.bfloat16)


def test_return_lse_under_torch_compile():
    """The opaque op carries the LSE output through a compiled graph."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False)
    kw = case.kwargs()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(query):
        return fna.paged_attention(query, *case.args()[1:], **kw, backend="reference",
                                   return_lse=True)  # fmt: skip

    out, lse = step(case.query)
    exact_out, exact_lse = float64_attention(case, return_lse=True)
    check_state(out, lse, exact_out, exact_lse, torch.bfloat16)


# ------------------------------------------------------------------- shards merged to the whole


def merge_backends():
    names = ["reference"]
    if DEVICE == "cuda" or triton_attention.interpreting():
        names.append("triton")
    if DEVICE == "cuda" and fna.available_backends()["mma_sync"]["available"]:
        names.append("mma_sync")
    return names


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("attend", ["reference", "triton"])
def test_shard_states_merge_to_the_whole(layout, attend):
    """Bidirectional rows: the states of each shard's keys merge, on every merge backend, into
    the attention over all keys (float64), the sink counted by one shard only. Shards that give
    a sequence no key are empty states (lse -inf) and change nothing."""
    if attend == "triton" and not (DEVICE == "cuda" or triton_attention.interpreting()):
        pytest.skip("Triton needs a GPU or its interpreter")
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    sinks = torch.tensor(SINKS, device=DEVICE)
    states = [
        run_backend(attend, shard_problem(case, keys, sinks=sinks if r == 0 else None))
        for r, keys in enumerate(LAYOUTS[layout])
    ]
    exact_out, exact_lse = float64_attention(case, sinks=SINKS, return_lse=True)
    for merger in merge_backends():
        out, lse = fna.merge_attention_states(
            [s[0] for s in states], [s[1] for s in states], backend=merger
        )
        check_state(out, lse, exact_out, exact_lse, torch.bfloat16)


def test_a_sink_on_every_shard_is_counted_too_often():
    """Negative control of the shard test: each shard's LSE holds the sink it was given, so a
    sink given to every shard enters the merged denominator once per shard."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    sinks = torch.tensor(SINKS, device=DEVICE)
    states = [
        run_backend("reference", shard_problem(case, keys, sinks=sinks))
        for keys in LAYOUTS["dcp2_interleave1"]
    ]
    _, exact_lse = float64_attention(case, sinks=SINKS, return_lse=True)
    _, lse = fna.merge_attention_states([s[0] for s in states], [s[1] for s in states])
    # q head 0's sink of +25 dominates its row: twice counted, its LSE is ~log 2 too large.
    assert lse_error(lse, exact_lse) > 0.5


def test_key_shard_plans_take_shards_shorter_than_the_query():
    """PagedAttention.plan(key_shard=True): a DCP rank's shard may hold fewer keys than a
    sequence has query rows, or none; the public path gives the backends' states (empty rows
    -inf) and merges to the whole. Without key_shard such lengths are refused (SPEC §5), and a
    key_shard plan refuses causal masks and windows."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    attn = fna.PagedAttention(
        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE,
        max_num_seqs=2, max_num_tokens=16,
    )  # fmt: skip
    states = []
    for keys in LAYOUTS["dcp4_interleave8"]:
        shard = shard_problem(case, keys)
        plan = attn.plan(shard.cu_seqlens_q, shard.seq_lens, shard.block_table, causal=False,
                         num_tokens=case.query.shape[0], key_shard=True)  # fmt: skip
        states.append(attn.run(case.query, shard.key_cache, shard.value_cache, shard.k_scale,
                               shard.v_scale, plan=plan, return_lse=True))  # fmt: skip
    assert torch.all(states[3][1][:3] == -math.inf)  # the first sequence has no key on rank 3
    exact_out, exact_lse = float64_attention(case, return_lse=True)
    out, lse = fna.merge_attention_states([s[0] for s in states], [s[1] for s in states])
    check_state(out, lse, exact_out, exact_lse, torch.bfloat16)
    shard = shard_problem(case, LAYOUTS["dcp4_interleave8"][3])
    with pytest.raises(ValueError, match="q_len must be <= kv_len"):
        attn.plan(shard.cu_seqlens_q, shard.seq_lens, shard.block_table, causal=False)
    for bad in ({"causal": True}, {"causal": False, "window": (4, 4)}):
        with pytest.raises(ValueError, match="key_shard=True needs causal=False"):
            attn.plan(shard.cu_seqlens_q, shard.seq_lens, shard.block_table, key_shard=True,
                      **bad)  # fmt: skip


def test_interleaved_shards_hold_vllms_local_lengths():
    """The test's DCP layout is vLLM's: each rank's key count is get_dcp_local_seq_lens'."""
    utils = pytest.importorskip("vllm.v1.attention.backends.utils")
    lens = torch.tensor([0, 1, 5, 17, 70, 129], dtype=torch.int32)
    for ranks, interleave in ((2, 1), (3, 16), (4, 8)):
        for rank in range(ranks):
            theirs = utils.get_dcp_local_seq_lens(lens, ranks, rank, interleave).tolist()
            ours = [len(interleaved_shards(n, ranks, interleave)[rank]) for n in lens.tolist()]
            assert ours == theirs, (ranks, interleave, rank)


def test_causal_cascade_prefix_and_suffix_merge_to_the_whole():
    """Cascade: a shared prefix attended bidirectionally (every row sees it whole) and each
    sequence's causal suffix merge into causal attention over the whole sequence."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, True, seed=5)
    prefix = [list(range(0, 8)), list(range(0, 40))]
    suffix = [list(range(8, KV_LENS[0])), list(range(40, KV_LENS[1]))]
    states = [
        run_backend("reference", shard_problem(case, prefix, causal=False)),
        run_backend("reference", shard_problem(case, suffix, causal=True)),
    ]
    exact_out, exact_lse = float64_attention(case, return_lse=True)
    out, lse = fna.merge_attention_states([s[0] for s in states], [s[1] for s in states])
    check_state(out, lse, exact_out, exact_lse, torch.bfloat16)


# ------------------------------------------------------------------- merge_attention_states


def random_states(num_states, shape=(6, 3, 40), dtype=torch.float32, seed=0):
    """Random states with LSEs of very different sizes (up to +-300: e^300 overflows float32)
    and empty ones: state 0 is empty for row 0, every state is empty for row 1."""
    gen = torch.Generator().manual_seed(seed)
    outs = torch.randn((num_states, *shape), generator=gen).to(dtype)
    lses = torch.randn((num_states, *shape[:2]), generator=gen) * 100
    lses[0, 0] = -math.inf
    lses[:, 1] = -math.inf
    outs[0, 0] = math.nan  # an empty state's output is never read
    outs[:, 1] = math.inf
    return outs.to(DEVICE), lses.to(DEVICE)


def float64_merge(outs, lses):
    """sum_s e^(lse_s) o_s / sum_s e^(lse_s) and log sum_s e^(lse_s), in float64, empty states
    dropped."""
    outs, lses = outs.double().cpu(), lses.double().cpu()
    seen = lses > -math.inf
    lse = torch.logsumexp(lses, dim=0)
    weights = torch.where(seen, torch.exp(lses - torch.where(seen, lse, 0.0)), 0.0)
    out = (torch.where(seen[..., None], outs, 0.0) * weights[..., None]).sum(0)
    return out, lse


def merge_error(out, lse, outs, lses) -> tuple[float, float]:
    exact_out, exact_lse = float64_merge(outs, lses)
    return relative_error(exact_out, out.double().cpu()), lse_error(lse, exact_lse)


MERGE_TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 5e-3}


@pytest.mark.parametrize("merger", merge_backends())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("num_states", [1, 2, 5])
def test_merge_matches_float64(merger, dtype, num_states):
    outs, lses = random_states(num_states, dtype=dtype, seed=num_states)
    out, lse = fna.merge_attention_states(list(outs), list(lses), backend=merger)
    assert out.dtype == dtype and lse.dtype == torch.float32
    out_error, lse_err = merge_error(out, lse, outs, lses)
    assert out_error < MERGE_TOLERANCE[dtype] and lse_err < LSE_TOLERANCE
    # A row no state saw: zeros and -inf, never NaN.
    assert torch.all(out[1] == 0) and torch.all(lse[1] == -math.inf)
    # The stacked form and a caller's out give the same.
    target = torch.empty_like(out)
    again, again_lse = fna.merge_attention_states(outs, lses, out=target, backend=merger)
    assert again is target and torch.equal(again, out) and torch.equal(again_lse, lse)


def test_merge_takes_strided_lses_as_vllm_passes_them():
    """An LSE transposed from FlashAttention's [heads, tokens] layout works as is."""
    outs, lses = random_states(2)
    transposed = [lse.t().contiguous().t() for lse in lses]
    assert not transposed[0].is_contiguous()
    for merger in merge_backends():
        out, lse = fna.merge_attention_states(list(outs), transposed, backend=merger)
        assert max(merge_error(out, lse, outs, lses)) < LSE_TOLERANCE


@pytest.mark.parametrize("merger", merge_backends())
def test_merge_passes_a_nan_state_on(merger):
    """A NaN lse (a state whose keys held a NaN) is no empty state: that row's output and LSE
    are NaN; a NaN in a state's output reaches that element only; the other rows stay right."""
    outs, lses = random_states(3, seed=4)
    lses[1, 3, 2] = math.nan
    outs[2, 4, 0, 7] = math.nan
    out, lse = fna.merge_attention_states(list(outs), list(lses), backend=merger)
    assert torch.isnan(out[3, 2]).all() and torch.isnan(lse[3, 2])
    assert torch.isnan(out[4, 0, 7]) and torch.isfinite(lse[4, 0])
    exact_out, exact_lse = float64_merge(outs, lses)
    finite = torch.ones(lse.shape, dtype=torch.bool)
    finite[3, 2] = finite[4, 0] = False
    out_error = relative_error(exact_out[finite], out[finite].double().cpu())
    assert out_error < MERGE_TOLERANCE[torch.float32]
    assert lse_error(lse[finite], exact_lse[finite]) < LSE_TOLERANCE


def overflowing_merge(outs, lses, out, lse):
    """Planted error: weights e^(lse_s) without the max shift (overflow for lse > 88)."""
    weights = torch.exp(lses)[..., None]
    total = weights.sum(0)
    out.copy_((weights * outs.float()).sum(0) / total)
    lse.copy_(torch.log(total[..., 0]))


def misweighted_merge(outs, lses, out, lse):
    """Planted error: the last state's weight doubled (a shard counted twice)."""
    doubled = lses.clone()
    doubled[-1] += math.log(2.0)
    reference.merge_states(outs, doubled, out, lse)


@pytest.mark.parametrize("wrong", [overflowing_merge, misweighted_merge])
def test_planted_wrong_merges_fail_the_comparison(wrong):
    """The float64 comparison catches a merge that skips the max shift or mis-weights a shard
    (on states with finite LSEs, so that the error is the planted one)."""
    outs, lses = random_states(3, seed=7)
    lses[:, :2] = torch.randn_like(lses[:, :2]) * 100
    outs[:, :2] = torch.randn_like(outs[:, :2])
    out = torch.empty_like(outs[0])
    lse = torch.empty(lses.shape[1:], device=lses.device)
    reference.merge_states(outs, lses, out, lse)
    assert max(merge_error(out, lse, outs, lses)) < LSE_TOLERANCE
    wrong(outs, lses, out, lse)
    out_error, lse_err = merge_error(out, lse, outs, lses)
    assert not (out_error < MERGE_TOLERANCE[torch.float32] and lse_err < LSE_TOLERANCE)


def test_merge_refuses_bad_input_by_name():
    outs, lses = random_states(2)
    with pytest.raises(TypeError, match="outs must be a non-empty sequence"):
        fna.merge_attention_states([], [])
    with pytest.raises(ValueError, match=r"outs\[1\] must have the shape"):
        fna.merge_attention_states([outs[0], outs[1][:3]], list(lses))
    with pytest.raises(TypeError, match="lses must be float32"):
        fna.merge_attention_states(list(outs), [lse.double() for lse in lses])
    with pytest.raises(ValueError, match="lses must be"):
        fna.merge_attention_states(list(outs), list(lses[:, :3]))
    with pytest.raises(TypeError, match="outs must be one of"):
        fna.merge_attention_states(list(outs.double()), list(lses))
    with pytest.raises(ValueError, match="out must be"):
        fna.merge_attention_states(list(outs), list(lses), out=torch.empty(2, 2))
    with pytest.raises(ValueError, match="backend must be"):
        fna.merge_attention_states(list(outs), list(lses), backend="flash")


# ------------------------------------------------------------------------- the CUDA kernels


def test_cuda_families_write_the_lse_in_the_launchs_own_passes(monkeypatch):
    """With the GPU mocked (helpers.gpu_mock): an unsplit mma_sync plan asked for the LSE
    launches once, unsplit, with the LSE output's pointer (the kernel's epilogue writes it): no
    partials, no merge pass; a split plan hands it to the same launch (its merge). A DSL
    family's split plan hands the LSE to its merge; its plan() refuses a batch that wants the
    LSE unsplit, at plan time when the plan states it, else on the run that asks."""
    mma_calls, merges = [], []
    library = FakeLibrary(DEFAULT_TABLES["wgmma"])
    mock_gpu(monkeypatch, libraries={"wgmma": library}, mma_calls=mma_calls)
    monkeypatch.setattr(extension, "merge_splits", lambda *args: merges.append(args), raising=True)
    case = make_case([3, 5], [40, 21], seed=9)
    attn = attention(case)
    out, lse = attn.run(*layer_args(case), plan=plan_case(attn, case), return_lse=True)
    (call,) = mma_calls  # the launch passes AttnParams by field name, the LSE beside them
    assert call["fields"]["num_splits"] == 1 and not call["fields"]["ws_o"]
    assert not call["fields"]["ws_lse"] and call["lse"] == lse.data_ptr() and not merges
    assert lse.shape == (8, 8) and lse.is_contiguous()

    mma_calls.clear()
    problem = problem_of(case)
    split = mma_sync.plan(problem.batch, None, num_splits=3)
    mma_sync.run(problem, split, out, lse)
    (call,) = mma_calls
    assert call["fields"]["num_splits"] == 3 and call["lse"] == lse.data_ptr() and not merges
    with pytest.raises(ValueError, match="contiguous"):
        mma_sync.run(problem, split, out, torch.empty(8, 8).t())

    mma_calls.clear()
    unsplit = plan_case(attn, case, backend="wgmma")
    refused = "'wgmma' does not support this call: wgmma: an unsplit plan has no LSE output"
    with pytest.raises(RuntimeError, match=refused):
        attn.run(*layer_args(case), plan=unsplit, return_lse=True)
    with pytest.raises(RuntimeError, match=refused):
        plan_case(attn, case, backend="wgmma", return_lse=True)
    assert not library.calls and not mma_calls and not merges

    wgmma = dsl.FAMILIES["wgmma"]
    split = wgmma.plan(problem.batch, None, 3)
    out = torch.empty_like(case.query)
    lse = torch.empty(case.query.shape[:2])
    wgmma.run(problem, split, out, lse)
    assert len(library.calls) == 1
    ((_, ws_o, ws_lse, merged_out, merged_lse),) = merges
    assert merged_out is out and merged_lse is lse and ws_lse.shape[0] == 3


def test_merge_entry_passes_the_lse_output(monkeypatch):
    """extension.merge_splits hands _C the LSE output's pointer and strides beside `out`; an
    LSE of the wrong shape or dtype is refused before any launch. Its merge_states gives _C
    float32 contiguous partials with log2 LSEs."""
    import contextlib
    from types import SimpleNamespace

    from helpers.backends import gpu_stand_in

    from fp8_noncausal_attn.backends.cuda import extension

    calls = []
    ext = SimpleNamespace(merge_splits=lambda **kwargs: calls.append(kwargs), MERGE_FP32=4)
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(
        cuda_stream=7))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False)
    problem = fna.validation.validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    ws_o, ws_lse = torch.zeros(2, 9, 4, 64), torch.zeros(2, 9, 4)
    lse, out = torch.empty(4, 9).t(), torch.empty(9, 4, 64, dtype=torch.bfloat16)
    extension.merge_splits(problem, ws_o, ws_lse, out, lse)
    (call,) = calls
    assert call["out"] == out.data_ptr() and call["lse"] == lse.data_ptr()
    assert call["lse_strides"] == (1, 9)
    assert call["q_dtype"] == extension.DTYPE_CODES[torch.bfloat16]
    for bad in (torch.empty(9, 3), torch.empty(9, 4, dtype=torch.float64)):
        with pytest.raises(ValueError, match="lse must be float32"):
            extension.merge_splits(problem, ws_o, ws_lse, out, bad)
    calls.clear()
    outs, lses = random_states(3, dtype=torch.float16)
    out, merged = torch.empty_like(outs[0]), torch.empty(lses.shape[1:])
    extension.merge_states(outs, lses, out, merged)
    (call,) = calls
    assert call["q_dtype"] == extension.DTYPE_CODES[torch.float16] and call["num_splits"] == 3
    assert call["num_seqs"] == 0 and call["lse"] == merged.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("cache_dtype,query_dtype,causal,window,sinks", LSE_CASES, ids=str)
def test_cuda_lse_matches_float64(cache_dtype, query_dtype, causal, window, sinks, splits):
    """mma_sync: an unsplit plan (1) writes the LSE in its kernel's epilogue, a split plan (3)
    in its merge; None: the plan's own choice."""
    if not fna.available_backends()["mma_sync"]["available"]:
        pytest.skip("the CUDA extension does not run here")
    case, problem, out, lse = lse_launch(
        cache_dtype, query_dtype, causal, window, sinks, validate=True
    )
    plan_and_run(mma_sync, problem, out, num_splits=splits, lse=lse)
    exact_out, exact_lse = float64_attention(
        case, window=window, sinks=SINKS if sinks else None, return_lse=True
    )
    check_state(out, lse, exact_out, exact_lse, query_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_shard_states_merge_to_the_whole(layout):
    if not fna.available_backends()["mma_sync"]["available"]:
        pytest.skip("the CUDA extension does not run here")
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    sinks = torch.tensor(SINKS, device=DEVICE)
    states = [
        run_backend("mma_sync", shard_problem(case, keys, sinks=sinks if r == 0 else None))
        for r, keys in enumerate(LAYOUTS[layout])
    ]
    exact_out, exact_lse = float64_attention(case, sinks=SINKS, return_lse=True)
    out, lse = fna.merge_attention_states(
        [s[0] for s in states], [s[1] for s in states], backend="mma_sync"
    )
    check_state(out, lse, exact_out, exact_lse, torch.bfloat16)


def test_lse_at_the_batch_limit_is_written_by_the_unsplit_epilogue(monkeypatch, host_code):
    """At MAX_SEQS sequences (the grid's z limit, 65,535 / num_seqs leaves one split) the plan
    asked for the LSE stays unsplit and its launch hands the kernel the LSE output (no forced
    split cut back to one over unwritten partials); one sequence more is refused by name."""
    from helpers.backends import gpu_stand_in

    most = host_code.MAX_SEQS
    calls = []
    ext = SimpleNamespace(
        plan=host_code.plan, MAX_SEQS=most, paged_attention=lambda **kwargs: calls.append(kwargs)
    )
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(mma_sync, "resident_ctas", lambda problem: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    case = make_case([1] * 4, [16] * 4, num_q_heads=4, num_kv_heads=2, seed=5)
    problem = fna.validation.validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )

    def with_seqs(count):  # the host sizes of a batch of `count` sequences (a view: no copy)
        batch = dataclasses.replace(
            problem.batch, seq_lens=problem.seq_lens[:1].expand(count), max_seqlen_k=1 << 20
        )
        return dataclasses.replace(problem, batch=batch)

    at_limit = with_seqs(most)
    for forced in (None, 2):
        plan = mma_sync.plan(at_limit.batch, None, forced)
        assert plan.num_splits == 1 and plan.launch.grid[2] == most + 1
        lse = torch.empty(problem.num_tokens, problem.num_q_heads)
        mma_sync.run(at_limit, plan, torch.empty_like(case.query), lse)
        assert calls[-1]["lse"] == lse.data_ptr() and calls[-1]["plan"] is plan.launch
        assert calls[-1]["fields"]["num_splits"] == 1 and not calls[-1]["fields"]["ws_lse"]
    over = with_seqs(most + 1)
    refusal = mma_sync.plan_refusal(over.batch)
    assert refusal == f"at most {most} sequences per launch, got {most + 1}"
