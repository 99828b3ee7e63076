"""Warp-instructions per pipe in one steady-state iteration of a kernel's main loop."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from . import pipes
from .cfg import ControlFlowGraph, Loop
from .sass import Instruction, parse


def _is_work(ins: Instruction) -> bool:
    return pipes.is_tensor(ins) or pipes.is_global_load(ins) or pipes.pipe_of(ins) == pipes.MUFU


@dataclass
class LoopCounts:
    """Per-warp counts of one main-loop iteration.

    ``per_pipe``: warp-instructions per pipe, with the blocks holding MMA / exp work weighted by
    1 / key_groups where a run-time split shares them out (a warp does that share of the tile;
    :func:`key_group_loop`); ``tensor_by_opcode``: tensor
    instructions per opcode base (weighted the same way), for the MAC arithmetic;
    ``opcodes``: unweighted opcode histogram of the iteration (for the notes).
    """

    per_pipe: dict[str, float]
    tensor: list[tuple[Instruction, float]]
    opcodes: Counter
    loop_instructions: int  # static size of the whole loop body (all paths)
    path_instructions: int  # one steady-state iteration (unweighted)
    unknown_opcodes: set[str] = field(default_factory=set)


def count_loop(
    graph: ControlFlowGraph,
    loop: Loop,
    key_groups: int = 1,
    is_work: Callable[[Instruction], bool] = _is_work,
) -> LoopCounts:
    """Counts one steady-state iteration of ``loop`` for one warp: the path with the most
    ``is_work`` instructions (default: MMA, KV loads, exp), then the fewest others."""
    path = graph.steady_state_path(loop, is_work)
    per_pipe = dict.fromkeys(pipes.PIPES, 0.0)
    tensor: list[tuple[Instruction, float]] = []
    opcodes: Counter = Counter()
    unknown: set[str] = set()
    for b in path:
        body = graph.block_instructions(b)
        shared = any(pipes.is_tensor(i) or pipes.pipe_of(i) == pipes.MUFU for i in body)
        weight = 1.0 / key_groups if shared else 1.0
        for ins in body:
            per_pipe[pipes.pipe_of(ins)] += weight
            opcodes[ins.opcode] += 1
            if pipes.is_tensor(ins):
                tensor.append((ins, weight))
            if not pipes.is_known(ins):
                unknown.add(ins.base)
    return LoopCounts(
        per_pipe=per_pipe,
        tensor=tensor,
        opcodes=opcodes,
        loop_instructions=len(graph.loop_instructions(loop)),
        path_instructions=sum(len(graph.block_instructions(b)) for b in path),
        unknown_opcodes=unknown,
    )


def key_group_loop(graph: ControlFlowGraph, key_groups: int) -> tuple[Loop, int]:
    """The key loop a warp of one of ``key_groups`` key groups runs, and the weight divisor
    still to apply to its MMA / exp blocks.

    A kernel that compiles one key loop per key-group count (the mma.sync family's
    ``stream_keys<..., kNG>``) has a loop holding 1 / key_groups of the MMAs of its largest
    one: that loop is the warp's own share, counted as it is (divisor 1). A kernel with one
    loop whose MMA blocks are guarded at run time (the pre-plan build) has none: its largest
    loop is counted with those blocks weighted by 1 / key_groups."""
    main = graph.main_loop(pipes.is_tensor)
    if key_groups == 1:
        return main, 1

    def tensor_count(loop: Loop) -> int:
        return sum(map(pipes.is_tensor, graph.loop_instructions(loop)))

    most = tensor_count(main)
    shares = [loop for loop in graph.loops() if tensor_count(loop) * key_groups == most]
    if shares:
        return max(shares, key=lambda loop: len(graph.loop_instructions(loop))), 1
    return main, key_groups


def count_main_loop(sass_text: str, key_groups: int = 1) -> LoopCounts:
    """Finds the key loop one warp runs for ``key_groups`` key groups (:func:`key_group_loop`)
    in one function's SASS and counts one steady-state iteration."""
    graph = ControlFlowGraph(parse(sass_text))
    loop, divisor = key_group_loop(graph, key_groups)
    return count_loop(graph, loop, divisor)
