"""The compiled CUDA backend against the reference: on a GPU, and (ON_DEVICES) on CPU tensors
through the SIMT executor."""

import pytest
import torch
from helpers import GPU_BACKEND, TOLERANCE, replaced
from helpers.backends import plan_and_run
from helpers.lse import run_backend
from helpers.matrix import AXES, CACHE_DTYPES, QUERY_DTYPES, build_case, sampled_matrix
from helpers.token_heads import token_head_problem

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import registry
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

# Every test runs on CUDA tensors (marked gpu: skipped without one); those marked ON_DEVICES
# also on CPU tensors, where mma_sync runs csrc/'s kernels through the SIMT executor.
ON_DEVICES = pytest.mark.parametrize(
    "device",
    [pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cpu", marks=pytest.mark.simt)],
)

# The shared matrix plus a longer-context row, which the compiled kernels run quickly.
GPU_AXES = AXES | {"lengths": AXES["lengths"] + [([8, 16, 1], [300, 1000, 65])]}
NUM_CASES = 60


@pytest.fixture(autouse=True)
def _require_cuda_backend():
    report = fna.available_backends()[GPU_BACKEND]
    if not report["available"]:
        pytest.skip(report["reason"])


def run(case, backend=GPU_BACKEND, **overrides):
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


@pytest.mark.gpu
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


# Sliding window and attention sinks (SPEC section 3). Per q head sink logits, large positive and
# negative among them: +25 outweighs every key of its head, -40 changes nothing.
SINKS = [25.0, -40.0, 0.5, 3.0, -3.0, 12.0, 0.0, -8.0]
# Windows inside one 16-key page, spanning pages and 64-key tiles, past the context, one-sided.
WINDOWS = [(3, 2), (40, 17), (300, 300), (1000, 1000), (-1, 0), (70, -1), (-1, 5)]


def window_problem(case, window, sinks):
    """The problem with ``window`` (and the sinks when ``sinks``), its reference output and the
    keyword arguments that add them to a call."""
    kwargs = {
        "window": window,
        "sinks": torch.tensor(SINKS[: case.query.shape[1]], device="cuda") if sinks else None,
    }
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, **kwargs
    )
    return problem, run(case, backend="reference", **kwargs), kwargs


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(
    "cache_dtype,query_dtype",
    [(c, q) for c in CACHE_DTYPES for q in QUERY_DTYPES if compiled_pair(c, q)],
)
@pytest.mark.parametrize("window,sinks", [((-1, -1), False), ((100, 20), True)], ids=str)
def test_every_compiled_kernel(cache_dtype, query_dtype, head_dim, window, sinks):
    """Each of the 18 (head_dim, query dtype, cache dtype) kernels, split and unsplit, plain and
    with a sliding window and attention sinks (which auto now runs on the CUDA kernels)."""
    case = make_case(
        [8, 1, 16], [900, 33, 16], num_q_heads=8, num_kv_heads=2, head_dim=head_dim,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=[False, True, False],
        device="cuda", seed=head_dim,
    )  # fmt: skip
    problem, ref, kwargs = window_problem(case, window, sinks)
    assert registry.plan_batch("auto", problem.batch)[0][0].name == "mma_sync"
    check(case, query_dtype, **kwargs)  # the API's path, the plan's split count
    for num_splits in (1, 3):
        out = torch.empty_like(case.query)
        plan_and_run(mma_sync, problem, out, num_splits=num_splits)
        assert relative_error(out, ref) <= TOLERANCE[query_dtype], num_splits


