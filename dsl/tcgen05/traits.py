"""Compile-time configuration of the tcgen05 family: variants, warp roles, TMEM and smem budgets.

Plain Python (no DSL import), so the budgets are host-testable and the build script can list
variants without the DSL installed. The kernel (dsl/tcgen05/kernel.py) reads every size from here.
"""

from dataclasses import dataclass

from dsl.common import launch
from dsl.common.variant import check_dtypes, query_agnostic_name, variant_name
from dsl.tcgen05.layouts import ITEM_BYTES, KEY_TILE

# The launch values the kernel reads, in its parameter order (dsl/common/launch.py).
Args = launch.KERNEL_ARGS["tcgen05"]

TMEM_COLUMNS = 512  # per SM: 128 lanes x 512 columns of 32 bits
SMEM_BYTES = 232448  # usable shared memory per CTA on sm_100 / sm_103 (227 KiB)
# The family-specific target: one cubin runs on sm_100 (B200) and sm_103 (B300), where an
# arch-specific sm_100a cubin runs on sm_100 only. Its SASS is the same as sm_100a's (checked on
# the d128 x 32-row kernel), and it halves the compiles.
ARCHS = ("sm_100f",)
HEAD_DIMS = (64, 128, 256)
# FP8 caches: e4m3 (F2FP and an integer-pipe share) and e5m2 (byte moves: the high byte of an fp16),
# both exact into the fp16 A operand (dsl/tcgen05/convert.py convert_exactly).
CACHE_DTYPES = ("float8_e4m3fn", "float8_e5m2")

# Warp roles: two warpgroups and two MMA warps, 320 threads. TMEM lane access is by warp % 4,
# so the two roles that touch all 128 lanes (softmax: S and O; converter: K and V) each take a
# whole warpgroup. With 10 warps every thread may hold 204 registers (64K / 320), so no role
# needs setmaxnreg (which a partial third warpgroup could not execute).
SOFTMAX_WARPGROUP = 0  # warps 0-3: S -> P, running max / sum, O rescale, epilogue
CONVERT_WARPGROUP = 1  # warps 4-7: Q prologue, cp.async K/V pages, FP8 -> fp16 into TMEM
MMA_KQ_WARP = 8  # issues S^T = K Q^T (tcgen05.mma, A = K from TMEM, B = Q from smem)
MMA_VP_WARP = 9  # issues O^T += V^T P (A = V^T from TMEM, B = P from smem)
THREADS = 320
REGISTERS_PER_THREAD = 65536 // THREADS // 8 * 8  # ptxas' cap for one CTA per SM: 200
# The most registers per thread at which two CTAs fit one SM's register file (96). Every kernel
# allocates all 512 TMEM columns, so a second resident CTA would sleep in tcgen05.alloc until
# the first exits: kernels must use more (the build test checks it; shared memory does not rule
# the second CTA out: 93 KiB at head_dim 128 x 32 rows).
TWO_CTA_REGISTERS = 65536 // (2 * THREADS) // 8 * 8
# S/P double buffering: BMM1 of tile s + 1 runs under the softmax of tile s. A variant whose
# TMEM does not hold two S stages is refused (a one-stage S was never compiled).
S_STAGES = 2

LOAD_STAGES = 4  # FP8 items in flight in shared memory (cp.async ring)
MAX_CONVERT_STAGES = 4  # fp16 items in TMEM between the converter and the MMA warps
# 32-bit words (4 FP8 bytes) of each converter thread's 32 per item converted on the integer
# pipe (layouts.e4m3x4_to_f16x2_scaled) rather than by F2FP: the share that balances the
# conversion pipe against issue slots in the static SASS model (tools/sass_model).
INTEGER_CONVERTED_WORDS = 9
MBARRIER_BYTES = 1024  # reserved for mbarriers, the TMEM pointer and row vectors
# TMEM columns of one converted fp16 item (128 lanes x 128 fp16 = 64 columns of 32 bits).
CONVERT_STAGE_COLUMNS = ITEM_BYTES * 16 // 32


