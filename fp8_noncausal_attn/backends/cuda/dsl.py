"""The CUTLASS-DSL kernel families: ``wgmma`` (Hopper, sm_90a) and ``tcgen05`` (Blackwell,
sm_100f), compiled ahead of time into one shared library per family (``libfp8nca_<family>.so``,
libc only, the cubins inside) and called here through ctypes. Each :class:`Family` is a backend
(:class:`~fp8_noncausal_attn.backends.protocol.Backend`): ``backend="wgmma"`` /
``backend="tcgen05"``. Their split planner, split merge and cache write are ``_C``'s.

NEVER RUN ON HARDWARE: both libraries are compiled and their SASS checked on CPU machines
(dsl/, docs/wgmma.md, docs/tcgen05.md); no GPU has executed them. They therefore run only when
named, ``auto`` never picks them, and a call they cannot serve raises with the reason. Both run
sliding windows and attention sinks.

Where the libraries come from: the package build compiles them when ``FP8NCA_BUILD_DSL=1``
(setup.py) into ``fp8_noncausal_attn/_<family>/``; ``FP8NCA_DSL_LIBRARY_DIR`` (folders separated
by ``os.pathsep``, searched first) names folders holding one built locally with
``python -m dsl.build --family <family> --out DIR``. Neither the DSL nor a JIT is needed at run
time. The C interface (dsl/build.py, from the launch record fp8_noncausal_attn/launch_record.py)::

    int fp8nca_<family>_variant_count(void);
    const char *fp8nca_<family>_variant_name(int i);   // "wgmma_d128_m64_bf16_e4m3@sm_90a"
    const char *fp8nca_<family>_arguments(void);   // "void *q, ..., cudaStream_t stream"
    const char *fp8nca_<family>_launch_record(void);   // the record's hash it was built from
    int fp8nca_<family>_load(int i);   // 0, the CUDA error of loading its cubin, -1: unknown i
    int fp8nca_<family>_run(int i, <its arguments>);  // 0, the DSL's error, -1: unknown i

A library built from another launch record (its hash is not the package's) is refused when it
is loaded, so that its family is unavailable with the reason before anything is planned. The plan
loads its variant's cubin (``load``, once per process), so that a failure is reported at plan
time and the first launch may be inside a CUDA-graph capture.

Every variant (``wgmma_d128_m64_bf16_e4m3``, ``tcgen05_d128_n32_bf16_e4m3``) takes the page size
at run time (``block_shift`` = log2 of it) and runs every power of two in 16..256.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ...launch_record import LaunchInputs, launch_values, refusal
from ...problem import AttentionProblem, Batch
from ..protocol import Refused
from . import extension

LIBRARY_DIR_ENV = "FP8NCA_DSL_LIBRARY_DIR"
STATUS = "compiled and SASS-checked, NEVER RUN ON HARDWARE"


@dataclass(frozen=True)
class Family:
    """What the host knows of one DSL family without the DSL (dsl/<family>/traits.py)."""

    name: str
    archs: dict[tuple[int, int], str]  # compute capability -> the arch of its cubins
    gpus: str  # the GPUs that capability means, for messages

    def key_tile(self, head_dim: int) -> int:
        """Keys per main-loop tile (dsl/<family>/traits.py; a test ties them): split-KV ranges
        are whole tiles."""
        return 64 if self.name == "wgmma" and head_dim > 128 else 128

    # The backend contract (backends/protocol.py).
    def availability(self) -> tuple[bool, str]:
        library, why = load_library(self.name)
        if library is None:
            return False, why
        found = f"{library.path}: {len(library.variants)} variant(s)"
        runs, why = extension.availability()
        if not runs:
            return False, f"{found}; {why}"
        why_not = self.device_reason(torch.device("cuda"))
        if why_not is not None:
            return False, f"{found}; {why_not}"
        return True, f"{found}; {why}"

    def device_reason(self, device: torch.device) -> str | None:
        """None when the family's kernels run on ``device`` (its GPU and ``_C``)."""
        capability = device_capability(device)
        if capability is None:
            return "the DSL families need CUDA tensors"
        if capability not in self.archs:
            major, minor = capability
            return f"needs an {self.gpus} GPU, this one is sm_{major}{minor}"
        return extension.device_reason(device)

    def plan(self, batch: Batch, workspace=None, num_splits: int | None = None) -> DslPlan:
        return plan(self, batch, workspace, num_splits)

    def run_unsupported_reason(
        self, problem: AttentionProblem, out: torch.Tensor | None
    ) -> str | None:
        return run_unsupported_reason(problem, out)

    def run(
        self,
        problem: AttentionProblem,
        plan: DslPlan,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        run(problem, plan, out, lse)


# An arch-specific cubin (sm_90a) runs only on that exact GPU; a family-specific one (sm_100f)
# on every GPU of its family from that minor up: sm_100 (B200) and sm_103 (B300).
FAMILIES = {
    "wgmma": Family("wgmma", {(9, 0): "sm_90a"}, "sm_90 (H100, H200)"),
    "tcgen05": Family(
        "tcgen05", {(10, 0): "sm_100f", (10, 3): "sm_100f"}, "sm_100/sm_103 (B200, B300)"
    ),
}


# C parameter types of the library's run entry -> ctypes. The library reports its parameters
# (fp8nca_<family>_arguments: the launch record's, written into it by dsl/build.py); the call is
# built from that list, so the package holds no copy of it.
C_TYPES = {"void *": ctypes.c_void_p, "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32,
           "float": ctypes.c_float, "cudaStream_t": ctypes.c_void_p}  # fmt: skip
_PARAMETER = re.compile(r"(void \*|[A-Za-z_][A-Za-z0-9_]*) ?([A-Za-z_][A-Za-z0-9_]*)")


def parse_arguments(prototype: str) -> tuple[tuple[str, object], ...]:
    """``"void *q, int64_t q_stride_t, ..."`` -> ``(("q", c_void_p), ...)`` (ValueError when a
    parameter is malformed or of a type this loader does not pass)."""
    parsed = []
    for part in prototype.split(", "):
        found = _PARAMETER.fullmatch(part.strip())
        if found is None or found[1] not in C_TYPES:
            raise ValueError(f"unexpected run parameter {part!r}")
        parsed.append((found[2], C_TYPES[found[1]]))
    return tuple(parsed)


# Sequences x splits is the grid's z.
MAX_GRID_Z = 65535
# The producers' page arithmetic is 32 x 32 -> 64 bits with 32-bit in-page offsets.
MAX_PAGE_ELEMENTS = 2**31
# The page sizes every variant runs (``block_shift`` 4..8).
RUN_TIME_PAGE_SIZES = tuple(2**shift for shift in range(4, 9))

_DTYPE_TAGS = {"bf16": torch.bfloat16, "f16": torch.float16,
               "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # fmt: skip
_NAME = re.compile(
    r"(?P<family>[a-z0-9]+)_d(?P<head_dim>\d+)_[mn](?P<rows>\d+)_"
    r"(?P<q>bf16|f16)_(?P<kv>e4m3|e5m2)@(?P<arch>sm_\d+[af])"
)


@dataclass(frozen=True)
class BuiltVariant:
    """One kernel of a library: its index in the C interface and what its name says."""

    index: int
    name: str  # "<variant>@<arch>"
    head_dim: int
    rows: int  # query rows per CTA
    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    arch: str


def parse_variant(index: int, name: str) -> BuiltVariant:
    """``"wgmma_d128_m64_bf16_e4m3@sm_90a"`` -> its fields (ValueError if malformed)."""
    found = _NAME.fullmatch(name)
    if found is None:
        raise ValueError(f"not a DSL variant name: {name!r}")
    return BuiltVariant(
        index, name, int(found["head_dim"]), int(found["rows"]),
        _DTYPE_TAGS[found["q"]], _DTYPE_TAGS[found["kv"]], found["arch"],
    )  # fmt: skip


class Library:
    """One family's loaded library: its variants, its launch function and the launch record's
    hash it was built from (``record_hash``; None when it exports none)."""

    def __init__(self, family: str, path: Path) -> None:
        self.family, self.path = family, path
        self._cdll = ctypes.CDLL(str(path))
        count = getattr(self._cdll, f"fp8nca_{family}_variant_count")
        count.restype, count.argtypes = ctypes.c_int, []
        name = getattr(self._cdll, f"fp8nca_{family}_variant_name")
        name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_int]
        self._load = getattr(self._cdll, f"fp8nca_{family}_load")
        self._load.restype, self._load.argtypes = ctypes.c_int, [ctypes.c_int]
        arguments = getattr(self._cdll, f"fp8nca_{family}_arguments")
        arguments.restype, arguments.argtypes = ctypes.c_char_p, []
        parsed = parse_arguments(arguments().decode())
        self.argument_names = tuple(name for name, _ in parsed)
        try:
            record = getattr(self._cdll, f"fp8nca_{family}_launch_record")
        except AttributeError:  # built before libraries exported it
            self.record_hash = None
        else:
            record.restype, record.argtypes = ctypes.c_char_p, []
            self.record_hash = record().decode()
        self._run = getattr(self._cdll, f"fp8nca_{family}_run")
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_int] + [kind for _, kind in parsed]
        self.variants = tuple(parse_variant(i, name(i).decode()) for i in range(count()))

    def load(self, index: int) -> int:
        """``fp8nca_<family>_load(index)``: load the variant's cubin on every visible device
        (once per process); 0, the CUDA error of the load (not retried), or -1 for an unknown
        index."""
        return self._load(index)

    def launch(self, index: int, arguments: dict[str, int | float]) -> int:
        """Call ``fp8nca_<family>_run(index, ...)`` with ``arguments`` by name (every parameter
        the library reports: the launch record's, as :func:`load_library` checked); returns its
        status (0: launched)."""
        return self._run(index, *(arguments[name] for name in self.argument_names))


