"""The CUTLASS-DSL families (dsl/wgmma for sm_90a, dsl/tcgen05 for sm_100a), role by role.

``python -m dsl.build --out DIR`` (per family) keeps each variant's cubin under
``DIR/<arch>/<variant>/`` and lists them in ``DIR/build.json``. Warp roles and tile sizes come
from each family's own compile-time configuration (``dsl/<family>/traits.py``, ``layouts.py``;
plain Python): which warps run which loop, and how many KV bytes one iteration of that loop
covers. Tensor work is the tile's, 2 x rows x head_dim multiply-accumulates per key (rows = the
variant's query rows per CTA; tcgen05 shapes live in instruction descriptors, not in SASS).

The tcgen05 converter specialises an item's copies per run-time page size (variant.BLOCK_SHIFTS):
ptxas dispatches them by a jump table (``BRX`` through constant bank 2). The model follows the
specialisation of one page size (``PAGE_SIZE``, the drafters' 16; recorded in each row) and no
other: ``one_page_specialisation``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import hardware, occupancy, pipes
from .cfg import ControlFlowGraph
from .cubins import read_cubin
from .loop_counts import LoopCounts, _is_work, count_loop
from .model import bound
from .roles import Role, instr_per_kv_byte, role_counts, role_loop
from .rows import ALL_SHAPES, Shape, ShapeSet, gpu_for, prediction_fields
from .sass import parse
from .toolchain import run

# The page size (keys) the tcgen05 converter's copies are modelled for: the drafter default.
PAGE_SIZE = 16

# A name without _p<N>: the page size is a run-time argument (both families today).
_NAME = re.compile(r"(wgmma|tcgen05)_d(\d+)_[mn](\d+)(?:_p(\d+))?_(bf16|f16)_(e4m3|e5m2)")
_Q = {"bf16": "bfloat16", "f16": "float16"}
_KV = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


@dataclass(frozen=True)
class Built:
    """One built variant: its family, arch, cubin and the family's own Variant object."""

    family: str
    arch: str
    cubin: Path
    variant: Any  # dsl.<family>.traits.Variant

    @property
    def rows(self) -> int:
        return self.variant.rows


