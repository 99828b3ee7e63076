"""Public API behaviour: backend choice and reporting, ops registration, edge cases, layouts."""

import subprocess
import sys

import pytest
import torch
from helpers import DEVICE

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import api, registry
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention


def test_available_backends_reports_every_backend_with_a_reason():
    report = fna.available_backends()
    for name in registry.BACKEND_NAMES:
        assert isinstance(report[name]["available"], bool)
        assert report[name]["reason"] and report[name]["status"]
    assert report["reference"]["available"]
    assert report["auto"]["choice"] in registry.AUTO_ORDER
    assert report["auto"]["reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_auto_picks_the_reference_on_cpu_and_says_why():
    report = fna.available_backends()
    assert report["auto"]["choice"] == "reference"
    assert "interpreter" in report["auto"]["reason"]
    case = make_case([2], [10], seed=1)
    auto = fna.paged_attention(*case.args(), **case.kwargs())
    ref = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    assert torch.equal(auto, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
@pytest.mark.parametrize("backend", ["wgmma", "tcgen05"])
def test_cuda_backend_on_cpu_tensors_fails_with_the_reason(backend):
    """(mma_sync runs CPU tensors through the SIMT executor: tests/test_simt_kernels.py.)"""
    case = make_case([2], [10], seed=1)
    with pytest.raises(RuntimeError, match=f"backend '{backend}' is not available here: "):
        fna.paged_attention(*case.args(), **case.kwargs(), backend=backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
def test_mma_sync_takes_cpu_tensors_only_when_the_executor_is_asked_for(monkeypatch):
    """Without FP8NCA_SIMT=1 (the tests set it), mma_sync on CPU tensors is refused with how to
    ask for the SIMT executor, and asking what runs here builds nothing."""
    from fp8_noncausal_attn.backends.cuda import extension, mma_sync, simt

    _, ext_why = extension.availability()
    built = []
    monkeypatch.setattr(simt, "build", lambda *args, **kwargs: built.append(args))
    monkeypatch.delenv(simt.ENABLE_ENV)
    report = fna.available_backends()
    assert not report["mma_sync"]["available"]
    assert f"{simt.ENABLE_ENV}=1" in report["mma_sync"]["reason"]
    case = make_case([2], [10], seed=1)
    with pytest.raises(RuntimeError, match=f"backend 'mma_sync' is not available here: .*"
                       f"{simt.ENABLE_ENV}=1"):  # fmt: skip
        fna.paged_attention(*case.args(), **case.kwargs(), backend="mma_sync")
    assert not built
    monkeypatch.setenv(simt.ENABLE_ENV, "1")
    assert mma_sync.availability() == (True, f"{simt.STATUS}; CUDA tensors: {ext_why}")


def test_a_bad_backend_name_fails_with_the_one_text_everywhere():
    case = make_case([2], [10], seed=1)
    expected = r"backend must be 'auto' or one of \('mma_sync', 'triton', 'reference', 'wgmma'"
    with pytest.raises(ValueError, match=expected):
        fna.paged_attention(*case.args(), **case.kwargs(), backend="cuda")
    with pytest.raises(ValueError, match=expected):
        fna.reshape_and_cache(*cache_write_case()[:5], backend="cuda")
    with pytest.raises(ValueError, match=expected):
        fna.merge_attention_states([case.query], [torch.zeros(case.query.shape[:2])], backend="x")
    with pytest.raises(ValueError, match=expected):
        fna.PagedAttention(
            num_q_heads=8,
            num_kv_heads=2,
            head_dim=64,
            block_size=16,
            device="cpu",
            max_num_seqs=1,
            max_num_tokens=8,
            backend="fa3",
        )


def cache_write_case(per_token_head: bool = False, seed: int = 5):
    """``(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)`` of a cache write:
    random rows, e4m3 caches holding random bytes, per-head or per-token-head scales."""
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(6, 2, 64, generator=gen).bfloat16() for _ in "kv")
    key_cache, value_cache = (
        torch.randint(0, 120, (4, 16, 2, 64), dtype=torch.uint8, generator=gen).view(
            torch.float8_e4m3fn
        )
        for _ in "kv"
    )
    slots = torch.tensor([0, 17, 33, -1, 63, 40])
    if per_token_head:
        k_scale, v_scale = (torch.rand(4, 16, 2, generator=gen) + 0.5 for _ in "kv")
    else:
        k_scale, v_scale = (torch.rand(2, generator=gen) + 0.5 for _ in "kv")
    return key, value, key_cache, value_cache, slots, k_scale, v_scale


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU behaviour")
@pytest.mark.parametrize("per_token_head", [False, True])
def test_reshape_and_cache_runs_the_named_backends_write(per_token_head):
    """``backend=`` names whose cache write runs: the reference's, Triton's (its CPU
    interpreter) and, for per-head scales, _C's (mma_sync on the SIMT executor) write the same
    bytes and scales as ``auto``; _C's write refuses per-token-head scales, and a family not
    available here raises with the reason."""
    names = ("reference", "triton") if per_token_head else ("reference", "triton", "mma_sync")
    written = {}
    for backend in ("auto", *names):
        *tensors, k_scale, v_scale = (t.clone() for t in cache_write_case(per_token_head))
        fna.reshape_and_cache(*tensors, k_scale=k_scale, v_scale=v_scale, backend=backend)
        written[backend] = [t.view(torch.uint8) for t in tensors[2:4]]
        if per_token_head:
            written[backend] += [k_scale, v_scale]
    before = cache_write_case(per_token_head)
    assert not torch.equal(written["auto"][0], before[2].view(torch.uint8))
    for backend in names:
        for got, expected in zip(written[backend], written["auto"], strict=True):
            assert torch.equal(got, expected), backend
    *tensors, k_scale, v_scale = cache_write_case(per_token_head)
    if per_token_head:
        with pytest.raises(RuntimeError, match="does not compute per-token-head scales"):
            fna.reshape_and_cache(*tensors, k_scale=k_scale, v_scale=v_scale, backend="mma_sync")
    with pytest.raises(RuntimeError, match="backend 'wgmma' is not available here: "):
        fna.reshape_and_cache(*tensors, k_scale=k_scale, v_scale=v_scale, backend="wgmma")


def test_ops_are_registered_with_torch_library():
    assert hasattr(torch.ops.fp8_noncausal_attn, "paged_attention")
    assert hasattr(torch.ops.fp8_noncausal_attn, "reshape_and_cache")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_sequences_without_queries_write_nothing(backend):
    case = make_case([0, 4, 0], [5, 30, 9], device=DEVICE, seed=2)
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend=backend)
    assert out.shape == (4, 8, 64)
    empty = make_case([0, 0], [5, 9], device=DEVICE, seed=3)
    assert fna.paged_attention(*empty.args(), **empty.kwargs(), backend=backend).shape[0] == 0


def test_max_seqlen_is_derived_when_not_given():
    case = make_case([3, 8], [40, 8], device=DEVICE, seed=4)
    given = fna.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    kwargs = case.kwargs() | {"max_seqlen_q": None, "max_seqlen_k": None}
    derived = fna.paged_attention(*case.args(), **kwargs, backend="triton")
    assert torch.equal(given, derived)


def test_larger_max_seqlen_bounds_give_the_same_answer():
    case = make_case([3, 8], [40, 8], device=DEVICE, seed=4)
    tight = fna.paged_attention(*case.args(), **case.kwargs(), backend="triton")
    kwargs = case.kwargs() | {"max_seqlen_q": 64, "max_seqlen_k": 1000}
    loose = fna.paged_attention(*case.args(), **kwargs, backend="triton")
    assert relative_error(loose, tight) < 1e-6


def test_scale_forms_agree():
    case = make_case([4], [33], num_kv_heads=2, device=DEVICE, seed=5, scales="none")
    as_float = fna.paged_attention(
        *case.args(), **(case.kwargs() | {"k_scale": 0.5, "v_scale": 2.0}), backend="reference"
    )
    for k_scale, v_scale in [
        (torch.tensor(0.5), torch.tensor(2.0)),
        (torch.tensor([0.5]), torch.tensor([2.0])),
        (torch.tensor([0.5, 0.5]), torch.tensor([2.0, 2.0])),
    ]:
        kwargs = case.kwargs() | {"k_scale": k_scale.to(DEVICE), "v_scale": v_scale.to(DEVICE)}
        out = fna.paged_attention(*case.args(), **kwargs, backend="reference")
        assert torch.equal(out, as_float)


def test_split_kv_cache_rejects_wrong_shapes_and_dtypes():
    with pytest.raises(ValueError, match="vllm"):
        fna.split_kv_cache(torch.zeros(4, 2, 16, 63, dtype=torch.uint8), "vllm")
    with pytest.raises(TypeError, match="cache_dtype"):
        fna.split_kv_cache(torch.zeros(4, 2, 16, 64), "vllm", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="kv_first"):
        fna.split_kv_cache(torch.zeros(3, 4, 16, 2, 64), "kv_first")
    with pytest.raises(ValueError, match="layout"):
        fna.split_kv_cache(torch.zeros(2, 4, 16, 2, 64), "nhd")


def test_vllm_layout_views_share_storage_without_copy():
    kv = torch.zeros(5, 2, 16, 128, dtype=torch.uint8)
    key_cache, value_cache = fna.split_kv_cache(kv, "vllm", torch.float8_e4m3fn)
    assert key_cache.shape == (5, 16, 2, 64) and key_cache.dtype == torch.float8_e4m3fn
    assert key_cache.data_ptr() == kv.data_ptr()
    assert value_cache.data_ptr() == kv.data_ptr() + 64


def test_compute_kv_scales_rejects_bad_input():
    key = torch.randn(4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp8_dtype"):
        fna.compute_kv_scales(key, key, fp8_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="value"):
        fna.compute_kv_scales(key, key[:2])
    with pytest.raises(TypeError, match="key"):
        fna.compute_kv_scales(key.long(), key)


PAGED_OP = torch.ops.fp8_noncausal_attn.paged_attention.default


def compile_recording(fn, graphs):
    """``torch.compile(fn, fullgraph=True)`` with a backend that keeps each traced graph and
    runs it as traced (fullgraph: any graph break or untraceable call fails the compile)."""

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(fn, fullgraph=True, backend=record)


def traced_targets(graphs):
    return [node.target for gm in graphs for node in gm.graph.nodes]


def refuse_while_tracing(monkeypatch, module, name):
    """Make ``module.name`` fail if called while Dynamo traces (backend choice, extension
    loading and pointer checks must stay out of traced code)."""
    real = getattr(module, name)

    def guarded(*args, **kwargs):
        if torch.compiler.is_compiling():
            raise AssertionError(f"{module.__name__}.{name} was traced")
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, guarded)


@pytest.mark.parametrize("extension", ["built", "missing", "gpu_mocked"])
def test_torch_compile_fullgraph_with_auto_backend(monkeypatch, extension):
    """fullgraph=True traces paged_attention(backend="auto") and PagedAttention.run to one
    opaque op, whether _C is built, missing, or the GPU backends report available (mocked):
    the backend is resolved inside the op when the graph runs, so no extension import,
    exception handling or data_ptr() arithmetic is ever traced."""
    from helpers.backends import Available, replace_kernels

    from fp8_noncausal_attn import registry
    from fp8_noncausal_attn.backends.cuda import extension as cuda_extension
    from fp8_noncausal_attn.backends.cuda import mma_sync

    if extension == "built" and cuda_extension.load()[0] is None:
        pytest.skip("the CUDA extension is not built here")
    if extension == "missing":
        monkeypatch.setattr(cuda_extension, "load", lambda: (None, "not built (test)"))
    if extension == "gpu_mocked":
        # Our backends report a GPU (torch.cuda itself stays real: Dynamo consults it).
        for name in ("mma_sync", "triton"):
            replace_kernels(monkeypatch, name, Available(registry.REGISTRY[name].kernels))
    fna.available_backends()  # the mocks above are asked afresh
    for module, name in [
        (registry, "plan_batch"),
        (registry, "for_device"),
        (registry, "auto_choice"),
        (mma_sync, "plan"),
        (mma_sync, "run_unsupported_reason"),
    ]:
        refuse_while_tracing(monkeypatch, module, name)  # fmt: skip
    case = make_case([3, 8], [40, 8], causal=[True, False], causal_dtype=torch.int32, seed=21)
    expected = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")

    def one_shot(query, key_cache, value_cache, block_table, cu, seq_lens, k_scale, v_scale):
        return fna.paged_attention(
            query, key_cache, value_cache, block_table, cu, seq_lens, causal=case.causal,
            k_scale=k_scale, v_scale=v_scale, max_seqlen_q=8, max_seqlen_k=40, backend="auto",
        )  # fmt: skip

    graphs = []
    out = compile_recording(one_shot, graphs)(*case.args(), case.k_scale, case.v_scale)
    assert PAGED_OP in traced_targets(graphs)
    assert torch.equal(out, expected)

    attn = fna.PagedAttention(num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                              device="cpu", max_num_seqs=4, max_num_tokens=16)  # fmt: skip
    attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=case.causal,
              max_seqlen_q=8, max_seqlen_k=40)  # fmt: skip
    graphs = []
    run = compile_recording(attn.run, graphs)
    out = run(case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    assert PAGED_OP in traced_targets(graphs)
    assert torch.equal(out, expected)


def test_opcheck_both_ops_with_bf16_caches():
    """torch.library.opcheck (schema, fake kernel, autograd registration, AOT dispatch) on both
    ops. bf16 caches: torch's own schema check cannot compare FP8 tensors (with FP8 caches it
    fails inside torch: test_schema, "mul_cpu_reduced_float" not implemented for
    'Float8_e4m3fn'), so FP8 is covered by the other tests, not by opcheck."""
    case = make_case([3, 8], [40, 8], cache_dtype=torch.bfloat16, causal=[True, False],
                     causal_dtype=torch.int32, seed=22)  # fmt: skip
    out = torch.empty_like(case.query)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=0.125, out=None, validate=False
    )
    args = (out, None, "reference", *api.op_arguments(problem))
    torch.library.opcheck(PAGED_OP, args)
    PAGED_OP(*args)  # opcheck ran on copies; the op itself writes out
    expected = fna.paged_attention(*case.args(), **case.kwargs(), softmax_scale=0.125,
                                   backend="reference")  # fmt: skip
    assert torch.equal(out, expected)

    key = torch.randn(5, 2, 64).to(torch.bfloat16)
    value = torch.randn(5, 2, 64).to(torch.bfloat16)
    key_cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([0, 17, 33, -1, 63])
    scales = torch.tensor([0.5, 2.0])
    write_op = torch.ops.fp8_noncausal_attn.reshape_and_cache.default
    args = (key, value, key_cache, value_cache, slots, scales, scales, "reference")
    torch.library.opcheck(write_op, args)
    write_op(*args)
    assert torch.equal(key_cache[1, 1], (key[1].float() / scales[:, None]).to(torch.bfloat16))


