"""Triton kernels against the reference (CPU interpreter here, compiled on a GPU)."""

import dataclasses

import pytest
import torch
from helpers import DEVICE, TOLERANCE
from helpers.backends import plan_and_run
from helpers.far_offsets import far_apart_views
from helpers.matrix import build_case, sampled_matrix

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends import reference as reference_backend
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.synthetic import make_case, relative_error, strided_view
from fp8_noncausal_attn.validation import validate_attention

NUM_CASES = 24


def reference(case, **overrides):
    kwargs = case.kwargs() | overrides
    return fna.paged_attention(*case.args(), **kwargs, backend="reference")


def problem_of(case, **overrides):
    """The normalised problem of ``case`` (what a plan holds), with no value sync."""
    kwargs = case.kwargs() | overrides
    return validate_attention(*case.args(), **kwargs, softmax_scale=None, out=None, validate=False)


def run_backend(backend, problem, out, num_splits=None):
    """One backend on an already validated problem (as a planned run does)."""
    if backend == "triton":
        plan_and_run(triton_attention, problem, out, num_splits=num_splits)
    else:
        reference_backend.paged_attention(problem, out)


# (backend, forced Triton split count): the unsplit kernel, the split kernel + merge, the oracle.
BACKEND_RUNS = [("triton", 1), ("triton", 3), ("reference", None)]


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_triton_matches_reference(index):
    params = sampled_matrix(NUM_CASES, seed=2026)[index]
    case = build_case(params, seed=index, device=DEVICE)
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    ref = reference(case)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[params["query_dtype"]], params
    assert (out[sum(case.q_lens) :] == 0).all()


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("causal", [False, True, [True, False]])
def test_split_kv_merge_matches_reference(num_splits, causal):
    case = make_case(
        [8, 5], [200, 61], num_q_heads=8, num_kv_heads=2, head_dim=64, causal=causal,
        device=DEVICE, seed=11,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    assert triton_attention.launch_plan(problem.batch, num_splits).num_splits > 1
    out = torch.empty_like(case.query)
    plan_and_run(triton_attention, problem, out, num_splits=num_splits)
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_per_head_scales_are_neither_dropped_nor_broadcast(backend):
    """Regression for a peer that used k_scale[0] for every head (vllm#51363)."""
    case = make_case([8, 8], [40, 90], num_q_heads=8, num_kv_heads=4, device=DEVICE, seed=7)
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    ref64 = reference(case)
    assert relative_error(out, ref64) <= TOLERANCE[torch.bfloat16]
    broadcast = reference(case, k_scale=case.k_scale[:1].clone(), v_scale=case.v_scale[:1].clone())
    dropped = reference(case, k_scale=None, v_scale=None)
    assert relative_error(broadcast, ref64) > 0.2
    assert relative_error(dropped, ref64) > 0.2


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_bidirectional_is_not_computed_as_causal(backend):
    """Regression for a peer whose fast path returned causal results for a full mask."""
    case = make_case([8, 16], [8, 40], device=DEVICE, seed=9)
    bidirectional = fna.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    as_causal = reference(case, causal=True)
    assert relative_error(bidirectional, reference(case, causal=False)) <= 1e-2
    assert relative_error(bidirectional, as_causal) > 0.1
    mixed = torch.tensor([True, False], device=DEVICE)
    out = fna.paged_attention(*case.args(), **(case.kwargs() | {"causal": mixed}), backend=backend)
    assert relative_error(out[:8], as_causal[:8]) <= 1e-2
    assert relative_error(out[8:], bidirectional[8:]) <= 1e-2


@pytest.mark.parametrize("k_scale,v_scale", [(1e-6, 1e-6), (1e3, 1e-4), (30.0, 1e4)])
def test_extreme_valid_scales_give_no_nan(k_scale, v_scale):
    case = make_case([8], [64], device=DEVICE, seed=2, scales="none")
    kwargs = case.kwargs() | {"k_scale": k_scale, "v_scale": v_scale}
    out = fna.paged_attention(*case.args(), **kwargs, backend="triton")
    ref = fna.paged_attention(*case.args(), **kwargs, backend="reference")
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]


