"""Helpers the two CUTLASS-DSL families' tests share (tcgen05 and wgmma): the CPU emulations'
shared cases and planted bugs (their driver: helpers/dsl_emulation.py), the AOT library's
variant-name check, the kept PTX's synchronisation checks, and the build the build tests read,
cached by its inputs' hash."""

import ctypes
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from dsl.common import indexing as X
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.synthetic import PagedCase, make_case


def check_library_names_every_variant(library_path: Path, family: str, record: dict) -> None:
    """The AOT library loads without a GPU, counts and names every built variant
    (``variant@arch``), and refuses an unknown index before anything touches CUDA."""
    library = ctypes.CDLL(str(library_path))
    variant_name = getattr(library, f"fp8nca_{family}_variant_name")
    variant_name.restype = ctypes.c_char_p
    assert getattr(library, f"fp8nca_{family}_variant_count")() == len(record["variants"])
    for entry in record["variants"]:
        name = variant_name(entry["index"]).decode()
        assert name == f"{entry['variant']}@{entry['arch']}"
    assert variant_name(len(record["variants"])) is None
    run = getattr(library, f"fp8nca_{family}_run")
    run.restype = ctypes.c_int
    assert run(len(record["variants"])) == -1


EXTREME_SCORE_LOG2 = -300.0  # scores x scale of extreme_scale_case, in log2 units


