"""Accuracy study: BF16 query over the FP8 cache (ours) vs the FP8-query route, against float64.

FA3 (SM90) and FA4 (SM100) run attention over an FP8 cache by quantising Q to e4m3 as well and
feeding P to the second matrix product in e4m3. That route is emulated here on the same cache:
Q scaled per (sequence, KV head) by its amax and rounded to e4m3 (the granularity of FA3's
``q_descale``); scores in float32; an online softmax over 128-key tiles, P = exp(S - running
max) rounded to e4m3 for the PV product, the row sum taken in float32 before rounding. It leaves
out the FP8 tensor cores' reduced-precision accumulation (vllm#23813), which only adds error.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fp8_noncausal_attn.scales import finite_max
from fp8_noncausal_attn.synthetic import relative_error

from .inputs import Case, make_case, sequence_kv
from .oracle import attention_oracle, key_mask
from .peers import Adapter, failure_reason
from .shapes import Shape, dry_run, quick

E4M3 = torch.float8_e4m3fn
E4M3_MAX = finite_max(torch.float8_e4m3fn)
# Keys per tile of the emulated kernel's online softmax (the order of FA3's FP8 key tile).
KEY_TILE = 128

ACCURACY_KV_LENS = {
    "dry-run": (40, 300),
    "quick": (1024, 8192, 32768, 131072),
    "full": (1024, 4096, 16384, 32768, 65536, 131072),
}


def accuracy_shapes(preset: str) -> list[Shape]:
    """One drafter sequence per kv_len of the preset, with the heads, head_dim, q_len and query
    dtype of the acceptance shape (of the dry run's first shape on CPU), bidirectional, FP8."""
    like = dry_run()[0] if preset == "dry-run" else quick()[0]
    base = replace(like, batch=1, causal=False, kv_dtype="fp8_e4m3")
    return [replace(base, kv_len=kv_len) for kv_len in ACCURACY_KV_LENS[preset]]


def fp8_query_route(case: Case) -> torch.Tensor:
    """The FP8-query route emulated on the case's FP8 cache: [num_tokens, num_q_heads, head_dim]
    float32 (see the module docstring)."""
    shape = case.shape
    group = shape.num_q_heads // shape.num_kv_heads
    heads = shape.num_kv_heads
    device = case.query.device
    ones = torch.ones(heads, device=device)
    out = torch.empty(
        (shape.num_tokens, shape.num_q_heads, shape.head_dim), dtype=torch.float32, device=device
    )
    mask = key_mask(case, 0, shape.q_len)
    for seq in range(shape.batch):
        pages = case.block_table[seq]
        key = sequence_kv(case.key_cache, ones, pages, shape.kv_len)
        value = sequence_kv(case.value_cache, ones, pages, shape.kv_len)
        rows = slice(seq * shape.q_len, (seq + 1) * shape.q_len)
        q = case.query[rows].float().view(shape.q_len, heads, group, shape.head_dim)
        q_scale = q.abs().amax(dim=(0, 2, 3)).clamp_min(1e-12) / E4M3_MAX
        q8 = (q / q_scale[None, :, None, None]).to(E4M3).float()
        score_scale = (q_scale * case.k_scale)[:, None, None, None] * case.softmax_scale
        row_max = torch.full((heads, group, shape.q_len), float("-inf"), device=device)
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros((heads, group, shape.q_len, shape.head_dim), device=device)
        for first in range(0, shape.kv_len, KEY_TILE):
            tile = slice(first, first + KEY_TILE)
            scores = torch.einsum("qhgd,khd->hgqk", q8, key[tile]) * score_scale
            if mask is not None:
                scores.masked_fill_(~mask[:, tile], float("-inf"))
            # Online softmax as the kernel runs it: P relative to the running max, in e4m3.
            new_max = torch.maximum(row_max, scores.amax(dim=-1))
            rescale = torch.exp(row_max - new_max)
            probs = torch.exp(scores - new_max[..., None])
            row_sum = row_sum * rescale + probs.sum(dim=-1)
            acc = acc * rescale[..., None] + torch.einsum(
                "hgqk,khd->hgqd", probs.to(E4M3).float(), value[tile]
            )
            row_max = new_max
        result = acc / row_sum[..., None] * case.v_scale[:, None, None, None]
        out[rows] = result.permute(2, 0, 1, 3).reshape(shape.q_len, shape.num_q_heads, -1)
    return out


def run_accuracy(shapes: list[Shape], ours: list[Adapter], device: torch.device) -> list[dict]:
    """Relative errors against float64 on the same FP8 cache, one entry per shape and route."""
    entries = []
    for shape in shapes:
        case = make_case(shape, device, seed=shape.kv_len)
        exact = attention_oracle(case, torch.float64)
        entries.append(
            {
                **shape.fields(),
                "route": "fp8_query_emulated",
                "backend": "torch emulation",
                "rel_err": relative_error(fp8_query_route(case), exact),
            }
        )
        for adapter in ours:
            entry = {
                **shape.fields(),
                "route": f"{shape.query_dtype}_query",
                "backend": adapter.name,
            }
            try:
                prepared = adapter.prepare(case)
                prepared.run()
                entry["rel_err"] = relative_error(prepared.result(), exact)
            except Exception as error:  # one failing backend must not end the study
                entry.update(rel_err=None, error=failure_reason(error))
            entries.append(entry)
        del case, exact
    return entries
