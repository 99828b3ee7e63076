"""Small launches shared by the smoke and sanitizer jobs: random problems that reach the
kernels' boundaries, run on one backend and compared with the reference."""

from __future__ import annotations

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.synthetic import make_case, relative_error

from .backends import backend_request

# SPEC §7: relative error against the reference on the same cache (bf16 query).
TOLERANCE = 1e-2
# Partial last pages, an empty query, rows past q_len in a tile, keys past kv_len in a key
# tile, both masks in one batch; head_dim 128 (every family's).
CASE = dict(q_lens=[1, 8, 0, 5], kv_lens=[37, 700, 5, 130], causal=[True, False, True, False],
            num_q_heads=16, num_kv_heads=4, head_dim=128, padded_rows=3)  # fmt: skip


def case(seed: int = 0):
    """The random case on the GPU (its cache written by the auto-chosen cache writer)."""
    return make_case(**CASE, device="cuda", seed=seed)


def attention(name: str, problem_case, **options) -> torch.Tensor:
    """One-shot ``paged_attention`` on backend ``name`` into a NaN-filled output."""
    out = torch.full_like(problem_case.query, float("nan"))
    fna.paged_attention(
        *problem_case.args(), **problem_case.kwargs(), **options, out=out,
        backend=backend_request(name)[0],
    )  # fmt: skip
    return out


def error_against_reference(name: str, problem_case, out: torch.Tensor, **options) -> float:
    """``out``'s relative error against the reference, its padding rows past the last
    sequence included (they must be zeros)."""
    expected = attention("reference", problem_case, **options)
    return relative_error(out, expected)
