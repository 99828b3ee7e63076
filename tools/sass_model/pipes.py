"""Which execution pipe each SASS opcode issues to, and the tensor work of MMA instructions.

The classes are the model's columns (``PIPES``). Tensor instructions of every family fit here:
``HMMA`` (mma.sync), ``HGMMA`` (wgmma, sm_90a) and ``UTC*MMA`` (tcgen05, sm_100a); their shape
(multiply-accumulates per instruction) comes from the opcode where SASS spells it (HMMA.16816,
HGMMA.64x128x16) and from the family's tile facts where it does not (tcgen05 descriptors).
"""

from __future__ import annotations

import re

from .sass import Instruction

TENSOR = "tensor"
FP32 = "fp32"
CONVERSION = "conversion"
MUFU = "mufu"
LSU = "lsu"
CONTROL = "control"
INTEGER = "integer"
PIPES = (TENSOR, FP32, CONVERSION, MUFU, LSU, CONTROL, INTEGER)

_OPCODES = {
    TENSOR: "HMMA IMMA BMMA DMMA QMMA OMMA HGMMA IGMMA QGMMA BGMMA UTCHMMA UTCQMMA UTCIMMA "
    "UTCOMMA UTCMMA",
    # FP32 / FP16x2 datapath (the FMA pipes), fp64 included for completeness.
    FP32: "FADD FMUL FFMA FADD32I FMUL32I FFMA32I FMNMX FMNMX3 FSETP FSET FSEL FCHK FSWZADD "
    "FADD2 FMUL2 FFMA2 HADD2 HMUL2 HFMA2 HADD2_32I HMUL2_32I HFMA2_32I HMNMX2 HSETP2 HSET2 "
    "DADD DMUL DFMA DSETP DMNMX UFADD UFMUL UFFMA UFSEL UFSETP UFMNMX",
    CONVERSION: "F2F F2FP F2I F2IP I2F I2FP I2I I2IP FRND UI2F UF2I UF2F UI2FP UF2FP",
    MUFU: "MUFU",
    # Load/store unit: shared, global, local, constant and tensor memory, shuffles, TMA.
    LSU: "LDS STS LDSM STSM LDG STG LDGSTS LD ST LDL STL LDC ULDC LDCU ATOM ATOMS ATOMG RED "
    "REDG REDUX CREDUX SHFL MATCH LDTM STTM UTMALDG UTMASTG UTMAPF UTMAREDG UBLKCP UBLKRED UBLKPF "
    "UTCCP UTCSHIFT LDGMC CCTL",
    CONTROL: "BRA BRX JMP JMX CALL RET EXIT KILL BSSY BSYNC BREAK BMOV WARPSYNC BAR "
    "DEPBAR LDGDEPBAR NOP YIELD VOTE VOTEU S2R S2UR CS2R NANOSLEEP MEMBAR FENCE ERRBAR "
    "SYNCS ELECT UCGABAR ACQBULK ACQSHMINIT WARPGROUP USETMAXREG SETMAXREG PMTRIG BPT "
    "UTCBAR UTCATOMSWS ENDCOLLECTIVE ARRIVES",
    INTEGER: "IMAD IMAD32I IADD IADD3 IADD32I LEA LOP LOP3 LOP32I SHF SHL SHR ISETP IMNMX "
    "VIMNMX VIMNMX3 IABS SEL MOV MOV32I PRMT POPC FLO BREV BMSK PLOP3 P2R R2P R2UR IDP "
    "IMUL VIADD VIADDMNMX VABSDIFF VABSDIFF4 LEPC SGXT UIADD3 UIMAD UMOV ULOP3 ULOP USHF "
    "ULEA USEL UPRMT UISETP UPLOP3 USGXT UFLO UPOPC UBREV UBMSK UP2UR UR2UP UVIRTCOUNT "
    "IDE FMNMX.INT",
}
_PIPE_OF = {op: pipe for pipe, ops in _OPCODES.items() for op in ops.split()}

# m16n8k16 -> 16*8*16 multiply-accumulates; HGMMA.64x128x16 -> 64*128*16.
_MMA_SHAPE = re.compile(r"\.(?:(\d+)x(\d+)x(\d+)|(16)(8)(16|8|32)|(8)(8)(4|16|32))(?:\.|$)")


def pipe_of(ins: Instruction) -> str:
    """The pipe class of one instruction; unknown opcodes count as integer/address work."""
    return _PIPE_OF.get(ins.base, INTEGER)


def is_known(ins: Instruction) -> bool:
    return ins.base in _PIPE_OF


def is_tensor(ins: Instruction) -> bool:
    return _PIPE_OF.get(ins.base) == TENSOR


def is_global_load(ins: Instruction) -> bool:
    """Loads that bring KV bytes on chip (the steady-state work besides MMA)."""
    return ins.base in ("LDGSTS", "LDG", "UTMALDG", "UBLKCP")


def tensor_macs(ins: Instruction) -> int | None:
    """Multiply-accumulates of one tensor instruction (per warp, or per warpgroup for HGMMA),
    or None where SASS does not spell the shape (tcgen05: it lives in the instruction
    descriptor, so the family's tile facts supply it)."""
    if not is_tensor(ins):
        return 0
    match = _MMA_SHAPE.search(ins.opcode)
    if match is None:
        return None
    dims = [int(g) for g in match.groups() if g is not None]
    return dims[0] * dims[1] * dims[2]
