"""Accuracy study: BF16 query over the FP8 cache (ours) vs the FP8-query route, against float64.

FA3 (SM90) and FA4 (SM100) run attention over an FP8 cache by quantising Q to e4m3 as well and
feeding P to the second matrix product in e4m3. That route is emulated here on the same cache,
with Q scaled one of two ways before it is rounded to e4m3 (:data:`FP8_QUERY_ROUTES`):

- ``fp8_query_static``: as vLLM's attention layer (0.33 and 0.34) does before FLASH_ATTN runs
  it, and before vLLM 0.34's FLASHINFER_TS runs an FP8 cache (its query in the cache's dtype):
  ``QuantFP8`` with the layer's static per-tensor ``_q_scale``, 1.0 unless the checkpoint has
  one; values saturate at the e4m3 finite max. FLASHINFER_TS's own kernel (PrimTS, SM100) is not
  emulated beyond that query rounding;
- ``fp8_query_amax``: per (sequence, KV head) by its amax, the finest granularity of FA3's
  ``q_descale`` (the best case of the route).

Then scores in float32; an online softmax over 128-key tiles, P = exp(S - running max) rounded
to e4m3 for the PV product, the row sum taken in float32 before rounding. It leaves out the FP8
tensor cores' reduced-precision accumulation (vllm#23813), which only adds error.

A second study (``--study cache_formats``) asks which cache a drafter should use: on K/V with
a drafter's magnitudes (:func:`drafter_kv`), the error against float64 on the *unquantised* K/V
of each cache format a drafter can be given, read by the reference backend, and of the FP8-query
route over the FP8 caches (:data:`CACHE_FORMATS`).

Run on its own (a CPU is enough: the Triton kernels then run in Triton's interpreter)::

    python -m benchmarks.accuracy [--preset quick] [--study all] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from dataclasses import replace
from pathlib import Path

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.layouts import split_per_token_head_cache
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
# Why Triton's error on a CPU is about twice the reference's: checked by comparing |out| with
# |float64| element by element (the interpreter's outputs are almost all smaller).
INTERPRETER_NOTE = (
    "On a CPU the Triton kernels run in Triton's interpreter, whose float32 -> bfloat16 output "
    "conversion truncates instead of rounding to nearest: about twice the reference's error."
)
# The FP8-query routes by their query scale: a static per-tensor value, or None for the
# per-(sequence, KV head) amax (see the module docstring).
FP8_QUERY_ROUTES: dict[str, float | None] = {"fp8_query_static": 1.0, "fp8_query_amax": None}

ACCURACY_KV_LENS = {
    "dry-run": (40, 300),
    "quick": (1024, 8192, 32768, 131072),
    "full": (1024, 4096, 16384, 32768, 65536, 131072),
}


def accuracy_shapes(preset: str) -> list[Shape]:
    """One drafter sequence per kv_len of the preset, with the heads, head_dim, q_len and query
    dtype of the acceptance shape (of the dry run's first shape on CPU), bidirectional, FP8."""
    like = dry_run()[0] if preset == "dry-run" else quick()[0]
    base = replace(like, batch=1, causal=False, kv_cache_dtype="fp8_e4m3")
    return [replace(base, kv_len=kv_len) for kv_len in ACCURACY_KV_LENS[preset]]


def fp8_query_route(case: Case, q_scale: float | None = None) -> torch.Tensor:
    """The FP8-query route emulated on the case's FP8 cache: [num_tokens, num_q_heads, head_dim]
    float32. ``q_scale``: the static per-tensor query scale, or None to scale Q per (sequence,
    KV head) by its amax (see the module docstring)."""
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
        if q_scale is None:
            head_scale = q.abs().amax(dim=(0, 2, 3)).clamp_min(1e-12) / E4M3_MAX
        else:
            head_scale = torch.full((heads,), q_scale, device=device)
        scaled = q / head_scale[None, :, None, None]
        q8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
        score_scale = (head_scale * case.k_scale)[:, None, None, None] * case.softmax_scale
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
        for route, q_scale in FP8_QUERY_ROUTES.items():
            entries.append(
                {
                    **shape.fields(),
                    "route": route,
                    "backend": "torch emulation",
                    "rel_err": relative_error(fp8_query_route(case, q_scale), exact),
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


def best_fp8_query_errors(entries: list[dict]) -> dict[int, float]:
    """kv_len -> the lower relative error of the FP8-query routes (the yardstick ours is set
    against: the route at its best)."""
    best: dict[int, float] = {}
    for entry in entries:
        if entry["route"] in FP8_QUERY_ROUTES:
            kv_len = entry["kv_len"]
            best[kv_len] = min(best.get(kv_len, float("inf")), entry["rel_err"])
    return best


def write_markdown(path: Path, payload: dict) -> None:
    """One row per kv_len: each route's relative error, and the worst of ours over the best
    FP8-query route."""
    entries = payload["accuracy"]
    columns = list(FP8_QUERY_ROUTES) + sorted(
        {e["backend"] for e in entries if e["route"] not in FP8_QUERY_ROUTES}
    )
    best = best_fp8_query_errors(entries)
    shape = {k: v for k, v in entries[0].items() if k not in ("kv_len", "route", "backend")}
    lines = [
        f"# Accuracy: relative error against float64 on the same FP8 cache ({payload['date']})",
        "",
        f"Command: `{payload['command']}`. Machine: {payload['machine']}. {payload['note']}",
        "",
        f"Shape: {shape['num_q_heads']}/{shape['num_kv_heads']} heads x head_dim "
        f"{shape['head_dim']}, one sequence of q_len {shape['q_len']}, "
        f"{'causal' if shape['causal'] else 'bidirectional'}, {shape['kv_cache_dtype']} cache with "
        f"per-KV-head scales, {shape['query_dtype']} query. FP8-query routes emulated in torch "
        "(benchmarks/accuracy.py); ours through `paged_attention(backend=...)`.",
        "",
        "| kv_len | " + " | ".join(columns) + " | worst of ours / best FP8 route |",
        "|---|" + "---|" * (len(columns) + 1),
    ]
    for kv_len in sorted(best):
        errors = {
            (e["route"] if e["route"] in FP8_QUERY_ROUTES else e["backend"]): e["rel_err"]
            for e in entries
            if e["kv_len"] == kv_len
        }
        ours = [errors[c] for c in columns[len(FP8_QUERY_ROUTES) :] if errors.get(c) is not None]
        ratio = f"{max(ours) / best[kv_len]:.3f}" if ours else "-"
        cells = " | ".join("-" if errors.get(c) is None else f"{errors[c]:.2e}" for c in columns)
        lines.append(f"| {kv_len} | {cells} | {ratio} |")
    path.write_text("\n".join(lines) + "\n")


# The drafter's K/V (DFlash / DSpark drafters normalise q and k per head before RoPE; their
# values are not normalised). Keys: per-KV-head std spread geometrically over KEY_HEAD_STD, a
# few RoPE channels per head carrying OUTLIER_CHANNEL_GAIN times more (elements of order 1-10);
# values: per-head std over VALUE_HEAD_STD (elements of order 0.01-0.1). One token in
# OUTLIER_TOKEN_EVERY has keys OUTLIER_TOKEN_GAIN times and values VALUE_OUTLIER_GAIN times larger
# (a sink-like token). The query: unit std with the keys' outlier channels.
KEY_HEAD_STD = (1.0, 3.0)
VALUE_HEAD_STD = (0.01, 0.1)
OUTLIER_CHANNELS = 4
OUTLIER_CHANNEL_GAIN = 3.0
OUTLIER_TOKEN_EVERY = 64
OUTLIER_TOKEN_GAIN = 3.0
VALUE_OUTLIER_GAIN = 10.0

# Cache formats a drafter can be given, by column: (cache dtype, None for the query's own
# 16-bit dtype, which holds the K/V exactly; how its scales are set). "one":
# scale 1.0 (an FP8 drafter without checkpoint scales today); "per_head": amax / max per KV head
# over the sequence (compute_kv_scales: the best a checkpoint's per-head scales can do);
# "per_token_head": computed per token and head by the write (vLLM's *_per_token_head).
CACHE_FORMATS: dict[str, tuple[torch.dtype | None, str]] = {
    "unquantised": (None, "one"),
    "fp8_scale_1": (E4M3, "one"),
    "fp8_per_head": (E4M3, "per_head"),
    "fp8_per_token_head": (E4M3, "per_token_head"),
    "int8_per_token_head": (torch.int8, "per_token_head"),
}
# The FP8-query route (static q_scale 1.0, as vLLM quantises Q) over an FP8 format above.
FP8_QUERY_OVER = {"fp8_query_scale_1": "fp8_scale_1", "fp8_query_per_head": "fp8_per_head"}


def drafter_kv(
    shape: Shape, generator: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, key, value) with a drafter's magnitudes (see :data:`KEY_HEAD_STD`):
    query ``[num_tokens, num_q_heads, head_dim]``, key and value ``[kv_len, num_kv_heads,
    head_dim]``, all in ``shape.query_dtype``."""
    heads, dim, kv_len = shape.num_kv_heads, shape.head_dim, shape.kv_len

    def spread(low_high: tuple[float, float]) -> torch.Tensor:
        low, high = (math.log10(x) for x in low_high)
        order = torch.randperm(heads, generator=generator, device=device)
        return torch.logspace(low, high, heads, device=device)[order]

    channel_gain = torch.ones(heads, dim, device=device)
    for head in range(heads):
        picked = torch.randperm(dim, generator=generator, device=device)[:OUTLIER_CHANNELS]
        channel_gain[head, picked] = OUTLIER_CHANNEL_GAIN
    token_gain = torch.ones(kv_len, 1, 1, device=device)
    token_gain[::OUTLIER_TOKEN_EVERY] = OUTLIER_TOKEN_GAIN
    size = (kv_len, heads, dim)
    key = torch.randn(size, generator=generator, device=device)
    key *= spread(KEY_HEAD_STD)[:, None] * channel_gain * token_gain
    value = torch.randn(size, generator=generator, device=device) * spread(VALUE_HEAD_STD)[:, None]
    value *= torch.where(token_gain > 1, VALUE_OUTLIER_GAIN, 1.0)
    group = shape.num_q_heads // heads
    query = torch.randn(shape.num_tokens, heads, group, dim, generator=generator, device=device)
    query *= channel_gain[None, :, None, :]
    dtype = shape.torch_query_dtype
    return query.flatten(1, 2).to(dtype), key.to(dtype), value.to(dtype)


def write_format(case: Case, key: torch.Tensor, value: torch.Tensor, fmt: str) -> Case:
    """The case with ``key``/``value`` written (by ``reshape_and_cache``) into a cache of
    format ``fmt`` (a :data:`CACHE_FORMATS` key): per-token-head formats in vLLM's page layout,
    their scales ``[num_blocks, block_size, num_kv_heads]`` views of it."""
    dtype, scaling = CACHE_FORMATS[fmt]
    shape = case.shape
    dtype = shape.torch_query_dtype if dtype is None else dtype
    blocks, heads, dim = case.key_cache.shape[0], shape.num_kv_heads, shape.head_dim
    device = key.device
    if scaling == "per_token_head":
        page = torch.zeros(blocks, heads, shape.block_size, 2 * (dim + 4), dtype=torch.uint8,
                           device=device)  # fmt: skip
        key_cache, value_cache, k_scale, v_scale = split_per_token_head_cache(page, dtype)
    else:
        key_cache, value_cache = (
            torch.zeros(case.key_cache.shape, dtype=dtype, device=device) for _ in range(2)
        )
        if scaling == "per_head":
            k_scale, v_scale = fna.compute_kv_scales(key, value, fp8_dtype=dtype)
        else:
            k_scale = v_scale = torch.ones(heads, device=device)
    pages = case.block_table[0].long()
    positions = torch.arange(shape.kv_len, device=device)
    slots = pages[positions // shape.block_size] * shape.block_size + positions % shape.block_size
    fna.reshape_and_cache(key, value, key_cache, value_cache, slots, k_scale=k_scale,
                          v_scale=v_scale)  # fmt: skip
    return replace(case, key_cache=key_cache, value_cache=value_cache, k_scale=k_scale,
                   v_scale=v_scale)  # fmt: skip


def reference_attention(case: Case) -> torch.Tensor:
    """The reference backend over the case's cache (per-head or per-token-head scales)."""
    args = (case.query, case.key_cache, case.value_cache, case.block_table, case.cu_seqlens_q,
            case.seq_lens)  # fmt: skip
    return fna.paged_attention(*args, causal=case.shape.causal, k_scale=case.k_scale,
                               v_scale=case.v_scale, backend="reference")  # fmt: skip


def run_cache_formats(shapes: list[Shape]) -> list[dict]:
    """Relative error against float64 on the unquantised K/V, one entry per shape and column
    (:data:`CACHE_FORMATS`, then :data:`FP8_QUERY_OVER`). One sequence per shape."""
    entries = []
    for shape in shapes:
        shape = replace(shape, kv_cache_dtype="bfloat16")
        device = torch.device("cpu")
        base = make_case(shape, device, seed=shape.kv_len)
        generator = torch.Generator(device=device).manual_seed(shape.kv_len)
        query, key, value = drafter_kv(shape, generator, device)
        base = replace(base, query=query)
        written = {fmt: write_format(base, key, value, fmt) for fmt in CACHE_FORMATS}
        # The 16-bit cache holds the drafter's K/V exactly: float64 over it is the exact answer.
        exact = attention_oracle(written["unquantised"], torch.float64)
        errors = {fmt: relative_error(reference_attention(c), exact) for fmt, c in written.items()}
        for route, fmt in FP8_QUERY_OVER.items():
            errors[route] = relative_error(fp8_query_route(written[fmt], 1.0), exact)
        for column, error in errors.items():
            entries.append({**shape.fields(), "format": column, "rel_err": error})
        del written, exact
    return entries


def write_cache_formats_markdown(path: Path, payload: dict) -> None:
    """One row per kv_len, one column per cache format and FP8-query route."""
    entries = payload["cache_formats"]
    columns = list(CACHE_FORMATS) + list(FP8_QUERY_OVER)
    shape = entries[0]
    lines = [
        f"# Accuracy by cache format: relative error against float64 on the unquantised K/V "
        f"({payload['date']})",
        "",
        f"Command: `{payload['command']}`. Machine: {payload['machine']}.",
        "",
        f"Shape: {shape['num_q_heads']}/{shape['num_kv_heads']} heads x head_dim "
        f"{shape['head_dim']}, one sequence of q_len {shape['q_len']}, "
        f"{'causal' if shape['causal'] else 'bidirectional'}, {shape['query_dtype']} query and "
        "K/V. K/V with a drafter's magnitudes (benchmarks/accuracy.py, `drafter_kv`): keys of "
        f"std {KEY_HEAD_STD[0]:g}-{KEY_HEAD_STD[1]:g} per KV head with {OUTLIER_CHANNELS} "
        f"channels per head {OUTLIER_CHANNEL_GAIN:g}x larger, values of std "
        f"{VALUE_HEAD_STD[0]:g}-{VALUE_HEAD_STD[1]:g} per head, one token in "
        f"{OUTLIER_TOKEN_EVERY} with keys {OUTLIER_TOKEN_GAIN:g}x and values "
        f"{VALUE_OUTLIER_GAIN:g}x larger. Each cache written by the library's write and read by "
        "the reference backend: `unquantised` (the query's 16-bit dtype), `fp8_scale_1` (e4m3, "
        "scale 1.0: a drafter without checkpoint scales), `fp8_per_head` (e4m3, amax scales per "
        "KV head over the sequence), `fp8_per_token_head` / `int8_per_token_head` (vLLM's "
        "formats, one scale per token and KV head). `fp8_query_*`: the FP8-query route (static "
        "q_scale 1.0, as vLLM quantises Q for FLASH_ATTN) over the e4m3 cache with scale 1.0 / "
        "per-head scales.",
        "",
        "| kv_len | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for kv_len in sorted({e["kv_len"] for e in entries}):
        errors = {e["format"]: e["rel_err"] for e in entries if e["kv_len"] == kv_len}
        lines.append(f"| {kv_len} | " + " | ".join(f"{errors[c]:.2e}" for c in columns) + " |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy",
        description="BF16 query over the FP8 cache (ours) vs the FP8-query routes, against "
        "float64; runs on a CPU (Triton in its interpreter) or a GPU.",
    )
    parser.add_argument("--preset", choices=sorted(ACCURACY_KV_LENS), default="quick")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument(
        "--backends", help="comma-separated subset of ours: cuda, triton, reference"
    )
    parser.add_argument(
        "--study",
        choices=("all", "fp8_query", "cache_formats"),
        default="all",
        help="fp8_query: ours vs the FP8-query route on one FP8 cache; cache_formats: each cache "
        "format a drafter can use against float64 on the unquantised K/V",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # The Triton kernels are defined at import: the interpreter needs a fresh process.
        os.environ["TRITON_INTERPRET"] = "1"
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.accuracy", *sys.argv[1:]])
    from .peers import Ours, adapters

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wanted = args.backends.split(",") if args.backends else None
    ours = [a for a in adapters(device) if isinstance(a, Ours) and not a.unavailable(device)]
    ours = [a for a in ours if wanted is None or a.name in wanted]
    if device.type == "cuda":
        machine = torch.cuda.get_device_name(device)
    else:
        machine = f"CPU ({platform.machine()}, {os.cpu_count()} cores; no GPU)"
    common = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": "python -m benchmarks.accuracy " + " ".join(sys.argv[1:]),
        "machine": machine,
        "torch": torch.__version__,
        "preset": args.preset,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if args.study in ("all", "fp8_query"):
        payload = {
            **common,
            "accuracy": run_accuracy(accuracy_shapes(args.preset), ours, device),
            "note": INTERPRETER_NOTE if device.type == "cpu" else "",
        }
        stem = f"accuracy-{args.preset}-{device.type}"
        (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
        write_markdown(args.out / f"{stem}.md", payload)
        written.append(args.out / f"{stem}.md")
    if args.study in ("all", "cache_formats"):
        payload = {**common, "cache_formats": run_cache_formats(accuracy_shapes(args.preset))}
        stem = f"accuracy-cache-formats-{args.preset}-{device.type}"
        (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
        write_cache_formats_markdown(args.out / f"{stem}.md", payload)
        written.append(args.out / f"{stem}.md")
    for path in written:
        print(path.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
