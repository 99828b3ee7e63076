"""Parsing ``cuobjdump -sass`` text into instructions with their branch targets."""

from __future__ import annotations

import re
from dataclasses import dataclass

# "/*0d90*/   @!P3 BRA 0x1030 ;   /* 0x0000... */"
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PREDICATE = re.compile(r"^@(!?U?P[0-9T])\s+")
_HEX = re.compile(r"\b0x([0-9a-f]+)\b")
# A branch conditional on a predicate operand: "BRA.U !UP0, 0x1580", "BRA.DIV UR4, 0x...".
_OPERAND_CONDITION = re.compile(r"^!?U?P[0-6T]\b|^UR\d+\s*,")

# Opcodes that transfer control to an immediate target (the last hex operand).
_BRANCHES = {"BRA", "JMP", "BRX", "JMX"}
# Opcodes after which execution does not fall through (when unpredicated).
_TERMINATORS = {"EXIT", "RET", "BRA", "JMP", "BRX", "JMX", "KILL"}


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction. ``offset`` is its byte offset in the function."""

    offset: int
    predicate: str | None  # "P0", "!P3", "UPT" ... or None
    opcode: str  # with modifiers, e.g. "HMMA.16816.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        """Opcode without modifiers, e.g. "HMMA"."""
        return self.opcode.split(".", 1)[0]

    @property
    def always(self) -> bool:
        """Executes unconditionally (no predicate, or the true predicate PT / UPT)."""
        return self.predicate is None or self.predicate in ("PT", "UPT")

    @property
    def target(self) -> int | None:
        """Immediate branch target of a direct branch, else None."""
        if self.base not in _BRANCHES:
            return None
        targets = _HEX.findall(self.operands)
        return int(targets[-1], 16) if targets else None

    @property
    def ends_flow(self) -> bool:
        """Control never falls through to the next instruction."""
        conditional = bool(_OPERAND_CONDITION.match(self.operands))
        return self.base in _TERMINATORS and self.always and not conditional

    @property
    def transfers(self) -> bool:
        """Ends a basic block (any branch or terminator, predicated or not)."""
        return self.base in _TERMINATORS


def parse(sass: str) -> list[Instruction]:
    """Instructions of one function's SASS, in address order."""
    instructions = []
    for match in _LINE.finditer(sass):
        text = match.group(2).strip()
        if not text or text.startswith("0x"):
            continue  # the second (encoding-only) line of a 128-bit instruction
        predicate = None
        pm = _PREDICATE.match(text)
        if pm:
            predicate = pm.group(1)
            text = text[pm.end() :]
        opcode, _, operands = text.partition(" ")
        offset = int(match.group(1), 16)
        instructions.append(Instruction(offset, predicate, opcode, operands.strip()))
    return instructions
