"""The randomised test matrix shared by every backend's tests (issue: foundation, Tests)."""

import random

import torch

from fp8_noncausal_attn.synthetic import PagedCase, make_case

CACHE_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float16]
QUERY_DTYPES = [torch.bfloat16, torch.float16]

AXES = {
    # "mixed" per-sequence flags as bool, and as int32 the way vLLM 0.33 passes them.
    "causal": [False, True, "mixed", "mixed_int32"],
    # MHA, GQA 4, GQA 6, MQA
    "heads": [(4, 4), (8, 2), (12, 2), (8, 1)],
    "head_dim": [64, 128, 256],
    "block_size": [16, 32, 64],
    "cache_dtype": CACHE_DTYPES,
    "query_dtype": QUERY_DTYPES,
    "scales": ["per_head", "scalar"],
    "layout": [None, "vllm", "kv_first", "block_first"],
    # (q_lens, kv_lens): empty sequences, single-token decode, drafter blocks of 8 and 16,
    # and q_len == kv_len (a whole bidirectional block with no context).
    "lengths": [
        ([1, 8, 0], [37, 100, 5]),
        ([16], [16]),
        ([8, 8], [8, 150]),
        ([3, 16], [70, 16]),
    ],
    # Every index tensor as a strided view (vLLM slices persistent buffers), and query rows past
    # the last sequence (vLLM pads under CUDA graphs; they must come back as zeros).
    "index_step": [1, 2],
    "padded_rows": [0, 3],
}


def sampled_matrix(num_cases: int, seed: int, axes: dict = AXES) -> list[dict]:
    """``num_cases`` cases in which every value of every axis appears, paired at random."""
    rng = random.Random(seed)
    columns = {}
    for name, values in axes.items():
        column = [values[i % len(values)] for i in range(num_cases)]
        rng.shuffle(column)
        columns[name] = column
    return [{name: columns[name][i] for name in axes} for i in range(num_cases)]


def build_case(params: dict, seed: int, device: str) -> PagedCase:
    """The random problem for one row of the matrix."""
    q_lens, kv_lens = params["lengths"]
    causal = params["causal"]
    causal_dtype = torch.int32 if causal == "mixed_int32" else torch.bool
    if causal in ("mixed", "mixed_int32"):
        causal = [i % 2 == 0 for i in range(len(q_lens))]
    num_q_heads, num_kv_heads = params["heads"]
    return make_case(
        q_lens, kv_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=params["head_dim"], block_size=params["block_size"],
        cache_dtype=params["cache_dtype"], query_dtype=params["query_dtype"], causal=causal,
        causal_dtype=causal_dtype, scales=params["scales"], layout=params["layout"],
        index_step=params["index_step"], padded_rows=params["padded_rows"], device=device,
        seed=seed,
    )  # fmt: skip