def test_out_is_written_in_place_through_strides():
    case = make_case([3, 8], [30, 8], device=DEVICE, seed=4)
    wide = torch.zeros(*case.query.shape[:2], 128, dtype=torch.bfloat16, device=DEVICE)
    out = wide[..., :64]
    returned = fna.paged_attention(*case.args(), **case.kwargs(), out=out, backend="triton")
    assert returned.data_ptr() == out.data_ptr()
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]
    assert (wide[..., 64:] == 0).all()


def test_torch_compile_traces_the_op_as_opaque():
    case = make_case([2, 8], [20, 12], device=DEVICE, seed=6)

    def step(query):
        return fna.paged_attention(query, *case.args()[1:], **case.kwargs(), backend="triton") * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    assert relative_error(compiled(case.query), step(case.query)) == 0.0


@pytest.mark.gpu
def test_cuda_graph_replay_with_new_lengths():
    case = make_case([8, 8], [64, 200], device="cuda", seed=8)
    out = torch.empty_like(case.query)
    kwargs = case.kwargs() | {"max_seqlen_k": 256}

    def run():
        fna.paged_attention(*case.args(), **kwargs, out=out, backend="triton")

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.seq_lens.copy_(torch.tensor([40, 130], dtype=torch.int32, device="cuda"))
    graph.replay()
    eager = fna.paged_attention(*case.args(), **kwargs, backend="triton")
    assert torch.equal(out, eager)


