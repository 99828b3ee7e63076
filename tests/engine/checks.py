"""What several engine-tier test modules share: float64 attention, pairing two runs' records
request by request, the drafts threshold and how the reference rounds its output."""

from __future__ import annotations

import importlib.util

import torch

from .scenarios import ROOT

# Drafts equal to the reference's: random drafter logits are flat, so a near-tie may flip one.
# Only a gross error moves them (a causal reference: 90/96 and 154/192 equal); FP8 rounding
# alone does not.
DRAFTS_EQUAL = 0.97


# vLLM's CPU kernel library for AVX512-BF16 hosts rounds float32 to bf16 to nearest; the ones
# for AVX-512 and AVX2 hosts (_C_AVX512, _C_AVX2) truncate, which doubles the reference's
# output rounding: measured on an AVX-512 host without BF16 (drafter e4m3, one layer), the
# reference vs float64 on the same cache 3.3e-3, the backend 1.7e-3.
ROUNDS_TO_NEAREST = "_C"


def reference_rounds_to_nearest(reference_run) -> bool:
    """Whether the vLLM kernels that ran the reference (its forward records say which) round
    their bf16 output to nearest, as the backend does."""
    kernels = {r["vllm_kernels"] for r in reference_run.kind("forward") if "vllm_kernels" in r}
    assert len(kernels) == 1 and "" not in kernels, kernels
    return kernels == {ROUNDS_TO_NEAREST}


def per_request(records: list[dict], field: str) -> dict[int, torch.Tensor]:
    """Each request's rows of ``field`` per engine step, keyed by its sequence length (which
    names one request and step: see scenarios.DRAFTER_PROMPTS), whatever the batching."""
    rows = {}
    for record in records:
        starts, seq_lens = record["key"]
        for i, seq_len in enumerate(seq_lens):
            if field == "drafts":  # one row of drafts per request
                rows.setdefault(seq_len, record[field][i])
            else:
                rows.setdefault(seq_len, record[field][starts[i] : starts[i + 1]])
    return rows


def matched(backend: list[dict], reference: list[dict], field: str):
    ours, theirs = per_request(backend, field), per_request(reference, field)
    common = sorted(ours.keys() & theirs.keys())
    # Steps after a draft was accepted in one run only are not in both.
    assert len(common) >= len(ours) // 2, "the runs diverged: too few steps in common"
    return [(ours[n], theirs[n]) for n in common]


def bf16_tolerance() -> float:
    """SPEC §7's bf16 tolerance, from the main suite's helpers (one place)."""
    path = ROOT / "tests" / "helpers" / "__init__.py"
    spec = importlib.util.spec_from_file_location("main_suite_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOLERANCE[torch.bfloat16]


def attention(query, keys, values, scale, causal_from: int | None) -> torch.Tensor:
    """float64 attention of query [q, h, d] over keys/values [n, kv_h, d] (GQA); causal_from:
    the position of the first query row (a causal mask), or None (bidirectional)."""
    group = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).double()
    v = values.repeat_interleave(group, 1).double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if causal_from is not None:
        rows = torch.arange(query.shape[0])[:, None] + causal_from
        scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > rows, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
