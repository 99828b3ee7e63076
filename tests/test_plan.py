"""PagedAttention: plan once per batch, run per layer (SPEC §4), against the one-shot API."""

import pytest
import torch
from helpers import DEVICE, TOLERANCE
from helpers.backends import RecordingBackend, auto_takes_cpu_tensors, replace_kernels

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import api, plan, registry
from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.plan import PagedAttention, Workspace
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

# A mixed vLLM-like batch: int32 per-sequence causal flags, an empty sequence, strided index
# tensors and padded rows past the last sequence.
Q_LENS, KV_LENS = [3, 8, 0, 5], [40, 8, 3, 70]
CAUSAL = [True, False, False, True]
PADDED = 3


def mixed_case(seed, **kwargs):
    options = {"causal": CAUSAL, "causal_dtype": torch.int32, "index_step": 2,
               "padded_rows": PADDED, "device": DEVICE, "seed": seed} | kwargs  # fmt: skip
    return make_case(Q_LENS, KV_LENS, **options)


def wrapper_for(case, **kwargs):
    num_q_heads, head_dim = case.query.shape[1:]
    _, block_size, num_kv_heads, _ = case.key_cache.shape
    options = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
               "block_size": block_size, "query_dtype": case.query.dtype,
               "cache_dtype": case.key_cache.dtype, "device": DEVICE, "max_num_seqs": 8,
               "max_num_tokens": 64} | kwargs  # fmt: skip
    return PagedAttention(**options)


def plan_for(attn, case, **kwargs):
    options = {
        "causal": case.causal,
        "max_seqlen_q": max(case.q_lens),
        "max_seqlen_k": max(case.kv_lens),
        "num_tokens": case.query.shape[0],
    } | kwargs
    return attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, **options)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_one_plan_runs_every_layer_like_the_one_shot_call(backend):
    # Three "layers": the same batch, each with its own query, caches and per-head scales.
    layers = [mixed_case(seed) for seed in (1, 2, 3)]
    for layer in layers[1:]:  # one batch: the same index tensors for every layer
        layer.block_table, layer.cu_seqlens_q = layers[0].block_table, layers[0].cu_seqlens_q
        layer.seq_lens, layer.causal = layers[0].seq_lens, layers[0].causal
    attn = wrapper_for(layers[0])
    assert plan_for(attn, layers[0], backend=backend).backend == backend
    for layer in layers:
        out = attn.run(layer.query, layer.key_cache, layer.value_cache, layer.k_scale,
                       layer.v_scale)  # fmt: skip
        oneshot = fna.paged_attention(*layer.args(), **layer.kwargs(), backend=backend)
        ref = fna.paged_attention(*layer.args(), **layer.kwargs(), backend="reference")
        assert torch.equal(out, oneshot)
        assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
        assert torch.all(out[-PADDED:] == 0), "padded rows are written as zeros"


def test_run_writes_out_in_place_and_plans_can_be_kept_side_by_side():
    first, second = mixed_case(4), make_case([2, 6], [9, 30], device=DEVICE, seed=5)
    attn = wrapper_for(first)
    plan_first = plan_for(attn, first, backend="reference")
    plan_second = plan_for(attn, second, backend="reference")
    out = torch.full_like(first.query, 3.0)
    returned = attn.run(first.query, first.key_cache, first.value_cache, first.k_scale,
                        first.v_scale, out=out, plan=plan_first)  # fmt: skip
    assert returned is out
    expected = fna.paged_attention(*first.args(), **first.kwargs(), backend="reference")
    assert torch.equal(out, expected)
    latest = attn.run(second.query, second.key_cache, second.value_cache, second.k_scale,
                      second.v_scale)  # fmt: skip
    assert attn.run(second.query, second.key_cache, second.value_cache, second.k_scale,
                    second.v_scale, plan=plan_second).equal(latest)  # fmt: skip
    assert torch.equal(
        latest, fna.paged_attention(*second.args(), **second.kwargs(), backend="reference")
    )


