"""Bad input (SPEC §5): each case raises the right exception and names the argument."""

import pytest
import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.synthetic import make_case


def base():
    case = make_case([2, 3], [10, 20], num_q_heads=4, num_kv_heads=2, seed=1)
    kwargs = dict(
        query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
        block_table=case.block_table, cu_seqlens_q=case.cu_seqlens_q, seq_lens=case.seq_lens,
        causal=False, k_scale=case.k_scale, v_scale=case.v_scale,
    )  # fmt: skip
    return case, kwargs


def call(**kwargs):
    positional = [kwargs.pop(n) for n in ("query", "key_cache", "value_cache")]
    positional += [kwargs.pop(n) for n in ("block_table", "cu_seqlens_q", "seq_lens")]
    return fna.paged_attention(*positional, **kwargs, backend="reference")


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def with_page(kw, seq, page, value):
    """``block_table`` with used page ``page`` of sequence ``seq`` set to ``value``."""
    block_table = kw["block_table"].clone()
    block_table[seq, page] = value
    return {"block_table": block_table}


BAD_CASES = {
    "query_fp32": (lambda kw: {"query": kw["query"].float()}, TypeError, "query"),
    "query_rank": (lambda kw: {"query": kw["query"][0]}, ValueError, "query"),
    "query_not_tensor": (lambda kw: {"query": [1.0]}, TypeError, "query"),
    "query_last_dim_strided": (
        lambda kw: {"query": torch.cat([kw["query"]] * 2, dim=-1)[..., ::2]},
        ValueError,
        "query",
    ),
    "cache_uint8": (
        lambda kw: {"key_cache": kw["key_cache"].view(torch.uint8)},
        TypeError,
        "key_cache",
    ),
    "cache_dtype_mismatch": (
        lambda kw: {"value_cache": kw["value_cache"].to(torch.bfloat16)},
        TypeError,
        "value_cache",
    ),
    "cache_shape_mismatch": (
        lambda kw: {"value_cache": kw["value_cache"][:-1]},
        ValueError,
        "value_cache",
    ),
    "cache_rank": (lambda kw: {"key_cache": kw["key_cache"][0]}, ValueError, "key_cache"),
    "head_dim_mismatch": (lambda kw: {"query": kw["query"][..., :32]}, ValueError, "head_dim"),
    "head_dim_unsupported": (
        lambda kw: {
            "query": kw["query"][..., :48],
            "key_cache": kw["key_cache"][..., :48],
            "value_cache": kw["value_cache"][..., :48],
        },
        ValueError,
        "head_dim",
    ),
    "block_size_not_pow2": (
        lambda kw: {"key_cache": kw["key_cache"][:, :12], "value_cache": kw["value_cache"][:, :12]},
        ValueError,
        "block_size",
    ),
    "gqa_not_integral": (lambda kw: {"query": kw["query"][:, :3]}, ValueError, "num_q_heads"),
    "block_table_int64": (
        lambda kw: {"block_table": kw["block_table"].long()},
        TypeError,
        "block_table",
    ),
    "block_table_rows": (
        lambda kw: {"block_table": kw["block_table"][:1]},
        ValueError,
        "block_table",
    ),
    "block_table_too_short": (
        lambda kw: {"block_table": kw["block_table"][:, :1]},
        ValueError,
        "block_table",
    ),
    "block_table_page_out_of_range": (
        lambda kw: {"block_table": kw["block_table"] + 1000},
        ValueError,
        "block_table",
    ),
    # The used pages are read as one block: each bound must hold at any place in it.
    "block_table_page_negative": (lambda kw: with_page(kw, 1, 1, -1), ValueError, "block_table"),
    "block_table_page_num_blocks": (
        lambda kw: with_page(kw, 0, 0, kw["key_cache"].shape[0]),
        ValueError,
        "block_table",
    ),
    "cu_seqlens_length": (lambda kw: {"cu_seqlens_q": i32([0, 5])}, ValueError, "cu_seqlens_q"),
    "cu_seqlens_decreasing": (
        lambda kw: {"cu_seqlens_q": i32([0, 4, 3])},
        ValueError,
        "cu_seqlens_q",
    ),
    # Fewer than num_tokens (padding rows) is valid; more is not.
    "cu_seqlens_past_num_tokens": (
        lambda kw: {"cu_seqlens_q": i32([0, 2, 6])},
        ValueError,
        r"cu_seqlens_q\[-1\] must be <= num_tokens .* = 5, got 6",
    ),
    "seq_lens_rank": (lambda kw: {"seq_lens": kw["seq_lens"][None]}, ValueError, "seq_lens"),
    "q_len_exceeds_kv_len": (lambda kw: {"seq_lens": i32([1, 20])}, ValueError, "q_len"),
    "k_scale_wrong_length": (
        lambda kw: {"k_scale": torch.ones(3, dtype=torch.float32)},
        ValueError,
        "k_scale",
    ),
    "k_scale_float64": (
        lambda kw: {"k_scale": torch.ones(2, dtype=torch.float64)},
        TypeError,
        "k_scale",
    ),
    "v_scale_nan": (
        lambda kw: {"v_scale": torch.tensor([1.0, float("nan")])},
        ValueError,
        "v_scale",
    ),
    "v_scale_negative": (lambda kw: {"v_scale": -1.0}, ValueError, "v_scale"),
    "k_scale_zero_tensor": (lambda kw: {"k_scale": torch.tensor(0.0)}, ValueError, "k_scale"),
    "k_scale_string": (lambda kw: {"k_scale": "1.0"}, TypeError, "k_scale"),
    "causal_wrong_length": (
        lambda kw: {"causal": torch.tensor([True, False, True])},
        ValueError,
        "causal",
    ),
    "causal_int64_tensor": (lambda kw: {"causal": torch.tensor([1, 0])}, TypeError, "causal"),
    "causal_float_tensor": (lambda kw: {"causal": torch.tensor([1.0, 0.0])}, TypeError, "causal"),
    "causal_int32_wrong_length": (
        lambda kw: {"causal": i32([1, 0, 1])},
        ValueError,
        "causal",
    ),
    "k_scale_not_float32_representable": (lambda kw: {"k_scale": 1e39}, ValueError, "k_scale"),
    "v_scale_rounds_to_zero_in_float32": (lambda kw: {"v_scale": 1e-46}, ValueError, "v_scale"),
    "softmax_scale_not_float32_representable": (
        lambda kw: {"softmax_scale": 1e39},
        ValueError,
        "softmax_scale",
    ),
    "softmax_scale_1e38_overflows_with_k_scale": (
        lambda kw: {"softmax_scale": 1e38},
        ValueError,
        "softmax_scale \\* k_scale",
    ),
    "score_scale_product_overflow": (
        lambda kw: {"softmax_scale": 1e30, "k_scale": 1e10},
        ValueError,
        "softmax_scale \\* k_scale",
    ),
    "score_scale_product_overflow_per_head_tensor": (
        lambda kw: {"k_scale": torch.tensor([1.0, 1e37])},
        ValueError,
        "k_scale = 1e\\+37",
    ),
    "score_scale_product_underflow": (
        lambda kw: {"softmax_scale": 1e-30, "k_scale": 1e-20},
        ValueError,
        "softmax_scale \\* k_scale",
    ),
    "softmax_scale_negative": (lambda kw: {"softmax_scale": -0.1}, ValueError, "softmax_scale"),
    "max_seqlen_k_too_small": (lambda kw: {"max_seqlen_k": 5}, ValueError, "max_seqlen_k"),
    "max_seqlen_q_float": (lambda kw: {"max_seqlen_q": 3.0}, TypeError, "max_seqlen_q"),
    "out_wrong_dtype": (
        lambda kw: {"out": torch.empty_like(kw["query"], dtype=torch.float16)},
        TypeError,
        "out",
    ),
    "out_wrong_shape": (lambda kw: {"out": torch.empty_like(kw["query"])[:1]}, ValueError, "out"),
    "seq_lens_meta_device": (
        lambda kw: {"seq_lens": kw["seq_lens"].to("meta")},
        ValueError,
        "seq_lens",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_input_is_rejected_with_named_argument(name):
    mutate, error, argument = BAD_CASES[name]
    _, kwargs = base()
    kwargs.update(mutate(kwargs))
    with pytest.raises(error, match=argument):
        call(**kwargs)


def test_valid_base_case_passes():
    _, kwargs = base()
    out = call(**kwargs)
    assert torch.isfinite(out.float()).all()


def test_unknown_backend_is_rejected():
    _, kwargs = base()
    with pytest.raises(ValueError, match="backend"):
        fna.paged_attention(
            *[kwargs.pop(n) for n in ("query", "key_cache", "value_cache")],
            *[kwargs.pop(n) for n in ("block_table", "cu_seqlens_q", "seq_lens")],
            **kwargs,
            backend="flash",
        )


def test_kv_len_zero_with_queries_is_rejected():
    _, kwargs = base()
    kwargs["seq_lens"] = i32([0, 20])
    with pytest.raises(ValueError, match="q_len"):
        call(**kwargs)


WRITE_CASES = {
    "slot_mapping_int32": (
        lambda kw: {"slot_mapping": kw["slot_mapping"].int()},
        TypeError,
        "slot_mapping",
    ),
    "slot_mapping_length": (
        lambda kw: {"slot_mapping": kw["slot_mapping"][:-1]},
        ValueError,
        "slot_mapping",
    ),
    "slot_mapping_out_of_range": (
        lambda kw: {"slot_mapping": kw["slot_mapping"] + 10_000},
        ValueError,
        "slot_mapping",
    ),
    "key_fp8": (lambda kw: {"key": kw["key"].to(torch.float8_e4m3fn)}, TypeError, "key"),
    "key_fp32": (lambda kw: {"key": kw["key"].float()}, TypeError, "key must"),
    "value_fp32": (lambda kw: {"value": kw["value"].float()}, TypeError, "value must"),
    "k_scale_not_float32_representable": (lambda kw: {"k_scale": 1e39}, ValueError, "k_scale"),
    "value_shape": (lambda kw: {"value": kw["value"][:, :1]}, ValueError, "value"),
    "key_heads_vs_cache": (
        lambda kw: {"key": kw["key"][:, :1], "value": kw["value"][:, :1]},
        ValueError,
        "key_cache",
    ),
    "k_scale_length": (lambda kw: {"k_scale": torch.ones(5)}, ValueError, "k_scale"),
}


@pytest.mark.parametrize("name", sorted(WRITE_CASES))
def test_bad_cache_write_is_rejected(name):
    case, _ = base()
    kwargs = dict(
        key=torch.randn(4, 2, 64, dtype=torch.bfloat16),
        value=torch.randn(4, 2, 64, dtype=torch.bfloat16),
        key_cache=case.key_cache, value_cache=case.value_cache,
        slot_mapping=torch.tensor([0, 1, -1, 3]), k_scale=None,
    )  # fmt: skip
    mutate, error, argument = WRITE_CASES[name]
    kwargs.update(mutate(kwargs))
    with pytest.raises(error, match=argument):
        fna.reshape_and_cache(**kwargs)


@pytest.mark.parametrize("name", ["key", "value"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_compute_kv_scales_refuses_non_finite_input(name, bad):
    tensors = {n: torch.randn(6, 3, 64, dtype=torch.bfloat16) for n in ("key", "value")}
    tensors[name][2, 1, 5] = bad
    with pytest.raises(ValueError, match=rf"{name} must be finite.*KV heads \[1\]"):
        fna.compute_kv_scales(tensors["key"], tensors["value"])


def test_int32_causal_and_padded_rows_are_valid():
    _, kwargs = base()
    kwargs["causal"] = i32([1, 0])
    kwargs["query"] = torch.cat([kwargs["query"], kwargs["query"][:2]])
    out = call(**kwargs, validate=True)
    assert torch.isfinite(out.float()).all() and (out[5:] == 0).all()
