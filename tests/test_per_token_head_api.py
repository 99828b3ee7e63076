"""Per-token-head scales through the public API: ``paged_attention``, ``PagedAttention`` and
``reshape_and_cache`` take float32 ``[num_blocks, block_size, num_kv_heads]`` scales (any
strides, no copy), name bad ones, and the backends that do not read them refuse (auto moves on)."""

import dataclasses

import pytest
import torch
from helpers import TOLERANCE
from helpers.backends import RecordingBackend, auto_takes_cpu_tensors, replace_kernels

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import api, registry
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.scales import PER_TOKEN_HEAD_DTYPES
from fp8_noncausal_attn.synthetic import relative_error, shuffled_block_table, slot_mapping
from fp8_noncausal_attn.validation import validate_attention

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 8, 2, 64, 16, 6
Q_LENS, KV_LENS = [5, 2], [37, 20]


def vllm_page(cache_dtype):
    """Views (key_cache, value_cache, k_scale, v_scale) of one vLLM page whose unwritten bytes
    are 0x5A (scales ~1.5e16: reading one shows)."""
    physical = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * (HEAD_DIM + 4))
    page = torch.full(physical, 0x5A, dtype=torch.uint8).transpose(1, 2)
    return split_per_token_head_cache(page, cache_dtype)


