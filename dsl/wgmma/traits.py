"""Compile-time configuration of the wgmma family: variants, warp roles, shared-memory budget.

Plain Python (no DSL import), so budgets are host-testable and the build can list variants
without the DSL. The kernel (dsl/wgmma/kernel.py) reads every size from here.
"""

from dataclasses import dataclass

from dsl.common import launch
from dsl.common.variant import check_dtypes, variant_name
from dsl.wgmma.layouts import ROWS_PER_WARPGROUP, WARPGROUP

# The launch values the kernel reads, in its parameter order (dsl/common/launch.py).
Args = launch.KERNEL_ARGS["wgmma"]

ARCHS = ("sm_90a",)
HEAD_DIMS = (64, 128, 256)
# Both FP8 caches convert exactly to fp16 (F2FP.F16.E4M3 / .E5M2.UNPACK_B, half an instruction
# per element), so e5m2 costs the producer nothing more.
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SMEM_BYTES = 232448  # usable dynamic shared memory per CTA on sm_90 (227 KiB)
REGISTER_FILE = 65536  # 32-bit registers per SM
MAX_STAGES = 4  # staged 16-bit K/V items between the producer and the consumers
# FP8 key tiles (K and V) the producer's cp.async keeps in flight ahead of its conversion: as
# many as the shared memory left by Q and the 16-bit ring holds, at most this many.
MAX_FP8_STAGES = 3
MIN_FP8_STAGES = 2  # one tile in flight while one is converted
BARRIER_BYTES = 1024  # mbarriers (full/empty per stage), aligned ahead of the 1024-B tiles

# Warp roles: warpgroup 0 is the producer (copies FP8 K/V pages into a staging ring with
# cp.async, dequantises them into the swizzled 16-bit ring), warpgroups 1..consumers each own 64
# query rows and run both GEMMs and the online softmax. With two consumers the producer gives
# registers away (setmaxnreg).
PRODUCER_WARPGROUP = 0
# setmaxnreg split of the 128-row launch's 168 x 384 registers (producer + 2 consumers): 104 /
# 200, and 72 / 216 at head_dim 256, whose O alone takes 128 of a consumer's registers (the
# cp.async producer keeps no K/V in registers: 56-70).
PRODUCER_REGISTERS = 104
CONSUMER_REGISTERS = 200
WIDE_PRODUCER_REGISTERS = 72
WIDE_CONSUMER_REGISTERS = 216


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``consumers`` x 64 query rows per CTA (R = q_len x group rows of one
    KV head; more rows take more CTAs, each streaming the KV again). The page size is a run-time
    argument (``block_shift``, any of dsl.common.variant.BLOCK_SHIFTS), not part of a variant."""

    head_dim: int
    consumers: int
    q_dtype: str
    cache_dtype: str = "float8_e4m3fn"

    @property
    def name(self) -> str:
        rows = f"m{self.rows}"
        return variant_name("wgmma", self.head_dim, rows, None, self.q_dtype, self.cache_dtype)

    @property
    def rows(self) -> int:
        """Query rows per CTA."""
        return self.consumers * ROWS_PER_WARPGROUP

    @property
    def key_tile(self) -> int:
        """Keys per tile: the N of S = Q K^T. 128 keys keep S at 64 fp32 registers per thread;
        head_dim 256 takes 64 so that S, O and P fit the consumer's registers."""
        return 128 if self.head_dim <= 128 else 64

    @property
    def threads(self) -> int:
        return (1 + self.consumers) * WARPGROUP

    @property
    def launch_registers(self) -> int:
        """Registers per thread the launch allocates (ptxas' cap for this many threads: the
        even share of the register file in units of 8, at most 255). setmaxnreg only moves
        registers between warpgroups inside this allocation."""
        return min(255, REGISTER_FILE // self.threads // 8 * 8)

    @property
    def set_max_registers(self) -> bool:
        """Rebalance registers between roles only where the even share is too small for the
        consumers (384 threads: 168 each)."""
        return self.launch_registers < CONSUMER_REGISTERS

    @property
    def item_bytes(self) -> int:
        """One staged K or V item: key_tile x head_dim 16-bit elements."""
        return self.key_tile * self.head_dim * 2

    @property
    def q_bytes(self) -> int:
        """Q tiles of all consumers (16-bit, 64 x head_dim each)."""
        return self.rows * self.head_dim * 2

    @property
    def stages(self) -> int:
        """Staged items in the ring: as many as fit beside MIN_FP8_STAGES FP8 tiles, at most
        MAX_STAGES."""
        free = SMEM_BYTES - BARRIER_BYTES - self.q_bytes - MIN_FP8_STAGES * self.fp8_tile_bytes
        return min(MAX_STAGES, free // self.item_bytes)

    @property
    def fp8_tile_bytes(self) -> int:
        """One FP8 staging slot: K then V of a key tile, key_tile x head_dim bytes each."""
        return 2 * self.key_tile * self.head_dim

    @property
    def fp8_stages(self) -> int:
        """Key tiles in the FP8 staging ring (cp.async destinations): what is left after Q and
        the 16-bit ring, at most MAX_FP8_STAGES. fp8_stages - 1 tiles are in flight while the
        producer converts one."""
        free = SMEM_BYTES - BARRIER_BYTES - self.q_bytes - self.stages * self.item_bytes
        return min(MAX_FP8_STAGES, free // self.fp8_tile_bytes)

    @property
    def smem_bytes(self) -> int:
        return (
            BARRIER_BYTES
            + self.q_bytes
            + self.stages * self.item_bytes
            + self.fp8_stages * self.fp8_tile_bytes
        )

    @property
    def registers_per_thread(self) -> dict:
        """ptxas' cap per role: the even share, or the setmaxnreg split."""
        if self.set_max_registers:
            if self.head_dim == 256:
                return {"producer": WIDE_PRODUCER_REGISTERS, "consumer": WIDE_CONSUMER_REGISTERS}
            return {"producer": PRODUCER_REGISTERS, "consumer": CONSUMER_REGISTERS}
        return {"producer": self.launch_registers, "consumer": self.launch_registers}

    def check(self) -> None:
        """Raise ValueError when the variant cannot be built."""
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim}: the wgmma family builds {HEAD_DIMS}")
        if self.consumers not in (1, 2):
            raise ValueError(f"consumers {self.consumers}: 1 or 2 consumer warpgroups")
        check_dtypes(self.q_dtype, self.cache_dtype, CACHE_DTYPES)
        if self.stages < 2:
            raise ValueError(f"{self.name}: room for {self.stages} staged item(s), need 2")
        regs = self.registers_per_thread
        total = WARPGROUP * (regs["producer"] + self.consumers * regs["consumer"])
        if total > self.threads * self.launch_registers:
            # setmaxnreg.inc would wait forever for registers the CTA was never given
            raise ValueError(
                f"{self.name}: {total} registers > the launch's "
                f"{self.threads} x {self.launch_registers}"
            )