def test_run_goes_straight_to_the_backend_not_through_the_custom_op(monkeypatch):
    case = mixed_case(6)
    attn = wrapper_for(case)
    plan_for(attn, case, backend="reference")

    def no_dispatcher(*args):
        raise AssertionError("the custom op was called outside torch.compile")

    monkeypatch.setattr(api, "_paged_attention_op", no_dispatcher)
    out = attn.run(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    oneshot = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.equal(out, oneshot)


def test_per_head_scales_pass_through_and_0d_scales_are_read_on_every_run(monkeypatch):
    case = mixed_case(7)
    attn = wrapper_for(case)
    plan_for(attn, case, backend="reference")
    seen = []
    monkeypatch.setattr(reference, "run", lambda problem, plan, out: seen.append(problem))
    attn.run(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    assert seen[-1].k_scale is case.k_scale and seen[-1].v_scale is case.v_scale
    monkeypatch.undo()
    # A 0-d scale its owner updates in place (vLLM's dynamic scales) is converted per run.
    k_scale = torch.tensor(0.5, device=DEVICE)
    before = attn.run(case.query, case.key_cache, case.value_cache, k_scale, case.v_scale)
    k_scale.fill_(2.0)
    after = attn.run(case.query, case.key_cache, case.value_cache, k_scale, case.v_scale)
    expected = fna.paged_attention(*case.args(), **(case.kwargs() | {"k_scale": 2.0}),
                                   backend="reference")  # fmt: skip
    assert torch.equal(after, expected) and not torch.equal(before, after)


def test_caches_are_checked_in_full_once_per_tensor(monkeypatch):
    case = mixed_case(8)
    attn = wrapper_for(case)
    plan_for(attn, case, backend="reference")
    calls = []
    real_check = plan.check_caches
    monkeypatch.setattr(plan, "check_caches", lambda *a: calls.append(a) or real_check(*a))
    for _ in range(3):
        attn.run(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    assert len(calls) == 1
    other = mixed_case(9)
    attn.run(case.query, other.key_cache, other.value_cache, case.k_scale, case.v_scale)
    assert len(calls) == 2
    bad = case.key_cache.float()
    with pytest.raises(TypeError, match="key_cache must have dtype"):
        attn.run(case.query, bad, case.value_cache, case.k_scale, case.v_scale)


def run_args(case):
    return case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale


BAD_LAYER_TENSORS = {
    "query dtype": (lambda c: {"query": c.query.half()}, TypeError, "planned dtype torch.bfloat16"),
    "query heads": (lambda c: {"query": c.query[:, :4]}, ValueError,
                    r"query must have shape \[num_tokens, 8, 64\]"),
    "query rows": (lambda c: {"query": torch.cat([c.query, c.query])}, ValueError,
                   "plan was made for at most 19"),
    "query stride": (lambda c: {"query": c.query[..., ::2]}, ValueError,
                     "query must have a contiguous last dim"),
    "cache block size": (lambda c: {"key_cache": c.key_cache[:, :8],
                                    "value_cache": c.value_cache[:, :8]},
                         ValueError, r"key_cache must be \[num_blocks, 16, 2, 64\]"),
    "cache too small": (lambda c: {"key_cache": c.key_cache[:2], "value_cache": c.value_cache[:2]},
                        ValueError, r"block_table entries for used pages must be in \[0, 2\)"),
    "scale length": (lambda c: {"k_scale": torch.ones(3, device=DEVICE)}, ValueError,
                     r"k_scale must be a scalar or have shape \[num_kv_heads\] = \[2\]"),
    "scale dtype": (lambda c: {"v_scale": torch.ones(2, dtype=torch.float64, device=DEVICE)},
                    TypeError, "v_scale must have dtype torch.float32"),
    "out shape": (lambda c: {"out": torch.empty_like(c.query)[:-1]}, ValueError,
                  "out must have the shape of query"),
    "out dtype": (lambda c: {"out": c.query.half()}, TypeError, "out must have the dtype of query"),
}  # fmt: skip


@pytest.mark.parametrize("bad", BAD_LAYER_TENSORS)
def test_run_refuses_bad_layer_tensors_by_name(bad):
    change, error, match = BAD_LAYER_TENSORS[bad]
    case = mixed_case(10)
    attn = wrapper_for(case)
    plan_for(attn, case, backend="reference")
    names = ("query", "key_cache", "value_cache", "k_scale", "v_scale")
    args = dict(zip(names, run_args(case), strict=True))
    with pytest.raises(error, match=match):
        attn.run(**(args | change(case)))


def test_run_before_plan_and_bad_plans_are_refused():
    case = mixed_case(11)
    attn = wrapper_for(case)
    with pytest.raises(RuntimeError, match="call plan"):
        attn.run(*run_args(case))
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        plan_for(attn, case, backend="flashinfer")
    with pytest.raises(ValueError, match="num_tokens must be <= max_num_tokens = 64"):
        plan_for(attn, case, num_tokens=65)
    small = wrapper_for(case, max_num_seqs=2)
    with pytest.raises(ValueError, match="num_seqs .* must be <= max_num_seqs = 2, got 4"):
        plan_for(small, case)
    with pytest.raises(TypeError, match="seq_lens must have dtype"):
        attn.plan(case.cu_seqlens_q, case.seq_lens.long(), case.block_table)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= the longest sequence 70"):
        plan_for(attn, case, max_seqlen_k=10)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[-1\] must be <= num_tokens"):
        plan_for(attn, case, num_tokens=4)
    with pytest.raises(TypeError, match="causal tensor must have dtype"):
        plan_for(attn, case, causal=case.causal.float())


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"head_dim": 96}, ValueError, "head_dim must be one of"),
        ({"block_size": 12}, ValueError, "block_size .* must be a power of two"),
        ({"num_q_heads": 6, "num_kv_heads": 4}, ValueError, "must be a multiple of num_kv_heads"),
        ({"query_dtype": torch.float32}, TypeError, "query_dtype must be one of"),
        ({"cache_dtype": torch.uint8}, TypeError, "cache_dtype must be one of"),
        ({"max_num_tokens": 0}, ValueError, "max_num_tokens must be an int >= 1"),
    ],
)
def test_construction_refuses_unsupported_sizes(change, error, match):
    options = {"num_q_heads": 8, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
               "device": DEVICE, "max_num_seqs": 4, "max_num_tokens": 32}  # fmt: skip
    with pytest.raises(error, match=match):
        PagedAttention(**(options | change))


