"""The issue-slot model: predicted fraction of HBM bandwidth from instructions per KV byte.

Per SM, streaming one KV byte costs at least max(all instructions / issue rate, each pipe's
instructions / its rate, tensor MACs / tensor rate) cycles; the GPU streams SMs x clock /
cycles bytes per second, and the prediction is that over the HBM bandwidth, capped at 1. It is a
PREDICTION: latency, occupancy, the memory system and the loop's prologue are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import pipes
from .hardware import Gpu
from .loop_counts import LoopCounts
from .tiles import TileFacts


@dataclass(frozen=True)
class Prediction:
    instr_per_kv_byte: dict[str, float]  # warp-instructions per KV byte, every warp of a CTA
    tensor_macs_per_kv_byte: float
    cycles_per_kv_byte: dict[str, float]  # per constraint ("issue", pipes, "tensor")
    binding: str  # the constraint that sets the time, or "hbm" when bandwidth does
    predicted_hbm_fraction: float


def per_kv_byte(counts: LoopCounts, facts: TileFacts, head_dim: int, kv_bytes: int) -> float:
    """Multiplier from per-warp-iteration counts to counts per KV byte: every warp of every
    CTA that streams this KV head's keys, over the K and V bytes of one iteration."""
    warps = -(-facts.threads // 32)
    return facts.ctas_per_kv_head * warps / facts.kv_bytes_per_iter(head_dim, kv_bytes)


def tensor_macs(counts: LoopCounts, facts: TileFacts) -> dict[str, float]:
    """Multiply-accumulates per warp-iteration, by tensor opcode base."""
    macs: dict[str, float] = {}
    unspelled: dict[str, float] = {}
    for ins, weight in counts.tensor:
        per_instruction = pipes.tensor_macs(ins)
        if per_instruction is None:
            unspelled[ins.base] = unspelled.get(ins.base, 0.0) + weight
            continue
        if ins.base.endswith("GMMA"):
            per_instruction /= 4  # a warpgroup instruction: each of its 4 warps issues it
        macs[ins.base] = macs.get(ins.base, 0.0) + weight * per_instruction
    if unspelled:
        if facts.cta_macs_per_iter is None:
            raise ValueError(f"{sorted(unspelled)}: MMA shape not in SASS nor in the tile facts")
        # The CTA's MACs not accounted for by spelled shapes, shared over the warps.
        warps = -(-facts.threads // 32)
        rest = max(0.0, facts.cta_macs_per_iter / warps - sum(macs.values()))
        total = sum(unspelled.values())
        for op, weight in unspelled.items():
            macs[op] = macs.get(op, 0.0) + rest * weight / total
    return macs


def bound(gpu: Gpu, instr: dict[str, float], macs: dict[str, float]) -> Prediction:
    """The issue-slot bound from warp-instructions per KV byte (per pipe) and tensor
    multiply-accumulates per KV byte (per tensor opcode), both summed over a CTA's warps."""
    cycles = {"issue": sum(instr.values()) / gpu.issue_per_clk}
    for pipe, rate in gpu.rates.items():
        cycles[pipe] = instr[pipe] / rate
    tensor_cycles = 0.0
    for op, m in macs.items():
        if op not in gpu.tensor_macs_per_clk:
            raise ValueError(f"{gpu.name} has no {op} (a cubin for another architecture?)")
        tensor_cycles += m / gpu.tensor_macs_per_clk[op]
    cycles[pipes.TENSOR] = tensor_cycles
    binding = max(cycles, key=cycles.get)
    bytes_per_s = gpu.sms * gpu.clock_hz / cycles[binding] if cycles[binding] > 0 else float("inf")
    fraction = min(1.0, bytes_per_s / gpu.hbm_bytes_per_s)
    return Prediction(
        instr_per_kv_byte=instr,
        tensor_macs_per_kv_byte=sum(macs.values()),
        cycles_per_kv_byte=cycles,
        binding="hbm" if fraction >= 1.0 else binding,
        predicted_hbm_fraction=fraction,
    )


def tensor_peak_fraction(
    gpu: Gpu, prediction: Prediction, flops_per_kv_byte: float
) -> tuple[float, str]:
    """(PREDICTED fraction of the dense 16-bit tensor peak, binding compute constraint) of a
    compute-bound problem (a long prefill) doing ``flops_per_kv_byte`` useful FLOPs (from its
    mask) per KV byte streamed: the FLOP rate the slowest compute constraint allows over the
    datasheet peak. Memory is not a constraint here (it is not modelled for prefill)."""
    binding = max(prediction.cycles_per_kv_byte, key=prediction.cycles_per_kv_byte.get)
    cycles = prediction.cycles_per_kv_byte[binding]
    flops_per_s = flops_per_kv_byte * gpu.sms * gpu.clock_hz / cycles
    return min(1.0, flops_per_s / gpu.dense_16bit_flops), binding


def predict(
    gpu: Gpu, counts: LoopCounts, facts: TileFacts, head_dim: int, kv_bytes: int
) -> Prediction:
    """Prediction for a kernel whose every warp runs the same main loop."""
    scale = per_kv_byte(counts, facts, head_dim, kv_bytes)
    instr = {p: counts.per_pipe[p] * scale for p in pipes.PIPES}
    macs = {op: m * scale for op, m in tensor_macs(counts, facts).items()}
    return bound(gpu, instr, macs)
