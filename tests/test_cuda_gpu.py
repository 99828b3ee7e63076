"""The compiled CUDA backend against the reference (GPU only; skipped without one)."""

import pytest
import torch
from conftest import TOLERANCE
from matrix import AXES, CACHE_DTYPES, QUERY_DTYPES, build_case, sampled_matrix

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import cuda_backend
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

pytestmark = pytest.mark.gpu

# The shared matrix plus a longer-context row, which the compiled kernels run quickly.
GPU_AXES = AXES | {"lengths": AXES["lengths"] + [([8, 16, 1], [300, 1000, 65])]}
NUM_CASES = 60


@pytest.fixture(autouse=True)
def _require_cuda_backend():
    runs, why = cuda_backend.availability()
    if not runs:
        pytest.skip(why)


def run(case, backend="cuda", **overrides):
    return fna.paged_attention(*case.args(), **(case.kwargs() | overrides), backend=backend)


def check(case, query_dtype, **overrides):
    out = run(case, **overrides)
    ref = run(case, backend="reference", **overrides)
    assert torch.isfinite(out.float()).all()
    err = relative_error(out, ref)
    assert err <= TOLERANCE[query_dtype], err
    return out


def compiled_pair(cache_dtype, query_dtype):
    """The CUDA kernels take FP8 caches, and 16-bit caches of the query's own dtype."""
    return cache_dtype.itemsize == 1 or cache_dtype == query_dtype


@pytest.mark.parametrize("index", range(NUM_CASES))
def test_cuda_matches_reference(index):
    params = sampled_matrix(NUM_CASES, seed=3, axes=GPU_AXES)[index]
    case = build_case(params, seed=index, device="cuda")
    if not compiled_pair(params["cache_dtype"], params["query_dtype"]):
        with pytest.raises(RuntimeError, match="Triton"):
            run(case)
        return
    out = run(case)
    ref = run(case, backend="reference")
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[params["query_dtype"]], params


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "cache_dtype,query_dtype",
    [(c, q) for c in CACHE_DTYPES for q in QUERY_DTYPES if compiled_pair(c, q)],
)
def test_every_compiled_kernel(cache_dtype, query_dtype, head_dim):
    """Each of the 18 (head_dim, query dtype, cache dtype) kernels, split and unsplit."""
    case = make_case(
        [8, 1, 16], [200, 33, 16], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=[False, True, False],
        device="cuda", seed=head_dim,
    )  # fmt: skip
    check(case, query_dtype)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    out = torch.empty_like(case.query)
    cuda_backend.paged_attention(problem, out, num_splits=3)
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[query_dtype]