def test_the_workspace_is_allocated_at_construction_and_bounds_the_splits():
    attn = PagedAttention(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                          device=DEVICE, max_num_seqs=8, max_num_tokens=64)  # fmt: skip
    workspace = attn.workspace
    assert workspace.ws_o.shape == (plan.DEFAULT_WORKSPACE_ROWS, 128)
    assert workspace.ws_lse.shape == (plan.DEFAULT_WORKSPACE_ROWS,)
    assert workspace.max_splits(64) == plan.DEFAULT_WORKSPACE_ROWS // (64 * 32)
    ws_o, ws_lse = workspace.partials(3, 64)
    assert ws_o.shape == (3, 64, 32, 128) and ws_lse.shape == (3, 64, 32)
    assert ws_o.data_ptr() == workspace.ws_o.data_ptr()
    with pytest.raises(ValueError, match="the workspace holds 65536 split rows"):
        workspace.partials(33, 64)
    tiny = PagedAttention(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                          device=DEVICE, max_num_seqs=1, max_num_tokens=1)  # fmt: skip
    assert tiny.workspace.rows == 32 * registry.max_splits()


def test_triton_splits_into_the_kept_workspace():
    case = mixed_case(12)
    # max_seqlen_k well above the real lengths (a graph captured at max_model_len): the split
    # count comes from it, each split's key range from the real lengths on the device.
    kwargs = case.kwargs() | {"max_seqlen_k": 600}
    problem = validate_attention(*case.args(), **kwargs, softmax_scale=None, out=None,
                                 validate=False)  # fmt: skip
    workspace = Workspace(4 * problem.num_tokens * problem.num_q_heads, problem.num_q_heads,
                          problem.head_dim, problem.query.device)  # fmt: skip
    planned = triton_attention.plan(problem.batch, workspace, num_splits=4)
    assert planned.launch.num_splits == 4
    assert planned.ws_o.data_ptr() == workspace.ws_o.data_ptr()
    out = torch.empty_like(case.query)
    triton_attention.run(problem, planned, out)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    assert torch.all(out[-PADDED:] == 0)
    # A workspace too small for the asked count caps it: no split, no partial buffers.
    capped = triton_attention.plan(problem.batch, Workspace(8, 8, 64, problem.query.device), 4)
    assert capped.launch.num_splits == 1 and capped.ws_o is None


def test_plan_with_max_lengths_reads_no_device_value():
    """Meta tensors have no values: any host read in plan() or run() would raise."""
    case = make_case([3, 8], [40, 8], seed=13)
    attn = PagedAttention(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                          device="meta", max_num_seqs=4, max_num_tokens=32)  # fmt: skip
    to_meta = [t.to("meta") for t in (case.cu_seqlens_q, case.seq_lens, case.block_table)]
    causal = torch.tensor([1, 0], dtype=torch.int32, device="meta")
    attn.plan(*to_meta, causal=causal, max_seqlen_q=8, max_seqlen_k=40)
    meta = [t.to("meta") for t in (case.query, case.key_cache, case.value_cache)]
    out = attn.run(*meta, case.k_scale.to("meta"), case.v_scale.to("meta"))
    assert out.shape == case.query.shape and out.device.type == "meta"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "mma_sync"])
