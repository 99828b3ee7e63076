"""Rows of sass-model.json: one per (GPU, cubin arch, family, kernel, shape).

Drafter shapes are memory-bound: their rows predict a fraction of HBM bandwidth. Non-causal
prefill shapes (q = kv = 4k-16k tokens) are compute-bound: their rows predict a fraction of the
dense 16-bit tensor peak (``model.tensor_peak_fraction``) from the same per-KV-byte counts.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import hardware, occupancy
from .cubins import Kernel, read_library
from .loop_counts import LoopCounts, count_main_loop
from .model import Prediction, predict, tensor_peak_fraction
from .tiles import DRAFTER_KV_LEN, GROUP, TileFacts, TileFactsError, cuda_tiles, normalise

HEAD_DIMS = (64, 128, 256)
QUERY_DTYPES = ("bfloat16", "float16")
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
ROWS_PER_KV_HEAD = (32, 64, 128)  # R = q_len x GQA group of the drafters
# Non-causal prefill, q = kv tokens, modelled for one configuration: head_dim 128,
# BF16 query, e4m3 cache, 32 query / 8 KV heads (the drafter's Qwen3-8B-style GQA 4), so
# R = 4 x tokens query rows per KV head.
PREFILL_LENS = (4096, 8192, 16384)
PREFILL_CONFIG = (128, "bfloat16", "float8_e4m3fn")


@dataclass(frozen=True)
class Shape:
    head_dim: int
    q_dtype: str
    cache_dtype: str
    rows: int
    # q = kv = this many tokens of a non-causal prefill (rows = GROUP x tokens); 0: a drafter.
    prefill_len: int = 0

    @property
    def kv_bytes(self) -> int:
        return 1 if self.cache_dtype.startswith("float8") else 2

    @property
    def kind(self) -> str:
        return "prefill" if self.prefill_len else "drafter"

    @property
    def flops_per_kv_byte(self) -> float:
        """Useful FLOPs per KV byte under a non-causal mask: each key's K and V (2 x head_dim
        elements) meet all R rows in both GEMMs (4 x R x head_dim FLOPs)."""
        return 2 * self.rows / self.kv_bytes


def prefill_shape(length: int) -> Shape:
    """The non-causal prefill of ``length`` query tokens over as many keys (PREFILL_CONFIG)."""
    return Shape(*PREFILL_CONFIG, rows=GROUP * length, prefill_len=length)


@dataclass(frozen=True)
class ShapeSet:
    """The drafter shapes, then the prefill shapes, to model (all by default; the CLI can
    narrow each axis). Prefill shapes come only when the axes hold PREFILL_CONFIG."""

    head_dims: tuple[int, ...] = HEAD_DIMS
    q_dtypes: tuple[str, ...] = QUERY_DTYPES
    cache_dtypes: tuple[str, ...] = CACHE_DTYPES
    rows: tuple[int, ...] = ROWS_PER_KV_HEAD
    prefill_lens: tuple[int, ...] = PREFILL_LENS

    def __iter__(self) -> Iterator[Shape]:
        for head_dim in self.head_dims:
            for q_dtype in self.q_dtypes:
                for cache_dtype in self.cache_dtypes:
                    for rows in self.rows:
                        yield Shape(head_dim, q_dtype, cache_dtype, rows)
        head_dim, q_dtype, cache_dtype = PREFILL_CONFIG
        if (
            head_dim in self.head_dims
            and q_dtype in self.q_dtypes
            and cache_dtype in self.cache_dtypes
        ):
            for length in self.prefill_lens:
                yield prefill_shape(length)


ALL_SHAPES = ShapeSet()


def gpu_for(arch: str) -> hardware.Gpu | None:
    """The modelled GPU that loads cubins of ``arch`` (sm_90a -> H200, sm_100a/f -> B200)."""
    for gpu in hardware.GPUS:
        if arch.startswith(gpu.arch_prefix) and arch[len(gpu.arch_prefix) :] in ("", "a", "f"):
            return gpu
    return None


def prediction_fields(gpu: hardware.Gpu, prediction: Prediction, shape: Shape) -> dict:
    """The row's yardstick: a drafter's PREDICTED fraction of HBM bandwidth, or a prefill's
    PREDICTED fraction of the dense 16-bit tensor peak (with its q and kv lengths)."""
    if shape.kind == "drafter":
        return {
            "binding": prediction.binding,
            "predicted_hbm_fraction": round(prediction.predicted_hbm_fraction, 4),
        }
    fraction, binding = tensor_peak_fraction(gpu, prediction, shape.flops_per_kv_byte)
    return {
        "q_len": shape.prefill_len,
        "kv_len": shape.prefill_len,
        "binding": binding,
        "predicted_tensor_fraction": round(fraction, 4),
    }


def make_row(
    gpu: hardware.Gpu, kernel: Kernel, facts: TileFacts, shape: Shape, label: str,
    counts: LoopCounts | None = None,
) -> dict:  # fmt: skip
    """One row of the JSON schema (values are PREDICTIONS)."""
    counts = counts or count_main_loop(kernel.sass, facts.key_groups)
    prediction = predict(gpu, counts, facts, shape.head_dim, shape.kv_bytes)
    # cuobjdump's static SHARED includes the 1 KB the system reserves per CTA on sm_80+.
    static = max(0, kernel.shared_static - gpu.limits.shared_reserved_per_cta)
    smem = facts.smem_bytes + static
    return {
        "kind": shape.kind,
        "gpu": gpu.name,
        "arch": kernel.arch,
        "family": facts.family,
        "kernel": f"[{label}] {kernel.name}" if label else kernel.name,
        "head_dim": shape.head_dim,
        "q_dtype": shape.q_dtype,
        "cache_dtype": shape.cache_dtype,
        "rows_per_kv_head": shape.rows,
        "instr_per_kv_byte": {p: round(v, 5) for p, v in prediction.instr_per_kv_byte.items()},
        "regs": kernel.regs,
        "smem_bytes": smem,
        "ctas_per_sm": occupancy.ctas_per_sm(gpu.limits, facts.threads, kernel.regs, smem),
        **prediction_fields(gpu, prediction, shape),
    }


_LOADED: dict[str, Path] = {}


def load_extension(path: str | Path) -> ModuleType:
    """Imports a built ``_C`` from its file (for its exported plan); TileFactsError if it
    cannot be imported (its tile facts come from the build, so there is nothing to model).

    One process can hold one module named ``_C`` (a second file would silently give the first
    module back): model other builds in their own run and merge them with ``--include``."""
    path = Path(path).resolve()
    if _LOADED.setdefault("_C", path) != path:
        raise RuntimeError(f"a _C from {_LOADED['_C']} is loaded: model {path} in its own run")
    spec = importlib.util.spec_from_file_location("_C", str(path))
    if spec is None or spec.loader is None:
        raise TileFactsError(f"{path} is not an importable extension module")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise TileFactsError(f"cannot import {path} to read its _C.plan: {error}") from error
    return module


def cuda_rows(path: str | Path, label: str = "", shapes: ShapeSet = ALL_SHAPES) -> list[dict]:
    """Rows for every shape x modelled GPU of the attention kernels in one build (tiles from
    the build's plan for that shape: a prefill's plan sees its q and kv lengths)."""
    kernels = read_library(path)
    ext = load_extension(path)
    rows = []
    cache: dict[tuple[str, int], LoopCounts] = {}
    for shape in shapes:
        facts = cuda_tiles(
            ext, shape.head_dim, shape.q_dtype, shape.cache_dtype, shape.rows,
            kv_len=shape.prefill_len or DRAFTER_KV_LEN,
        )  # fmt: skip
        wanted = normalise(facts.kernel)
        for kernel in kernels:
            gpu = gpu_for(kernel.arch)
            if gpu is None or wanted not in normalise(kernel.name):
                continue
            key = (kernel.arch + kernel.symbol, facts.key_groups)
            if key not in cache:
                cache[key] = count_main_loop(kernel.sass, facts.key_groups)
            rows.append(make_row(gpu, kernel, facts, shape, label, cache[key]))
    return rows


# Triton targets modelled: compute capability -> the GPU whose cubins it produces.
TRITON_TARGETS = {90: hardware.H200, 100: hardware.B200}


def triton_facts(launch, shape: Shape, compiled) -> TileFacts:
    """Tile facts of a captured Triton launch: tiles and warps from the launcher's plan
    (``triton_attention.launch_plan``, passed as the launch's constexprs and options)."""
    block_m, block_n = launch.kwargs["BLOCK_M"], launch.kwargs["BLOCK_N"]
    return TileFacts(
        family="triton",
        kernel=launch.fn.__name__,
        rows_per_cta=block_m,
        ctas_per_kv_head=-(-shape.rows // block_m),
        keys_per_iter=block_n,
        threads=32 * launch.kwargs["num_warps"],
        smem_bytes=compiled.compiled.metadata.shared,
        key_groups=1,
        source="triton_attention.launch_plan (captured launch)",
        cta_macs_per_iter=2 * block_m * block_n * shape.head_dim,
    )


def triton_rows(
    label: str = "",
    shapes: ShapeSet = ALL_SHAPES,
    window: tuple[int, int] = (-1, -1),
    sinks: bool = False,
) -> list[dict]:
    """Rows of the Triton drafter kernel, compiled as launched for sm_90 and sm_100; with a
    ``window`` / ``sinks`` the launch is of that variant (the WINDOW / SINKS constexprs change
    the compiled kernel; label its rows apart, e.g. ``label="window"``)."""
    import torch

    from fp8_noncausal_attn.backends.triton import attention as triton_attention
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    from .triton_kernels import captured_launches, compile_launch

    rows = []
    for shape in shapes:
        q_len = shape.rows // GROUP
        case = make_case(
            [q_len], [shape.prefill_len or q_len + 512], num_q_heads=8 * GROUP, num_kv_heads=8,
            head_dim=shape.head_dim, cache_dtype=getattr(torch, shape.cache_dtype),
            query_dtype=getattr(torch, shape.q_dtype), scales="none",
        )  # fmt: skip
        problem = validate_attention(
            *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False,
            window=window, sinks=torch.zeros(8 * GROUP) if sinks else None,
        )  # fmt: skip
        with captured_launches(triton_attention, "_paged_attention_kernel") as launches:
            # The launch plan itself: plan() refuses CPU tensors outside the interpreter.
            plan = triton_attention.launch_plan(problem.batch, 1)
            triton_attention.launch(problem, plan, torch.empty_like(problem.query))
        (launch,) = launches
        for cc, gpu in TRITON_TARGETS.items():
            compiled = compile_launch(launch, cc)
            facts = triton_facts(launch, shape, compiled)
            rows.append(make_row(gpu, compiled.kernel(), facts, shape, label))
    return rows
