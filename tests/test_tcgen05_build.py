"""AOT build of the CI tcgen05 variants (skipped without ``nvidia-cutlass-dsl``): compile each
kernel for sm_100f (B200 and B300; one kernel serves a shape's bf16 and fp16 variants), export,
link, load the library on this CPU machine, and check the kept cubins' SASS. NEVER RUN ON A GPU:
nothing here launches a kernel."""

import re

import pytest
from helpers.dsl import (
    PtxFlow,
    barrier_init_problems,
    cached_ci_build,
    check_ci_build_record,
    check_library_names_every_variant,
    empty_split_lse_problems,
    tmem_load_wait_problems,
)

from dsl import build, sass_check
from dsl.tcgen05 import layouts as L
from dsl.tcgen05 import traits as T

# Compiles kernels or packages and reads what they hold (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.compile

pytest.importorskip("cutlass")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return cached_ci_build(build, "tcgen05", tmp_path_factory.mktemp("tcgen05"))


def test_build_record_lists_every_ci_variant_and_arch(built):
    assert build.FAMILIES["tcgen05"][2]() == build.TCGEN05_CI_VARIANTS
    # Every shape, and each cache dtype's conversion, is compiled.
    ci = build.TCGEN05_CI_VARIANTS
    assert {(v.head_dim, v.rows) for v in ci} == {(v.head_dim, v.rows) for v in build.VARIANTS}
    assert {v.cache_dtype for v in ci} == {v.cache_dtype for v in build.VARIANTS}
    check_ci_build_record(build, "tcgen05", *built)


def test_library_loads_without_a_gpu_and_names_every_variant(built):
    out, record = built
    check_library_names_every_variant(out / build.library_name("tcgen05"), "tcgen05", record)


def test_sass_has_tcgen05_tmem_cp_async_and_no_local_memory(built):
    out, record = built
    assert len({e["symbol"] for e in record["variants"]}) == len(build.TCGEN05_CI_VARIANTS) // 2
    for entry in record["variants"]:
        cubin = out / entry["cubins"][0]
        variant = next(v for v in build.VARIANTS if v.name == entry["variant"])
        assert sass_check.problems(cubin, variant.cache_dtype) == [], entry["symbol"]
        ops = sass_check.opcodes(cubin)
        # Per 128-wide head-dim slice: BMM2 is 128 x 128 fp16 in K steps of 16 -> 8 UTCHMMA,
        # BMM1 the k-steps covering the item's head dims (8, or 4 at head_dim 64; ptxas may
        # emit that loop body more than once: it peels it at head_dim 64).
        bmm2, bmm1 = 8 * variant.d_tiles, L.bmm1_k_blocks(variant.head_dim) * variant.d_tiles
        mmas = sass_check.count(ops, "UTCHMMA")
        assert mmas > bmm2 and (mmas - bmm2) % bmm1 == 0, (entry["symbol"], mmas)
        usage = sass_check.resource_usage(cubin)
        # One CTA per SM, by registers: a second would sleep in tcgen05.alloc (all 512 columns).
        assert T.TWO_CTA_REGISTERS < usage["REG"] <= T.REGISTERS_PER_THREAD, entry["symbol"]