@pytest.mark.gpu
def test_cuda_graph_replay_follows_in_place_updates():
    """As vLLM replays: captured at max_model_len with padded rows; lengths and int32 causal
    flags change in place (strided buffers); replay equals eager and the reference."""
    case = make_case(
        [8, 8], [300, 2000], causal=[1, 0], causal_dtype=torch.int32, index_step=2,
        padded_rows=8, device="cuda", seed=21,
    )  # fmt: skip
    out = torch.empty_like(case.query)
    kwargs = case.kwargs() | {"max_seqlen_k": 32768}

    def run():
        fna.paged_attention(*case.args(), **kwargs, out=out, backend="triton")

    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    case.seq_lens.copy_(torch.tensor([90, 1500], dtype=torch.int32, device="cuda"))
    case.causal.copy_(torch.tensor([0, 1], dtype=torch.int32, device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    eager = fna.paged_attention(*case.args(), **kwargs, backend="triton")
    assert torch.equal(out, eager) and (out[16:] == 0).all()
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "cache_dtype,query_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_16bit_cache_of_the_other_dtype_keeps_its_range(cache_dtype, query_dtype):
    """bf16 keys beyond fp16's range (65504) must not overflow when the query is fp16."""
    case = make_case(
        [8], [90], cache_dtype=cache_dtype, query_dtype=query_dtype, scales="none",
        device=DEVICE, seed=12,
    )  # fmt: skip
    if cache_dtype == torch.bfloat16:
        case.key_cache.mul_(1e4)
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, reference(case)) <= TOLERANCE[query_dtype]


@pytest.mark.parametrize("backend,num_splits", BACKEND_RUNS)
def test_int32_causal_is_read_in_place(backend, num_splits):
    """vLLM 0.33 passes int32 flags from a buffer it updates in place between graph replays."""
    case = make_case(
        [8, 5, 3], [40, 61, 3], causal=[True, False, True], causal_dtype=torch.int32,
        device=DEVICE, seed=13,
    )  # fmt: skip
    problem = problem_of(case)
    assert problem.causal_per_seq is case.causal  # the user's tensor, not a converted copy
    # Updated after planning; any nonzero value means causal.
    case.causal.copy_(torch.tensor([0, 7, 0], dtype=torch.int32))
    out = torch.empty_like(case.query)
    run_backend(backend, problem, out, num_splits)
    updated = reference(case, causal=torch.tensor([False, True, False], device=DEVICE))
    planned = reference(case, causal=torch.tensor([True, False, True], device=DEVICE))
    assert relative_error(out, updated) <= TOLERANCE[torch.bfloat16]
    assert relative_error(out, planned) > 0.1


@pytest.mark.parametrize("backend,num_splits", BACKEND_RUNS)
def test_padded_rows_are_written_as_zeros(backend, num_splits):
    """Rows past cu_seqlens_q[-1] (vLLM pads under CUDA graphs) come back as exact zeros."""
    case = make_case([8, 5], [40, 61], causal=[False, True], padded_rows=6, device=DEVICE, seed=14)
    unpadded = make_case([8, 5], [40, 61], causal=[False, True], device=DEVICE, seed=14)
    unpadded.query = case.query[:13]
    out = torch.full_like(case.query, float("nan"))
    run_backend(backend, problem_of(case), out, num_splits)
    assert (out[13:] == 0).all()
    assert relative_error(out[:13], reference(unpadded)) <= TOLERANCE[torch.bfloat16]


def test_merge_reads_no_unwritten_partials():
    """NaN-filled workspace: padding rows and splits with no keys must not reach the output."""
    case = make_case([8, 1], [300, 20], padded_rows=5, device=DEVICE, seed=17)
    problem = problem_of(case)
    plan = triton_attention.launch_plan(problem.batch, num_splits=3)
    out_shape, lse_shape = triton_attention.workspace_shapes(3, 14, 8, 64)
    ws_o = torch.full(out_shape, float("nan"), device=DEVICE)
    ws_lse = torch.full(lse_shape, float("nan"), device=DEVICE)
    out = torch.empty_like(case.query)
    triton_attention.launch(problem, plan, out, ws_o, ws_lse)
    assert torch.isfinite(out.float()).all() and (out[9:] == 0).all()
    # Sequence 1 (20 keys) has work in split 0 only: its other splits report lse = -inf.
    assert plan.num_splits == 3 and (ws_lse[1:, 8] == float("-inf")).all()
    assert torch.isnan(ws_lse[:, 9:]).all()  # padding rows: never written, never read
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]


INDEX_TENSORS = ["block_table", "cu_seqlens_q", "seq_lens", "causal"]


@pytest.mark.parametrize("backend,num_splits", [("triton", 1), ("reference", None)])
@pytest.mark.parametrize("name", INDEX_TENSORS)
def test_strided_index_tensor(name, backend, num_splits):
    """Each index tensor as a strided view (zeros in the gaps) against contiguous copies."""
    case = make_case(
        [8, 5, 3], [40, 61, 17], causal=[True, False, True], causal_dtype=torch.int32,
        device=DEVICE, seed=15,
    )  # fmt: skip
    expected = reference(case)
    setattr(case, name, strided_view(getattr(case, name), dim=-1, step=3))
    assert not getattr(case, name).is_contiguous()
    out = torch.empty_like(case.query)
    run_backend(backend, problem_of(case), out, num_splits)
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_all_index_tensors_strided_with_padding(num_splits):
    case = make_case(
        [8, 5, 1], [40, 61, 17], causal=[False, True, True], causal_dtype=torch.int32,
        index_step=2, padded_rows=4, device=DEVICE, seed=18,
    )  # fmt: skip
    contiguous = make_case(
        [8, 5, 1], [40, 61, 17], causal=[False, True, True], padded_rows=4, device=DEVICE,
        seed=18,
    )  # fmt: skip
    out = torch.empty_like(case.query)
    plan_and_run(triton_attention, problem_of(case), out, num_splits=num_splits)
    assert (out[14:] == 0).all()
    assert relative_error(out, reference(contiguous)) <= TOLERANCE[torch.bfloat16]


