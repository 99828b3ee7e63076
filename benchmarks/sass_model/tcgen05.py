"""The tcgen05 family (dsl/tcgen05, issue 10), role by role, from its AOT build directory.

``python -m dsl.build --out DIR`` keeps each variant's cubin under ``DIR/<arch>/<variant>/`` and
lists them in ``DIR/build.json``. The warp roles and tile sizes come from the family's own
compile-time configuration (``dsl/tcgen05/traits.py`` and ``layouts.py``, plain Python):
softmax and converter warpgroups, one MMA warp per GEMM, 128-key tiles, 128-byte items.
tcgen05 MMA shapes live in instruction descriptors, not in SASS, so the tensor work is the
tile's: 2 x rows x head_dim multiply-accumulates per key (rows = the variant's N).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from . import hardware, occupancy, pipes
from .cubins import read_cubin
from .model import bound
from .roles import Role, instr_per_kv_byte, role_counts
from .rows import ALL_SHAPES, Shape, ShapeSet, gpu_for

_NAME = re.compile(r"tcgen05_d(\d+)_n(\d+)_p(\d+)_(bf16|f16)_(e4m3|e5m2)")
_Q = {"bf16": "bfloat16", "f16": "float16"}
_KV = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def family_roles(head_dim: int) -> tuple[tuple[Role, ...], int]:
    """(roles, threads per CTA) from the family's traits and layouts."""
    from dsl.tcgen05 import layouts, traits

    per_tile = 2 * layouts.KEY_TILE * head_dim  # K and V bytes of one key tile (FP8)
    item = layouts.KEY_TILE * layouts.ITEM_BYTES  # one staged K or V item
    roles = (
        Role("softmax", 4, "MUFU", 0, per_tile),
        Role("convert", 4, "LDGSTS", 0, item),
        Role("mma_kq", 1, "UTCHMMA", 0, per_tile),
        Role("mma_vp", 1, "UTCHMMA", 1, per_tile),
    )
    assert sum(r.warps for r in roles) * 32 == traits.THREADS, "roles must cover every warp"
    return roles, traits.THREADS


def tcgen05_rows(build_dir: str | Path, label: str = "", shapes: ShapeSet = ALL_SHAPES) -> list:
    """Rows for the drafter shapes a built variant serves (the smallest N >= R, else the
    largest N with ceil(R / N) CTAs streaming the same KV)."""
    from dsl.tcgen05.traits import Variant

    build = json.loads((Path(build_dir) / "build.json").read_text())
    variants = []
    for entry in build["variants"]:
        d, n, p, q, kv = _NAME.search(entry["variant"]).groups()
        cubin = Path(build_dir) / entry["cubins"][0]
        variants.append((entry["arch"], Variant(int(d), int(n), int(p), _Q[q], _KV[kv]), cubin))
    rows = []
    for shape in shapes:
        for arch in sorted({a for a, _, _ in variants}):
            gpu = gpu_for(arch)
            fits = [
                (v, c)
                for a, v, c in variants
                if a == arch
                and gpu is not None
                and (v.head_dim, v.q_dtype, v.kv_dtype)
                == (shape.head_dim, shape.q_dtype, shape.kv_dtype)
            ]
            if not fits:
                continue
            wide = [f for f in fits if f[0].rows >= shape.rows]
            variant, cubin = (
                min(wide, key=lambda f: f[0].rows) if wide else max(fits, key=lambda f: f[0].rows)
            )
            rows.append(_row(gpu, cubin, variant, shape, label))
    return rows


def _row(gpu: hardware.Gpu, cubin: Path, variant, shape: Shape, label: str) -> dict:
    (kernel,) = read_cubin(cubin)
    roles, threads = family_roles(variant.head_dim)
    ctas = -(-shape.rows // variant.rows)
    counts = role_counts(kernel.sass, roles)
    instr = instr_per_kv_byte(counts, roles, ctas)
    macs = {"UTCHMMA": float(variant.rows * ctas)}  # 2 N D MACs per key / 2 D bytes per key
    prediction = bound(gpu, instr, macs)
    smem = variant.smem_bytes
    name = f"{variant.name} ({', '.join(f'{r.name} {r.warps}w' for r in roles)})"
    return {
        "gpu": gpu.name,
        "arch": kernel.arch,
        "family": "tcgen05",
        "kernel": f"[{label}] {name}" if label else name,
        "head_dim": shape.head_dim,
        "q_dtype": shape.q_dtype,
        "kv_dtype": shape.kv_dtype,
        "rows_per_kv_head": shape.rows,
        "instr_per_kv_byte": {p: round(instr[p], 5) for p in pipes.PIPES},
        "regs": kernel.regs,
        "smem_bytes": smem,
        "ctas_per_sm": occupancy.ctas_per_sm(gpu.limits, threads, kernel.regs, smem),
        "binding": prediction.binding,
        "predicted_hbm_fraction": round(prediction.predicted_hbm_fraction, 4),
    }