@dataclass(frozen=True)
class Variant:
    """One compiled kernel. ``rows`` is the MMA N (query rows per CTA): 32..256, a multiple of 32
    (the softmax reads S in 32-column chunks, layouts.score_key_column).
    The page size is a run-time argument (``block_shift``, variant.BLOCK_SHIFTS: pages of 16..256
    keys), not part of a variant."""

    head_dim: int
    rows: int
    q_dtype: str
    cache_dtype: str = "float8_e4m3fn"

    @property
    def name(self) -> str:
        """The variant's name in the library (``tcgen05_d128_n32_bf16_e4m3``)."""
        rows = f"n{self.rows}"
        return variant_name("tcgen05", self.head_dim, rows, None, self.q_dtype, self.cache_dtype)

    @property
    def kernel_name(self) -> str:
        """The compiled kernel this variant runs: both query dtypes share one (the library's C
        entry passes ``q_is_bf16``; the query is read as 16-bit words and widened by it)."""
        return query_agnostic_name("tcgen05", self.head_dim, f"n{self.rows}", self.cache_dtype)

    @property
    def q_is_bf16(self) -> int:
        """The kernel's run-time query-dtype flag for this variant."""
        return int(self.q_dtype == "bfloat16")

    @property
    def d_tiles(self) -> int:
        """128-wide slices of head_dim: K items per tile (BMM1 k-blocks) and O^T M tiles. Head_dim
        64 takes one: half of each staged 128-byte key row, BMM1's first 4 k-steps, O^T lanes
        0..63 (docs/tcgen05.md, "head_dim 64")."""
        return max(1, self.head_dim // ITEM_BYTES)

    @property
    def o_columns(self) -> int:
        """TMEM columns of O^T (head_dim lanes in 128-lane slices x rows, fp32)."""
        return self.d_tiles * self.rows

    @property
    def s_stages(self) -> int:
        """S (TMEM) and P (shared memory) stages: :data:`S_STAGES`."""
        return S_STAGES

    @property
    def convert_stages(self) -> int:
        """Converted fp16 K/V items in TMEM between the converter and the MMA warps."""
        free = TMEM_COLUMNS - self.s_stages * self.rows - self.o_columns
        return min(MAX_CONVERT_STAGES, free // CONVERT_STAGE_COLUMNS)

    @property
    def tmem_columns(self) -> int:
        """Columns used: S stages + O + converted K/V stages."""
        return (
            self.s_stages * self.rows + self.o_columns + self.convert_stages * CONVERT_STAGE_COLUMNS
        )

    @property
    def tmem_alloc_columns(self) -> int:
        """tcgen05.alloc takes a power of two >= 32."""
        cols = 32
        while cols < self.tmem_columns:
            cols *= 2
        return cols

    @property
    def smem_bytes(self) -> int:
        """Upper bound of the kernel's shared memory: FP8 ring + Q (fp16, rows x head_dim) + P
        stages (fp16, 128 x rows) + row vectors (max double buffer, 4 per-warp sums, row scale,
        column scale, last key) + mbarriers, with up to 1 KiB of padding before each of the
        three 1024-byte-aligned tiles."""
        ring = LOAD_STAGES * KEY_TILE * ITEM_BYTES
        q = self.rows * self.d_tiles * ITEM_BYTES * 2  # head_dim 64: a 128-wide B tile
        p = self.s_stages * KEY_TILE * self.rows * 2
        vectors = (2 + 4 + 3) * self.rows * 4
        return ring + q + p + vectors + MBARRIER_BYTES + 3 * 1024

    def check(self) -> None:
        """Raise ValueError when the variant cannot be built."""
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim {self.head_dim}: the tcgen05 family builds {HEAD_DIMS}")
        if self.rows % 32 or not 32 <= self.rows <= 256:
            raise ValueError(f"rows {self.rows}: whole 32-column softmax chunks in 32..256")
        check_dtypes(self.q_dtype, self.cache_dtype, CACHE_DTYPES)
        if self.convert_stages < 1:
            need = self.s_stages * self.rows + self.o_columns + CONVERT_STAGE_COLUMNS
            raise ValueError(
                f"{self.name}: {self.s_stages} S stages, O and one converted K/V item need {need} "
                f"TMEM columns > {TMEM_COLUMNS}"
            )
        if self.smem_bytes > SMEM_BYTES:
            raise ValueError(f"{self.name}: {self.smem_bytes} B of shared memory > {SMEM_BYTES}")