def test_graph_replay_split_rule_spreads_real_lengths():
    """A plan made for max_seqlen_k = 32768 (vLLM captures graphs at max_model_len) still splits
    the real, short lengths: count the (split, sequence) programs that saw keys."""
    kv_lens = [512, 300]
    case = make_case([4, 4], kv_lens, num_q_heads=4, num_kv_heads=1, device=DEVICE, seed=16)
    problem = problem_of(case, max_seqlen_k=32768)
    plan = triton_attention.launch_plan(problem.batch, num_splits=4)
    assert plan.num_splits == 4
    out_shape, lse_shape = triton_attention.workspace_shapes(4, 8, 4, 64)
    ws_o = torch.full(out_shape, float("nan"), device=DEVICE)
    ws_lse = torch.full(lse_shape, float("nan"), device=DEVICE)
    out = torch.empty_like(case.query)
    triton_attention.launch(problem, plan, out, ws_o, ws_lse)
    worked = torch.isfinite(ws_lse).flatten(1)
    seq0_splits = int(worked[:, :16].all(1).sum())
    seq1_splits = int(worked[:, 16:].all(1).sum())
    # 512 keys fill every split; 300 keys are 3 tiles of 128 keys (the interpreter's BLOCK_N), so
    # the last split has none. The host-only rule (split length from max_seqlen_k) gave 1 and 1.
    assert plan.block_n == 128 and (seq0_splits, seq1_splits) == (4, 3)
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]


def test_preallocated_workspace_slices_are_used_through_strides():
    case = make_case([8, 3], [300, 90], causal=True, device=DEVICE, seed=19)
    problem = problem_of(case)
    plan = triton_attention.launch_plan(problem.batch, num_splits=3)
    assert plan.num_splits == 3
    # A max-batch buffer (more splits and tokens than this batch), every other split.
    ws_o = torch.full((6, 20, 8, 64), float("nan"), device=DEVICE)[::2]
    ws_lse = torch.full((6, 20, 8), float("nan"), device=DEVICE)[::2]
    out = torch.empty_like(case.query)
    triton_attention.launch(problem, plan, out, ws_o, ws_lse)
    # Written (finite, or -inf for a split with no keys) for this batch's rows only.
    assert not torch.isnan(ws_lse[:, :11]).any() and torch.isnan(ws_lse[:, 11:]).all()
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]
    with pytest.raises(ValueError, match="ws_o"):
        triton_attention.launch(problem, plan, out, ws_o.half(), ws_lse)
    with pytest.raises(ValueError, match="ws_lse"):
        triton_attention.launch(problem, plan, out, ws_o, ws_lse[:2])


@pytest.mark.parametrize(
    "head_dim,num_splits,cache_dtype,query_dtype",
    [
        (128, 1, torch.float8_e4m3fn, torch.bfloat16),
        (128, 3, torch.float8_e4m3fn, torch.bfloat16),
        (256, 3, torch.float8_e5m2, torch.float16),
        # The mixed 16-bit pair takes the fp32-dot tiles on a GPU (several query tiles here).
        (128, 3, torch.bfloat16, torch.float16),
    ],
)
def test_production_tile_configuration(head_dim, num_splits, cache_dtype, query_dtype, monkeypatch):
    """The tiles a GPU gets (the interpreter plans BLOCK_N = 128 to run faster), fp32 dots."""
    case = make_case(
        [8, 3], [150, 70], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=[True, False],
        causal_dtype=torch.int32, padded_rows=2, device=DEVICE, seed=20,
    )  # fmt: skip
    problem = problem_of(case)
    with monkeypatch.context() as patch:
        patch.setattr(triton_attention, "interpreting", lambda: False)
        plan = triton_attention.launch_plan(problem.batch, num_splits=num_splits)
    if cache_dtype.itemsize == 1:
        assert plan.block_n == (64 if head_dim == 128 else 32)
    assert plan.block_n < 128
    plan = dataclasses.replace(plan, dot_fp32=True)  # the interpreter's 16-bit dots are wrong
    out = torch.empty_like(case.query)
    triton_attention.launch(problem, plan, out)
    assert (out[11:] == 0).all()
    assert relative_error(out, reference(case)) <= TOLERANCE[query_dtype]