def test_cuda_graph_replays_run_with_changing_lengths_like_eager(backend):
    """A plan made at a large max_seqlen_k (vLLM captures at max_model_len), run() captured in a
    CUDA graph, then the lengths, causal flags and query rewritten in place between replays:
    each replay equals an eager run of the same plan bit for bit and the reference within
    tolerance. (Written without a GPU at hand: it has not run yet.)"""
    if not fna.available_backends()[backend]["available"]:
        pytest.skip(fna.available_backends()[backend]["reason"])
    q_lens, kv_lens = [8, 8, 8, 8], [300, 200, 130, 90]
    case = make_case(q_lens, kv_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                     causal=[False, True, False, False], causal_dtype=torch.int32,
                     device="cuda", seed=30)  # fmt: skip
    seq_lens, causal, query = case.seq_lens.clone(), case.causal.clone(), case.query.clone()
    out = torch.empty_like(query)
    layer = (query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    attn = wrapper_for(case, max_num_seqs=4, max_num_tokens=32)
    attn.plan(case.cu_seqlens_q, seq_lens, case.block_table, causal=causal, max_seqlen_q=8,
              max_seqlen_k=8192, num_tokens=32, backend=backend)  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, checks the caches
        attn.run(*layer, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.run(*layer, out=out)
    gen = torch.Generator(device="cuda").manual_seed(31)
    for lens, flags in [(kv_lens, [0, 1, 0, 0]), ([120, 64, 130, 9], [1, 1, 0, 1])]:
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        causal.copy_(torch.tensor(flags, dtype=torch.int32))
        query.copy_(torch.randn(query.shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        eager = attn.run(*layer, out=torch.empty_like(out))
        assert torch.equal(out, eager)
        ref = fna.paged_attention(query, case.key_cache, case.value_cache, case.block_table,
                                  case.cu_seqlens_q, seq_lens, causal=causal,
                                  k_scale=case.k_scale, v_scale=case.v_scale,
                                  backend="reference")  # fmt: skip
        assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]


def test_plan_and_run_inside_one_compiled_function():
    """plan() under tracing only records the batch (the op plans when the graph runs), so a
    whole step compiles with fullgraph=True and gives the eager answer."""
    case = make_case([3, 8], [40, 8], causal=[True, False], causal_dtype=torch.int32, seed=24)
    attn = wrapper_for(case, max_num_seqs=4, max_num_tokens=16)

    def step(query, key_cache, value_cache, block_table, cu, seq_lens, causal, k_scale, v_scale):
        attn.plan(cu, seq_lens, block_table, causal=causal, max_seqlen_q=8, max_seqlen_k=40)
        return attn.run(query, key_cache, value_cache, k_scale, v_scale)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    out = compiled(*case.args()[:3], case.block_table, case.cu_seqlens_q, case.seq_lens,
                   case.causal, case.k_scale, case.v_scale)  # fmt: skip
    expected = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.equal(out, expected)


class RefusesMisalignedQueries(RecordingBackend):
    """A backend whose kernels take only 16-byte aligned queries (as the CUDA families')."""

    def run_unsupported_reason(self, problem, out):
        return None if problem.query.data_ptr() % 16 == 0 else "query needs a 16-byte aligned base"


def test_auto_plans_the_next_backend_for_a_layer_its_first_cannot_take(monkeypatch):
    """auto plans only its first backend; the next one of its order is planned when a layer's
    tensors are refused by the first (once: later layers reuse it). A named backend raises with
    the reason instead."""
    case = mixed_case(5, device="cpu")  # where auto's next backend is the reference
    fussy = RefusesMisalignedQueries()
    replace_kernels(monkeypatch, "mma_sync", fussy)
    auto_takes_cpu_tensors(monkeypatch, "mma_sync")
    attn = wrapper_for(case, device="cpu")
    fussy.plans.clear()  # available_backends() asked it too
    plan = plan_for(attn, case)
    assert [planned.name for planned in plan.chain] == ["mma_sync"]
    layer = (case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    attn.run(case.query, *layer)
    assert len(fussy.runs) == 1 and len(fussy.plans) == 1
    numel = case.query.numel()
    shifted = torch.empty(numel + 8, dtype=case.query.dtype)[4 : 4 + numel]
    query = shifted.view(case.query.shape).copy_(case.query)  # 8-byte aligned
    out = attn.run(query, *layer)
    assert len(fussy.runs) == 1 and len(fussy.plans) == 1  # neither run nor planned again
    assert [planned.name for planned in plan.chain] == ["mma_sync", "reference"]
    assert torch.equal(attn.run(query, *layer), out)
    assert len(plan.chain) == 2
    expected = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.equal(out, expected)
    named = plan_for(attn, case, backend="mma_sync")
    assert [planned.name for planned in named.chain] == ["mma_sync"]
    with pytest.raises(RuntimeError, match="mma_sync: query needs a 16-byte aligned base"):
        attn.run(query, *layer, plan=named)
