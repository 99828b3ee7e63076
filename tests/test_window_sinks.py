"""Sliding window ``(left, right)`` and attention sinks (SPEC §3) outside the CUDA
families: the Triton kernels (interpreter here) against the reference, the key tiles a windowed
launch reads, bad input, the plan/run API, the CUDA backend's contract, the benchmark accounting.

The reference itself is checked against float64 in test_reference.py.
"""

import pytest
import torch
from helpers import DEVICE, TOLERANCE
from helpers.backends import (
    RecordingBackend,
    auto_takes_cpu_tensors,
    plan_and_run,
    replace_kernels,
)

import fp8_noncausal_attn as fna
from benchmarks import shapes
from fp8_noncausal_attn import api, registry
from fp8_noncausal_attn.backends.triton import attention as triton_attention
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

# Large positive and negative sink logits, per q head: a sink of +25 outweighs every key
# (the output shrinks ~e^-25 relative to the plain softmax), one of -40 changes nothing.
SINKS = [25.0, -40.0, 0.5, 3.0]


def sinks_tensor(values=SINKS, device=DEVICE):
    return torch.tensor(values, dtype=torch.float32, device=device)


def reference(case, **kwargs):
    return fna.paged_attention(*case.args(), **case.kwargs(), **kwargs, backend="reference")


def triton_run(case, num_splits, **kwargs):
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, **kwargs
    )
    out = torch.full_like(problem.query, float("nan"))
    plan_and_run(triton_attention, problem, out, num_splits=num_splits)
    return out


# (causal, window, sinks) on sequences [q 3 / kv 21, q 4 / kv 150] with 8-key pages: a window
# inside one page, one spanning pages, one past the context, one-sided ones; splits 1 and 3.
CASES = [
    (False, (3, 2), None),
    (True, (3, 2), True),
    ([True, False], (20, 11), True),
    (False, (1000, 1000), True),
    (True, (-1, -1), True),
    ([True, False], (-1, 0), None),
    (False, (37, -1), True),
]


