"""Warp-specialised kernels: one loop per warp role (load / convert / MMA / softmax).

Each role's warps run their own loop over the KV; the model sums every role's warp-instructions
per KV byte (role loop count x the role's warps / the KV bytes one iteration of that loop
covers). A role's loop is found by a signature opcode it alone issues in a loop (e.g. MUFU for
softmax, LDGSTS for the converter, UTCHMMA for the MMA warps, taken in address order when two
roles share it).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import pipes
from .cfg import ControlFlowGraph
from .loop_counts import LoopCounts, count_loop
from .sass import parse


@dataclass(frozen=True)
class Role:
    """name; warps per CTA; signature opcode base; which loop holding it (address order);
    KV bytes (K and V) one iteration of the role's loop covers."""

    name: str
    warps: int
    signature: str
    occurrence: int
    kv_bytes_per_iter: int


def role_loop(graph: ControlFlowGraph, role: Role):
    """The loop of ``role``: the ``role.occurrence``-th innermost loop (in code order) holding
    its signature instruction."""
    loops = sorted(graph.loops(), key=lambda loop: graph.blocks[loop.header].start)
    holding = [
        loop
        for loop in loops
        if any(i.base == role.signature for i in graph.loop_instructions(loop))
    ]
    # An outer (e.g. persistent tile) loop around a role's KV loop holds its signature too:
    # keep the innermost loops, those containing no other loop that holds it.
    innermost = [
        loop for loop in holding if not any(o.body < loop.body for o in holding if o != loop)
    ]
    if len(innermost) <= role.occurrence:
        raise ValueError(f"role {role.name}: no loop #{role.occurrence} with {role.signature}")
    return innermost[role.occurrence]


def role_counts(sass_text: str, roles: tuple[Role, ...]) -> dict[str, LoopCounts]:
    """Per-warp counts of one steady-state iteration of each role's loop."""
    graph = ControlFlowGraph(parse(sass_text))
    return {role.name: count_loop(graph, role_loop(graph, role)) for role in roles}


def instr_per_kv_byte(
    counts: dict[str, LoopCounts], roles: tuple[Role, ...], ctas_per_kv_head: int
) -> dict[str, float]:
    """Warp-instructions per KV byte by pipe, summed over every role's warps."""
    total = dict.fromkeys(pipes.PIPES, 0.0)
    for role in roles:
        scale = ctas_per_kv_head * role.warps / role.kv_bytes_per_iter
        for pipe, n in counts[role.name].per_pipe.items():
            total[pipe] += n * scale
    return total