def make_case(cache_dtype=torch.float8_e4m3fn, seed=0):
    """A batch over a per-token-head page written by ``reshape_and_cache``: keys whose magnitude
    varies per token over two decades (one scale per head cannot stand in), shuffled pages.
    Returns (args, kwargs, keys, values) for ``paged_attention``; keys/values per sequence."""
    gen = torch.Generator().manual_seed(seed)
    key_cache, value_cache, k_scale, v_scale = vllm_page(cache_dtype)
    block_table = shuffled_block_table(KV_LENS, BLOCK_SIZE, NUM_BLOCKS, gen, width=3)
    keys, values = [], []
    for kv_len in KV_LENS:
        gain = torch.logspace(-1, 1, kv_len)[torch.randperm(kv_len, generator=gen)][:, None, None]
        shape = (kv_len, NUM_KV_HEADS, HEAD_DIM)
        keys.append((torch.randn(shape, generator=gen) * gain).bfloat16())
        values.append((torch.randn(shape, generator=gen) * gain * 0.05).bfloat16())
    fna.reshape_and_cache(torch.cat(keys), torch.cat(values), key_cache, value_cache,
                          slot_mapping(block_table, KV_LENS, BLOCK_SIZE), k_scale=k_scale,
                          v_scale=v_scale)  # fmt: skip
    query = torch.randn(sum(Q_LENS), NUM_Q_HEADS, HEAD_DIM, generator=gen).bfloat16()
    cu = torch.tensor([0, *Q_LENS]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(KV_LENS, dtype=torch.int32)
    args = (query, key_cache, value_cache, block_table, cu, seq_lens)
    return args, {"causal": False, "k_scale": k_scale, "v_scale": v_scale}, keys, values


def float64_attention(args, kwargs):
    """Bidirectional attention in float64 over stored K/V times each key's own scales."""
    query, key_cache, value_cache, block_table, cu, _ = args
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = NUM_Q_HEADS // NUM_KV_HEADS
    for seq, kv_len in enumerate(KV_LENS):
        j = torch.arange(kv_len)
        page, slot = block_table[seq, j // BLOCK_SIZE].long(), j % BLOCK_SIZE
        k = key_cache[page, slot].double() * kwargs["k_scale"][page, slot].double()[..., None]
        v = value_cache[page, slot].double() * kwargs["v_scale"][page, slot].double()[..., None]
        q = query[cu[seq] : cu[seq + 1]].double().unflatten(1, (NUM_KV_HEADS, group))
        probs = torch.einsum("qhgd,khd->qhgk", q, k).mul(HEAD_DIM**-0.5).softmax(-1)
        out[cu[seq] : cu[seq + 1]] = torch.einsum("qhgk,khd->qhgd", probs, v).flatten(1, 2)
    return out


def paged_attention_object(cache_dtype, backend="auto"):
    return fna.PagedAttention(
        num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE, cache_dtype=cache_dtype, device="cpu", max_num_seqs=4,
        max_num_tokens=16, backend=backend,
    )  # fmt: skip


def run_planned(args, kwargs, backend="auto", validate=False, **run_kwargs):
    query, key_cache, value_cache, block_table, cu, seq_lens = args
    attn = paged_attention_object(key_cache.dtype, backend)
    attn.plan(cu, seq_lens, block_table, causal=kwargs["causal"], validate=validate)
    return attn.run(query, key_cache, value_cache, kwargs["k_scale"], kwargs["v_scale"],
                    **run_kwargs)  # fmt: skip


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_public_paths_read_each_keys_scales(cache_dtype):
    args, kwargs, *_ = make_case(cache_dtype)
    exact = float64_attention(args, kwargs)
    one_shot = fna.paged_attention(*args, **kwargs)
    planned = run_planned(args, kwargs)
    assert relative_error(one_shot, exact) < TOLERANCE[torch.bfloat16]
    assert torch.equal(planned, one_shot)
    # A validated call reads the scales of every key and finds them fine.
    assert torch.equal(fna.paged_attention(*args, **kwargs, validate=True), one_shot)
    assert torch.equal(run_planned(args, kwargs, validate=True), one_shot)


def test_scales_reach_the_backend_uncopied(monkeypatch):
    recorder = RecordingBackend()
    replace_kernels(monkeypatch, "reference", recorder)
    args, kwargs, *_ = make_case()
    fna.paged_attention(*args, **kwargs, backend="reference")
    run_planned(args, kwargs, backend="reference")
    assert len(recorder.runs) == 2
    for problem, *_ in recorder.runs:
        assert problem.k_scale is kwargs["k_scale"] and problem.v_scale is kwargs["v_scale"]
        assert problem.key_cache is args[1]


def with_change(args, kwargs, change):
    """(args, kwargs) after ``change``: a dict of kwargs, or ``"bf16_cache"`` / ``"int8_cache"``
    to swap in caches of that dtype (the scales kept)."""
    args = list(args)
    if change == "bf16_cache":
        args[1:3] = [torch.zeros(args[1].shape, dtype=torch.bfloat16) for _ in range(2)]
    elif change == "int8_cache":
        args[1:3] = [c.view(torch.int8) for c in args[1:3]]
        kwargs = {**kwargs, "k_scale": None, "v_scale": None}
    else:
        kwargs = {**kwargs, **change(kwargs)}
    return args, kwargs


BAD_SCALES = [
    (lambda kw: {"k_scale": torch.ones(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS + 1)}, ValueError,
     r"k_scale per token and head must have the key_cache's first dims \[num_blocks, "
     r"block_size, num_kv_heads\] = \[6, 16, 2\], got \[6, 16, 3\]"),
    (lambda kw: {"v_scale": kw["v_scale"].double()}, TypeError,
     "v_scale must have dtype torch.float32, got torch.float64"),
    (lambda kw: {"k_scale": kw["k_scale"].to("meta")}, ValueError, "k_scale must be on cpu"),
    (lambda kw: {"v_scale": torch.ones(NUM_KV_HEADS)}, ValueError,
     r"v_scale must be a float32 tensor per token and head.*both scales must be of one kind\), "
     r"got a tensor of shape \[2\]"),
    (lambda kw: {"k_scale": kw["k_scale"].flatten(0, 1)}, ValueError,
     r"k_scale must be a float32 tensor per token and head.*got a tensor of shape \[96, 2\]"),
    ("bf16_cache", TypeError,
     r"per-token-head k_scale/v_scale .* need a key_cache of dtype in .*, got torch.bfloat16"),
    ("int8_cache", ValueError,
     r"k_scale must be a float32 tensor per token and head, .* \(an int8 cache has "
     r"per-token-head scales only\), got None"),
]  # fmt: skip


@pytest.mark.parametrize("entry", ["paged_attention", "PagedAttention", "reshape_and_cache"])
@pytest.mark.parametrize("change,error,match", BAD_SCALES)
def test_bad_scales_are_named(entry, change, error, match):
    args, kwargs = with_change(*make_case()[:2], change)
    with pytest.raises(error, match=match):
        if entry == "paged_attention":
            fna.paged_attention(*args, **kwargs)
        elif entry == "PagedAttention":
            run_planned(args, kwargs)
        else:
            rows = torch.randn(3, NUM_KV_HEADS, HEAD_DIM).bfloat16()
            fna.reshape_and_cache(rows, rows, args[1], args[2], torch.tensor([0, 5, 9]),
                                  k_scale=kwargs["k_scale"], v_scale=kwargs["v_scale"])  # fmt: skip


def test_validate_reads_the_scales_of_the_keys_read():
    """With validate=True every key's scale must be > 0 (NaN: a poisoned row, passed on) and the
    score products must fit float32; scales of slots no key reads may hold anything."""
    args, kwargs, *_ = make_case()
    query, key_cache, value_cache, block_table, cu, seq_lens = args
    k_scale = kwargs["k_scale"]
    unread_page = sorted(set(range(NUM_BLOCKS)) - set(block_table.flatten().tolist()))[0]
    last_page, last_slot = int(block_table[0, 2]), KV_LENS[0] % BLOCK_SIZE  # past seq 0's keys
    k_scale[unread_page] = 0.0
    k_scale[last_page, last_slot:] = -1.0
    expected = fna.paged_attention(*args, **kwargs, validate=True)
    read_page = int(block_table[1, 1])
    k_scale[read_page, 3, 1] = 0.0
    for call in (lambda: fna.paged_attention(*args, **kwargs, validate=True),
                 lambda: run_planned(args, kwargs, validate=True)):  # fmt: skip
        with pytest.raises(ValueError, match=rf"k_scale\[{read_page}, 3, 1\] = 0.0"):
            call()
    k_scale[read_page, 3, 1] = 1e37
    with pytest.raises(ValueError, match="must fit in float32"):
        fna.paged_attention(*args, **kwargs, validate=True)
    k_scale[read_page, 3, 1] = float("nan")
    poisoned = fna.paged_attention(*args, **kwargs, validate=True)
    # Sequence 1's query heads over KV head 1 read the NaN; every other row is as before.
    nan_rows = (slice(Q_LENS[0], None), slice(NUM_Q_HEADS // NUM_KV_HEADS, None))
    assert poisoned[nan_rows].isnan().all()
    poisoned[nan_rows] = expected[nan_rows]
    assert torch.equal(poisoned, expected)
    # Without validate=True no value is read; the floor of every written scale still bounds the
    # softmax scale (host values only).
    with pytest.raises(ValueError, match=r"k_scale = 1e-06 gives"):
        fna.paged_attention(*args, **kwargs, softmax_scale=1e-33)


def refusing_backend(monkeypatch, name="mma_sync"):
    """Backend ``name`` stood in for by a recorder whose ``plan()`` refuses per-token-head
    scales and that ``auto`` may pick for CPU tensors, ahead of the reference."""
    recorder = RecordingBackend(
        refuse=lambda batch: (
            "reads per-head scales only (test)" if batch.per_token_head_scales else None
        )
    )
    replace_kernels(monkeypatch, name, recorder)
    auto_takes_cpu_tensors(monkeypatch, name)
    return recorder


def test_a_backend_whose_plan_refuses_per_token_head_raises_and_auto_moves_on(monkeypatch):
    recorder = refusing_backend(monkeypatch)
    args, kwargs, *_ = make_case()
    expected = fna.paged_attention(*args, **kwargs, backend="reference")
    for call in (lambda b: fna.paged_attention(*args, **kwargs, backend=b),
                 lambda b: run_planned(args, kwargs, backend=b)):  # fmt: skip
        with pytest.raises(RuntimeError, match=r"'mma_sync' does not support this call: reads"):
            call("mma_sync")
        assert torch.equal(call("auto"), expected)
    assert recorder.plans and not recorder.runs
    # The same batch with per-head scales does run there: auto would have picked it.
    fna.paged_attention(*args, causal=False, k_scale=1.0, v_scale=1.0)
    assert len(recorder.runs) == 1


def test_an_int8_cache_is_refused_at_plan_time(monkeypatch):
    recorder = refusing_backend(monkeypatch)
    args, kwargs, *_ = make_case(torch.int8)
    cu, seq_lens, block_table = args[4], args[5], args[3]
    recorder.plans.clear()  # available_backends() asked it too
    with pytest.raises(RuntimeError, match="does not support this call: reads per-head scales"):
        paged_attention_object(torch.int8, "mma_sync").plan(cu, seq_lens, block_table)
    plan = paged_attention_object(torch.int8).plan(cu, seq_lens, block_table)
    assert plan.backend == "reference" and plan.passed_over[0][0] == "mma_sync"
    assert len(recorder.plans) == 2 and not recorder.runs
    assert all(batch.per_token_head_scales for batch in recorder.plans)


def test_a_stated_scale_mode_plans_it_and_refuses_the_other_kind(monkeypatch):
    """``PagedAttention(scale_mode=)`` is what every plan is made for: a backend whose plan
    refuses it is refused at plan time (auto moves on), and a layer of the other kind raises.
    Unstated on an FP8 cache, a per-token-head layer plans its batch on its first run."""
    recorder = refusing_backend(monkeypatch)
    args, kwargs, *_ = make_case()
    query, key_cache, value_cache, block_table, cu, seq_lens = args
    expected = fna.paged_attention(*args, **kwargs, backend="reference")
    stated = fna.PagedAttention(
        num_q_heads=NUM_Q_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE, cache_dtype=key_cache.dtype, device="cpu", max_num_seqs=4,
        max_num_tokens=16, scale_mode="per_token_head",
    )  # fmt: skip
    plan = stated.plan(cu, seq_lens, block_table, causal=kwargs["causal"])
    assert plan.backend == "reference" and plan.passed_over[0][0] == "mma_sync"
    layer = (query, key_cache, value_cache, kwargs["k_scale"], kwargs["v_scale"])
    assert torch.equal(stated.run(*layer), expected)
    with pytest.raises(ValueError, match="built with scale_mode='per_token_head', got per-head"):
        stated.run(query, key_cache, value_cache, 1.0, 1.0)
    unstated = paged_attention_object(key_cache.dtype)
    plan = unstated.plan(cu, seq_lens, block_table, causal=kwargs["causal"])
    assert plan.backend == "mma_sync"  # planned for per-head scales
    assert torch.equal(unstated.run(*layer), expected)
    batch, chain = plan.variants[("per_token_head", False)]
    assert batch.per_token_head_scales and [p.name for p in chain] == ["reference"]
    assert not recorder.runs
    with pytest.raises(ValueError, match="scale_mode='per_head' needs an FP8 or 16-bit cache"):
        fna.PagedAttention(
            num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, cache_dtype=torch.int8,
            device="cpu", max_num_seqs=1, max_num_tokens=1, scale_mode="per_head",
        )  # fmt: skip


def test_each_backend_says_whether_its_plan_takes_per_token_head_scales():
    report = fna.available_backends()
    for name in ("reference", "triton", "mma_sync"):  # mma_sync: on the SIMT executor
        assert report[name]["per_token_head"] == "yes"
    for name in ("wgmma", "tcgen05"):
        assert report[name]["per_token_head"] != "yes"  # not available on this machine


def test_the_extensions_write_is_passed_over_for_per_token_head_scales(monkeypatch):
    """_C's cache write takes per-head scales only: a per-token-head write on a GPU goes to the
    next backend's (Triton's), and naming the CUDA family's write for it raises."""
    monkeypatch.setattr(mma_sync, "availability", lambda: (True, "mocked GPU"))
    monkeypatch.setattr(extension, "device_reason", lambda device: None)
    fna.available_backends()
    cuda = torch.device("cuda")
    assert api.cache_writer(cuda) is extension.reshape_and_cache
    triton_write = registry.REGISTRY["triton"].reshape_and_cache
    assert api.cache_writer(cuda, per_token_head=True) is triton_write
    with pytest.raises(RuntimeError, match="does not compute per-token-head scales"):
        registry.for_device("mma_sync", cuda, per_token_head=True)


def test_the_write_op_declares_the_scales_it_writes():
    """torch.library.opcheck: the op mutates per-token-head scales and says so (int8 caches:
    opcheck cannot compare FP8 tensors)."""
    key = torch.randn(5, NUM_KV_HEADS, HEAD_DIM).bfloat16()
    caches = [torch.zeros(2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.int8) for _ in "kv"]
    scales = [torch.zeros(2, BLOCK_SIZE, NUM_KV_HEADS) for _ in "kv"]
    slots = torch.tensor([0, 17, 3, -1, 31])
    write_op = torch.ops.fp8_noncausal_attn.reshape_and_cache.default
    torch.library.opcheck(write_op, (key, key * 2, *caches, slots, *scales))
    write_op(key, key * 2, *caches, slots, *scales)
    assert (scales[0].flatten(0, 1)[slots[slots >= 0]] > 0).all()


def test_mma_sync_runs_per_token_head_layers_on_aligned_caches_and_refuses_vllm_pages(
    monkeypatch,
):
    """With the GPU mocked: ``backend="mma_sync"`` and ``auto`` plan a per-token-head batch on
    mma_sync and launch its per-token-head kernels (scale_mode) where the caches are 16-byte
    aligned; an int8 cache plans there too. vLLM's inline page (rows of d + 4 bytes) is
    refused with one stated reason by a named mma_sync, and ``auto`` runs it on Triton."""
    from helpers.gpu_mock import mock_gpu

    from fp8_noncausal_attn.launch_record import SCALE_MODES

    calls = []
    mock_gpu(monkeypatch, mma_calls=calls)
    for name in ("mma_sync", "triton"):
        auto_takes_cpu_tensors(monkeypatch, name)
    args, kwargs, *_ = make_case()
    query, key_cache, value_cache, block_table, cu, seq_lens = args
    aligned = (query, key_cache.contiguous(), value_cache.contiguous(), block_table, cu, seq_lens)
    scales = {"k_scale": kwargs["k_scale"].contiguous(), "v_scale": kwargs["v_scale"].contiguous()}
    for backend in ("mma_sync", "auto"):
        fna.paged_attention(*aligned, causal=False, **scales, backend=backend)
    assert [call["fields"]["scale_mode"] for call in calls] == [SCALE_MODES["per_token_head"]] * 2
    assert calls[0]["fields"]["k_scale"] == scales["k_scale"].data_ptr()
    calls.clear()
    with pytest.raises(RuntimeError, match=r"tensors: mma_sync: key_cache pointer and strides "
                       r"must be multiples of 16 bytes$"):  # fmt: skip
        fna.paged_attention(*args, **kwargs, backend="mma_sync")
    attn = paged_attention_object(key_cache.dtype)
    plan = attn.plan(cu, seq_lens, block_table, causal=False)
    assert plan.backend == "mma_sync" and not plan.variants
    out = attn.run(query, key_cache, value_cache, kwargs["k_scale"], kwargs["v_scale"])
    _, chain = plan.variants[("per_token_head", False)]
    assert [planned.name for planned in chain] == ["mma_sync", "triton"] and not calls
    expected = fna.paged_attention(*args, **kwargs, backend="reference")
    assert relative_error(out, expected) <= TOLERANCE[torch.bfloat16]
    int8 = paged_attention_object(torch.int8, "mma_sync").plan(cu, seq_lens, block_table)
    assert int8.chain[0].name == "mma_sync" and int8.batch.per_token_head_scales


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_the_mma_sync_plan_names_the_kernel_that_runs(monkeypatch, cache_dtype):
    """The C++ plan names the tile's kernel; the launch runs its per-token-head twin for
    per-token-head scales (every int8 cache), and the same kernel whether or not it writes the
    LSE (csrc/mma_sync/kernel.cuh kernel_of): the plan's report says which."""
    from helpers.gpu_mock import mock_gpu

    mock_gpu(monkeypatch)
    args, kwargs, *_ = make_case(cache_dtype)
    problem = validate_attention(*args, **kwargs, softmax_scale=None, max_seqlen_q=None,
                                 max_seqlen_k=None, out=None, validate=False)  # fmt: skip
    batch = problem.batch
    assert mma_sync.kernel_plan(batch, 132)["kernel_name"] == "paged_attention_kernel_pth"
    per_head = dataclasses.replace(batch, scale_mode="per_head", return_lse=True)
    if cache_dtype == torch.int8:
        return
    assert mma_sync.kernel_plan(per_head, 132)["kernel_name"] == "paged_attention_kernel"
    assert mma_sync.kernel_plan(per_head, 132, 3)["kernel_name"] == "paged_attention_kernel"
    plain = dataclasses.replace(per_head, return_lse=False)
    assert mma_sync.kernel_plan(plain, 132)["kernel_name"] == "paged_attention_kernel"