def extreme_scale_case(
    tokens: int, query_exponent: int, key_exponent: int, seed: int
) -> tuple[PagedCase, dict]:
    """(case, extra reference kwargs: the window) with extreme but valid scales and rows whose
    first key tiles (of 128 keys) hold no key for them. Query entries in [1, 2) x
    2^query_exponent, keys -(1 + N(0, 0.1)) x 2^key_exponent in an e4m3 cache (random, every
    score negative), head_dim 128, GQA 4, every KV head's k_scale set so that scores x scale
    are about EXTREME_SCORE_LOG2 with a spread of a few units across keys (a real softmax).
    Two sequences over one window (left, 0): a bidirectional drafter block (q_len 40 over 1000
    keys) whose left edge puts the first visible key of query token ``tokens - 1`` (the last of
    the first row tile when a row tile holds ``tokens`` tokens) exactly on key 768 = 6 x 128 (the
    tile before is masked and empty for it, the one after is whole), and a causal prefill (150
    of 450) whose row tiles straddle the window's edges (masked tiles give rows their first key
    past their CTA's first tile)."""
    left = 960 + tokens - 1 - 768
    case = make_case(
        [40, 150], [1000, 450], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
        causal=[False, True], causal_dtype=torch.bool, seed=seed,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    query = (1 + torch.rand(case.query.shape, generator=gen)) * 2.0**query_exponent
    case.query.copy_(query.to(case.query.dtype))
    keys = -(1 + 0.1 * torch.randn(case.key_cache.shape, generator=gen)) * 2.0**key_exponent
    case.key_cache.copy_(keys.to(case.key_cache.dtype))
    softmax_scale = case.query.shape[-1] ** -0.5
    mean_score = case.query.shape[-1] * 1.5 * 2.0 ** (query_exponent + key_exponent)
    case.k_scale.fill_(-EXTREME_SCORE_LOG2 / (mean_score * softmax_scale * math.log2(math.e)))
    return case, {"window": (left, 0)}


# (token, query head) rows of tiny_query_rows_case and the power of two each is scaled by: below
# 2^-111 (max |q| ~2^-119, ~2^-112) precision.row_scale_exponent is clamped to 126 (unclamped,
# 2^e is inf in fp32, or 2^-e subnormal); 0.0 is an all-zero row.
TINY_QUERY_ROWS = {(0, 1): 2.0**-120, (3, 1): 2.0**-120, (17, 6): 2.0**-113, (5, 2): 0.0}


def tiny_query_rows_case(seed: int) -> PagedCase:
    """A random bf16 case (head_dim 128, GQA 4, a bidirectional and a causal sequence) whose
    TINY_QUERY_ROWS are scaled to ~2^-120 / ~2^-112 or zeroed; the other rows stay ordinary."""
    case = make_case(
        [24, 40], [300, 200], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
        causal=[False, True], causal_dtype=torch.bool, seed=seed,
    )  # fmt: skip
    for (token, head), factor in TINY_QUERY_ROWS.items():
        case.query[token, head] = (case.query[token, head].float() * factor).to(case.query.dtype)
    return case


def worst_row_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error of one (token, head) row (inf for a non-finite one): the
    hazards hit a few rows only, which the whole output's error can hide."""
    diff = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    return float(diff.nan_to_num(math.inf).max())


def window_cases(mid_tile: dict, large_tile: dict) -> dict[str, dict]:
    """The sliding-window and sink cases both DSL families' emulations replay (fields of
    ``make_case`` plus window, sinks, splits, head_dim). Sinks are natural-log logits per query
    head: large positive (the sink dominates the row), large negative (no effect), small.
    ``mid_tile`` / ``large_tile`` are the family's launch knobs for a mid-size and its largest
    CTA (tcgen05: 64 / 128 rows; wgmma: one / two consumer warpgroups)."""
    return {
        # Window smaller than a page, causal, GQA 4: each CTA loads one or two of the tiles.
        "window_below_a_page_causal_sinks": dict(
            q_lens=[9, 30], kv_lens=[700, 400], num_q_heads=8, num_kv_heads=2, block_size=16,
            causal=True, window=(5, 0), sinks=[9.0, -40.0, 0.5, 3.0, -2.0, 12.0, 0.0, -7.5],
            splits=1,
        ),
        # Window spanning pages and tiles, both sides, bidirectional, split-KV over the
        # windowed range.
        "window_pages_bidir_split3_sinks": dict(
            q_lens=[16, 20], kv_lens=[900, 300], num_q_heads=8, num_kv_heads=2, block_size=16,
            causal=False, window=(150, 70), sinks=[7.0, -30.0, 1.0, 0.0, -1.0, 10.0, 2.0, -3.0],
            splits=3, **mid_tile,
        ),
        # Window larger than the context: the same as none (per-sequence mixed flags, split 2).
        "window_beyond_context_mixed": dict(
            q_lens=[5, 8, 3], kv_lens=[133, 8, 257], num_q_heads=2, num_kv_heads=2, block_size=32,
            causal=[True, False, True], causal_dtype=torch.int32, window=(5000, 2**31 - 1),
            sinks=[20.0, -50.0], splits=2,
        ),
        # One-sided: left only, bidirectional, the largest CTA (R = 160: two row tiles), split 2.
        "window_left_only_large_tile_split2": dict(
            q_lens=[40, 12], kv_lens=[800, 500], num_q_heads=8, num_kv_heads=2, block_size=16,
            causal=False, window=(200, -1), splits=2, **large_tile,
        ),
        # One-sided: right only, bidirectional (causal rows would cap it), fp16, page 64.
        "window_right_only_f16_sinks": dict(
            q_lens=[7, 12], kv_lens=[600, 40], num_q_heads=4, num_kv_heads=1, block_size=64,
            causal=False, query_dtype=torch.float16, window=(-1, 9), sinks=[4.0, -4.0, 15.0, 1.0],
            splits=1,
        ),
        # Mixed bool flags with a two-sided window on a causal prefill (right capped at 0
        # there), page 256 (a page holds two key tiles: half of one may be skipped).
        "window_mixed_flags_page256_split2": dict(
            q_lens=[130, 4], kv_lens=[130, 900], num_q_heads=4, num_kv_heads=2, block_size=256,
            causal=[True, False], causal_dtype=torch.bool, window=(60, 20),
            sinks=[5.0, -5.0, 0.0, 8.0], splits=2, **large_tile,
        ),
        # head_dim 256 (key tile 64 in wgmma), causal, window left only, sinks, unsplit.
        "window_d256_causal_sinks": dict(
            q_lens=[6, 3], kv_lens=[400, 70], num_q_heads=4, num_kv_heads=2, block_size=16,
            head_dim=256, causal=True, window=(90, -1), sinks=[6.0, -6.0, 0.25, 11.0], splits=1,
        ),
    }  # fmt: skip


def poison_pages_outside_windows(problem, key_tile: int) -> int:
    """Fill with FP8 NaN (0x7F in both formats) every K and V page that lies wholly in key tiles
    (of ``key_tile`` keys) no query row of its sequence sees (masking.visible_range, the
    reference's own rule); returns how many pages. A kernel that loads such a tile turns NaN
    (0 x NaN in P V)."""
    poisoned = 0
    for seq in range(problem.num_seqs):
        q_len = int(problem.cu_seqlens_q[seq + 1] - problem.cu_seqlens_q[seq])
        kv_len = int(problem.seq_lens[seq])
        causal = problem.causal if problem.causal_per_seq is None else problem.causal_per_seq[seq]
        start, end = visible_range(torch.arange(q_len), q_len, kv_len, causal, problem.window)
        low = int(start.min()) // key_tile * key_tile
        high = X.ceil_div(int(end.max()), key_tile) * key_tile
        for col in range(X.ceil_div(kv_len, problem.block_size)):
            if (col + 1) * problem.block_size <= low or col * problem.block_size >= high:
                page = int(problem.block_table[seq, col])
                problem.key_cache[page].view(torch.uint8).fill_(0x7F)
                problem.value_cache[page].view(torch.uint8).fill_(0x7F)
                poisoned += 1
    return poisoned


def poison_keys_before_windows(problem, key_tile: int) -> int:
    """Unwritten slots as vLLM leaves them (SPEC section 5), NaN: every block-table column
    wholly before a sequence's first visible key (masking.visible_range) points at a spare
    (null) page of FP8 NaN (0x7F in both formats), and the slots of the first key's page before
    it and the slots past kv_len in the last page hold NaN, in K and V. Returns how many NaN
    keys share a key tile (of ``key_tile`` keys) with a window's first key: a kernel that loads
    them and masks only the scores turns NaN (0 x NaN in P V)."""
    block_size = problem.block_size
    pages_used = [X.ceil_div(int(kv), block_size) for kv in problem.seq_lens]
    owned = {int(p) for seq, n in enumerate(pages_used) for p in problem.block_table[seq, :n]}
    null_page = min(set(range(problem.key_cache.shape[0])) - owned)

    def poison(page, slots):
        for cache in (problem.key_cache, problem.value_cache):
            cache.view(torch.uint8)[page, slots] = 0x7F

    poison(null_page, slice(None))
    in_first_tile = 0
    for seq, n_pages in enumerate(pages_used):
        q_len = int(problem.cu_seqlens_q[seq + 1] - problem.cu_seqlens_q[seq])
        kv_len = int(problem.seq_lens[seq])
        causal = problem.causal if problem.causal_per_seq is None else problem.causal_per_seq[seq]
        start, _ = visible_range(torch.arange(q_len), q_len, kv_len, causal, problem.window)
        first = int(start.min())
        problem.block_table[seq, : first // block_size] = null_page
        poison(int(problem.block_table[seq, first // block_size]), slice(0, first % block_size))
        poison(
            int(problem.block_table[seq, n_pages - 1]), slice((kv_len - 1) % block_size + 1, None)
        )
        in_first_tile += first % key_tile
    return in_first_tile


# ---- Planted bugs in the maps both families share (dsl/common/indexing.py) -----------------
# The originals are taken at import, before a test patches the module: a planted bug that
# calls the map it replaces must reach the real one.
_WINDOW_TILES, _WINDOW_LAST_KEY = X.window_tiles, X.window_last_key
_SPLIT_TILE_RANGE = X.split_tile_range


def key_loaded_from_the_tile_start(j, first_key, kv_len):
    """Planted: keys before the window's first key in its first tile loaded (the old rule)."""
    return j < kv_len


def split_range_drops_last_tile(begin, end, num_splits, split, minimum):
    first, last = _SPLIT_TILE_RANGE(begin, end, num_splits, split, minimum)
    return first, minimum(last, end - 1)


def head_from_token(r, group, kv_head):
    return kv_head * group + r // group % group


def page_count_floor(kv_len, block_shift):
    return kv_len >> block_shift  # forgets the last partial page


def index_offset_ignores_stride(i, stride):
    """Planted: index tensors read as packed vectors (the launch's strides dropped)."""
    return i


def causal_off_by_one(j, kv_len, position, before, after):
    return (j < kv_len) & (j - position < after) & (position - j <= before)


def window_lower_bound_unmasked(j, kv_len, position, before, after):
    return (j < kv_len) & (j - position <= after)


def tile_mask_ignores_causal(key0, key_end, kv_len, first_position, last_position, before, after):
    return (key_end > kv_len) | (last_position - key0 > before)


def tile_mask_ignores_window_start(key0, key_end, kv_len, first_position, last_position,
                                   before, after):  # fmt: skip
    return (key_end > kv_len) | (key_end - 1 - first_position > after)


def offsets_ignore_causal(left, right, causal, select, minimum):
    return select(left >= 0, left, X.INT32_MAX), select(right >= 0, right, X.INT32_MAX)


def window_end_floor(first_key, last_key, key_tile):
    return first_key // key_tile, last_key // key_tile


def window_begins_a_tile_early(first_key, last_key, key_tile):
    begin, end = _WINDOW_TILES(first_key, last_key, key_tile)
    return max(begin - 1, 0), end


def window_left_unbounded_forgotten(token, q_len, kv_len, left, select, maximum):
    return maximum(X.query_position(token, q_len, kv_len) - left, 0)


def window_last_key_of_q_len(token, q_len, kv_len, causal, right, select):
    return _WINDOW_LAST_KEY(token, q_len, q_len, causal, right, select)


class PtxFlow:
    """The control flow of a one-kernel PTX file, instruction by instruction, for the
    synchronisation checks of the DSL kernels' kept PTX (the order the PTX memory model asks for
    must hold on every path, which no CPU run can show). An inline-asm scope (``{ ... }``, the
    DSL's mbarrier wait loops) is straight-line code that leaves at its end."""

    def __init__(self, text: str) -> None:
        body = text[text.index("\n{\n") + 3 : text.rindex("\n}")]
        self.ops: list[str] = []
        labels: dict[str, int] = {}
        jumps: list[tuple[int, str, bool]] = []  # (op index, target label, conditional)
        depth = 0
        for raw in body.splitlines():
            line = raw.split("//")[0].strip()
            if line in ("{", "}"):
                depth += 1 if line == "{" else -1
                continue
            if not line or line.startswith("."):
                continue
            if depth == 0 and line.endswith(":"):
                labels[line[:-1]] = len(self.ops)
                continue
            if depth > 0 and (line.endswith(":") or " bra" in f" {line}"):
                continue  # the inline scope's own wait loop
            op = line.rstrip(";").strip()
            branch = re.fullmatch(r"(@!?%?\w+\s+)?bra(?:\.uni)?\s+(\S+)", op)
            if branch:
                jumps.append((len(self.ops), branch.group(2), branch.group(1) is not None))
            self.ops.append(op)
        self.successors = [[i + 1] for i in range(len(self.ops))]
        for i, op in enumerate(self.ops):
            if op == "ret" or op == "exit":
                self.successors[i] = []
        for i, target, conditional in jumps:
            self.successors[i] = ([i + 1] if conditional else []) + [labels[target]]

    def find(self, pattern: str) -> list[int]:
        """Indices of the instructions matching the regular expression ``pattern``."""
        return [i for i, op in enumerate(self.ops) if re.match(pattern, op)]

    def reaches(self, starts: list[int] | None, target: str, avoiding: str) -> bool:
        """Whether some path from just after an instruction of ``starts`` (None: from the
        kernel's entry) reaches an instruction matching ``target`` without passing one matching
        ``avoiding`` (regular expressions; ``"ret"`` as target: the kernel's end)."""
        seen: set[int] = set()
        todo = [0] if starts is None else [s for i in starts for s in self.successors[i]]
        while todo:
            i = todo.pop()
            if i in seen or i >= len(self.ops):
                continue
            seen.add(i)
            if re.match(avoiding, self.ops[i]):
                continue
            if re.match(target, self.ops[i]):
                return True
            todo.extend(self.successors[i])
        return False

    def warps_reaching(self, target: str, num_warps: int) -> set[int]:
        """The warps (``tid.x / 32``) for which a path from the kernel's entry reaches an
        instruction matching ``target``: a branch on a predicate that the warp index fixes
        (``setp`` of ``tid.x >> s``, s >= 5, or its ``shfl.sync.idx`` broadcast, against a
        constant, combined by not / and / or) goes the way that warp goes; any other both ways."""
        return {w for w in range(num_warps) if self._reaches_as_warp(w, target)}

    def _reaches_as_warp(self, warp: int, target: str) -> bool:
        values: dict[str, object] = {}  # register -> "tid", or an int / bool the warp fixes
        compare = {"eq": int.__eq__, "ne": int.__ne__, "lt": int.__lt__, "le": int.__le__,
                   "gt": int.__gt__, "ge": int.__ge__}  # fmt: skip
        for op in self.ops:
            words = re.split(r"[\s,]+", op)
            if re.fullmatch(r"mov\.u32 \S+ %tid\.x", " ".join(words)):
                values[words[1]] = "tid"
            elif words[0] == "shr.u32" and values.get(words[2]) == "tid" and int(words[3]) >= 5:
                values[words[1]] = (warp * 32) >> int(words[3])
            elif words[0] == "shfl.sync.idx.b32" and isinstance(values.get(words[2]), int):
                values[words[1]] = values[words[2]]
            elif re.fullmatch(r"setp\.(eq|ne|lt|le|gt|ge)\.[bsu]32", words[0]):
                left = values.get(words[2])
                if isinstance(left, int) and re.fullmatch(r"-?\d+", words[3]):
                    values[words[1]] = compare[words[0].split(".")[1]](left, int(words[3]))
            elif words[0] == "not.pred" and isinstance(values.get(words[2]), bool):
                values[words[1]] = not values[words[2]]
            elif words[0] in ("and.pred", "or.pred"):
                known = [values.get(w) for w in words[2:4]]
                absorbing = words[0] == "or.pred"  # True absorbs an or, False an and
                if absorbing in known:
                    values[words[1]] = absorbing
                elif all(isinstance(k, bool) for k in known):
                    values[words[1]] = not absorbing
        seen: set[int] = set()
        todo = [0]
        while todo:
            i = todo.pop()
            if i in seen or i >= len(self.ops):
                continue
            seen.add(i)
            if re.match(target, self.ops[i]):
                return True
            branch = re.match(r"@(!?)(%p\d+)\s+bra", self.ops[i])
            taken = values.get(branch.group(2)) if branch else None
            if isinstance(taken, bool):
                jumps = taken != (branch.group(1) == "!")
                todo.append(self.successors[i][-1] if jumps else i + 1)
            else:
                todo.extend(self.successors[i])
        return False


def tmem_load_wait_problems(flow: PtxFlow) -> list[str]:
    """Empty when no ``tcgen05.ld``'s destination registers are touched before a
    ``tcgen05.wait::ld`` on any path (the PTX ISA leaves them undefined until then). Plain
    ``mov`` copies (the DSL packs the registers into 64-bit ones before the wait and unpacks
    them after) carry the registers on; any other instruction naming one is a use."""
    loads = flow.find(r"tcgen05\.ld\.")
    if not loads:
        return ["no tcgen05.ld"]
    problems = []
    for start in loads:
        loaded = frozenset(re.findall(r"%\w+", re.search(r"\{[^}]*\}", flow.ops[start])[0]))
        todo = [(i, loaded) for i in flow.successors[start]]
        seen = set()
        while todo:
            i, carried = todo.pop()
            if (i, carried) in seen or i >= len(flow.ops):
                continue
            seen.add((i, carried))
            op = flow.ops[i]
            if re.match(r"tcgen05\.wait::ld", op):
                continue
            copy = re.fullmatch(r"mov\.b\d+\s+(\{[^}]*\}|%\w+),\s*(\{[^}]*\}|%\w+)", op)
            if copy:
                if carried & set(re.findall(r"%\w+", copy[2])):
                    carried = carried | set(re.findall(r"%\w+", copy[1]))
            elif carried & set(re.findall(r"%\w+", op)):
                problems.append(f"{op!r} uses a register of {flow.ops[start][:50]}... unwaited")
                break
            todo.extend((j, carried) for j in flow.successors[i])
    return problems


def empty_split_lse_problems(flow: PtxFlow) -> list[str]:
    """Empty when the kernel selects an LSE of -inf (an empty split) and every such select on
    a float compared with 0 (the row sum l) compares unordered-not-equal, ``setp.neu``: a NaN l
    (a NaN in the inputs) then keeps its NaN LSE, which the merge passes on, instead of reading
    as an empty split that the merge drops (``setp.gt`` is false for NaN)."""
    compares = {}
    for op in flow.ops:
        setp = re.fullmatch(r"setp\.(\w+)\.f32\s+(%p\d+), %r\d+, 0f00000000", op)
        if setp:
            compares[setp[2]] = setp[1]
    selects = [
        select[1]
        for op in flow.ops
        if (select := re.fullmatch(r"selp\.f32\s+%r\d+, %r\d+, 0fFF800000, (%p\d+)", op))
    ]
    on_zero = [compares[p] for p in selects if p in compares]
    if not on_zero:
        return ["no select of -inf on a float compared with 0"]
    return [f"setp.{cmp} selects the empty split's -inf" for cmp in on_zero if cmp != "neu"]


def barrier_init_problems(flow: PtxFlow) -> list[str]:
    """An mbarrier initialisation that can reach the CTA's first sync without
    ``fence.mbarrier_init`` (the fence that makes the inits visible to the async proxy, which
    tcgen05.commit and cp.async arrive from); empty when there is none."""
    inits = flow.find(r"mbarrier\.init")
    if not inits:
        return ["no mbarrier.init"]
    if flow.reaches(inits, r"bar(rier)?\.sync\s+0$", r"fence\.mbarrier_init"):
        return ["an mbarrier.init reaches bar.sync 0 without fence.mbarrier_init"]
    return []


# Where the build tests keep the DSL families' builds, one folder per hash of everything a build
# depends on (minutes of compile time each); FP8NCA_TEST_CACHE=off builds afresh every time.
TEST_CACHE_ENV = "FP8NCA_TEST_CACHE"
DSL_SOURCES = Path(__file__).resolve().parents[2] / "dsl"


def dsl_build_key(family: str, archs: list[str], variants: list) -> str:
    """The hash of a build's inputs: every file under dsl/, the DSL and Python versions, the
    CUDA toolkit it links, the family, its architectures and variants."""
    digest = hashlib.sha256()
    for path in sorted(DSL_SOURCES.rglob("*.py")):
        digest.update(path.relative_to(DSL_SOURCES).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    facts = [
        importlib.metadata.version("nvidia-cutlass-dsl"),
        sys.version,
        os.environ.get("CUDA_HOME", "/usr/local/cuda"),
        family,
        *archs,
        *(v.name for v in variants),
    ]
    digest.update("\0".join(facts).encode())
    return digest.hexdigest()[:20]


def cached_dsl_build(build, family: str, archs: list[str], variants: list, scratch: Path):
    """``(folder, record)`` of ``build.build(folder, archs, variants, family)``, reused when a
    build of the same inputs exists (built into a temporary folder, then renamed into place, so
    a build cut short is never reused). ``scratch`` is used when the cache is off."""
    root = os.environ.get(TEST_CACHE_ENV, str(Path.home() / ".cache" / "fp8nca-tests"))
    if root == "off":
        return scratch, build.build(scratch, archs, variants, family)
    out = Path(root) / "dsl" / f"{family}-{dsl_build_key(family, archs, variants)}"
    if not (out / "build.json").is_file():
        partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            build.build(partial, archs, variants, family)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(out, ignore_errors=True)
        partial.rename(out)
    return out, json.loads((out / "build.json").read_text())


def cached_ci_build(build, family: str, scratch: Path):
    """``(folder, record)`` of the family's CI build (``build.FAMILIES``: its architectures and
    the variants CI compiles), through cached_dsl_build."""
    archs, _, ci_variants = build.FAMILIES[family]
    return cached_dsl_build(build, family, list(archs), list(ci_variants()), scratch)


def check_ci_build_record(build, family: str, out: Path, record: dict) -> None:
    """The record cached_ci_build returns is the folder's build.json: never run on a GPU, the
    family's library, one entry per (architecture, CI variant), each with its compile time, one
    cubin for its architecture and its kernel's header."""
    archs, _, ci_variants = build.FAMILIES[family]
    assert record == json.loads((out / "build.json").read_text())
    assert record["never_run_on_gpu"] is True
    assert record["library"] == build.library_name(family)
    pairs = {(e["arch"], e["variant"]) for e in record["variants"]}
    assert pairs == {(a, v.name) for a in archs for v in ci_variants()}
    for entry in record["variants"]:
        assert entry["compile_seconds"] > 0
        assert len(entry["cubins"]) == 1 and entry["cubins"][0].endswith(f".{entry['arch']}.cubin")
        assert (out / entry["header"]).exists()
