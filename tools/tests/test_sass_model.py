"""The static SASS model (tools/sass_model): loop finder, counts, occupancy, JSON schema.

The counts are checked on SASS one can reason about by hand: a hand-written listing, and a tiny
kernel compiled here with nvcc (skipped without nvcc) whose main loop holds exactly one global
load, one MUFU.EX2 and one mma.sync next to a larger loop without MMA. A CI test runs the tool
over the freshly built extension (skipped without ``_C``). All figures are PREDICTIONS.
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools.sass_model import cubins, hardware, loop_counts, occupancy, pipes, report, rows
from tools.sass_model.cfg import ControlFlowGraph
from tools.sass_model.model import bound, predict, tensor_peak_fraction
from tools.sass_model.sass import parse
from tools.sass_model.tiles import TileFacts, TileFactsError, cuda_tiles

ROOT = Path(__file__).resolve().parents[2]
NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
)


def sass_listing(lines: list[str]) -> str:
    """cuobjdump-style text for instructions at offsets 0x00, 0x10, ..."""
    return "\n".join(
        f"        /*{16 * i:04x}*/   {text} ;   /* 0x0 */" for i, text in enumerate(lines)
    )


# A loop (0x20..0xd0) whose iteration skips a mask block (FSELs) unless a predicate says so,
# and takes an MMA block guarded by another branch (a key-group split), then a tail.
HAND_LISTING = [
    "S2R R0, SR_TID.X",  # 0x00
    "MOV R1, RZ",  # 0x10
    "LDGSTS.E.128 [R2], desc[UR4][R4.64]",  # 0x20 loop header: KV load
    "ISETP.GE.AND P0, PT, R1, R0, PT",  # 0x30
    "@P0 BRA 0x80",  # 0x40 skip the MMA block when this warp has no share
    "LDS.128 R8, [R3]",  # 0x50
    "F2FP.F16.E4M3.UNPACK_B R9, R8",  # 0x60
    "HMMA.16816.F32 R12, R8, R9, R12",  # 0x70
    "@!P1 BRA 0xc0",  # 0x80 mask only on the last tile
    "FSEL R12, R12, -INF , P2",  # 0x90
    "FSEL R13, R13, -INF , P2",  # 0xa0
    "FSEL R14, R14, -INF , P2",  # 0xb0
    "MUFU.EX2 R12, R12",  # 0xc0
    "IADD3 R1, R1, 0x1, RZ",  # 0xd0
    "@P3 BRA 0x20",  # 0xe0 back edge
    "STG.E desc[UR4][R6.64], R12",  # 0xf0
    "EXIT",  # 0x100
]


def test_parser_reads_predicates_opcodes_and_targets():
    ins = parse(sass_listing(HAND_LISTING))
    assert len(ins) == len(HAND_LISTING)
    assert ins[4].predicate == "P0" and ins[4].base == "BRA" and ins[4].target == 0x80
    assert ins[8].predicate == "!P1" and ins[8].target == 0xC0
    assert ins[7].opcode == "HMMA.16816.F32" and pipes.tensor_macs(ins[7]) == 16 * 8 * 16
    assert ins[16].ends_flow and not ins[14].ends_flow
    # A uniform-predicate operand makes a branch conditional (Triton's loops on sm_100).
    (uniform,) = parse(sass_listing(["BRA.U !UP0, 0x0"]))
    assert uniform.target == 0 and uniform.transfers and not uniform.ends_flow
    (plain,) = parse(sass_listing(["BRA 0x0"]))
    assert plain.ends_flow


def test_loop_finder_and_steady_state_path_on_hand_listing():
    graph = ControlFlowGraph(parse(sass_listing(HAND_LISTING)))
    (loop,) = graph.loops()
    assert graph.instructions[graph.blocks[loop.header].start].offset == 0x20
    assert {graph.instructions[graph.blocks[b].start].offset for b in loop.body} == {
        0x20, 0x50, 0x80, 0x90, 0xC0,
    }  # fmt: skip
    path = graph.steady_state_path(loop, loop_counts._is_work)
    offsets = [i.offset for b in path for i in graph.block_instructions(b)]
    # The MMA block is taken (work), the FSEL mask block skipped (no work).
    assert offsets == [0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0xC0, 0xD0, 0xE0]


# Two key loops, as the mma.sync kernel compiles one per key-group count: 0x30..0x80 holds the
# whole tile's MMAs (one key group), 0xa0..0xe0 half of them (a warp of two key groups).
TWO_KEY_LOOPS = [
    "S2R R0, SR_TID.X",  # 0x00
    "ISETP.NE.AND P0, PT, R0, RZ, PT",  # 0x10
    "@P0 BRA 0xa0",  # 0x20 two key groups
    "LDGSTS.E.128 [R2], desc[UR4][R4.64]",  # 0x30 loop of one key group
    "HMMA.16816.F32 R12, R8, R9, R12",  # 0x40
    "HMMA.16816.F32 R16, R8, R9, R16",  # 0x50
    "MUFU.EX2 R12, R12",  # 0x60
    "IADD3 R1, R1, 0x1, RZ",  # 0x70
    "@P3 BRA 0x30",  # 0x80
    "EXIT",  # 0x90
    "LDGSTS.E.128 [R2], desc[UR4][R4.64]",  # 0xa0 loop of a warp of two key groups
    "HMMA.16816.F32 R12, R8, R9, R12",  # 0xb0
    "MUFU.EX2 R12, R12",  # 0xc0
    "IADD3 R1, R1, 0x1, RZ",  # 0xd0
    "@P3 BRA 0xa0",  # 0xe0
    "EXIT",  # 0xf0
]


def test_counts_take_the_loop_of_the_key_group_count():
    """With one key loop per key-group count, the warp's own loop is counted unweighted (the one
    holding 1 / key_groups of the largest loop's MMAs); with no such loop, the largest loop's
    MMA / exp blocks are weighted by 1 / key_groups (a run-time split)."""
    text = sass_listing(TWO_KEY_LOOPS)
    graph = ControlFlowGraph(parse(text))
    one, two = sorted(graph.loops(), key=lambda loop: loop.header)
    assert loop_counts.key_group_loop(graph, 1) == (one, 1)
    assert loop_counts.key_group_loop(graph, 2) == (two, 1)
    assert loop_counts.key_group_loop(graph, 4) == (one, 4)
    whole = loop_counts.count_main_loop(text, key_groups=1)
    assert whole.per_pipe[pipes.TENSOR] == 2 and whole.per_pipe[pipes.MUFU] == 1
    half = loop_counts.count_main_loop(text, key_groups=2)
    assert half.per_pipe[pipes.TENSOR] == 1 and half.per_pipe[pipes.MUFU] == 1
    assert half.per_pipe[pipes.INTEGER] == 1 and half.path_instructions == 5
    quarter = loop_counts.count_main_loop(text, key_groups=4)
    assert quarter.per_pipe[pipes.TENSOR] == 0.5 and quarter.per_pipe[pipes.MUFU] == 0.25


def test_counts_weight_shared_blocks_by_key_groups():
    text = sass_listing(HAND_LISTING)
    whole = loop_counts.count_main_loop(text, key_groups=1)
    assert whole.path_instructions == 10 and whole.loop_instructions == 13
    assert whole.per_pipe[pipes.TENSOR] == 1 and whole.per_pipe[pipes.CONVERSION] == 1
    assert whole.per_pipe[pipes.MUFU] == 1 and whole.per_pipe[pipes.LSU] == 2
    assert whole.per_pipe[pipes.FP32] == 0  # the mask block is not in the steady state
    assert whole.per_pipe[pipes.CONTROL] == 3 and whole.per_pipe[pipes.INTEGER] == 2
    half = loop_counts.count_main_loop(text, key_groups=2)
    # The MMA block (LDS, F2FP, HMMA) and the MUFU block (MUFU, IADD3, BRA) are shared out.
    assert half.per_pipe[pipes.TENSOR] == 0.5 and half.per_pipe[pipes.MUFU] == 0.5
    assert half.per_pipe[pipes.LSU] == 1.5 and half.per_pipe[pipes.INTEGER] == 1.5
    assert sum(half.per_pipe.values()) == pytest.approx(10 - 6 / 2)


TINY_KERNEL = r"""
extern "C" __global__ void tiny(const float* __restrict__ x, const unsigned* __restrict__ b,
                                float* __restrict__ y, int n, int m) {
  float acc = 0.f;
#pragma unroll 1
  for (int i = threadIdx.x; i < m; i += 32) {  // larger loop, four FFMAs, no MMA
    float v = x[i];
    acc = fmaf(acc, v, 1.f); acc = fmaf(acc, v, 2.f);
    acc = fmaf(acc, v, 3.f); acc = fmaf(acc, v, 4.f);
  }
  float c0 = acc, c1 = 0.f, c2 = 0.f, c3 = 0.f;
#pragma unroll 1
  for (int i = threadIdx.x; i < n; i += 32) {  // main loop: one LDG, one MUFU.EX2, one HMMA
    unsigned a = b[i];
    float e;
    asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(__uint_as_float(a)));
    unsigned w = __float_as_uint(e);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%4,%4,%4}, {%4,%4}, {%0,%1,%2,%3};"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3) : "r"(w));
  }
  y[threadIdx.x] = c0 + c1 + c2 + c3;
}
"""


@pytest.fixture(scope="module")
def tiny_kernel(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found")
    tmp = tmp_path_factory.mktemp("tiny")
    (tmp / "tiny.cu").write_text(TINY_KERNEL)
    cubin, source = tmp / "tiny.cubin", tmp / "tiny.cu"
    subprocess.run(
        [NVCC, "-cubin", "-arch=sm_90a", "-O3", "-o", str(cubin), str(source)],
        check=True, capture_output=True,
    )  # fmt: skip
    (kernel,) = cubins.read_cubin(cubin)
    return kernel


# An array indexed at run time, too large for registers: it lives in local memory (the stack).
LOCAL_KERNEL = r"""
extern "C" __global__ void local_array(const int* __restrict__ i, float* __restrict__ y, int n) {
  float a[256];
  for (int k = 0; k < 256; ++k) a[k] = y[k * threadIdx.x];
  for (int k = 0; k < n; ++k) a[i[k] & 255] += 1.f;
  y[threadIdx.x] = a[i[threadIdx.x] & 255];
}
"""


@pytest.mark.parametrize(
    "header",
    [
        "64-bit ELF: type=ET_EXEC, ABI=8, sm=90a, toolkit=13.4, flags=0xa005a04",
        "64bit elf: type=2, abi=7, sm=90a, toolkit=128, flags = 0x5a0d5a",  # Triton 3.6's ptxas
    ],
)
def test_elf_target_reads_either_header_form(header):
    assert cubins.elf_target(f"\n{header}\nSections:\n") == "sm_90a"
    assert cubins.elf_target(f"\n{header.replace('sm=', 'arch=')}\n") is None


@pytest.mark.parametrize("source", [TINY_KERNEL, LOCAL_KERNEL], ids=["registers", "local"])
def test_resources_without_the_sass_are_the_kernels_own(source, tmp_path):
    """read_resources (no disassembly) reads what read_cubin reads, the stack included."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    (tmp_path / "k.cu").write_text(source)
    cubin = tmp_path / "k.cubin"
    subprocess.run(
        [NVCC, "-cubin", "-arch=sm_90a", "-O3", "-o", str(cubin), str(tmp_path / "k.cu")],
        check=True, capture_output=True,
    )  # fmt: skip
    (resources,) = cubins.read_resources(cubin)
    (kernel,) = cubins.read_cubin(cubin)
    fields = [f.name for f in dataclasses.fields(cubins.Resources)]
    assert resources == cubins.Resources(*(getattr(kernel, f) for f in fields))
    assert resources.arch == "sm_90a" and resources.regs > 0
    assert (resources.stack + resources.local > 0) == (source is LOCAL_KERNEL)