@pytest.mark.sass_model
def test_sass_model_counts_one_copy_sequence_per_converter_item(built):
    """The SASS model's converter path (tools/sass_model/dsl_families.py) follows the
    page-16 case of the copies' jump table, and only it. Hand count from the cubins (per warp
    and 128-key x 128-byte item; 128 bytes = 32 words per thread): 8 cp.async (LDGSTS) with 8
    page shuffles (SHFL.IDX: 8 pages of 16 keys per tile), 8 LDSM; e4m3: 2 words on the
    integer pipe (traits.INTEGER_CONVERTED_WORDS, 2 PRMT each), the rest by F2FP (2 per
    word: 46 conversion-pipe instructions with 9 integer words);
    e5m2: 2 PRMT per word = 64, none on the conversion pipe. Before, the model counted 16
    LDGSTS for e5m2 (the if-converted page-256 case laid out after the BRX)."""
    from tools.sass_model import dsl_families, pipes
    from tools.sass_model.cubins import read_cubin
    from tools.sass_model.roles import role_counts

    out, _ = built
    # One variant per cache dtype: an item's copies and conversions do not depend on rows or
    # the query dtype, and each model run takes ~5 s of CI time.
    chosen = {}
    for b in dsl_families.read_build(out):
        if b.variant.head_dim == 128:
            chosen.setdefault(b.variant.cache_dtype, b)
    assert set(chosen) == {"float8_e4m3fn", "float8_e5m2"}
    for b in chosen.values():
        roles, _, _ = dsl_families.family_roles(b.family, b.variant)
        (convert,) = (r for r in roles if r.name == "convert")
        (kernel,) = read_cubin(b.cubin)
        text = dsl_families.one_page_specialisation(
            kernel.sass, convert, dsl_families.jump_table_words(b.cubin), 8, 8
        )
        counts = role_counts(text, (convert,))["convert"]
        ops = {}
        for op, n in counts.opcodes.items():
            ops[op.split(".", 1)[0]] = ops.get(op.split(".", 1)[0], 0) + n
        assert (ops["LDGSTS"], ops["SHFL"], ops["LDSM"]) == (8, 8, 8), b.variant.name
        if b.variant.cache_dtype == "float8_e5m2":
            assert ops["PRMT"] == 64 and counts.per_pipe[pipes.CONVERSION] == 0, b.variant.name
        else:
            f2fp, prmt = 2 * (32 - T.INTEGER_CONVERTED_WORDS), 2 * T.INTEGER_CONVERTED_WORDS
            assert counts.opcodes["F2FP.F16.E4M3.UNPACK_B"] == f2fp, b.variant.name
            assert counts.per_pipe[pipes.CONVERSION] == f2fp and ops["PRMT"] == prmt, b.variant.name


# The softmax warpgroup's own TMEM accesses: S and O loads, O stores (32x32b; the converter stores
# K/V with 16x256b).
SOFTMAX_TMEM = r"tcgen05\.(ld\.|st\.sync\.aligned\.32x32b)"
AFTER_SYNC = r"tcgen05\.fence::after_thread_sync"
BEFORE_SYNC = r"tcgen05\.fence::before_thread_sync"


def tmem_free_problems(flow: PtxFlow) -> list[str]:
    """Empty when TMEM is freed only after a named barrier that the softmax warpgroup arrives
    on after every TMEM access of its own, on every path (a CTA with no key tile included),
    with the tcgen05 fences on both sides."""
    dealloc = r"tcgen05\.dealloc"
    if not flow.find(dealloc):
        return ["no tcgen05.dealloc"]
    accesses = flow.find(SOFTMAX_TMEM)
    for n in sorted({int(m) for op in flow.ops for m in re.findall(r"^bar\.arrive\s+(\d+),", op)}):
        sync, signal = rf"bar(rier)?\.sync\s+{n},", rf"bar(rier)?\.(arrive|sync)\s+{n},"
        if flow.reaches(None, dealloc, sync) or flow.reaches(accesses, "ret", signal):
            continue
        problems = []
        if flow.reaches(flow.find(sync), dealloc, AFTER_SYNC):
            problems.append(f"bar.sync {n} reaches the dealloc without {AFTER_SYNC}")
        if flow.reaches(accesses, rf"bar\.arrive\s+{n},", BEFORE_SYNC):
            problems.append(f"a softmax TMEM access reaches bar.arrive {n} without {BEFORE_SYNC}")
        return problems
    return ["no named barrier orders every softmax TMEM access before tcgen05.dealloc"]