@pytest.mark.parametrize(
    "far_dim,num_splits,padded_rows",
    [(0, 1, 0), (0, 3, 0), (0, 1, 1), (0, 3, 1), (1, 1, 0), (1, 3, 0)],
)
def test_offsets_past_int32_reach_the_right_rows(far_dim, num_splits, padded_rows):
    """Query, out and LSE rows (far_dim 0: tokens; 1: heads) 2^31 elements apart give the bits
    of a compact launch: every offset product is 64-bit (an int32 one wraps to another row)."""
    case = make_case(
        [3 - padded_rows], [300], num_q_heads=3, num_kv_heads=1, padded_rows=padded_rows,
        device=DEVICE, seed=22,
    )  # fmt: skip
    out = torch.empty_like(case.query)
    lse = torch.empty(case.query.shape[:2], device=DEVICE)
    plan_and_run(triton_attention, problem_of(case), out, num_splits, lse)
    assert triton_attention.launch_plan(problem_of(case).batch, num_splits).num_splits == num_splits
    assert relative_error(out, reference(case)) <= TOLERANCE[torch.bfloat16]
    case.query, far_out = far_apart_views([case.query, torch.full_like(out, float("nan"))], far_dim)
    (far_lse,) = far_apart_views([torch.full_like(lse, float("nan"))], far_dim)
    plan_and_run(triton_attention, problem_of(case), far_out, num_splits, far_lse)
    assert torch.equal(far_out, out) and torch.equal(far_lse, lse)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_arguments_are_the_launch_records_triton_fields(num_splits):
    """Both kernels take their runtime arguments from one dict: the launch record's Triton
    fields under their record parameter names (tensors, None where absent) plus Triton's own.
    The attention kernel has a parameter for every record field, each kernel gets each of its
    runtime parameters from it, and every entry goes to one of them."""
    from fp8_noncausal_attn import launch_record as R

    case = make_case([3, 8], [40, 70], causal=[True, False], device=DEVICE, seed=31)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        sinks=torch.randn(8, device=DEVICE),
    )  # fmt: skip
    plan = triton_attention.launch_plan(problem.batch, num_splits)
    out, lse = torch.empty_like(case.query), torch.empty(case.query.shape[:2], device=DEVICE)
    shapes = triton_attention.workspace_shapes(num_splits, *case.query.shape)
    ws_o, ws_lse = (torch.empty(shape, device=DEVICE) for shape in shapes)
    if num_splits == 1:
        ws_o = ws_lse = None
    arguments = triton_attention.kernel_arguments(problem, plan, out, ws_o, ws_lse, lse)
    attention = set(triton_attention.runtime_parameters(triton_attention._paged_attention_kernel))
    merge = set(triton_attention.runtime_parameters(triton_attention._merge_splits_kernel))
    record = {f.parameter for f in R.given(R.TRITON)}
    assert record <= attention
    assert attention <= set(arguments) and merge - {"lse_to_log2"} <= set(arguments)
    assert set(arguments) == attention | merge - {"lse_to_log2"}
    assert arguments["q_ptr"] is problem.query and arguments["k_ptr"] is problem.key_cache
    assert arguments["sinks_ptr"] is problem.sinks and arguments["lse_ptr"] is lse
    assert arguments["causal_per_seq_ptr"] is problem.causal_per_seq
    assert arguments["ws_o_ptr"] is ws_o and arguments["ws_lse_ptr"] is ws_lse
    assert arguments["k_stride_s"] == problem.key_cache.stride(1)
    assert arguments["ws_lse_stride_t"] == (0 if ws_lse is None else ws_lse.stride(1))
