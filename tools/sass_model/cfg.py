"""Control-flow graph of one SASS function and its loops (back edges, natural loops).

A kernel's main loop is the natural loop holding the most tensor-core instructions (the KV tile
loop of an attention kernel); without any, the loop holding the most instructions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .sass import Instruction


@dataclass
class Block:
    """A basic block: instructions [start, end) of the function's instruction list."""

    index: int
    start: int
    end: int
    successors: list[int] = field(default_factory=list)
    predecessors: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Loop:
    """A natural loop: its header block, the blocks with a back edge to it, and its body."""

    header: int
    latches: tuple[int, ...]
    body: frozenset[int]


class ControlFlowGraph:
    """Basic blocks of a function; block 0 is the entry."""

    def __init__(self, instructions: Sequence[Instruction]):
        self.instructions = list(instructions)
        self.blocks = self._split()
        self._link()
        self.dominators = self._dominators()

    def _split(self) -> list[Block]:
        by_offset = {ins.offset: i for i, ins in enumerate(self.instructions)}
        leaders = {0}
        for i, ins in enumerate(self.instructions):
            if ins.target is not None and ins.target in by_offset:
                leaders.add(by_offset[ins.target])
            if ins.transfers and i + 1 < len(self.instructions):
                leaders.add(i + 1)
        starts = sorted(leaders)
        ends = starts[1:] + [len(self.instructions)]
        return [Block(n, s, e) for n, (s, e) in enumerate(zip(starts, ends, strict=True))]

    def _link(self) -> None:
        block_at = {b.start: b.index for b in self.blocks}
        by_offset = {ins.offset: i for i, ins in enumerate(self.instructions)}
        for block in self.blocks:
            last = self.instructions[block.end - 1]
            succ = []
            if last.target is not None and last.target in by_offset:
                succ.append(block_at[by_offset[last.target]])
            if not last.ends_flow and block.end < len(self.instructions):
                succ.append(block_at[block.end])
            block.successors = sorted(set(succ))
            for s in block.successors:
                self.blocks[s].predecessors.append(block.index)

    def reachable(self) -> list[int]:
        seen, stack = {0}, [0]
        while stack:
            for s in self.blocks[stack.pop()].successors:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return sorted(seen)

    def _dominators(self) -> dict[int, set[int]]:
        nodes = self.reachable()
        node_set = set(nodes)
        dom = {n: set(nodes) for n in nodes}
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for n in nodes[1:]:
                preds = [p for p in self.blocks[n].predecessors if p in node_set]
                new = set.intersection(*(dom[p] for p in preds)) if preds else set()
                new = new | {n}
                if new != dom[n]:
                    dom[n], changed = new, True
        return dom

    def loops(self) -> list[Loop]:
        """Natural loops, one per header (back edges to one header are merged)."""
        latches: dict[int, list[int]] = {}
        for n, doms in self.dominators.items():
            for s in self.blocks[n].successors:
                if s in doms:  # n -> s with s dominating n: a back edge
                    latches.setdefault(s, []).append(n)
        loops = []
        for header, tails in sorted(latches.items()):
            body, stack = {header}, list(tails)
            while stack:
                n = stack.pop()
                if n not in body:
                    body.add(n)
                    stack.extend(self.blocks[n].predecessors)
            loops.append(Loop(header, tuple(sorted(tails)), frozenset(body)))
        return loops

    def block_instructions(self, index: int) -> list[Instruction]:
        block = self.blocks[index]
        return self.instructions[block.start : block.end]

    def loop_instructions(self, loop: Loop) -> list[Instruction]:
        return [ins for b in sorted(loop.body) for ins in self.block_instructions(b)]

    def every_iteration(self, loop: Loop) -> frozenset[int]:
        """Blocks of the loop executed on every iteration: those dominating all its latches."""
        return frozenset(b for b in loop.body if all(b in self.dominators[t] for t in loop.latches))

    def main_loop(self, is_tensor: Callable[[Instruction], bool]) -> Loop:
        """The loop with the most tensor instructions (then the most instructions)."""
        loops = self.loops()
        if not loops:
            raise ValueError("no loop in this function")

        def weight(loop: Loop) -> tuple[int, int]:
            body = self.loop_instructions(loop)
            return sum(map(is_tensor, body)), len(body)

        return max(loops, key=weight)

    def steady_state_path(self, loop: Loop, is_work: Callable[[Instruction], bool]) -> list[int]:
        """Blocks of one steady-state iteration: the path from the header to a latch that
        executes the most work instructions (MMA and KV loads) and, among those, the fewest
        others, so masking, tail and slow-path blocks are skipped and guarded tiles are taken.
        Inner loops count once (their back edges are cut)."""
        best: dict[int, tuple[tuple[int, int], list[int]]] = {}

        def score(b: int) -> tuple[int, int]:
            body = self.block_instructions(b)
            work = sum(map(is_work, body))
            return work, -(len(body) - work)

        order = self._topological(loop)
        for b in reversed(order):
            own = score(b)
            options = []
            if b in loop.latches:
                options.append(((0, 0), []))
            for s in self.blocks[b].successors:
                forward = s in loop.body and s not in self.dominators[b]  # not a back edge
                if forward and s in best:
                    options.append(best[s])
            if not options:
                continue
            (w, o), path = max(options, key=lambda item: item[0])
            best[b] = ((own[0] + w, own[1] + o), [b] + path)
        return best[loop.header][1]

    def _topological(self, loop: Loop) -> list[int]:
        """Loop blocks in an order where every forward (non-back) edge goes left to right."""
        seen: set[int] = set()
        order: list[int] = []

        def visit(b: int) -> None:
            seen.add(b)
            for s in self.blocks[b].successors:
                if s in loop.body and s not in seen and s not in self.dominators[b]:
                    visit(s)
            order.append(b)

        visit(loop.header)
        return order[::-1]