def tmem_alloc_warp_problems(flow: PtxFlow) -> list[str]:
    """Empty when one warp, and the same one, allocates and frees TMEM (as CUTLASS's and FA4's
    kernels do), by the warp-index branches that lead to tcgen05.alloc and tcgen05.dealloc."""
    warps = T.THREADS // 32
    alloc = flow.warps_reaching(r"tcgen05\.alloc", warps)
    dealloc = flow.warps_reaching(r"tcgen05\.dealloc", warps)
    if len(alloc) != 1 or alloc != dealloc:
        return [f"tcgen05.alloc by warps {sorted(alloc)}, tcgen05.dealloc by {sorted(dealloc)}"]
    return []


def handoff_fence_problems(flow: PtxFlow) -> list[str]:
    """Empty when every TMEM hand-off between threads is fenced: an mbarrier wait reaches a
    tcgen05.ld / st / mma only through ``after_thread_sync``, a tcgen05.ld / st reaches an
    mbarrier or named-barrier arrival only through ``before_thread_sync``."""
    problems = []
    if flow.reaches(flow.find(r"mbarrier\.try_wait"), r"tcgen05\.(ld|st|mma)\.", AFTER_SYNC):
        problems.append(f"an mbarrier wait reaches a tcgen05 ld/st/mma without {AFTER_SYNC}")
    if flow.reaches(flow.find(r"tcgen05\.(ld|st)\."), r"(mbarrier|bar)\.arrive", BEFORE_SYNC):
        problems.append(f"a tcgen05 ld/st reaches an arrival without {BEFORE_SYNC}")
    return problems


def mma_barrier_problems(flow: PtxFlow) -> list[str]:
    """Empty when, on every path, the two-warp named barriers (64 threads: BMM1's a, BMM2's b,
    a < b) are used in alternating pairs: arrive a, wait b, arrive a, ... (BMM1) or wait a,
    arrive b, wait a, ... (BMM2), each warp ending after a whole pair. Then neither warp
    arrives twice on a barrier before the other has waited (its wait in between needs the
    other's arrival, which follows the other's wait), and no arrival is left unmatched at the
    end (the warps' pair counts are then equal, or one of them would hang)."""
    ops = {}
    for i, op in enumerate(flow.ops):
        m = re.match(r"bar(?:rier)?\.(sync|arrive)\s+(\d+),\s*64$", op)
        if m:
            ops[i] = (m.group(1), int(m.group(2)))
    ids = sorted({n for _, n in ops.values()})
    if len(ids) != 2:
        return [f"two-warp named barriers {ids}, expected two"]
    a, b = ids
    # Automaton: state 0 (start), "A" after BMM1's arrive on a, "B" after BMM2's wait on a;
    # "A0" / "B0" after a whole pair (accepting, like 0).
    step = {
        (0, ("arrive", a)): "A", ("A0", ("arrive", a)): "A", ("A", ("sync", b)): "A0",
        (0, ("sync", a)): "B", ("B0", ("sync", a)): "B", ("B", ("arrive", b)): "B0",
    }  # fmt: skip
    seen, todo = set(), [(0, 0)]
    while todo:
        i, state = todo.pop()
        if (i, state) in seen:
            continue
        seen.add((i, state))
        if i in ops:
            state = step.get((state, ops[i]))
            if state is None:
                return [f"{' '.join(map(str, ops[i]))} out of turn at PTX instruction {i}"]
        if not flow.successors[i] and state in ("A", "B"):
            return [f"a path ends inside a pair ({state})"]
        todo.extend((j, state) for j in flow.successors[i])
    return []


def kept_ptx(built) -> dict[str, str]:
    """{kernel symbol: its kept PTX} of the build."""
    out, record = built
    found = {}
    for entry in record["variants"]:
        (ptx,) = (out / entry["cubins"][0]).parent.glob("*.ptx")
        found[entry["symbol"]] = ptx.read_text()
    return found


