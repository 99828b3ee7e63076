"""How one main-loop iteration maps to KV bytes, and R rows to CTAs and warps, per kernel.

One source per family: the extension's own plan, ``_C.sass_tiles`` when it exports it, else
``_C.plan`` (tiles, threads, shared memory, key groups; ``_C.host.key_groups`` for builds whose plan
does not report them), the function the plan/run API launches with, so the model follows the
kernel as it changes. The Triton family's facts come from ``triton_attention.launch_plan`` (see
``rows.triton_facts``).

The one exception is the pre-plan build (commit b66bef0), which predates
``_C.plan``: its dynamic shared memory is a launch argument, recorded nowhere in its cubins, so its
constants (csrc/params.h and csrc/attention.cuh AttnConfig at b66bef0) are copied below. That
fallback is taken only for a build that exports that pre-plan API (``BLOCK_M`` and ``block_n``,
no ``plan``), and only after the tile sizes it does export agree with the copy. Any other build
without ``_C.plan`` (or one that cannot be imported) is an error, never silently modelled with
the pre-plan formula: a copied formula goes stale as soon as the kernel changes (it reported
68,608 B for the d128 FP8 kernel whose plan says 84,992 B).
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
DRAFTER_KV_LEN = 32768  # the long context a drafter shape's plan is asked for
# Keys of _C.plan(...)'s dict the model reads (any others are ignored).
PLAN_KEYS = ("family", "block_m", "block_n", "threads", "smem_bytes", "m_tiles")


class TileFactsError(RuntimeError):
    """A build whose tile facts cannot be read from the build itself."""


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


def _pre_plan_mma_sync(head_dim: int, q_dtype: str, cache_dtype: str, rows: int) -> TileFacts:
    """The pre-plan mma.sync kernel (commit b66bef0): csrc/params.h kBlockM = 64 and
    block_n_for; csrc/attention.cuh AttnConfig (4 warps, kStageBytes, kStages, kQBytes, kSmem)
    and the runtime key-group split (row_warps -> n_groups). Only for that build (see the
    module docstring; :func:`cuda_tiles` checks its exported BLOCK_M / block_n first)."""
    block_m, warps = 64, 4
    block_n = _pre_plan_block_n(head_dim)
    elt = 1 if cache_dtype.startswith("float8") else 2
    row_bytes = head_dim * elt
    stage = block_n * (row_bytes + row_bytes + 16)  # K swizzled, V padded by 16 bytes
    stages = 3 if 3 * stage <= 100 * 1024 else 2
    smem = block_m * head_dim * 2 + stages * stage
    rows_in_cta = min(rows, block_m)
    row_warps = -(-rows_in_cta // 16)
    max_groups = min(block_n // 16, warps)
    groups = max_groups if row_warps == 1 else 2 if row_warps == 2 else 1
    kv_code = CODE_OF[cache_dtype]
    return TileFacts(
        family="mma_sync",
        kernel=f"paged_attention_kernel<{head_dim}, {QUERY_TYPES[q_dtype]}, {kv_code}>",
        rows_per_cta=block_m,
        ctas_per_kv_head=-(-rows // block_m),
        keys_per_iter=block_n,
        threads=warps * 32,
        smem_bytes=smem,
        key_groups=groups,
        source="fallback table for the pre-plan build: csrc/params.h + csrc/attention.cuh at "
        "b66bef0 (BLOCK_M, block_n checked against the build)",
    )


def _pre_plan_block_n(head_dim: int) -> int:
    return 32 if head_dim == 256 else 64  # csrc/params.h block_n_for at b66bef0


def _is_pre_plan_build(ext: ModuleType) -> bool:
    """The pre-plan API of commit b66bef0: module constants BLOCK_M and block_n(head_dim)."""
    return not hasattr(ext, "plan") and hasattr(ext, "BLOCK_M") and hasattr(ext, "block_n")


def _check_pre_plan_build(ext: ModuleType, head_dim: int) -> None:
    exported = (int(ext.BLOCK_M), int(ext.block_n(head_dim)))
    copied = (64, _pre_plan_block_n(head_dim))
    if exported != copied:
        raise TileFactsError(
            f"{ext.__file__} exports the pre-plan API but BLOCK_M, block_n({head_dim}) = "
            f"{exported}, not b66bef0's {copied}: the copied shared-memory formula does not "
            "describe it; rebuild it with _C.plan"
        )


def _from_plan(
    ext: ModuleType, head_dim: int, q_dtype: str, cache_dtype: str, rows: int, kv_len: int
) -> TileFacts:
    """Tile facts from the extension's C++ plan (``_C.plan``, the function the plan/run API
    calls) and the kernel's own key-group map (``_C.host.key_groups``) unless the plan reports
    ``key_groups``, for one sequence of R / GROUP tokens of a GQA-4 model (8 KV heads) over
    ``kv_len`` keys, unsplit. A ``kernel`` key of the plan, if any, names the instantiation;
    else ``kernel_name`` (the template the plan launches, e.g. the 128-row tile's
    ``paged_attention_kernel_m128``) with the shape's template arguments."""
    q_len = -(-rows // GROUP)
    plan = ext.plan(
        num_seqs=1, num_tokens=q_len, num_q_heads=8 * GROUP, num_kv_heads=8, head_dim=head_dim,
        cache_dtype=CODE_OF[cache_dtype], max_seqlen_q=q_len, max_seqlen_k=kv_len, resident_ctas=1,
        num_splits=1,
    )  # fmt: skip
    missing = [key for key in PLAN_KEYS if key not in plan]
    if missing:
        raise TileFactsError(
            f"_C.plan of {ext.__file__} lacks {missing} (has {sorted(plan)}): the model needs "
            f"{list(PLAN_KEYS)}"
        )
    elt = 1 if cache_dtype.startswith("float8") else 2
    rows_in_cta = min(rows, int(plan["block_m"]))
    source = "_C.plan (the extension's plan)"
    if "key_groups" in plan:
        key_groups = int(plan["key_groups"])
    elif hasattr(getattr(ext, "host", None), "key_groups"):
        # The tile's rows: builds before the 128-row tile (block_m always 64) take no block_m.
        block_m = int(plan["block_m"])
        tile = (block_m,) if block_m != 64 else ()
        key_groups = int(ext.host.key_groups(head_dim, elt, rows_in_cta, *tile))
        source = "_C.plan + _C.host.key_groups (the extension's plan and index maps)"
    else:
        raise TileFactsError(
            f"{ext.__file__}: _C.plan reports no key_groups and _C.host.key_groups is missing"
        )
    name = plan.get("kernel_name", "paged_attention_kernel")
    default = f"{name}<{head_dim}, {QUERY_TYPES[q_dtype]}, {CODE_OF[cache_dtype]}>"
    return TileFacts(
        family=str(plan["family"]),
        kernel=str(plan.get("kernel", default)),
        rows_per_cta=int(plan["block_m"]),
        ctas_per_kv_head=int(plan["m_tiles"]),
        keys_per_iter=int(plan["block_n"]),
        threads=int(plan["threads"]),
        smem_bytes=int(plan["smem_bytes"]),
        key_groups=key_groups,
        source=source,
    )


def cuda_tiles(
    ext: ModuleType | None, head_dim: int, q_dtype: str, cache_dtype: str, rows: int,
    kv_len: int = DRAFTER_KV_LEN,
) -> TileFacts:  # fmt: skip
    """Tile facts of the CUDA kernel the extension's plan launches for this shape (R = rows
    query rows per KV head over ``kv_len`` keys): from ``_C.sass_tiles`` if exported, else
    ``_C.plan``, else (the pre-plan build of b66bef0 only) that build's constants. Raises
    TileFactsError when the build gives none of them."""
    if ext is None:
        raise TileFactsError(
            "the built extension could not be imported, so its _C.plan cannot be read: import "
            "it on this machine (python -c 'import fp8_noncausal_attn._C') to see why"
        )
    export = getattr(ext, "sass_tiles", None)
    if export is None:
        if hasattr(ext, "plan"):
            return _from_plan(ext, head_dim, q_dtype, cache_dtype, rows, kv_len)
        if _is_pre_plan_build(ext):
            _check_pre_plan_build(ext, head_dim)
            return _pre_plan_mma_sync(head_dim, q_dtype, cache_dtype, rows)
        raise TileFactsError(
            f"{getattr(ext, '__file__', ext)} exports neither _C.plan nor _C.sass_tiles (nor "
            "the pre-plan API of b66bef0): its tile facts (smem bytes, block sizes, threads) "
            "can only come from the build; export _C.plan"
        )
    facts = dict(export(head_dim, CODE_OF[q_dtype], CODE_OF[cache_dtype], rows))
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