def package_library_dir(family: str) -> Path:
    """The package's own folder of ``libfp8nca_<family>.so`` (``_<family>/``)."""
    return Path(__file__).resolve().parents[2] / f"_{family}"


def library_dirs(family: str) -> list[Path]:
    """Where ``libfp8nca_<family>.so`` is looked for: ``$FP8NCA_DSL_LIBRARY_DIR``'s folders,
    then the package's own."""
    local = [Path(p) for p in os.environ.get(LIBRARY_DIR_ENV, "").split(os.pathsep) if p]
    return [*local, package_library_dir(family)]


@functools.cache
def load_library(family: str) -> tuple[Library | None, str]:
    """The family's library (loaded once per process; no GPU needed), or None and why not: none
    found, not a library, or built from another launch record (refused here, naming both
    hashes, so the family is unavailable before anything is planned). A library the
    environment names never replaces the package's own silently: a warning names both paths."""
    file = f"libfp8nca_{family}.so"
    own = package_library_dir(family) / file
    for folder in library_dirs(family):
        if (folder / file).is_file():
            if folder / file != own and own.is_file():
                warnings.warn(
                    f"{LIBRARY_DIR_ENV} puts {folder / file} before the package's own {own}",
                    RuntimeWarning,
                    stacklevel=2,
                )
            try:
                library = Library(family, folder / file)
            except (OSError, AttributeError, ValueError) as err:
                return None, f"{folder / file} does not load as the {family} library ({err})"
            why = refusal(str(folder / file), library.record_hash, family)
            return (None, why) if why else (library, "")
    return None, (
        f"{file} is not in this package (build it with FP8NCA_BUILD_DSL=1, or point "
        f"{LIBRARY_DIR_ENV} at a folder built by python -m dsl.build --family {family} --out DIR)"
    )


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """Compute capability of a CUDA ``device``; None for other devices."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def resident_ctas(device: torch.device) -> int:
    """CTAs of a DSL kernel the GPU holds at once: one per SM (each takes most of an SM's shared
    memory, and a tcgen05 CTA all 512 TMEM columns)."""
    return _multiprocessors(device.index if device.index is not None else 0)


def choose_variant(
    variants: tuple[BuiltVariant, ...],
    arch: str,
    head_dim: int,
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    page_size: int,
    rows: int,
) -> tuple[BuiltVariant | None, str]:
    """The built variant for ``rows`` = max_seqlen_q x group query rows per KV head: the one
    with the fewest rows per CTA that holds them all, else the one with the most (several row
    tiles). None and the reason when nothing built matches the other fields (every variant
    runs each page size in RUN_TIME_PAGE_SIZES)."""
    wanted = {"arch": arch, "head_dim": head_dim, "q_dtype": q_dtype, "cache_dtype": cache_dtype}
    fits = list(variants)
    for field, value in wanted.items():
        narrowed = [v for v in fits if getattr(v, field) == value]
        if not narrowed:
            built = sorted({str(getattr(v, field)).removeprefix("torch.") for v in fits})
            shown = str(value).removeprefix("torch.")
            return None, f"no built variant for {field} {shown} (built: {', '.join(built)})"
        fits = narrowed
    if page_size not in RUN_TIME_PAGE_SIZES:
        pages = f"{RUN_TIME_PAGE_SIZES[0]}..{RUN_TIME_PAGE_SIZES[-1]}"
        return None, f"no built variant for page_size {page_size} (built: {pages})"
    holding = [v for v in fits if v.rows >= rows]
    if holding:
        return min(holding, key=lambda v: v.rows), ""
    return max(fits, key=lambda v: v.rows), ""


def _aligned(t: torch.Tensor, strides: tuple[int, ...], elements: int) -> bool:
    """Base 16-byte aligned and each stride a multiple of ``elements``."""
    return t.data_ptr() % 16 == 0 and all(s % elements == 0 for s in strides)


def run_unsupported_reason(problem: AttentionProblem, out: torch.Tensor) -> str | None:
    """None when the layer's tensors suit a DSL kernel (checked every run: pointers and
    strides differ per layer), else why not. The kernels were compiled assuming 16-byte aligned
    q/out/K/V bases; K/V rows are read 16 FP8 bytes at a time and Q 8 elements at a time."""
    for name, cache in (("key_cache", problem.key_cache), ("value_cache", problem.value_cache)):
        block, slot, head = cache.stride()[:3]
        if not _aligned(cache, (block, slot, head), 16):
            return f"{name} needs a 16-byte aligned base and strides multiples of 16 elements"
        if block >= MAX_PAGE_ELEMENTS or problem.block_size * slot >= MAX_PAGE_ELEMENTS:
            return f"{name}: a page stride of 2^31 elements or more (32-bit page arithmetic)"
    if not _aligned(problem.query, problem.query.stride()[:2], 8):
        return "query needs a 16-byte aligned base and strides multiples of 8 elements"
    if out.data_ptr() % 16:
        return "out needs a 16-byte aligned base"
    return None


# Kernels never run on hardware get no new code: per-KV-head scales only.
PER_HEAD_ONLY = f"the CUTLASS-DSL kernels ({STATUS}) read per-KV-head scales only"
UNSPLIT_LSE = "an unsplit plan has no LSE output (the DSL kernels' epilogue writes none)"


def plan_refusal(family: Family, batch: Batch) -> str | None:
    """None when ``family``'s library loads and the batch's device, sequences and scale kind
    suit it, else why not (the variant and the LSE are decided by :func:`plan`)."""
    library, why = load_library(family.name)
    if library is None:
        return why
    why_not = family.device_reason(batch.device)
    if why_not is not None:
        return why_not
    if batch.num_seqs > MAX_GRID_Z:
        return f"at most {MAX_GRID_Z} sequences per launch, got {batch.num_seqs}"
    if batch.per_token_head_scales:
        return PER_HEAD_ONLY
    return None


@dataclass(frozen=True)
class DslPlan:
    """A batch's launch of one DSL variant (host values and workspace views only)."""

    family: str
    library: Library
    variant: BuiltVariant
    row_tiles: int  # ceil(max_seqlen_q x group / variant.rows)
    num_splits: int
    ws_o: torch.Tensor | None  # float32 [splits, tokens, q_heads, head_dim], or None
    ws_lse: torch.Tensor | None  # float32 [splits, tokens, q_heads] (log2), or None