def _variant(family: str, head_dim: int, rows: int, page: int | None, q: str, kv: str):
    if family == "wgmma":
        from dsl.wgmma.layouts import ROWS_PER_WARPGROUP
        from dsl.wgmma.traits import Variant

        return Variant(head_dim, rows // ROWS_PER_WARPGROUP, q, kv)
    from dsl.tcgen05.traits import Variant

    return Variant(head_dim, rows, q, kv)


def family_roles(family: str, variant) -> tuple[tuple[Role, ...], int, str]:
    """(roles, threads per CTA, tensor opcode) of one variant, from the family's traits."""
    d = variant.head_dim
    if family == "wgmma":
        from dsl.wgmma.layouts import WARPGROUP

        consumers = variant.threads // WARPGROUP - 1
        roles = (
            # The producer warpgroup stages both items of one key tile (K and V, key_tile x
            # head_dim FP8 bytes each) per iteration of its loop.
            Role("producer", WARPGROUP // 32, "STS", 0, 2 * variant.key_tile * d),
            # Each consumer warpgroup: both GEMMs and the softmax of one key tile (K and V).
            Role("consumer", consumers * WARPGROUP // 32, "HGMMA", 0, 2 * variant.key_tile * d),
        )
        return roles, variant.threads, "HGMMA"
    from dsl.tcgen05 import layouts, traits

    per_tile = 2 * layouts.KEY_TILE * d  # K and V bytes of one key tile (FP8)
    # The converter's loop by its ldmatrix reads of the ring: its copy prologue is a loop of
    # cp.async (LDGSTS) too, ahead of it in code order.
    roles = (
        Role("softmax", 4, "MUFU", 0, per_tile),
        # One staged item: 128 keys x its head dims (head_dim 64: half of each 128-byte row).
        Role("convert", 4, "LDSM", 0, layouts.KEY_TILE * layouts.item_dims(d)),
        Role("mma_kq", 1, "UTCHMMA", 0, per_tile),
        Role("mma_vp", 1, "UTCHMMA", 1, per_tile),
    )
    return roles, traits.THREADS, "UTCHMMA"


def macs_per_kv_byte(family: str, variant) -> float:
    """Tensor multiply-accumulates per KV byte of one CTA: 2 x rows x head_dim per key over
    2 x head_dim FP8 bytes = rows, except where a tcgen05 GEMM runs wider than head_dim: BMM2's
    M is 128 head dims per slice (head_dim 64: O^T lanes 64..127 are computed, never written),
    BMM1's k the dims layouts.bmm1_k_blocks covers."""
    if family != "tcgen05":
        return float(variant.rows)
    from dsl.tcgen05 import layouts

    bmm1_k = variant.d_tiles * layouts.bmm1_k_blocks(variant.head_dim) * layouts.UMMA_K
    bmm2_m = variant.d_tiles * layouts.ITEM_BYTES
    return variant.rows * (bmm1_k + bmm2_m) / (2 * variant.head_dim)


_BRX = re.compile(r"(/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?)BRX\s[^;]*;")
_CONSTANT2 = re.compile(r"^\.nv\.constant2\.\S+\n((?:0x[0-9a-f]{8}\s*)+)", re.M)


def jump_table_words(cubin: str | Path) -> list[int]:
    """The 32-bit words of the cubin's constant bank 2 (``.nv.constant2.<kernel>``), where
    ptxas keeps its jump tables (absolute code offsets of the cases a ``BRX`` may take)."""
    words = []
    for table in _CONSTANT2.finditer(run("cuobjdump", "-elf", str(cubin))):
        words += [int(w, 16) for w in table.group(1).split()]
    return words


def _copies(counts: LoopCounts) -> tuple[int, int]:
    """(LDGSTS, SHFL) on one counted iteration's path."""
    ldgsts = sum(n for op, n in counts.opcodes.items() if op.split(".", 1)[0] == "LDGSTS")
    shfl = sum(n for op, n in counts.opcodes.items() if op.split(".", 1)[0] == "SHFL")
    return ldgsts, shfl


def one_page_specialisation(
    sass_text: str, role: Role, table: list[int], copies: int, shuffles: int
) -> str:
    """``sass_text`` with every ``BRX`` of ``role``'s loop turned into a branch to the one
    jump-table case whose steady-state path issues ``copies`` LDGSTS and ``shuffles`` SHFL (an
    item's copies for one page size: a shuffle per page of the key tile when it spans more than
    one, none otherwise). The CFG cannot follow a ``BRX`` (its successor is the next
    instruction), so the path picker took whichever case is laid out after it, and an
    if-converted case (predicated unchecked copies falling through to the checked ones) counted
    two copy sequences. Raises unless exactly one case matches (or, without a ``BRX`` in the
    loop, unless the path already issues ``copies`` LDGSTS)."""
    graph = ControlFlowGraph(parse(sass_text))
    loop = role_loop(graph, role)
    body = graph.loop_instructions(loop)
    dispatch = {i.offset for i in body if i.base == "BRX"}
    if not dispatch:
        found = _copies(role_counts(sass_text, (role,))[role.name])[0]
        if found != copies:
            raise ValueError(f"role {role.name}: {found} LDGSTS per iteration, not {copies}")
        return sass_text
    starts = {graph.instructions[graph.blocks[b].start].offset for b in loop.body}
    matches = []
    for case in sorted(set(table) & starts):
        text = _BRX.sub(
            lambda m, c=case: (
                f"{m.group(1)}BRA 0x{c:x} ;" if int(m.group(2), 16) in dispatch else m.group(0)
            ),
            sass_text,
        )
        if _copies(role_counts(text, (role,))[role.name]) == (copies, shuffles):
            matches.append((case, text))
    if len(matches) != 1:
        cases = [hex(c) for c, _ in matches]
        raise ValueError(
            f"role {role.name}: {len(matches)} jump-table cases issue {copies} LDGSTS and "
            f"{shuffles} SHFL ({cases}); expected exactly one"
        )
    return matches[0][1]


def converter_item_counts(sass_text: str, convert: Role) -> LoopCounts:
    """Per-warp counts of the tcgen05 converter's mean item: its loop takes a K item on one
    path and a V item on another (convert.py), and at head_dim 64 the K path converts half as
    much (only the head dims BMM1 reads). The steady-state path picker takes the cheaper of two
    paths with the same copies (the K item's); the V item's is the one with the most ring
    reads (LDSM). Both count half (per_pipe; ``opcodes`` is the K path's)."""
    graph = ControlFlowGraph(parse(sass_text))
    loop = role_loop(graph, convert)
    cheap = count_loop(graph, loop)
    reads = count_loop(graph, loop, is_work=lambda i: _is_work(i) or i.base == "LDSM")
    mean = {p: (cheap.per_pipe[p] + reads.per_pipe[p]) / 2 for p in cheap.per_pipe}
    return replace(cheap, per_pipe=mean)


def tcgen05_copy_signature(page_size: int = PAGE_SIZE) -> tuple[int, int]:
    """(LDGSTS, SHFL) per converter warp and item for ``page_size`` (dsl/tcgen05/layouts.py):
    LOADER_STEPS copies; a shuffle per page when the key tile spans several pages."""
    from dsl.common.variant import BLOCK_SHIFTS
    from dsl.tcgen05 import layouts

    shift = page_size.bit_length() - 1
    if page_size != 1 << shift or shift not in BLOCK_SHIFTS:
        raise ValueError(f"page size {page_size}: not one of the converter's specialisations")
    pages = layouts.pages_per_tile(shift)
    # Steps sharing a page shuffle from the same lane: ptxas keeps one SHFL per page.
    return layouts.LOADER_STEPS, (pages if pages > 1 else 0)


def read_build(build_dir: str | Path) -> list[Built]:
    """The variants a DSL build directory holds."""
    build = json.loads((Path(build_dir) / "build.json").read_text())
    found = []
    for entry in build["variants"]:
        family, d, rows, page, q, kv = _NAME.search(entry["variant"]).groups()
        variant = _variant(family, int(d), int(rows), page and int(page), _Q[q], _KV[kv])
        cubin = Path(build_dir) / entry["cubins"][0]
        found.append(Built(family, entry["arch"], cubin, variant))
    return found


def dsl_rows(build_dir: str | Path, label: str = "", shapes: ShapeSet = ALL_SHAPES) -> list:
    """Rows for the shapes a built variant serves: per arch, the smallest rows-per-CTA >= R,
    else the largest (a prefill's), with ceil(R / rows) CTAs each streaming the KV."""
    built = read_build(build_dir)
    rows = []
    for shape in shapes:
        for arch in sorted({b.arch for b in built}):
            gpu = gpu_for(arch)
            fits = [
                b
                for b in built
                if b.arch == arch
                and (b.variant.head_dim, b.variant.q_dtype, b.variant.cache_dtype)
                == (shape.head_dim, shape.q_dtype, shape.cache_dtype)
            ]
            if gpu is None or not fits:
                continue
            wide = [b for b in fits if b.rows >= shape.rows]
            chosen = min(wide, key=lambda b: b.rows) if wide else max(fits, key=lambda b: b.rows)
            rows.append(_row(gpu, chosen, shape, label))
    return rows


def _row(gpu: hardware.Gpu, built: Built, shape: Shape, label: str) -> dict:
    (kernel,) = read_cubin(built.cubin)
    roles, threads, tensor_op = family_roles(built.family, built.variant)
    ctas = -(-shape.rows // built.rows)
    sass_text, page = kernel.sass, None
    if built.family == "tcgen05":
        page = PAGE_SIZE
        (convert,) = (r for r in roles if r.name == "convert")
        sass_text = one_page_specialisation(
            sass_text, convert, jump_table_words(built.cubin), *tcgen05_copy_signature(page)
        )
    counts = role_counts(sass_text, roles)
    if built.family == "tcgen05":
        counts["convert"] = converter_item_counts(sass_text, convert)
    instr = instr_per_kv_byte(counts, roles, ctas)
    prediction = bound(
        gpu, instr, {tensor_op: macs_per_kv_byte(built.family, built.variant) * ctas}
    )
    smem = built.variant.smem_bytes
    name = f"{built.variant.name} ({', '.join(f'{r.name} {r.warps}w' for r in roles)})"
    if page is not None:
        name += f" page {page}"
    return {
        "kind": shape.kind,
        "gpu": gpu.name,
        "arch": kernel.arch,
        "family": built.family,
        "kernel": f"[{label}] {name}" if label else name,
        "head_dim": shape.head_dim,
        "q_dtype": shape.q_dtype,
        "cache_dtype": shape.cache_dtype,
        "rows_per_kv_head": shape.rows,
        "instr_per_kv_byte": {p: round(instr[p], 5) for p in pipes.PIPES},
        "regs": kernel.regs,
        "smem_bytes": smem,
        "ctas_per_sm": occupancy.ctas_per_sm(gpu.limits, threads, kernel.regs, smem),
        **prediction_fields(gpu, prediction, shape),  # HBM fraction, or tensor peak (prefill)
    }