@pytest.mark.gpu
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
    plan_and_run(mma_sync, problem, out, num_splits=num_splits)
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [8, 128])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_other_power_of_two_page_sizes(block_size, cache_dtype):
    case = make_case(
        [8, 3], [90, 250], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=block_size,
        cache_dtype=cache_dtype, causal=[False, True], device="cuda", seed=block_size,
    )  # fmt: skip
    check(case, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_long_prefill_tiles_over_m(causal):
    """q_len in the thousands: many M tiles per KV head, with and without causal masking."""
    case = make_case(
        [1500, 7], [2000, 7], num_q_heads=4, num_kv_heads=2, head_dim=128, causal=causal,
        device="cuda", seed=5,
    )  # fmt: skip
    check(case, torch.bfloat16)


@pytest.mark.gpu
def test_large_gqa_group_spans_several_m_tiles():
    """64 q heads on one KV head x 16 tokens = 1024 rows of one KV head."""
    case = make_case(
        [16, 2], [400, 90], num_q_heads=64, num_kv_heads=1, head_dim=64, causal=[True, False],
        device="cuda", seed=13,
    )  # fmt: skip
    check(case, torch.bfloat16)


@pytest.mark.gpu
def test_drafter_shape_uses_split_kv():
    """The benchmark's drafter shape (smaller batch): enough splits to fill the GPU."""
    case = make_case(
        [8] * 4, [4000, 2500, 8, 1200], num_q_heads=32, num_kv_heads=8, head_dim=128,
        causal=False, device="cuda", seed=21,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    assert mma_sync.num_splits_for(problem, mma_sync.resident_ctas(problem.batch)) > 1
    check(case, torch.bfloat16)


@ON_DEVICES
def test_per_head_scales_are_neither_dropped_nor_broadcast(device):
    """Regression for a peer that used k_scale[0] for every head (vllm#51363)."""
    case = make_case([8, 8], [40, 90], num_q_heads=8, num_kv_heads=4, device=device, seed=7)
    out = run(case)
    ref = run(case, backend="reference")
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    broadcast = run(case, k_scale=case.k_scale[:1].clone(), v_scale=case.v_scale[:1].clone())
    dropped = run(case, k_scale=None, v_scale=None)
    assert relative_error(broadcast, ref) > 0.2
    assert relative_error(dropped, ref) > 0.2


@ON_DEVICES
def test_bidirectional_is_not_computed_as_causal(device):
    case = make_case([8, 16], [8, 40], device=device, seed=9)
    bidirectional = run(case, causal=False)
    as_causal = run(case, backend="reference", causal=True)
    assert relative_error(bidirectional, run(case, backend="reference", causal=False)) <= 1e-2
    assert relative_error(bidirectional, as_causal) > 0.1
    mixed = run(case, causal=torch.tensor([True, False], device=device))
    assert relative_error(mixed[:8], as_causal[:8]) <= 1e-2
    assert relative_error(mixed[8:], bidirectional[8:]) <= 1e-2


@ON_DEVICES
@pytest.mark.parametrize("k_scale,v_scale", [(1e-6, 1e-6), (1e3, 1e-4), (30.0, 1e4)])
def test_extreme_valid_scales_give_no_nan(device, k_scale, v_scale):
    case = make_case([8], [64], device=device, seed=2, scales="none")
    out = check(case, torch.bfloat16, k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out.float()).all()


@ON_DEVICES
def test_out_is_written_in_place_through_strides(device):
    case = make_case([3, 8], [30, 8], device=device, seed=4)
    wide = torch.zeros(*case.query.shape[:2], 128, dtype=torch.bfloat16, device=device)
    out = wide[..., :64]
    returned = run(case, out=out)
    assert returned.data_ptr() == out.data_ptr()
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]
    assert (wide[..., 64:] == 0).all()


@pytest.mark.gpu
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
        fna.paged_attention(*case.args(), **kwargs, out=out, backend=GPU_BACKEND)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    new_lens = [max(8, kv_len // (i + 2)) for i in range(num_seqs)]
    case.seq_lens.copy_(torch.tensor(new_lens, dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = fna.paged_attention(*case.args(), **kwargs, backend=GPU_BACKEND)
    assert torch.equal(out, eager)
    assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
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


def strided_on_device(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """1-D ``t`` as a stride-3 view into a larger buffer of garbage (vLLM's persistent slices)."""
    buffer = torch.full((t.numel(), 3), 7, dtype=dtype or t.dtype, device=t.device)
    buffer[:, 0] = t.to(buffer.dtype)
    return buffer[:, 0]


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("causal_dtype", [torch.int32, torch.bool])
def test_vllm_index_tensors_are_read_in_place(causal_dtype, num_splits):
    """int32 (or bool) per-sequence causal flags, strided cu_seqlens_q / seq_lens, and rows past
    cu_seqlens_q[-1] (vLLM's CUDA-graph padding) written as exact zeros, split and unsplit."""
    causal = [True, False, True]
    case = make_case(
        [8, 5, 16], [300, 61, 140], num_q_heads=8, num_kv_heads=2, head_dim=128, causal=causal,
        device="cuda", seed=31,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    flags = torch.tensor([5 if c else 0 for c in causal], dtype=torch.int32, device="cuda")
    tokens = case.query.shape[0]
    padded = torch.cat([case.query, torch.randn_like(case.query[:7])])
    vllm_like = replaced(
        problem,
        query=padded,
        cu_seqlens_q=strided_on_device(problem.cu_seqlens_q),
        seq_lens=strided_on_device(problem.seq_lens),
        causal_per_seq=strided_on_device(flags, causal_dtype),
    )
    out = torch.full_like(padded, float("nan"))
    plan_and_run(mma_sync, vllm_like, out, num_splits=num_splits)
    ref = run(case, backend="reference")
    assert relative_error(out[:tokens], ref) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


@ON_DEVICES
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_unaligned_out_is_written_in_place(device, cache_dtype):
    """An `out` at an odd element offset (2-byte aligned only): the kernels switch to element
    stores; nothing outside `out` is touched and no temporary is copied over it."""
    case = make_case(
        [8, 3], [90, 40], num_q_heads=8, num_kv_heads=2, head_dim=64, cache_dtype=cache_dtype,
        device=device, seed=17,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    flat = torch.full((case.query.numel() + 2,), 3.0, dtype=torch.bfloat16, device=device)
    out = flat[1:-1].view_as(case.query)
    assert out.data_ptr() % 4 == 2
    for splits in (1, 2):
        out.fill_(float("nan"))
        plan_and_run(mma_sync, problem, out, num_splits=splits)
        assert relative_error(out, run(case, backend="reference")) <= TOLERANCE[torch.bfloat16]
        assert flat[0].item() == 3.0 and flat[-1].item() == 3.0


@ON_DEVICES
@pytest.mark.parametrize(
    "cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16]
)
def test_cuda_cache_write_is_bit_exact(device, cache_dtype):
    """The extension's reshape_and_cache writes the reference's bytes (values past the format's
    max saturate), into strided caches, skipping slots < 0, through a strided slot_mapping."""
    from fp8_noncausal_attn.backends import reference
    from fp8_noncausal_attn.scales import finite_max

    gen = torch.Generator(device=device).manual_seed(3)
    tokens, heads, dim, blocks, block_size = 37, 4, 128, 12, 16
    key = torch.randn(tokens, heads, dim, device=device, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, heads, dim, device=device, generator=gen).to(torch.bfloat16)
    key[0, 0, :4] = torch.tensor([1e30, -1e30, 3e38, -3e38])  # past every format's max
    value[1, 1, :2] = finite_max(cache_dtype) * 1.5 * torch.tensor([1.0, -1.0])
    k_scale = torch.rand(heads, device=device, generator=gen) + 0.05
    v_scale = torch.rand(heads, device=device, generator=gen) + 0.05
    slots = torch.randperm(blocks * block_size, device=device, generator=gen)[:tokens]
    slots[::5] = -1
    slot_mapping = strided_on_device(slots.to(torch.int64))
    # vLLM's combined layout: K and V side by side in the last dim, heads before block slots.
    kv = torch.zeros(blocks, heads, block_size, 2 * dim, dtype=cache_dtype, device=device)
    key_cache, value_cache = kv[..., :dim].transpose(1, 2), kv[..., dim:].transpose(1, 2)
    expected = kv.clone()
    extension.reshape_and_cache(CacheWrite(key, value, key_cache, value_cache, slot_mapping,
                                              k_scale, v_scale))  # fmt: skip
    reference.reshape_and_cache(CacheWrite(
        key, value, expected[..., :dim].transpose(1, 2), expected[..., dim:].transpose(1, 2),
        slots.to(torch.int64), k_scale, v_scale,
    ))  # fmt: skip
    storage = torch.uint8 if cache_dtype.itemsize == 1 else torch.int16
    assert torch.equal(kv.view(storage), expected.view(storage))
    assert torch.isfinite(kv.float()).all()


@pytest.mark.gpu
def test_occupancy_query_restores_the_callers_device():
    from fp8_noncausal_attn import _C

    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(0)
    assert _C.ctas_per_sm(last, 128, 0, 2) >= 1
    assert _C.ctas_per_sm(last, 128, 0, 2, 128) >= 1  # the 128-row tile
    assert torch.cuda.current_device() == 0


@ON_DEVICES
@pytest.mark.parametrize("with_sinks", [False, True])
def test_merge_entry_merges_partials_of_another_family(device, with_sinks):
    """extension.merge_splits (the _C merge kernel, as the DSL families call it) on random
    fp32 partials: an empty split (LSE -inf, O NaN) never read, each sink once, the padded rows
    past cu_seqlens_q[-1] zero, `out` written through its strides."""
    case = make_case([3, 2], [40, 9], num_q_heads=8, num_kv_heads=2, device=device, seed=29,
                     padded_rows=2)  # fmt: skip
    sinks = torch.randn(8, device=device) * 4 if with_sinks else None
    problem = validate_attention(
        *case.args(), **case.kwargs(), sinks=sinks, softmax_scale=None, out=None, validate=False
    )
    gen = torch.Generator(device=device).manual_seed(3)
    ws_o = torch.randn(3, 7, 8, 64, device=device, generator=gen)
    ws_lse = torch.randn(3, 7, 8, device=device, generator=gen) * 6
    ws_o[1, 2], ws_lse[1, 2] = float("nan"), -float("inf")
    out = torch.full((7, 9, 64), float("nan"), dtype=torch.bfloat16, device=device)[:, :8]
    extension.merge_splits(problem, ws_o, ws_lse, out)
    sink = (sinks * 1.4426950408889634 if with_sinks else torch.full((8,), -float("inf"),
            device=device)).expand(7, 8)  # fmt: skip
    top = torch.maximum(ws_lse.amax(0), sink)
    w = torch.exp2(ws_lse - top)
    merged = torch.where(w[..., None] > 0, w[..., None] * ws_o, 0.0).sum(0)
    want = merged / (w.sum(0) + torch.exp2(sink - top))[..., None]
    assert relative_error(out[:5], want[:5].to(out.dtype)) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))


@ON_DEVICES
def test_a_batch_of_only_padding_is_zeroed(device):
    """No sequence at all (cu_seqlens_q == [0]) but padded query rows: all written as zeros."""
    case = make_case([4], [20], num_q_heads=8, num_kv_heads=2, device=device, seed=23)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    empty = replaced(
        problem,
        cu_seqlens_q=problem.cu_seqlens_q[:1],
        seq_lens=problem.seq_lens[:0],
        block_table=problem.block_table[:0],
        causal_per_seq=None,
    )
    out = torch.full_like(case.query, float("nan"))
    plan_and_run(mma_sync, empty, out)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 32])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", [False, True, [True, False, False]], ids=str)
def test_window_and_sinks_match_reference(causal, window, sinks, num_splits):
    """Split-KV over the windowed tile range (the plan's count, or forced), the sink in the
    unsplit epilogue or once in the merge; the padded rows past the last sequence are zeros."""
    case = make_case(
        [8, 5, 24], [700, 61, 2000], num_q_heads=8, num_kv_heads=2, head_dim=128, causal=causal,
        padded_rows=3, device="cuda", seed=17,
    )  # fmt: skip
    problem, ref, _ = window_problem(case, window, sinks)
    out = torch.full_like(case.query, float("nan"))
    plan_and_run(mma_sync, problem, out, num_splits=num_splits)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:]))


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_windowed_launch_loads_only_the_windows_tiles(num_splits):
    """Pages of every 64-key tile that no query's window touches hold FP8 NaN bytes (K and V): a
    kernel that loads one (even masked, 0 * NaN = NaN in P V) gives NaN."""
    q_len, kv_len, block_size, window = 8, 5000, 16, (300, 3)
    case = make_case(
        [q_len], [kv_len], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=block_size,
        device="cuda", seed=6,
    )  # fmt: skip
    problem, ref, _ = window_problem(case, window, sinks=True)
    first_tile = (kv_len - q_len - window[0]) // 64
    end_tile = -(-kv_len // 64)
    pages = case.block_table[0].tolist()
    poisoned = [
        pages[n]
        for n in range(-(-kv_len // block_size))
        if not first_tile <= n * block_size // 64 < end_tile
    ]
    for cache in (case.key_cache, case.value_cache):
        cache.view(torch.uint8)[poisoned] = 0x7F  # e4m3 NaN
    out = torch.empty_like(case.query)
    plan_and_run(mma_sync, problem, out, num_splits=num_splits)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    unwindowed = torch.empty_like(case.query)
    plan_and_run(mma_sync, replaced(problem, window=(-1, -1)), unwindowed, num_splits=num_splits)
    assert not torch.isfinite(unwindowed.float()).all()


# Per-token-head caches (mma.sync only: paged_attention_kernel_pth): (q_len, num_splits) over
# sequences [q_len / 700 keys, 3 / 90]: GQA 4 gives 32 rows per KV head (the 64-row tile) or 160
# (the 128-row tile at head_dim 128); the plan's split count, or forced.
TOKEN_SCALE_LAUNCHES = [(8, None), (8, 1), (8, 3), (40, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("q_len,num_splits", TOKEN_SCALE_LAUNCHES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("query_dtype", QUERY_DTYPES, ids=str)
def test_token_scale_kernels_match_reference(query_dtype, cache_dtype, head_dim, q_len,
                                             num_splits):  # fmt: skip
    """Every per-token-head kernel (head dims x query dtypes x e4m3 / e5m2 / int8, both tiles),
    causal and bidirectional, split and unsplit, with the LSE, on aligned inline pages (strided
    scales); padded rows zero."""
    if GPU_BACKEND != "mma_sync":
        pytest.skip("per-token-head caches run on the mma.sync kernels only")
    problem = token_head_problem(
        cache_dtype, query_dtype, [q_len, 3], [700, 90], head_dim=head_dim,
        causal=[False, True], padded_rows=2, device="cuda", seed=head_dim,
    )  # fmt: skip
    assert mma_sync.run_unsupported_reason(problem, None) is None
    out = torch.full_like(problem.query, float("nan"))
    lse = torch.full(problem.query.shape[:2], float("nan"), device="cuda")
    plan_and_run(mma_sync, problem, out, num_splits=num_splits, lse=lse)
    ref, ref_lse = run_backend("reference", problem)
    tokens = q_len + 3
    assert torch.isfinite(out.float()).all()
    assert relative_error(out[:tokens], ref[:tokens]) <= TOLERANCE[query_dtype]
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))
    assert torch.allclose(lse, ref_lse, rtol=0, atol=1e-3)