def test_tiny_kernel_main_loop_is_the_mma_loop(tiny_kernel):
    assert tiny_kernel.arch == "sm_90a" and tiny_kernel.name == "tiny"
    assert tiny_kernel.regs > 0 and tiny_kernel.local == 0 and tiny_kernel.stack == 0
    graph = ControlFlowGraph(parse(tiny_kernel.sass))
    loops = graph.loops()
    assert len(loops) == 2
    main = graph.main_loop(pipes.is_tensor)
    other = next(loop for loop in loops if loop != main)
    main_body = graph.loop_instructions(main)
    # The FFMA loop is the larger one, but the main loop is the one holding the MMA.
    assert sum(i.base == "FFMA" for i in graph.loop_instructions(other)) == 4
    assert sum(i.base == "FFMA" for i in main_body) == 0
    assert [i.base for i in main_body].count("HMMA") == 1
    # A single-block loop: its body runs from the header to the one backward branch.
    back = [i for i in main_body if i.target is not None and i.target <= i.offset]
    assert len(back) == 1 and back[0] is main_body[-1]
    assert len(main_body) == (back[0].offset - back[0].target) // 16 + 1


def test_tiny_kernel_counts_per_pipe(tiny_kernel):
    counts = loop_counts.count_main_loop(tiny_kernel.sass)
    assert counts.per_pipe[pipes.TENSOR] == 1
    assert counts.per_pipe[pipes.MUFU] == 1
    assert counts.per_pipe[pipes.FP32] == 0 and counts.per_pipe[pipes.CONVERSION] == 0
    assert counts.per_pipe[pipes.LSU] == 1  # the one LDG
    assert counts.per_pipe[pipes.CONTROL] >= 1  # the back branch
    assert sum(counts.per_pipe.values()) == counts.path_instructions == counts.loop_instructions
    assert not counts.unknown_opcodes


