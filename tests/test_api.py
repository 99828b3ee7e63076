"""Public API behaviour: backend choice and reporting, ops registration, edge cases, layouts."""

import pytest
import torch
from conftest import DEVICE

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.synthetic import make_case, relative_error


def test_available_backends_reports_every_backend_with_a_reason():
    report = fna.available_backends()
    for name in ("cuda", "triton", "reference"):
        assert isinstance(report[name]["available"], bool)
        assert report[name]["reason"]
    assert report["reference"]["available"]
    assert report["auto"]["choice"] in ("cuda", "triton", "reference")
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
def test_cuda_backend_on_cpu_tensors_fails_with_the_reason():
    case = make_case([2], [10], seed=1)
    with pytest.raises(RuntimeError, match="cuda"):
        fna.paged_attention(*case.args(), **case.kwargs(), backend="cuda")


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
