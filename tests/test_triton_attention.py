"""Triton kernels against the reference (CPU interpreter here, compiled on a GPU)."""

import pytest
import torch
from conftest import DEVICE, TOLERANCE
from matrix import build_case, sampled_matrix

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import triton_attention
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

NUM_CASES = 24


def reference(case, **overrides):
    kwargs = case.kwargs() | overrides
    return fna.paged_attention(*case.args(), **kwargs, backend="reference")


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_triton_matches_reference(index):
    params = sampled_matrix(NUM_CASES, seed=2026)[index]
    case = build_case(params, seed=index, device=DEVICE)
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    ref = reference(case)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[params["query_dtype"]], params


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
    assert triton_attention.launch_plan(problem, num_splits)["num_splits"] > 1
    out = torch.empty_like(case.query)
    triton_attention.paged_attention(problem, out, num_splits=num_splits)
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