def test_model_arithmetic_on_tiny_kernel(tiny_kernel):
    """Per KV byte = per-warp count x warps x CTAs / (2 x keys x head_dim x bytes)."""
    counts = loop_counts.count_main_loop(tiny_kernel.sass)
    facts = TileFacts("mma_sync", "tiny", 64, 2, 16, 128, 0, 1, "test")
    prediction = predict(hardware.H200, counts, facts, head_dim=64, kv_bytes=1)
    scale = 2 * 4 / (2 * 16 * 64)
    assert prediction.instr_per_kv_byte[pipes.TENSOR] == pytest.approx(scale)
    total = counts.path_instructions * scale
    cycles = prediction.cycles_per_kv_byte
    assert cycles["issue"] == pytest.approx(total / 4)
    assert cycles[pipes.TENSOR] == pytest.approx(scale * 2048 / 1024)
    assert cycles[pipes.MUFU] == pytest.approx(scale / 0.5)
    binding = max(cycles.values())
    expected = min(1.0, 132 * hardware.H200.clock_hz / binding / 4.8e12)
    assert prediction.predicted_hbm_fraction == pytest.approx(expected)


@pytest.mark.parametrize(
    "threads, regs, smem, expected",
    [
        (128, 168, 68608, 3),  # the pre-plan d128 kernel on sm_90a (3 CTAs per SM)
        (128, 192, 68608, 2),  # the same on sm_100a (2)
        (128, 64, 117760, 1),  # 16-bit cache d128, 3 stages: shared memory allows one
        (1024, 32, 0, 2),  # 64 warps per SM
        (128, 32, 0, 16),  # registers 16, warps 16
        (32, 16, 0, 32),  # the 32-CTA limit
        (256, 255, 0, 1),  # 255 registers round to 8192 per warp: 8 warps per SM
        (128, 32, 228 * 1024, 0),  # more than a CTA may have
    ],
)
def test_occupancy_arithmetic(threads, regs, smem, expected):
    limits = hardware.H200.limits
    assert occupancy.ctas_per_sm(limits, threads, regs, smem) == expected


def pre_plan_build(block_m: int = 64) -> SimpleNamespace:
    """The pre-plan API of b66bef0's _C: no plan."""
    return SimpleNamespace(
        __file__="before/_C.so", BLOCK_M=block_m, block_n=lambda d: 32 if d == 256 else 64
    )


def test_pre_plan_tile_facts_match_issue_9():
    ext = pre_plan_build()
    facts = cuda_tiles(ext, 128, "bfloat16", "float8_e4m3fn", 128)
    assert (facts.rows_per_cta, facts.ctas_per_kv_head, facts.keys_per_iter) == (64, 2, 64)
    assert facts.smem_bytes == 68608  # 68.6 KB
    assert "b66bef0" in facts.source
    assert cuda_tiles(ext, 128, "bfloat16", "bfloat16", 64).smem_bytes == 117760
    assert cuda_tiles(ext, 256, "float16", "float16", 64).smem_bytes == 132608
    groups = [cuda_tiles(ext, 128, "float16", "float8_e5m2", r).key_groups for r in (16, 32, 64)]
    assert groups == [4, 2, 1]


def test_tile_facts_without_a_plan_are_an_error_not_the_pre_plan_formula():
    with pytest.raises(TileFactsError, match="could not be imported"):
        cuda_tiles(None, 128, "bfloat16", "float8_e4m3fn", 64)
    with pytest.raises(TileFactsError, match="exports neither _C.plan"):
        cuda_tiles(SimpleNamespace(__file__="x.so"), 128, "bfloat16", "float8_e4m3fn", 64)
    # A pre-plan build whose exported tiles differ from b66bef0's is not that build.
    with pytest.raises(TileFactsError, match="BLOCK_M, block_n"):
        cuda_tiles(pre_plan_build(block_m=128), 128, "bfloat16", "float8_e4m3fn", 64)


