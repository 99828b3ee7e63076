"""SASS facts the wgmma family's compiled kernels must show (cuobjdump on the kept cubins).

Reuses dsl/sass_check.py's readers; counts are static instruction counts over the whole kernel
(not per tile, not per byte): they show which instructions the kernel uses, never its speed.
"""

import re
from pathlib import Path

from dsl import sass_check
from dsl.wgmma.layouts import loader_steps, q_steps
from dsl.wgmma.traits import Variant

# The MMA (HGMMA = wgmma), the load path (16-byte cp.async of FP8 pages into the staging ring,
# 16-byte shared loads of them back, 16-byte global loads of Q, 16-byte shared stores of the
# dequantised operands), the exact FP8 -> fp16 conversion of the variant's cache dtype
# (``conversion``) and the mbarrier pipeline between producer and consumers (SYNCS).
REQUIRED = ("HGMMA", "LDGSTS.E.BYPASS.128", "LDS.128", "LDG.E.128", "STS.128", "SYNCS")
FORBIDDEN = sass_check.FORBIDDEN  # local memory: spills or stack arrays
_CONVERSIONS = {"float8_e4m3fn": "F2FP.F16.E4M3.UNPACK_B", "float8_e5m2": "F2FP.F16.E5M2.UNPACK_B"}


def conversion(variant: Variant) -> str:
    """The exact FP8 -> fp16 conversion (two elements per instruction) of the variant's cache."""
    return _CONVERSIONS[variant.cache_dtype]


def expected_counts(variant: Variant) -> dict[str, int]:
    """Static counts the kernel's structure fixes: one HGMMA per 16-deep k-step of each GEMM;
    one 16-byte cp.async (cp.async.cg: LDGSTS.E.BYPASS.128) per producer chunk of K and of V in
    each copy path: the prologue's fp8_stages - 1 tiles (checked rows) and the main loop's
    unchecked tile inside the sequence and checked last tile; in each checked path a 16-byte
    zero store instead for a row past kv_len; one 16-byte shared load per chunk read back,
    two 16-byte stores per FP8 chunk (one per 8 converted elements), one conversion per FP8
    pair; one 16-byte global load and store per Q chunk."""
    steps = loader_steps(variant.key_tile, variant.head_dim)
    copies = 2 * steps  # K and V chunks of one tile per thread
    paths = variant.fp8_stages - 1 + 2  # prologue tiles, unchecked, checked
    checked = variant.fp8_stages - 1 + 1
    return {
        "HGMMA": variant.head_dim // 16 + variant.key_tile // 16,
        "LDGSTS.E.BYPASS.128": copies * paths,
        "LDS.128": copies,
        "LDG.E.128": q_steps(variant.head_dim),
        "STS.128": copies * checked + 2 * copies + q_steps(variant.head_dim),
        conversion(variant): copies * 16 // 2,
    }


def role_registers(cubin: Path) -> dict[str, int] | None:
    """Registers each role's code touches (1 + the highest Rn): ptxas lays the producer's
    branch out between ``setmaxnreg.dec`` and ``setmaxnreg.inc``, the consumers' after the
    latter. Registers above a role's setmaxnreg limit would be lost at run time, so each must
    stay under its own. None without setmaxnreg."""
    text = sass_check.disassembly(cubin)
    start, end = text.find("USETMAXREG.DEALLOC"), text.find("USETMAXREG.TRY_ALLOC")
    if start < 0 or end < start:
        return None
    found = {}
    for role, code in (("producer", text[start:end]), ("consumer", text[end:])):
        used = [int(n) for n in re.findall(r"\bR(\d+)\b", code)]
        found[role] = max(used) + 1 if used else 0
    return found


def producer_registers(cubin: Path) -> int | None:
    """Registers the producer's code touches (role_registers), None without setmaxnreg."""
    roles = role_registers(cubin)
    return None if roles is None else roles["producer"]


def problems(cubin: Path, variant: Variant) -> list[str]:
    """What is wrong with a wgmma cubin (empty when every check passes)."""
    ops = sass_check.opcodes(cubin)
    usage = sass_check.resource_usage(cubin)
    found = [f"missing {name}" for name in REQUIRED if sass_check.count(ops, name) == 0]
    found += [f"{sass_check.count(ops, n)} x {n}" for n in FORBIDDEN if sass_check.count(ops, n)]
    found += [f"{key} {usage[key]} bytes" for key in ("STACK", "LOCAL") if usage[key]]
    for name, want in expected_counts(variant).items():
        if sass_check.count(ops, name) != want:
            found.append(f"{sass_check.count(ops, name)} x {name}, expected {want}")
    if variant.set_max_registers:
        roles = role_registers(cubin)
        if roles is None:
            found.append("missing USETMAXREG (setmaxnreg between producer and consumers)")
        else:
            for role, limit in variant.registers_per_thread.items():
                if roles[role] > limit:
                    found.append(f"{role} touches {roles[role]} registers > {limit}")
    if usage["REG"] > variant.registers_per_thread["consumer"]:
        found.append(f"{usage['REG']} registers > {variant.registers_per_thread['consumer']}")
    return found