CHECKS = {
    "barrier inits": barrier_init_problems,
    "TMEM free": tmem_free_problems,
    "hand-off fences": handoff_fence_problems,
    "MMA barrier order": mma_barrier_problems,
    "TMEM alloc warp": tmem_alloc_warp_problems,
    "TMEM load wait": tmem_load_wait_problems,
    "empty split LSE": empty_split_lse_problems,
}
# Per check, planted bugs: (regular expression, replacement) applied once to a kernel's PTX.
PLANTED = {
    "barrier inits": [(r"\tfence\.mbarrier_init\.release\.cluster;\n", "")],
    "TMEM free": [
        (r"\tbar\.sync \t6, 160;\n", ""),  # the dealloc waits for nothing
        (r"\tbar\.arrive 6, 160;\n", ""),  # nobody signals
        # the signal moved to the kernel's start, before the softmax's TMEM accesses
        (
            r"\tbar\.sync \t0;\n((?s:.*))\tbar\.arrive 6, 160;\n",
            "\tbar.sync \t0;\n\tbar.arrive 6, 160;\n\\1",
        ),
        (r"\ttcgen05\.fence::after_thread_sync;\n(?=\ttcgen05\.relinquish)", ""),
    ],
    "MMA barrier order": [
        (r"\tbar\.sync \t3, 64;\n", ""),  # BMM1 arrives on 2 twice in a row
        # BMM2's arrival after its first wait (BMM1 would wait on 3 once more than BMM2 arrives)
        (r"(\tbar\.sync \t2, 64;\n(?:.*\n){0,4}?)\tbar\.arrive 3, 64;\n", "\\1"),
    ],
    # the allocation moved to the BMM1 warp (warp 8), the dealloc left in BMM2's (warp 9)
    "TMEM alloc warp": [
        (r"(\tsetp\.ne\.b32 \t%p\d+, %r\d+, )9(;\n(?:.*\n){0,3}\ttcgen05\.alloc)", r"\g<1>8\2")
    ],
    # O's registers read (rescaled) before the wait of their 32x32b load
    "TMEM load wait": [
        (
            r"(\ttcgen05\.ld\.sync\.aligned\.32x32b.*\n(?:(?!\ttcgen05\.wait).*\n)*?)"
            r"\ttcgen05\.wait::ld\.sync\.aligned;\n",
            r"\1",
        )
    ],
    # a NaN row sum read as an empty split (l > 0 instead of l != 0)
    "empty split LSE": [(r"setp\.neu\.f32", "setp.gt.f32")],
    "hand-off fences": [
        # the converter's fence before it hands converted items to the MMA warps
        (
            r"\ttcgen05\.fence::before_thread_sync;\n"
            r"(?=\tmov\.b32\s+%r\d+, 1;\n\tmbarrier\.arrive)",
            "",
        ),
        # BMM1's fence after its waits
        (r"\ttcgen05\.fence::after_thread_sync;\n(?=\t// begin inline asm\n\tbar\.arrive 2,)", ""),
    ],
}


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_ptx_synchronisation_holds_on_every_path(built, check):
    """Every kernel's kept PTX: barrier inits fenced before the first sync, TMEM freed after the
    softmax's last access (also for a CTA without key tiles) by the warp that allocated it, TMEM
    hand-offs fenced, TMEM loads waited for before their registers are used, a NaN split LSE
    kept."""
    for symbol, text in kept_ptx(built).items():
        assert CHECKS[check](PtxFlow(text)) == [], symbol


@pytest.mark.parametrize("check", sorted(CHECKS))
def test_ptx_synchronisation_checks_catch_a_planted_bug(built, check):
    text = kept_ptx(built)[f"fp8nca_{build.VARIANTS[0].kernel_name}_{T.ARCHS[0]}"]
    for pattern, replacement in PLANTED[check]:
        planted, found = re.subn(pattern, replacement, text, count=1)
        assert found == 1, pattern
        assert CHECKS[check](PtxFlow(planted)) != [], pattern