@pytest.mark.parametrize("causal,window,sinks", CASES)
def test_triton_window_and_sinks_match_reference(causal, window, sinks):
    case = make_case(
        [3, 4], [21, 150], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
        causal=causal, device=DEVICE, seed=13,
    )  # fmt: skip
    kwargs = {"window": window, "sinks": sinks_tensor() if sinks else None}
    ref = reference(case, **kwargs)
    # The window and the sinks each change the result (else these checks could not fail).
    plain = reference(case)
    if window not in ((-1, -1), (1000, 1000)):
        assert not torch.equal(reference(case, window=window), plain)
    if sinks:  # q head 0's sink of +25 outweighs its keys
        assert ref[:, 0].abs().max() < 1e-4 * plain[:, 0].abs().max()
    for num_splits in (1, 3):
        out = triton_run(case, num_splits, **kwargs)
        assert torch.isfinite(out.float()).all()
        assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16], (num_splits, window)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_windowed_launch_reads_only_keys_inside_the_window(num_splits):
    """Pages holding no key that any query of the sequence sees are poisoned with NaN (K and V):
    a kernel that loads one of them (even masked out afterwards, 0 * NaN = NaN in P @ V) returns
    NaN. The loop bounds come from the window, so the output stays finite and correct.
    A bf16 cache: Triton's interpreter does not convert FP8 NaN bytes to NaN."""
    q_len, kv_len, block_size, window = 4, 600, 16, (40, 3)
    case = make_case(
        [q_len], [kv_len], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size,
        cache_dtype=torch.bfloat16, causal=False, device=DEVICE, seed=5,
    )  # fmt: skip
    sinks = sinks_tensor()
    ref = reference(case, window=window, sinks=sinks)
    start, end = visible_range(torch.arange(q_len), q_len, kv_len, False, window)
    first_key, last_key = int(start.min()), int(end.max()) - 1
    pages = case.block_table[0].tolist()
    poisoned = [
        pages[n]
        for n in range(-(-kv_len // block_size))
        if (n + 1) * block_size <= first_key or n * block_size > last_key
    ]
    assert len(poisoned) >= 30  # most of the context lies outside the window
    for cache in (case.key_cache, case.value_cache):
        cache[poisoned] = float("nan")
    out = triton_run(case, num_splits, window=window, sinks=sinks)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    # Without the window the same poisoned cache is read and the output is wrong (NaN, or zeros
    # where the merge weighs NaN partials as empty): the check bites.
    unwindowed = triton_run(case, num_splits, sinks=sinks)
    assert not torch.isfinite(unwindowed.float()).all() or relative_error(unwindowed, ref) > 0.5


def test_sinks_are_added_once_in_the_split_merge():
    """Sinks that dominate the denominator: counted once per split, the output would shrink by
    the split count; the merged result equals the unsplit one."""
    case = make_case([2], [300], num_q_heads=4, num_kv_heads=2, seed=8, device=DEVICE)
    sinks = sinks_tensor([30.0, 12.0, 20.0, 40.0])
    ref = reference(case, sinks=sinks)
    assert relative_error(ref, reference(case)) > 0.02
    for num_splits in (1, 3):
        out = triton_run(case, num_splits, sinks=sinks)
        assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16], num_splits


def test_plan_run_and_one_shot_take_window_and_sinks():
    case = make_case(
        [3, 5], [30, 70], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        causal=[True, False], device=DEVICE, seed=21,
    )  # fmt: skip
    window, sinks = (9, 9), sinks_tensor()
    attn = fna.PagedAttention(
        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        cache_dtype=case.key_cache.dtype, device=DEVICE, max_num_seqs=4, max_num_tokens=16,
    )  # fmt: skip
    plan = attn.plan(
        case.cu_seqlens_q, case.seq_lens, case.block_table, causal=case.causal, window=window,
        backend="triton",
    )  # fmt: skip
    args = (case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    out = attn.run(*args, sinks=sinks, plan=plan)
    ref = reference(case, window=window, sinks=sinks)
    assert relative_error(out, ref) <= TOLERANCE[torch.bfloat16]
    one_shot = fna.paged_attention(
        *case.args(), **case.kwargs(), window=window, sinks=sinks, backend="triton"
    )
    assert relative_error(one_shot, ref) <= TOLERANCE[torch.bfloat16]
    # The opaque op (what torch.compile sees) carries both.
    op_out = torch.empty_like(case.query)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
        window=window, sinks=sinks,
    )  # fmt: skip
    torch.ops.fp8_noncausal_attn.paged_attention(
        op_out, None, "reference", *api.op_arguments(problem)
    )
    assert relative_error(op_out, ref) < 2**-8
    with pytest.raises(ValueError, match=r"sinks must have shape \[num_q_heads\] = \[4\]"):
        attn.run(*args, sinks=sinks[:3], plan=plan)
    with pytest.raises(ValueError, match=r"window\[0\] \(left\) must be -1"):
        attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, window=(-2, 0))


BAD_WINDOWS = [
    (5, TypeError, r"window must be a \(left, right\) tuple of two ints.*got 5"),
    ((1, 2, 3), TypeError, r"window must be a \(left, right\) tuple"),
    ((-2, 0), ValueError, r"window\[0\] \(left\) must be -1 \(unbounded\) or >= 0, got -2"),
    ((0, -5), ValueError, r"window\[1\] \(right\) must be -1 \(unbounded\) or >= 0, got -5"),
    ((1.5, 0), TypeError, r"window\[0\] \(left\) must be an int, got float"),
    ((True, 0), TypeError, r"window\[0\] \(left\) must be an int, got bool"),
]


@pytest.mark.parametrize("window,error,message", BAD_WINDOWS)
def test_bad_window_is_refused_by_name(window, error, message):
    case = make_case([2], [20], num_q_heads=4, num_kv_heads=2)
    with pytest.raises(error, match=message):
        reference(case, window=window)