def planning_build(drop: tuple[str, ...] = (), **extra: object) -> SimpleNamespace:
    """A build whose _C.plan reports tiles no copied formula gives (and records its calls)."""
    calls = []

    def plan(**args):
        calls.append(args)
        q_len = args["max_seqlen_q"]
        reported = {
            "family": "mma_sync", "block_m": 128, "block_n": 64, "threads": 256,
            "smem_bytes": 84992 + args["head_dim"], "m_tiles": -(-q_len * 4 // 128),
            "num_splits": 1,
            **extra,
        }  # fmt: skip
        return {key: value for key, value in reported.items() if key not in drop}

    host = SimpleNamespace(key_groups=lambda head_dim, elt, rows, block_m=64: 3 * block_m // 128)
    return SimpleNamespace(__file__="after/_C.so", plan=plan, host=host, calls=calls)


def test_tile_facts_come_from_the_plan():
    ext = planning_build()
    facts = cuda_tiles(ext, 128, "bfloat16", "float8_e4m3fn", 64)
    assert (facts.rows_per_cta, facts.keys_per_iter, facts.threads) == (128, 64, 256)
    assert facts.smem_bytes == 84992 + 128 and facts.ctas_per_kv_head == 1
    assert facts.key_groups == 3 and "_C.plan" in facts.source
    assert facts.kernel == "paged_attention_kernel<128, __nv_bfloat16, 2>"
    # One sequence of R / 4 tokens, GQA 4 over 8 KV heads, e4m3 (code 2), a long context.
    (call,) = ext.calls
    assert call == {
        "num_seqs": 1, "num_tokens": 16, "num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128,
        "cache_dtype": 2, "max_seqlen_q": 16, "max_seqlen_k": 32768, "resident_ctas": 1,
        "num_splits": 1,
    }  # fmt: skip
    # Keys the plan adds win: the kernel's name and the key-group split.
    named = planning_build(kernel="paged_attention_kernel<128, 128, __half, 3>", key_groups=2)
    facts = cuda_tiles(named, 128, "float16", "float8_e5m2", 128)
    assert facts.kernel == "paged_attention_kernel<128, 128, __half, 3>" and facts.key_groups == 2
    # The plan's kernel template (the 128-row tile) names the kernel; key_groups gets its rows.
    wide = planning_build(kernel_name="paged_attention_kernel_m128")
    facts = cuda_tiles(wide, 128, "bfloat16", "float8_e4m3fn", 128)
    assert facts.kernel == "paged_attention_kernel_m128<128, __nv_bfloat16, 2>"
    assert facts.key_groups == 3
    with pytest.raises(TileFactsError, match="smem_bytes"):
        cuda_tiles(planning_build(drop=("smem_bytes",)), 128, "bfloat16", "float8_e4m3fn", 64)
    # A prefill's plan is asked for its own q and kv lengths (R = 4 x 4096 rows).
    ext = planning_build()
    facts = cuda_tiles(ext, 128, "bfloat16", "float8_e4m3fn", 4 * 4096, kv_len=4096)
    (call,) = ext.calls
    assert (call["num_tokens"], call["max_seqlen_q"], call["max_seqlen_k"]) == (4096, 4096, 4096)
    assert facts.ctas_per_kv_head == 4 * 4096 // 128


ROW_KEYS = {
    "kind": str, "gpu": str, "arch": str, "family": str, "kernel": str, "head_dim": int,
    "q_dtype": str, "cache_dtype": str, "rows_per_kv_head": int, "instr_per_kv_byte": dict,
    "regs": int, "smem_bytes": int, "ctas_per_sm": int, "binding": str,
    "predicted_hbm_fraction": float,
}  # fmt: skip
# A prefill row: the tensor-peak fraction instead of the HBM fraction, with its lengths.
PREFILL_ROW_KEYS = {
    **{key: kind for key, kind in ROW_KEYS.items() if key != "predicted_hbm_fraction"},
    "q_len": int, "kv_len": int, "predicted_tensor_fraction": float,
}  # fmt: skip


def check_schema(document: dict) -> None:
    assert set(document) == {"assumptions", "rows"}
    assert "PREDICTION" in document["assumptions"]["model"]["kind"]
    for gpu in hardware.GPUS:
        entry = document["assumptions"][gpu.name]
        assert entry["sms"] > 0 and entry["clock_hz"] > 1e9 and entry["hbm_bytes_per_s"] > 1e12
        assert entry["sources"]
        assert entry["dense_16bit_flops"] > 1e14
    assert "dense 16-bit tensor peak" in document["assumptions"]["model"]["prefill_rows"]
    assert document["rows"]
    for row in document["rows"]:
        keys = PREFILL_ROW_KEYS if row["kind"] == "prefill" else ROW_KEYS
        assert set(row) == set(keys)
        for key, kind in keys.items():
            assert isinstance(row[key], kind), (key, row[key])
        assert row["gpu"] in ("H200", "B200") and row["arch"].startswith("sm_")
        assert row["q_dtype"] in ("bfloat16", "float16")
        assert row["cache_dtype"] in ("float8_e4m3fn", "float8_e5m2")
        assert set(row["instr_per_kv_byte"]) == set(pipes.PIPES)
        if row["kind"] == "prefill":
            assert row["q_len"] == row["kv_len"] == row["rows_per_kv_head"] // 4
            assert 0 < row["predicted_tensor_fraction"] <= 1
            assert row["binding"] in ("issue", *pipes.PIPES)  # memory is not modelled
        else:
            assert row["kind"] == "drafter"
            assert 0 < row["predicted_hbm_fraction"] <= 1
            assert row["binding"] in ("hbm", "issue", *pipes.PIPES)


def test_json_and_markdown_schema(tiny_kernel, tmp_path):
    facts = TileFacts("mma_sync", "tiny", 64, 1, 16, 128, 4096, 1, "test")
    shape = rows.Shape(64, "bfloat16", "float8_e4m3fn", 64)
    row = rows.make_row(hardware.H200, tiny_kernel, facts, shape, "test")
    prefill_facts = TileFacts("mma_sync", "tiny", 64, 256, 16, 128, 4096, 1, "test")
    prefill = rows.make_row(hardware.H200, tiny_kernel, prefill_facts, rows.prefill_shape(4096), "")
    json_path, md_path = report.write(tmp_path, [row, prefill])
    check_schema(json.loads(json_path.read_text()))
    table = md_path.read_text()
    assert "PREDICTED" in table and "(predicted)" in table and "[test] tiny" in table
    headline, _, all_rows = table.partition("All drafter shapes:")
    assert "| - | mma_sync | H200 (sm_90a) | " in headline and "| q=kv=4096 |" in headline
    percent = f"{100 * prefill['predicted_tensor_fraction']:.0f}% ({prefill['binding']})"
    assert percent in headline and "dense 16-bit tensor peak" in headline
    assert "`predicted_tensor_fraction`" in headline  # the schema addition, explained
    drafter_table, _, prefill_table = all_rows.partition("Prefill shapes")
    assert drafter_table.count("| H200 | sm_90a |") == 1 and "| 16384 |" not in drafter_table
    assert "| 4096 | 128 | bfloat16 | float8_e4m3fn | 16384 |" in prefill_table
    # A file written before prefill rows existed (rows without a kind) still reads as drafters.
    old = {key: value for key, value in row.items() if key != "kind"}
    assert "| test | mma_sync | H200 (sm_90a) | - | " in report.summary([old], head_dim=64)


@pytest.mark.parametrize(
    "gpu, opcode, expected",
    [
        (hardware.H200, "HGMMA", 1.0),  # wgmma at its full rate is the dense peak
        (hardware.H200, "HMMA", 0.5),  # mma.sync: half of it
        (hardware.B200, "UTCHMMA", 1.0),
        (hardware.B200, "HMMA", 0.25),  # mma.sync on B200: a quarter of tcgen05
    ],
)
def test_tensor_peak_fraction_of_a_kernel_bound_by_its_mma_alone(gpu, opcode, expected):
    """R rows x 2 x head_dim MACs per key over 2 x head_dim FP8 bytes: R MACs per KV byte, and
    2R FLOPs of the mask per KV byte; with nothing else issued the tensor pipe sets the time."""
    shape = rows.prefill_shape(4096)
    assert shape.rows == 16384 and shape.flops_per_kv_byte == 2 * 16384
    instr = dict.fromkeys(pipes.PIPES, 0.0)
    prediction = bound(gpu, instr, {opcode: float(shape.rows)})
    assert tensor_peak_fraction(gpu, prediction, shape.flops_per_kv_byte) == (
        pytest.approx(expected),
        pipes.TENSOR,
    )
    # Another pipe needing four times the tensor time (integer: 8T instructions at 2 per
    # clock; issue 8T / 4) binds instead, and the fraction drops to a quarter.
    instr[pipes.INTEGER] = 2.0 * prediction.cycles_per_kv_byte[pipes.TENSOR] * gpu.issue_per_clk
    slowed = bound(gpu, instr, {opcode: float(shape.rows)})
    fraction, binding = tensor_peak_fraction(gpu, slowed, shape.flops_per_kv_byte)
    assert binding == pipes.INTEGER and fraction == pytest.approx(expected / 4)


def test_prefill_fraction_on_tiny_kernel_by_hand(tiny_kernel):
    """The tiny kernel as a 64-row, 16-key prefill kernel: per KV byte, every pipe's count x
    (R / 64 CTAs x 4 warps) / (2 x 16 keys x 64 dims); fraction = 2R FLOP/B x SMs x clock /
    binding cycles / peak = R / (2048 x binding cycles per byte) on H200 (peak = SMs x clock
    x 4096 FLOP)."""
    shape = rows.Shape(64, "bfloat16", "float8_e4m3fn", 4 * 1024, prefill_len=1024)
    facts = TileFacts("mma_sync", "tiny", 64, shape.rows // 64, 16, 128, 0, 1, "test")
    counts = loop_counts.count_main_loop(tiny_kernel.sass)
    row = rows.make_row(hardware.H200, tiny_kernel, facts, shape, "", counts)
    scale = (shape.rows // 64) * 4 / (2 * 16 * 64)
    # Warp-instructions per clock per SM (hardware.py's table), by hand.
    rates = {pipes.FP32: 4, pipes.INTEGER: 2, pipes.CONVERSION: 0.5, pipes.MUFU: 0.5,
             pipes.LSU: 1, pipes.CONTROL: 4}  # fmt: skip
    cycles = {p: counts.per_pipe[p] * scale / rate for p, rate in rates.items()}
    cycles["issue"] = counts.path_instructions * scale / 4
    cycles[pipes.TENSOR] = 2048 * scale / 1024  # one HMMA.16816 (2048 MACs) per iteration
    assert counts.per_pipe[pipes.TENSOR] == 1
    assert cycles[row["binding"]] == pytest.approx(max(cycles.values()))
    expected = min(1.0, shape.rows / (2048 * max(cycles.values())))
    assert row["predicted_tensor_fraction"] == pytest.approx(expected, abs=1e-4)
    assert (row["kind"], row["q_len"], row["kv_len"]) == ("prefill", 1024, 1024)
    # Twice the rows in twice the CTAs: the same fraction (no prologue is modelled).
    longer = rows.Shape(64, "bfloat16", "float8_e4m3fn", 8 * 1024, prefill_len=2048)
    facts2 = TileFacts("mma_sync", "tiny", 64, longer.rows // 64, 16, 128, 0, 1, "test")
    row2 = rows.make_row(hardware.H200, tiny_kernel, facts2, longer, "", counts)
    assert row2["predicted_tensor_fraction"] == row["predicted_tensor_fraction"]


def test_shape_set_adds_the_prefill_shapes_for_their_configuration():
    from benchmarks import shapes as bench_shapes

    every = list(rows.ShapeSet())
    prefill = [s for s in every if s.kind == "prefill"]
    assert prefill == [rows.prefill_shape(n) for n in (4096, 8192, 16384)]
    for shape in prefill:
        assert (shape.head_dim, shape.q_dtype, shape.cache_dtype) == (
            128,
            "bfloat16",
            "float8_e4m3fn",
        )
        # The benchmark's shape: its mask's FLOPs over the KV bytes it reads.
        bench = bench_shapes.prefill(shape.prefill_len)
        assert shape.flops_per_kv_byte == bench.flops / bench.kv_bytes()
        assert shape.rows == bench.q_len * bench.num_q_heads // bench.num_kv_heads
    assert len(every) - len(prefill) == 3 * 2 * 2 * 3  # the drafter shapes are unchanged
    assert not [s for s in rows.ShapeSet(head_dims=(64,)) if s.kind == "prefill"]
    assert not [s for s in rows.ShapeSet(prefill_lens=()) if s.kind == "prefill"]


def built_extension() -> Path | None:
    found = sorted((ROOT / "fp8_noncausal_attn").glob("_C*.so"))
    return found[0] if found else None


@pytest.mark.skipif(built_extension() is None, reason="CUDA extension _C not built")
def test_tool_covers_every_built_arch_and_shape(tmp_path):
    """CI: the tool over the freshly built _C; one row per modelled arch x shape of head_dim 128,
    a bf16 query and an e4m3 cache (the other head dims and dtypes run other kernels of the same
    code: modelling them all took 150 s of CI's 20 minutes)."""
    narrowed = ["--head-dim", "128", "--q-dtype", "bfloat16", "--cache-dtype", "float8_e4m3fn"]
    result = subprocess.run(
        [sys.executable, "-m", "tools.sass_model", "--out", str(tmp_path), "--no-triton",
         *narrowed],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads((tmp_path / "sass-model.json").read_text())
    check_schema(document)
    archs = {k.arch for k in cubins.read_library(built_extension()) if rows.gpu_for(k.arch)}
    assert archs, "no cubin for a modelled GPU in the build"
    shapes = rows.ShapeSet(
        head_dims=(128,), q_dtypes=("bfloat16",), cache_dtypes=("float8_e4m3fn",)
    )
    expected = {
        (arch, s.head_dim, s.q_dtype, s.cache_dtype, s.rows) for arch in archs for s in shapes
    }
    got = [
        (r["arch"], r["head_dim"], r["q_dtype"], r["cache_dtype"], r["rows_per_kv_head"])
        for r in document["rows"]
    ]
    assert sorted(got) == sorted(expected)
    assert {r["family"] for r in document["rows"]} >= {"mma_sync"}
    assert all(r["ctas_per_sm"] >= 1 for r in document["rows"])
    # Tile facts come from the build's own plan, not a copied formula: each row's
    # shared memory is the plan's dynamic bytes plus the cubin's static bytes.
    (source,) = document["assumptions"]["tile_facts"].values()
    assert "_C.plan" in source
    from fp8_noncausal_attn import _C

    for row in document["rows"]:
        q_len = row["rows_per_kv_head"] // 4
        code = {"float8_e4m3fn": 2, "float8_e5m2": 3}[row["cache_dtype"]]
        plan = _C.plan(
            num_seqs=1, num_tokens=q_len, num_q_heads=32, num_kv_heads=8,
            head_dim=row["head_dim"], cache_dtype=code, max_seqlen_q=q_len, max_seqlen_k=32768,
            resident_ctas=1, num_splits=1,
        )  # fmt: skip
        assert row["smem_bytes"] >= plan["smem_bytes"] > 0


# A warp-specialised kernel: a converter loop (LDGSTS, F2FP) and two MMA-warp loops (UTCHMMA),
# each role entered by a branch on the warp index; role loops are found by signature opcode.
ROLE_LISTING = [
    "S2R R0, SR_TID.X",  # 0x00
    "ISETP.GE.AND P0, PT, R0, 0x80, PT",  # 0x10
    "@P0 BRA 0x80",  # 0x20
    "LDGSTS.E.128 [R2], desc[UR4][R4.64]",  # 0x30 converter loop
    "F2FP.F16.E4M3.UNPACK_B R9, R8",  # 0x40
    "F2FP.F16.E4M3.UNPACK_B R10, R8.H1",  # 0x50
    "STTM.x4 tmem[UR4], R8",  # 0x60
    "@P1 BRA 0x30",  # 0x70
    "ISETP.NE.AND P0, PT, R0, 0x80, PT",  # 0x80
    "@P0 BRA 0xd0",  # 0x90
    "UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT",  # 0xa0 MMA 0
    "SYNCS.ARRIVE.TRANS64 RZ, [UR4], RZ",  # 0xb0
    "@P2 BRA 0xa0",  # 0xc0
    "UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT",  # 0xd0 MMA 1
    "UTCHMMA gdesc[UR4], gdesc[UR6], tmem[UR8], tmem[UR10], idesc[UR12], UPT",  # 0xe0
    "@P3 BRA 0xd0",  # 0xf0
    "EXIT",  # 0x100
]


def test_role_loops_and_per_byte_sum():
    from tools.sass_model import roles

    spec = (
        roles.Role("convert", 4, "LDGSTS", 0, 1024),
        roles.Role("mma_kq", 1, "UTCHMMA", 0, 4096),
        roles.Role("mma_vp", 1, "UTCHMMA", 1, 4096),
    )
    counts = roles.role_counts(sass_listing(ROLE_LISTING), spec)
    assert counts["convert"].per_pipe[pipes.CONVERSION] == 2
    assert counts["convert"].path_instructions == 5
    assert counts["mma_kq"].per_pipe[pipes.TENSOR] == 1
    assert counts["mma_vp"].per_pipe[pipes.TENSOR] == 2
    assert pipes.tensor_macs(counts["mma_vp"].tensor[0][0]) is None  # shape in the descriptor
    per_byte = roles.instr_per_kv_byte(counts, spec, ctas_per_kv_head=2)
    assert per_byte[pipes.CONVERSION] == pytest.approx(2 * 4 * 2 / 1024)
    assert per_byte[pipes.TENSOR] == pytest.approx(2 * (1 + 2) / 4096)
    assert per_byte[pipes.LSU] == pytest.approx(2 * 4 * 2 / 1024)  # LDGSTS + STTM
    with pytest.raises(ValueError, match="no loop #2"):
        roles.role_counts(sass_listing(ROLE_LISTING), (roles.Role("x", 1, "UTCHMMA", 2, 1),))


def test_tool_models_the_triton_drafter_kernel(tmp_path):
    """The Triton kernel, compiled as launched for sm_90 and sm_100 (one shape: 2 compiles)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "tools.sass_model", "--out", str(tmp_path), "--no-cuda",
         "--head-dim", "64", "--rows", "32", "--q-dtype", "bfloat16",
         "--cache-dtype", "float8_e4m3fn"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    document = json.loads((tmp_path / "sass-model.json").read_text())
    check_schema(document)
    got = {(r["gpu"], r["arch"], r["family"], r["kernel"]) for r in document["rows"]}
    assert got == {
        ("H200", "sm_90a", "triton", "_paged_attention_kernel"),
        ("B200", "sm_100a", "triton", "_paged_attention_kernel"),
    }
    for row in document["rows"]:
        assert row["instr_per_kv_byte"][pipes.TENSOR] > 0 and row["ctas_per_sm"] >= 1


def test_triton_rows_model_the_window_and_sink_variant(monkeypatch):
    """--triton-window / --triton-sinks launch the WINDOW / SINKS variant (no compile here)."""
    pytest.importorskip("triton")
    from tools.sass_model import triton_kernels

    compiled_launches = []

    def fake_compile(launch, cc):
        compiled_launches.append((launch, cc))
        metadata = SimpleNamespace(shared=1024)
        return SimpleNamespace(kernel=lambda: None, compiled=SimpleNamespace(metadata=metadata))

    monkeypatch.setattr(triton_kernels, "compile_launch", fake_compile)
    monkeypatch.setattr(rows, "make_row", lambda gpu, kernel, facts, shape, label: label)
    shapes = rows.ShapeSet((64,), ("bfloat16",), ("float8_e4m3fn",), (32,))
    assert rows.triton_rows("window", shapes, window=(64, 64), sinks=True) == ["window"] * 2
    assert rows.triton_rows("", shapes) == [""] * 2
    flags = [(launch.kwargs["WINDOW"], launch.kwargs["SINKS"]) for launch, _ in compiled_launches]
    assert flags == [(True, True)] * 2 + [(False, False)] * 2
    assert [cc for _, cc in compiled_launches] == [90, 100, 90, 100]


def test_triton_rows_launch_the_prefill_over_as_many_keys(monkeypatch):
    """A prefill shape is launched as one sequence of q = kv tokens (no compile here): its
    tile facts give R / BLOCK_M CTAs per KV head, and the row is a prefill row."""
    pytest.importorskip("triton")
    from tools.sass_model import triton_kernels

    launches = []

    def fake_compile(launch, cc):
        launches.append(launch)
        metadata = SimpleNamespace(shared=1024)
        return SimpleNamespace(kernel=lambda: None, compiled=SimpleNamespace(metadata=metadata))

    made = []
    monkeypatch.setattr(triton_kernels, "compile_launch", fake_compile)
    monkeypatch.setattr(rows, "make_row", lambda *args: made.append(args[2:4]))
    shapes = rows.ShapeSet((128,), ("bfloat16",), ("float8_e4m3fn",), (), prefill_lens=(1024,))
    rows.triton_rows("", shapes)
    assert len(made) == 2  # sm_90 and sm_100
    for facts, shape in made:
        assert shape == rows.prefill_shape(1024)
        assert facts.ctas_per_kv_head * facts.rows_per_cta == 4 * 1024
    launch = launches[0]
    assert launch.kwargs["MASK_MODE"] == 0  # non-causal, no window
    seq_lens = [a for a in launch.kwargs.values() if hasattr(a, "tolist") and a.numel() == 1]
    assert [1024] in [a.tolist() for a in seq_lens]


# A converter loop whose copies are specialised per page size and dispatched by a jump table
# (BRX; its cases' offsets live in constant bank 2): case 0x50 (laid out after the BRX) is
# if-converted, predicated unchecked copies falling through to the checked ones; case 0xc0
# shuffles its pages (a small page), case 0x110 does not (a large page).
JUMP_TABLE_LISTING = [
    "S2R R0, SR_TID.X",  # 0x00
    "MOV R1, RZ",  # 0x10
    "LDS R3, [R2]",  # 0x20 loop header
    "LDC R12, c[0x2][R4+0x10]",  # 0x30
    "BRX R12 -0x50",  # 0x40
    "ISETP.GT.AND P0, PT, R5, R6, PT",  # 0x50 case: if-converted
    "@!P0 LDGSTS.E.128 [R8], desc[UR4][R10.64]",  # 0x60
    "@!P0 LDGSTS.E.128 [R8+0x800], desc[UR4][R12.64]",  # 0x70
    "@!P0 BRA 0x150",  # 0x80
    "@P1 LDGSTS.E.128 [R8], desc[UR4][R10.64]",  # 0x90
    "@P2 LDGSTS.E.128 [R8+0x800], desc[UR4][R12.64]",  # 0xa0
    "BRA 0x150",  # 0xb0
    "SHFL.IDX PT, R14, R3, RZ, 0x1f",  # 0xc0 case: two pages per tile
    "SHFL.IDX PT, R15, R3, 0x1, 0x1f",  # 0xd0
    "LDGSTS.E.128 [R8], desc[UR4][R10.64]",  # 0xe0
    "LDGSTS.E.128 [R8+0x800], desc[UR4][R12.64]",  # 0xf0
    "BRA 0x150",  # 0x100
    "IMAD.WIDE.U32 R10, R3, R7, R10",  # 0x110 case: one page per tile
    "LDGSTS.E.128 [R8], desc[UR4][R10.64]",  # 0x120
    "LDGSTS.E.128 [R8+0x800], desc[UR4][R12.64]",  # 0x130
    "BRA 0x150",  # 0x140
    "F2FP.F16.E4M3.UNPACK_B R9, R8",  # 0x150 join: conversion
    "F2FP.F16.E4M3.UNPACK_B R10, R8.H1",  # 0x160
    "@P3 BRA 0x20",  # 0x170 back edge
    "EXIT",  # 0x180
]
# Constant bank 2: the three cases, the join (a default case) and a float constant.
JUMP_TABLE_WORDS = [0x3F800000, 0x50, 0xC0, 0x110, 0x150]


def test_converter_counts_one_page_specialisation_of_a_jump_table():
    """Hand count: each case copies an item with 2 LDGSTS; the plain path picker follows the
    case laid out after the BRX and counts its predicated and checked copies (4)."""
    from tools.sass_model import dsl_families, roles

    convert = roles.Role("convert", 4, "LDGSTS", 0, 1024)
    text = sass_listing(JUMP_TABLE_LISTING)

    def copies(sass_text):
        counts = roles.role_counts(sass_text, (convert,))["convert"]
        return dsl_families._copies(counts), counts.per_pipe[pipes.CONVERSION]

    assert copies(text) == ((4, 0), 2)  # two copy sequences: the bug this guards against
    small = dsl_families.one_page_specialisation(text, convert, JUMP_TABLE_WORDS, 2, 2)
    assert copies(small) == ((2, 2), 2)
    assert "BRA 0xc0" in small and "BRX" not in small
    large = dsl_families.one_page_specialisation(text, convert, JUMP_TABLE_WORDS, 2, 0)
    assert copies(large) == ((2, 0), 2)
    assert "BRA 0x110" in large
    with pytest.raises(ValueError, match="0 jump-table cases issue 2 LDGSTS and 1 SHFL"):
        dsl_families.one_page_specialisation(text, convert, JUMP_TABLE_WORDS, 2, 1)
    # Without a BRX the path is kept, but only if it copies one item once.
    plain = sass_listing(ROLE_LISTING)
    assert dsl_families.one_page_specialisation(plain, convert, [], 1, 0) == plain
    with pytest.raises(ValueError, match="1 LDGSTS per iteration, not 2"):
        dsl_families.one_page_specialisation(plain, convert, [], 2, 0)


def test_tcgen05_copy_signature_follows_the_page_size():
    from tools.sass_model import dsl_families

    assert dsl_families.PAGE_SIZE == 16
    assert dsl_families.tcgen05_copy_signature(16) == (8, 8)  # 8 pages per 128-key tile
    assert dsl_families.tcgen05_copy_signature(32) == (8, 4)
    assert dsl_families.tcgen05_copy_signature(64) == (8, 2)
    assert dsl_families.tcgen05_copy_signature(128) == (8, 0)
    for bad in (8, 24, 512):
        with pytest.raises(ValueError, match="not one of the converter's specialisations"):
            dsl_families.tcgen05_copy_signature(bad)


def test_tcgen05_head_dim_64_work_per_kv_byte():
    """Head_dim 64: a converter item carries 128 keys x 64 bytes, and BMM2 keeps M = 128 (1.5 x
    the useful MACs); head_dim 128 / 256 do exactly 2 x rows x head_dim MACs per 2 x head_dim
    bytes."""
    from tools.sass_model import dsl_families

    shapes = ((64, 32, 8192, 48.0), (128, 64, 16384, 64.0), (256, 32, 16384, 32.0))
    for head_dim, per_cta, item, macs in shapes:
        variant = dsl_families._variant(
            "tcgen05", head_dim, per_cta, None, "bfloat16", "float8_e4m3fn"
        )
        roles, _, _ = dsl_families.family_roles("tcgen05", variant)
        by_name = {r.name: r.kv_bytes_per_iter for r in roles}
        assert by_name == {"softmax": 256 * head_dim, "convert": item, "mma_kq": 256 * head_dim,
                           "mma_vp": 256 * head_dim}  # fmt: skip
        assert dsl_families.macs_per_kv_byte("tcgen05", variant) == macs
    assert dsl_families.macs_per_kv_byte("wgmma", SimpleNamespace(rows=64)) == 64.0


# A tcgen05 converter loop: one copy, then a K item (one ring read and conversion: head_dim 64
# converts only the dims BMM1 reads) or a V item (two reads and conversions).
CONVERTER_LISTING = [
    "S2R R0, SR_TID.X",  # 0x00
    "LDS R3, [R2]",  # 0x10 loop header
    "LDGSTS.E.128 [R8], desc[UR4][R10.64]",  # 0x20
    "ISETP.NE.AND P0, PT, R5, RZ, PT",  # 0x30
    "@P0 BRA 0x90",  # 0x40 V item
    "LDSM.16.M88.4 R12, [R9]",  # 0x50 K item
    "F2FP.F16.E4M3.UNPACK_B R13, R12",  # 0x60
    "IADD3 R1, R1, 0x1, RZ",  # 0x70
    "BRA 0xe0",  # 0x80
    "LDSM.16.MT88.4 R12, [R9]",  # 0x90
    "LDSM.16.MT88.4 R16, [R9+0x200]",  # 0xa0
    "F2FP.F16.E4M3.UNPACK_B R13, R12",  # 0xb0
    "F2FP.F16.E4M3.UNPACK_B R14, R16",  # 0xc0
    "IADD3 R1, R1, 0x1, RZ",  # 0xd0
    "@P3 BRA 0x10",  # 0xe0 back edge
    "EXIT",  # 0xf0
]


def test_tcgen05_converter_counts_the_mean_of_its_k_and_v_items():
    """The steady-state path alone takes the cheaper K item (1 conversion); the converter's
    item is the mean of it and the V item (2 conversions, the most ring reads)."""
    from tools.sass_model import dsl_families, roles

    convert = roles.Role("convert", 4, "LDGSTS", 0, 8192)
    text = sass_listing(CONVERTER_LISTING)
    alone = roles.role_counts(text, (convert,))["convert"]
    assert alone.per_pipe[pipes.CONVERSION] == 1
    mean = dsl_families.converter_item_counts(text, convert)
    assert mean.per_pipe[pipes.CONVERSION] == 1.5
    total = sum(mean.per_pipe.values())
    assert (sum(alone.per_pipe.values()), total) == (9, (9 + 10) / 2)  # K path 9, V path 10


def test_sass_model_counts_k_and_v_per_producer_iteration():
    """The producer's loop (kernel.producer_role) stages the K and the V item of one key tile
    per iteration: the SASS model must divide its instructions by both items' FP8 bytes."""
    from dsl.wgmma import traits as wgmma_traits
    from tools.sass_model.dsl_families import family_roles

    v = wgmma_traits.Variant(128, 2, "bfloat16")
    roles, threads, _ = family_roles("wgmma", v)
    per_iter = {role.name: role.kv_bytes_per_iter for role in roles}
    assert per_iter == {"producer": 2 * v.key_tile * 128, "consumer": 2 * v.key_tile * 128}
    assert threads == v.threads
