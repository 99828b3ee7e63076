"""CTAs per SM from registers, shared memory and threads (the occupancy calculator's rules)."""

from __future__ import annotations

from .hardware import Limits

PARTITIONS = 4  # an SM's register file and warp schedulers are split in four


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def ctas_per_sm(limits: Limits, threads: int, regs: int, smem_bytes: int) -> int:
    """Resident CTAs per SM for a kernel of ``threads`` per CTA, ``regs`` registers per thread
    and ``smem_bytes`` of shared memory per CTA (static + dynamic); 0 if one CTA cannot fit."""
    warps = -(-threads // 32)
    if warps == 0 or smem_bytes > limits.shared_per_cta_max:
        return 0
    by_ctas = limits.max_ctas
    by_warps = limits.max_warps // warps
    by_regs = by_ctas
    if regs > 0:
        regs_per_warp = _round_up(regs * 32, limits.register_unit)
        warps_per_partition = (limits.registers // PARTITIONS) // regs_per_warp
        by_regs = warps_per_partition * PARTITIONS // warps
    per_cta = _round_up(smem_bytes + limits.shared_reserved_per_cta, limits.shared_unit)
    by_smem = limits.shared_bytes // per_cta
    return max(0, min(by_ctas, by_warps, by_regs, by_smem))