BAD_SINKS = [
    ([1.0, 2.0, 3.0], None, TypeError, r"sinks must be a torch.Tensor, got list"),
    (torch.zeros(4, dtype=torch.bfloat16), None, TypeError, r"sinks must have dtype in \[torch.float32\], got torch.bfloat16"),  # noqa: E501
    (torch.zeros(3), None, ValueError, r"sinks must have shape \[num_q_heads\] = \[4\], got \[3\]"),
    (torch.zeros(2, 2), None, ValueError, r"sinks must have shape \[num_q_heads\] = \[4\], got \[2, 2\]"),  # noqa: E501
    (torch.zeros(4, device="meta"), None, ValueError, r"sinks must be on cpu like query, got meta"),
    (torch.tensor([0.0, float("nan"), 0.0, 0.0]), None, ValueError, r"sinks must be finite, got nan"),  # noqa: E501
    (torch.tensor([0.0, 0.0, float("inf"), 0.0]), None, ValueError, r"sinks must be finite, got inf"),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize("sinks,_,error,message", BAD_SINKS)
def test_bad_sinks_are_refused_by_name(sinks, _, error, message):
    case = make_case([2], [20], num_q_heads=4, num_kv_heads=2)
    with pytest.raises(error, match=message):
        reference(case, sinks=sinks)


def test_cuda_backend_takes_window_and_sinks_like_a_plain_call():
    """A window is a batch property every CUDA family plans like a plain batch; sinks are a
    layer's and no plan sees them."""
    case = make_case([2, 3], [20, 40], num_q_heads=4, num_kv_heads=2, seed=4)
    plain = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    for window in ((7, 0), (-1, 3)):
        problem = validate_attention(
            *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
            window=window,
        )  # fmt: skip
        for name in ("mma_sync", "wgmma", "tcgen05"):
            assert registry.plan_refusal(name, problem.batch) == registry.plan_refusal(
                name, plain.batch
            )


def test_plan_on_cuda_runs_window_and_sinks_there(monkeypatch):
    """Sinks come per layer, at run time, after a plan chose the CUDA kernels (a recording
    backend in mma_sync's registry entry, taking CPU tensors): the run stays on them and passes
    them the sinks; a windowed plan picks them too."""
    cuda_kernels = RecordingBackend()
    replace_kernels(monkeypatch, "mma_sync", cuda_kernels)
    case = make_case([2, 3], [20, 40], num_q_heads=4, num_kv_heads=2, seed=4)
    auto_takes_cpu_tensors(monkeypatch, "mma_sync")
    attn = fna.PagedAttention(
        num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu",
        max_num_seqs=2, max_num_tokens=8,
    )  # fmt: skip
    args = (case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale)
    sinks = sinks_tensor(device="cpu")
    for backend in ("auto", "mma_sync"):
        plan = attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=False,
                         backend=backend)  # fmt: skip
        assert plan.backend == "mma_sync"
        attn.run(*args, sinks=sinks, plan=plan)
        ((problem, _, _, _),) = cuda_kernels.runs
        assert problem.sinks is sinks
        cuda_kernels.runs.clear()
    windowed = attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, window=(4, 4))
    assert windowed.backend == "mma_sync"
    attn.run(*args, plan=windowed)
    ((problem, _, _, _),) = cuda_kernels.runs
    assert problem.window == (4, 4)


def test_windowed_benchmark_shape_bytes_scale_with_the_window():
    shape = shapes.windowed_drafter()
    full = shapes._drafter(kv_len=shape.kv_len)
    assert shape.kv_len == 131072 and shape.window == (4095, 4095) and not shape.causal
    # Keys read: from the page holding the first query's p - left to the end of the context
    # (whole pages: a kernel loads a page or none of it).
    first_visible = shape.kv_len - shape.q_len - 4095
    first_page_key = first_visible // shape.block_size * shape.block_size
    assert shape.keys_read == shape.kv_len - first_page_key
    assert shape.keys_read == shape.pages_read * shape.block_size
    per_key = 2 * shape.batch * shape.num_kv_heads * shape.head_dim  # K and V, FP8
    assert shape.kv_bytes() == per_key * shape.keys_read
    assert full.kv_bytes() == per_key * 131072
    assert 31 < full.kv_bytes() / shape.kv_bytes() < 33
    # Query i sees p - 4095 .. kv_len - 1 (its right side runs past the context): 4095 keys
    # before it, itself, and the q_len - 1 - i after it.
    keys = sum(4095 + 1 + shape.q_len - 1 - i for i in range(shape.q_len))
    assert shape.flops == 4 * shape.batch * keys * shape.num_q_heads * shape.head_dim
    assert "window4095,4095" in shape.label()
    # A window wider than the context reads the context, as an unwindowed shape does.
    wide = shapes._drafter(kv_len=2048, window=(8192, 8192))
    assert wide.kv_bytes() == shapes._drafter(kv_len=2048).kv_bytes()
    assert wide.flops == shapes._drafter(kv_len=2048).flops
    causal = shapes._drafter(kv_len=2048, causal=True, window=(100, -1))
    assert causal.flops == 4 * 32 * 8 * 101 * 32 * 128  # each causal query sees 101 keys
