"""How one main-loop iteration maps to KV bytes, and R rows to CTAs and warps, per kernel.

One source per family: the extension's own plan (``_C.sass_tiles`` when it exports it, else
``_C.plan`` with ``_C.host.key_groups``), else the constants of the morning's mma.sync kernel
(csrc/params.h and csrc/attention.cuh at commit b66bef0), copied below and named; the Triton
family's facts come from ``triton_attention.launch_plan`` (see ``rows.triton_facts``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import ModuleType

# Element type codes of the extension (csrc params.h enum DType).
DTYPE_CODES = {0: "bfloat16", 1: "float16", 2: "float8_e4m3fn", 3: "float8_e5m2"}
CODE_OF = {name: code for code, name in DTYPE_CODES.items()}
# Template spelling of the query dtype in demangled kernel names.
QUERY_TYPES = {"bfloat16": "__nv_bfloat16", "float16": "__half"}
GROUP = 4  # query heads per KV head of the modelled drafter (32 query heads over 8 KV heads)


@dataclass(frozen=True)
class TileFacts:
    """What a kernel does per main-loop iteration for one shape.

    rows_per_cta: query rows one CTA holds; ctas_per_kv_head: CTAs streaming the same KV for
    R rows; keys_per_iter: keys per iteration; threads: per CTA (every warp runs the loop,
    whatever its role); key_groups: warps sharing one key tile (each does 1/key_groups of the
    tile's MMA / exp blocks); kernel: substring of the demangled name of the kernel launched.
    """

    family: str
    kernel: str
    rows_per_cta: int
    ctas_per_kv_head: int
    keys_per_iter: int
    threads: int
    smem_bytes: int
    key_groups: int
    source: str
    # Multiply-accumulates of one CTA per iteration, for tensor instructions whose shape SASS
    # does not spell (tcgen05 UTC*MMA: it lives in the instruction descriptor).
    cta_macs_per_iter: int | None = None

    def kv_bytes_per_iter(self, head_dim: int, kv_bytes_per_element: int) -> int:
        """K and V bytes one iteration brings in: keys x head_dim x bytes, twice."""
        return 2 * self.keys_per_iter * head_dim * kv_bytes_per_element


def _morning_mma_sync(head_dim: int, q_dtype: str, kv_dtype: str, rows: int) -> TileFacts:
    """This morning's mma.sync kernel (commit b66bef0): csrc/params.h kBlockM = 64 and
    block_n_for; csrc/attention.cuh AttnConfig (4 warps, kStageBytes, kStages, kQBytes, kSmem)
    and the runtime key-group split (row_warps -> n_groups)."""
    block_m, warps = 64, 4
    block_n = 32 if head_dim == 256 else 64
    elt = 1 if kv_dtype.startswith("float8") else 2
    row_bytes = head_dim * elt
    stage = block_n * (row_bytes + row_bytes + 16)  # K swizzled, V padded by 16 bytes
    stages = 3 if 3 * stage <= 100 * 1024 else 2
    smem = block_m * head_dim * 2 + stages * stage
    rows_in_cta = min(rows, block_m)
    row_warps = -(-rows_in_cta // 16)
    max_groups = min(block_n // 16, warps)
    groups = max_groups if row_warps == 1 else 2 if row_warps == 2 else 1
    kv_code = CODE_OF[kv_dtype]
    return TileFacts(
        family="mma_sync",
        kernel=f"paged_attention_kernel<{head_dim}, {QUERY_TYPES[q_dtype]}, {kv_code}>",
        rows_per_cta=block_m,
        ctas_per_kv_head=-(-rows // block_m),
        keys_per_iter=block_n,
        threads=warps * 32,
        smem_bytes=smem,
        key_groups=groups,
        source="fallback table: csrc/params.h + csrc/attention.cuh at b66bef0",
    )


def _from_plan(ext: ModuleType, head_dim: int, q_dtype: str, kv_dtype: str, rows: int):
    """Tile facts from the extension's C++ plan (``_C.plan``, the function the plan/run API
    calls) and the kernel's own key-group map (``_C.host.key_groups``), for one sequence of
    R / GROUP tokens of a GQA-4 model (8 KV heads) over a long context, unsplit."""
    q_len = -(-rows // GROUP)
    plan = ext.plan(1, q_len, 8 * GROUP, 8, head_dim, CODE_OF[kv_dtype], q_len, 32768, 1, 1)
    elt = 1 if kv_dtype.startswith("float8") else 2
    rows_in_cta = min(rows, int(plan["block_m"]))
    return TileFacts(
        family=str(plan["family"]),
        kernel=f"paged_attention_kernel<{head_dim}, {QUERY_TYPES[q_dtype]}, {CODE_OF[kv_dtype]}>",
        rows_per_cta=int(plan["block_m"]),
        ctas_per_kv_head=int(plan["m_tiles"]),
        keys_per_iter=int(plan["block_n"]),
        threads=int(plan["threads"]),
        smem_bytes=int(plan["smem_bytes"]),
        key_groups=int(ext.host.key_groups(head_dim, elt, rows_in_cta)),
        source="_C.plan + _C.host.key_groups (the extension's plan and index maps)",
    )


def cuda_tiles(
    ext: ModuleType | None, head_dim: int, q_dtype: str, kv_dtype: str, rows: int
) -> TileFacts:
    """Tile facts of the CUDA kernel the extension's plan launches for this shape: from
    ``_C.sass_tiles`` if exported, else ``_C.plan``, else this morning's constants."""
    export = getattr(ext, "sass_tiles", None)
    if export is None:
        if hasattr(ext, "plan") and hasattr(getattr(ext, "host", None), "key_groups"):
            return _from_plan(ext, head_dim, q_dtype, kv_dtype, rows)
        return _morning_mma_sync(head_dim, q_dtype, kv_dtype, rows)
    facts = dict(export(head_dim, CODE_OF[q_dtype], CODE_OF[kv_dtype], rows))
    return TileFacts(
        family=str(facts["family"]),
        kernel=str(facts["kernel"]),
        rows_per_cta=int(facts["rows_per_cta"]),
        ctas_per_kv_head=int(facts["ctas_per_kv_head"]),
        keys_per_iter=int(facts["keys_per_iter"]),
        threads=int(facts["threads"]),
        smem_bytes=int(facts["smem_bytes"]),
        key_groups=int(facts.get("key_groups", 1)),
        source="_C.sass_tiles (the extension's plan)",
        cta_macs_per_iter=facts.get("cta_macs_per_iter"),
    )


def normalise(name: str) -> str:
    """Demangled names with whitespace collapsed, so substrings match across c++filt styles."""
    return re.sub(r"\s+", "", name)