def plan(family: Family, batch: Batch, workspace, num_splits: int | None) -> DslPlan:
    """Plan time (host sizes only): the variant, its row tiles and the split count from _C's
    planner (``num_splits`` forces it; ``workspace``, ``fp8_noncausal_attn.plan.Workspace`` or
    None, bounds it and holds the partials). The variant's cubin is loaded here, so that a
    failure refuses the family now and the first launch may be inside a CUDA-graph capture.
    Raises :class:`Refused` with why not (:func:`plan_refusal`; no built variant; a batch that
    wants the LSE from a plan that does not split, whose epilogue writes none)."""
    why = plan_refusal(family, batch)
    if why is not None:
        raise Refused(why)
    library, _ = load_library(family.name)
    arch = family.archs[device_capability(batch.device)]
    rows = max(batch.max_seqlen_q, 1) * batch.group_size
    variant, why = choose_variant(
        library.variants, arch, batch.head_dim, batch.query_dtype, batch.cache_dtype,
        batch.block_size, rows,
    )  # fmt: skip
    if variant is None:
        raise Refused(why)
    status = library.load(variant.index)
    if status != 0:
        raise Refused(f"{variant.name} did not load (CUDA error {status})")
    row_tiles = -(-rows // variant.rows)
    # The one split-KV planner (csrc/common/plan.h), with this variant's tiles.
    num_splits = extension.loaded().plan_splits(
        **extension.plan_sizes(batch), resident_ctas=resident_ctas(batch.device),
        block_m=variant.rows, block_n=family.key_tile(batch.head_dim),
        num_splits=num_splits or 0,
    )  # fmt: skip
    ws_o = ws_lse = None
    if workspace is not None and num_splits > 1:
        num_splits = min(num_splits, workspace.max_splits(batch.num_tokens))
        if num_splits > 1:
            ws_o, ws_lse = workspace.partials(num_splits, batch.num_tokens)
    if batch.return_lse and num_splits == 1:
        raise Refused(f"{family.name}: {UNSPLIT_LSE}")
    return DslPlan(family.name, library, variant, row_tiles, num_splits, ws_o, ws_lse)


def run(
    problem: AttentionProblem, plan: DslPlan, out: torch.Tensor, lse: torch.Tensor | None = None
) -> None:
    """Launch the planned variant, writing ``out`` [num_tokens, num_q_heads, head_dim] in place
    (rows past ``cu_seqlens_q[-1]`` as zeros); with splits, then the merge, which also writes
    ``lse`` (float32 [num_tokens, num_q_heads], natural log) when given (:func:`plan` refuses a
    batch that wants it unsplit). Asynchronous on the current stream;
    :func:`run_unsupported_reason` must have accepted the tensors."""
    if lse is not None and plan.num_splits == 1:
        raise ValueError(f"{plan.family}: {UNSPLIT_LSE}")
    device = problem.query.device
    ws_o, ws_lse = plan.ws_o, plan.ws_lse
    if plan.num_splits > 1:
        rows = (plan.num_splits, problem.num_tokens, problem.num_q_heads)
        if ws_o is None:
            ws_lse = torch.empty(rows, dtype=torch.float32, device=device)
            ws_o = torch.empty(rows + (problem.head_dim,), dtype=torch.float32, device=device)
        else:
            # The kernel strides the partials by this layer's token count, which may be below
            # the plan's: view the kept (contiguous) buffers that way.
            ws_lse = ws_lse.view(-1)[: math.prod(rows)].view(rows)
            ws_o = ws_o.view(-1)[: math.prod(rows) * problem.head_dim].view(
                rows + (problem.head_dim,)
            )
        # Rows no CTA writes (padding past cu_seqlens_q[-1]) then merge to zeros.
        ws_lse.fill_(-math.inf)
    else:
        # The kernel writes every row of every sequence and none past them: zero those.
        out.zero_()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device).cuda_stream
        if problem.sinks is None:  # the kernels read them: -inf adds 0 to every denominator
            no_sinks = torch.full((problem.num_q_heads,), -math.inf, device=device)
            problem = dataclasses.replace(problem, sinks=no_sinks)
        inputs = LaunchInputs(problem, out, plan.num_splits, ws_o, ws_lse, plan.row_tiles, stream)
        arguments = launch_values(plan.family, inputs)
        status = plan.library.launch(plan.variant.index, arguments)
    if status != 0:
        raise RuntimeError(
            f"the {plan.family} kernel {plan.variant.name} failed to launch (status {status}; "
            f"{STATUS})"
        )
    if plan.num_splits > 1:
        extra = () if lse is None else (lse,)
        extension.merge_splits(problem, ws_o, ws_lse, out, *extra)