@pytest.mark.parametrize("num_splits", [2, 3, 7, 32])
@pytest.mark.parametrize("causal", [False, True, [True, False]])
def test_split_kv_merge_matches_reference(num_splits, causal):
    case = make_case(
        [8, 5], [700, 61], num_q_heads=8, num_kv_heads=2, head_dim=128, causal=causal,
        device="cuda", seed=11,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    out = torch.empty_like(case.query)
    cuda_backend.paged_attention(problem, out, num_splits=num_splits)
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("block_size", [8, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_other_power_of_two_page_sizes(block_size, cache_dtype):
    case = make_case(
        [8, 3], [90, 250], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=block_size,
        cache_dtype=cache_dtype, causal=[False, True], device="cuda", seed=block_size,
    )  # fmt: skip
    check(case, torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
def test_long_prefill_tiles_over_m(causal):
    """q_len in the thousands: many M tiles per KV head, with and without causal masking."""
    case = make_case(
        [1500, 7], [2000, 7], num_q_heads=4, num_kv_heads=2, head_dim=128, causal=causal,
        device="cuda", seed=5,
    )  # fmt: skip
    check(case, torch.bfloat16)


def test_large_gqa_group_spans_several_m_tiles():
    """64 q heads on one KV head x 16 tokens = 1024 rows of one KV head."""
    case = make_case(
        [16, 2], [400, 90], num_q_heads=64, num_kv_heads=1, head_dim=64, causal=[True, False],
        device="cuda", seed=13,
    )  # fmt: skip
    check(case, torch.bfloat16)


def test_drafter_shape_uses_split_kv():
    """The benchmark's drafter shape (smaller batch): enough splits to fill the GPU."""
    case = make_case(
        [8] * 4, [4000, 2500, 8, 1200], num_q_heads=32, num_kv_heads=8, head_dim=128,
        causal=False, device="cuda", seed=21,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    assert cuda_backend.num_splits_for(problem, cuda_backend.resident_ctas(problem)) > 1
    check(case, torch.bfloat16)


def test_per_head_scales_are_neither_dropped_nor_broadcast():
    """Regression for a peer that used k_scale[0] for every head (vllm#51363)."""
    case = make_case([8, 8], [40, 90], num_q_heads=8, num_kv_heads=4, device="cuda", seed=7)
    out = run(case)
    ref = run(case, backend="reference")
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    broadcast = run(case, k_scale=case.k_scale[:1].clone(), v_scale=case.v_scale[:1].clone())
    dropped = run(case, k_scale=None, v_scale=None)
    assert relative_error(broadcast, ref) > 0.2
    assert relative_error(dropped, ref) > 0.2


def test_bidirectional_is_not_computed_as_causal():
    case = make_case([8, 16], [8, 40], device="cuda", seed=9)
    bidirectional = run(case, causal=False)
    as_causal = run(case, backend="reference", causal=True)
    assert relative_error(bidirectional, run(case, backend="reference", causal=False)) <= 1e-2
    assert relative_error(bidirectional, as_causal) > 0.1
    mixed = run(case, causal=torch.tensor([True, False], device="cuda"))
    assert relative_error(mixed[:8], as_causal[:8]) <= 1e-2
    assert relative_error(mixed[8:], bidirectional[8:]) <= 1e-2


@pytest.mark.parametrize("k_scale,v_scale", [(1e-6, 1e-6), (1e3, 1e-4), (30.0, 1e4)])
def test_extreme_valid_scales_give_no_nan(k_scale, v_scale):
    case = make_case([8], [64], device="cuda", seed=2, scales="none")
    out = check(case, torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out.float()).all()


def test_out_is_written_in_place_through_strides():
    case = make_case([3, 8], [30, 8], device="cuda", seed=4)
    wide = torch.zeros(*case.query.shape[:2], 128, dtype=torch.bfloat16, device="cuda")
    out = wide[..., :64]
    returned = run(case, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]
    assert (wide[..., 64:] == 0).all()


@pytest.mark.parametrize("num_seqs,kv_len", [(2, 200), (4, 3000)])
def test_cuda_graph_replay_with_new_lengths(num_seqs, kv_len):
    """Capture once, replay with other seq_lens: equals eager (also through split-KV)."""
    case = make_case(
        [8] * num_seqs, [kv_len] * num_seqs, num_q_heads=32, num_kv_heads=8, head_dim=128,
        device="cuda", seed=8,
    )  # fmt: skip
    out = torch.empty_like(case.query)
    kwargs = case.kwargs() | {"max_seqlen_k": kv_len}

    def step():
        fna.paged_attention(*case.args(), **kwargs, out=out, backend="cuda")

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [max(8, kv_len // (i + 2)) for i in range(num_seqs)]
    case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = fna.paged_attention(*case.args(), **kwargs, backend="cuda")
    assert torch.equal(out, eager)
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize(
    "cache_dtype,query_dtype", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)]
)
def test_16bit_cache_of_the_other_dtype_goes_to_triton(cache_dtype, query_dtype):
    """The CUDA kernels refuse it; auto runs it on Triton, where bf16 keys beyond fp16's range
    (65504) do not overflow under an fp16 query."""
    case = make_case(
        [8], [90], cache_dtype=cache_dtype, query_dtype=query_dtype, scales="none",
        device="cuda", seed=12,
    )  # fmt: skip
    if cache_dtype == torch.bfloat16:
        case.key_cache.mul_(1e4)
    with pytest.raises(RuntimeError, match="Triton"):
        run(case)
    check_auto = run(case, backend="auto")
    assert torch.isfinite(check_auto.float()).all()
    reference = run(case, backend="reference")
    assert relative_error(check_auto, reference) <= TOLERANCE[query_dtype]