def test_block_table_entries_past_a_sequences_pages_are_ignored():
    # Entries a sequence does not use may hold anything (vLLM leaves stale ids there): the page
    # check must not refuse them, and no backend may read them.
    case = make_case([3, 8], [40, 8], seed=23)
    garbage = case.block_table.clone()
    garbage[1, 1:] = -7  # sequence 1 (8 keys) uses one page
    garbage[0, 3:] = 10**6  # sequence 0 (40 keys) uses three
    args = list(case.args())
    expected = fna.paged_attention(*args, **case.kwargs(), backend="reference")
    args[3] = garbage
    assert torch.equal(fna.paged_attention(*args, **case.kwargs(), backend="reference"), expected)
    garbage[0, 2] = 10**6  # a used page out of range is refused
    with pytest.raises(ValueError, match=r"used pages must be in \[0, \d+\), got range"):
        fna.paged_attention(*args, **case.kwargs(), backend="reference")


def test_cuda_cache_write_uses_the_extension_and_leaves_triton_unimported():
    """On CUDA tensors reshape_and_cache runs the extension's kernel when _C runs here; only
    otherwise Triton's (an optional dependency, imported only when it runs). Checked in a fresh
    process with the backends' availability mocked."""
    code = (
        "import sys, torch\n"
        "from fp8_noncausal_attn import api, registry\n"
        "from fp8_noncausal_attn.backends import reference\n"
        "from fp8_noncausal_attn.backends.cuda import extension, mma_sync\n"
        "from fp8_noncausal_attn.backends.triton import attention\n"
        "mma_sync.availability = lambda: (True, 'mocked')\n"
        "extension.device_reason = lambda device: None\n"
        "attention.availability = lambda: (True, 'mocked')\n"
        "registry.available_backends()\n"
        "assert api.cache_writer(torch.device('cuda')) is extension.reshape_and_cache\n"
        "assert 'fp8_noncausal_attn.backends.triton.cache' not in sys.modules\n"
        "mma_sync.availability = lambda: (False, 'mocked')\n"
        "registry.available_backends()\n"
        "write = api.cache_writer(torch.device('cuda'))\n"
        "assert write is registry.REGISTRY['triton'].reshape_and_cache\n"
        "assert 'fp8_noncausal_attn.backends.triton.cache' not in sys.modules\n"
        "assert api.cache_writer(torch.device('cpu')) is reference.reshape_and_cache\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_op_schema_lists_the_records_fields_in_order(monkeypatch):
    """The registered op takes ``out``, ``lse``, ``backend`` and then exactly the fields of
    AttentionProblem (but its batch) and Batch, in their order, each typed as its annotation
    (resolved here, not through the api's table); the traced call's values (``op_arguments``)
    come back from the op's body as an equal problem."""
    import dataclasses
    import typing

    from fp8_noncausal_attn.problem import AttentionProblem, Batch

    schema_type = {torch.Tensor: "Tensor", torch.Tensor | None: "Tensor?", bool: "bool",
                   float: "float", int: "SymInt", str: "str", torch.dtype: "ScalarType",
                   torch.device: "str", tuple[int, int]: "SymInt[]"}  # fmt: skip
    arguments = ["Tensor(a0!) out", "Tensor(a1!)? lse", "str backend"]
    for record in (AttentionProblem, Batch):
        hints = typing.get_type_hints(record)
        for field in dataclasses.fields(record):
            if field.name != "batch":
                arguments.append(f"{schema_type[hints[field.name]]} {field.name}")
    expected = f"fp8_noncausal_attn::paged_attention({', '.join(arguments)}) -> ()"
    assert str(PAGED_OP._schema) == expected

    case = make_case([3, 8], [40, 8], causal=[True, False], causal_dtype=torch.int32, seed=23)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=(5, 2), sinks=torch.randn(8), return_lse=True,
    )  # fmt: skip
    seen = []
    monkeypatch.setattr(api, "run_one_shot", lambda problem, *rest: seen.append(problem))
    out, lse = torch.empty_like(case.query), api.new_lse(case.query)
    PAGED_OP(out, lse, "reference", *api.op_arguments(problem))
    (rebuilt,) = seen
    for record, original in ((rebuilt, problem), (rebuilt.batch, problem.batch)):
        for field in dataclasses.fields(original):
            if field.name != "batch":
                got, want = getattr(record, field.name), getattr(original, field.name)
                same = got is want if isinstance(want, torch.Tensor) else got == want
                assert same and type(got) is type(want), (field.name, got, want)
