"""Every hardware assumption of the model, with its public source (one table).

Rates are warp-instructions per clock per SM unless named otherwise. ``results/clk/SM`` figures
of the CUDA C++ Programming Guide ("Arithmetic Instructions" throughput table) are divided by 32
lanes. Clocks are the ones implied by the datasheets' dense tensor peaks (peak / SMs / per-SM
tensor rate), so that tensor peak, clock and SM count agree with one another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from . import pipes

PROGRAMMING_GUIDE = (
    "CUDA C++ Programming Guide, 'Arithmetic Instructions' throughput table (cc 9.0 / 10.0)"
)
TECH_SPECS = (
    "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' (cc 9.0 / 10.0)"
)
HOPPER_WHITEPAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (SM: 4 partitions)"


@dataclass(frozen=True)
class Limits:
    """Per-SM residency limits of an architecture (occupancy arithmetic)."""

    max_ctas: int
    max_warps: int
    registers: int  # 32-bit registers per SM (split evenly over 4 partitions)
    register_unit: int  # registers are allocated per warp in units of this many
    shared_bytes: int  # shared memory per SM usable by CTAs
    shared_per_cta_max: int
    shared_reserved_per_cta: int  # the system's reservation per resident CTA
    shared_unit: int  # allocation granularity


@dataclass(frozen=True)
class Gpu:
    name: str
    arch_prefix: str  # cubins of this arch family run here ("sm_90", "sm_100")
    sms: int
    clock_hz: float
    hbm_bytes_per_s: float
    # Datasheet dense (no sparsity) BF16/FP16 tensor peak, FLOP/s: the prefill yardstick.
    dense_16bit_flops: float
    limits: Limits
    issue_per_clk: float  # warp-instructions issued per clock per SM (all pipes together)
    rates: dict[str, float]  # pipe -> warp-instructions per clock per SM
    tensor_macs_per_clk: dict[str, float]  # tensor opcode base -> multiply-accumulates/clk/SM
    sources: dict[str, str]


_LIMITS = Limits(
    max_ctas=32, max_warps=64, registers=65536, register_unit=256, shared_bytes=228 * 1024,
    shared_per_cta_max=227 * 1024, shared_reserved_per_cta=1024, shared_unit=128,
)  # fmt: skip

_COMMON_RATES = {
    pipes.FP32: 128 / 32,  # 128 FP32 lanes per SM
    pipes.INTEGER: 64 / 32,  # 64 INT32 lanes per SM (IMAD, shifts, logic, compares)
    pipes.CONVERSION: 16 / 32,  # "all other type conversions": 16 results/clk/SM
    pipes.MUFU: 16 / 32,  # exp2 / rcp / lg2: 16 results/clk/SM
    pipes.LSU: 32 / 32,  # 32 load/store lanes per SM; shuffles 32 results/clk/SM
    pipes.CONTROL: 4.0,  # no pipe limit beyond issue
}
_COMMON_SOURCES = {
    "issue_per_clk": f"{HOPPER_WHITEPAPER}: one warp-instruction per clock per partition",
    "fp32/integer/mufu/conversion/lsu rates": PROGRAMMING_GUIDE
    + "; conversions are slow on Hopper: triton-lang/triton PR #4563 ('Hopper has very low "
    "throughput of conversion instructions')",
    "limits": TECH_SPECS + " (32 CTAs, 64 warps, 64K registers, 228 KB shared, "
    "227 KB per CTA, 1 KB reserved per CTA)",
    "mma.sync rate": "1024 MAC/clk/SM, the A100 per-SM rate (A100 whitepaper: 1024 dense FP16 "
    "FMA/clk/SM): half of Hopper's wgmma peak (FlashAttention-3 paper, Shah et al. 2024: "
    "FlashAttention-2 on mma.sync reaches ~35% of H100 peak); on sm_100 no public "
    "figure, assumed the same per SM clock (a quarter of tcgen05's peak)",
}

H200 = Gpu(
    name="H200",
    arch_prefix="sm_90",
    sms=132,
    clock_hz=989.4e12 / (132 * 4096),  # 1.83 GHz
    hbm_bytes_per_s=4.8e12,
    dense_16bit_flops=989.4e12,
    limits=_LIMITS,
    issue_per_clk=4.0,
    rates=dict(_COMMON_RATES),
    # Dense 16-bit peak 2048 MAC/clk/SM (wgmma); mma.sync half of it; tcgen05 absent.
    tensor_macs_per_clk={"HGMMA": 2048.0, "HMMA": 1024.0},
    sources={
        **_COMMON_SOURCES,
        "sms/clock/tensor peak": "NVIDIA H200 datasheet: 989 TFLOP/s dense BF16 (1,979 with "
        "sparsity), 132 SMs as H100 SXM; 2048 dense MAC/clk/SM (H100 whitepaper: 2x A100 per "
        "SM) -> 1.83 GHz",
        "hbm": "NVIDIA H200 datasheet: 4.8 TB/s (a device copy measured ~4.3 TB/s, PEERS.md)",
    },
)

B200 = Gpu(
    name="B200",
    arch_prefix="sm_100",
    sms=148,
    clock_hz=2.25e15 / (148 * 8192),  # 1.86 GHz
    hbm_bytes_per_s=8.0e12,
    dense_16bit_flops=2.25e15,
    limits=_LIMITS,
    issue_per_clk=4.0,
    rates=dict(_COMMON_RATES),
    # tcgen05 dense 16-bit 4096 MAC/clk/SM; mma.sync assumed at the Hopper mma.sync rate.
    tensor_macs_per_clk={"UTCHMMA": 4096.0, "HMMA": 1024.0},
    sources={
        **_COMMON_SOURCES,
        "sms/clock/tensor peak": "NVIDIA HGX B200 datasheet: 2.25 PFLOP/s dense FP16/BF16 per "
        "GPU (4.5 with sparsity); 148 SMs; 4096 dense MAC/clk/SM -> 1.86 GHz",
        "hbm": "NVIDIA HGX B200 datasheet: 8 TB/s per GPU",
    },
)

GPUS = (H200, B200)


def dense_16bit_peak(device_name: str) -> tuple[float, str] | None:
    """(dense BF16/FP16 tensor peak in FLOP/s, its source) of a GPU named as torch names it
    (``"NVIDIA H200"``), or None when it is not one of :data:`GPUS`. The name must match
    exactly: other SKUs of a chip (H200 NVL, H100 PCIe) run other clocks and peaks."""
    for gpu in GPUS:
        if device_name.removeprefix("NVIDIA ").strip() == gpu.name:
            return gpu.dense_16bit_flops, gpu.sources["sms/clock/tensor peak"]
    return None


def assumptions() -> dict:
    """The assumption table written into sass-model.json."""
    table = {}
    for gpu in GPUS:
        entry = asdict(gpu)
        entry["rates_unit"] = "warp-instructions per clock per SM"
        entry["tensor_macs_per_clk_unit"] = "multiply-accumulates per clock per SM"
        table[gpu.name] = entry
    table["model"] = {
        "kind": "PREDICTION from static SASS, not a measurement",
        "time_per_kv_byte": "max over (all instructions / issue_per_clk, each pipe's "
        "instructions / its rate, tensor MACs / tensor_macs_per_clk) cycles per SM",
        "predicted_hbm_fraction": "min(1, SMs * clock / cycles_per_kv_byte / hbm_bytes_per_s)",
        "prefill_rows": "rows with kind 'prefill' (non-causal q = kv = q_len tokens, 32 query / "
        "8 KV heads, rows_per_kv_head = 4 q_len) carry predicted_tensor_fraction instead of "
        "predicted_hbm_fraction: a long prefill is compute-bound, so its yardstick is the "
        "GPU's dense 16-bit tensor peak (dense_16bit_flops, datasheet): "
        "min(1, flops_per_kv_byte * SMs * clock / cycles_per_kv_byte / dense_16bit_flops), "
        "flops_per_kv_byte = 2 * rows_per_kv_head / KV bytes per element (the mask's FLOPs, "
        "4 * q * kv * head_dim * query heads, over the K and V bytes each KV head streams); "
        "binding is the compute constraint (HBM and L2 not modelled: the KV of a KV head is "
        "re-read by every CTA of its rows); drafter rows carry kind 'drafter'",
        "main_loop": "natural loop with the most tensor instructions; one steady-state "
        "iteration = the header-to-latch path with the most MMA / MUFU / KV-load instructions "
        "and the fewest others (mask, tail and slow-path blocks skipped)",
        "ignored": "prologue/epilogue, split-KV merge, latency and memory-system effects "
        "(occupancy is reported, not modelled), L2 hits",
    }
    return table
