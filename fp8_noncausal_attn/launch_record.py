"""The launch record: the one definition of the attention launch's arguments, one name per value,
shared by every compiled kernel family.

Every other form is produced from :data:`FIELDS`:

- the mma.sync parameter struct: ``csrc/common/launch_record.h`` (``FP8NCA_ATTN_FIELDS``, the
  X-macro ``AttnParams`` is declared from, and ``FP8NCA_LAUNCH_RECORD_HASH``), written by
  ``python -m tools.launch_record`` and checked byte for byte by the tests;
- the CUTLASS-DSL families' C entry and prototype (dsl/build.py, through dsl/common/launch.py);
- the values of one launch by name (:func:`launch_values`), which ``mma_sync.run`` and the DSL
  launch both pass;
- Triton's kernel arguments by parameter name (:func:`launch_arguments`, the tensors
  themselves), which its launch completes with what only Triton takes.

Each compiled library exports :func:`record_hash` of the fields it was built with (``_C``:
``LAUNCH_RECORD_HASH``; a DSL library: ``fp8nca_<family>_launch_record()``); the package refuses
one whose hash differs when it loads it, never at launch.

Adding a launch argument is one :class:`Field` here plus the kernel code that reads it (and, for
Triton, its kernels' parameter of the field's :attr:`Field.parameter` name).

Pure Python (no torch, no DSL): the DSL build and the header generator read it without either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# The launches that take a field: the mma.sync kernels (members of AttnParams), the two
# CUTLASS-DSL families (parameters of their library's entry) and Triton's kernels (keyword
# arguments, JIT-compiled: no library, so no record hash).
MMA_SYNC = "mma_sync"
DSL_FAMILIES = ("wgmma", "tcgen05")
FAMILIES = (MMA_SYNC, *DSL_FAMILIES)
TRITON = "triton"
LAUNCHES = (*FAMILIES, TRITON)

# The scale_mode field's values (csrc/common/params.h ScaleMode, _C.SCALE_MODES).
SCALE_MODES = {"per_head": 0, "per_token_head": 1}

# Window sides travel as C ints; a side this long reaches past any context, so larger ones
# (validation admits any int) go as this.
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class LaunchInputs:
    """What one launch's values are read from (torch objects, duck-typed here).

    ``problem``: ``fp8_noncausal_attn.problem.AttentionProblem``; ``out``: the output tensor;
    ``ws_o`` / ``ws_lse``: the split-KV partials (None when unsplit; ``ws_lse`` may be the
    unsplit LSE output of mma.sync); ``row_tiles`` and ``stream`` only the DSL launches take."""

    problem: Any
    out: Any
    num_splits: int
    ws_o: Any = None
    ws_lse: Any = None
    row_tiles: int = 0
    stream: int = 0


@dataclass(frozen=True)
class Field:
    """One launch argument.

    ``kind``: ``ptr`` (a device pointer), ``i64``, ``i32``, ``f32`` or ``stream``. A pointer's
    ``element`` is what it points to (``query``: the 16-bit query / output dtype, ``cache``: the
    FP8 cache dtype, ``flags``: bytes of bool or int32 flags, ``int32``, ``float32``), ``align``
    the alignment in bytes the DSL kernels assume, ``written`` whether the kernels write it.
    ``value`` gives its value for one launch (a tensor for a pointer: its address goes).

    ``families``: the launches that take it (:data:`LAUNCHES`). ``source``: ``given`` (the
    caller's value), ``derived`` (mma.sync's binding computes it from the others) or ``entry``
    (a DSL library's entry fixes it per variant). DSL only: ``kernel_families`` names the
    families whose kernel reads it; ``launch_only`` fields size the grid or pick the stream and
    are not passed to the kernel; ``kernel_as`` names the kernel parameter of a value the entry
    transforms first (the softmax scale in log2 units). Every mma.sync field is a member of the
    one ``AttnParams`` that every mma.sync kernel takes."""

    name: str
    kind: str
    doc: str
    value: Callable[[LaunchInputs], Any] | None = None
    element: str = ""
    align: int = 0
    written: bool = False
    families: tuple[str, ...] = FAMILIES
    source: str = "given"
    kernel_families: tuple[str, ...] = DSL_FAMILIES
    launch_only: bool = False
    kernel_as: str = ""

    @property
    def parameter(self) -> str:
        """The DSL entry's (``__call__``) and Triton kernels' parameter that takes it:
        ``<name>_ptr`` for a pointer, else its name."""
        return f"{self.name}_ptr" if self.kind == "ptr" else self.name

    @property
    def kernel_parameter(self) -> str:
        """The DSL ``kernel`` parameter that takes it."""
        return self.kernel_as or self.parameter

    @property
    def cpp_type(self) -> str:
        """Its type in AttnParams (csrc/common/launch_record.h)."""
        if self.kind != "ptr":
            return CPP_TYPES[self.kind]
        pointee = {"int32": "int32_t", "float32": "float"}.get(self.element, "void")
        return f"{pointee}*" if self.written else f"const {pointee}*"


CPP_TYPES = {"i64": "int64_t", "i32": "int", "f32": "float"}


def _window_side(side: int) -> int:
    return min(side, INT32_MAX)


def window_sides(problem) -> tuple[int, int]:
    """The ``(left, right)`` window of a problem or batch as the kernels take it: -1 =
    unbounded, others capped at INT32_MAX (already past any position)."""
    left, right = problem.window
    return _window_side(left), _window_side(right)


# Every launch takes the tensors' pointers and strides, the sequence count, the query rows and
# the split count; Triton takes the rest in its own forms or as constexprs.
_ALL = LAUNCHES


def _ptr(name: str, element: str, align: int, doc: str, value, **more) -> Field:
    return Field(name, "ptr", doc, value, element, align, families=_ALL, **more)


def _strides(prefix: str, dims: str, tensor, doc: str) -> tuple[Field, ...]:
    """One i64 field per dimension of ``tensor(inputs)``, in order: ``<prefix>_stride_<dim>``."""
    return tuple(
        Field(
            f"{prefix}_stride_{d}", "i64", doc, lambda i, at=at: tensor(i).stride(at), families=_ALL
        )  # fmt: skip
        for at, d in enumerate(dims)
    )


def _flags(i: LaunchInputs):
    return i.problem.causal_per_seq


def _token_scale_strides(prefix: str, scale) -> tuple[Field, ...]:
    """A per-token-head scale's block, slot and head strides (0 with per-KV-head scales)."""
    return tuple(
        Field(
            f"{prefix}_stride_{d}",
            "i64",
            f"per-token-head {prefix[0]}_scale stride: {d}",
            lambda i, at=at: scale(i).stride(at) if scale(i).dim() == 3 else 0,
            families=(MMA_SYNC, TRITON),
        )  # fmt: skip
        for at, d in enumerate("bsh")
    )


def _size(name: str, doc: str, **more) -> Field:
    return Field(name, "i32", doc, lambda i: getattr(i.problem, name), **more)


_DSL = DSL_FAMILIES
_MMA = (MMA_SYNC,)

# In the order of AttnParams: the mma.sync kernels' cubins depend on it.
FIELDS: tuple[Field, ...] = (
    _ptr("q", "query", 16, "[num_tokens, num_q_heads, head_dim] 16-bit", lambda i: i.problem.query),
    _ptr("k", "cache", 16, "[num_blocks, block_size, num_kv_heads, head_dim] FP8",
         lambda i: i.problem.key_cache),
    _ptr("v", "cache", 16, "the shape of k, own strides", lambda i: i.problem.value_cache),
    _ptr("out", "query", 16, "[num_tokens, num_q_heads, head_dim], the query dtype",
         lambda i: i.out, written=True),
    _ptr("block_table", "int32", 4, "int32 [num_seqs, max_blocks]",
         lambda i: i.problem.block_table),
    _ptr("cu_seqlens_q", "int32", 4, "int32 [num_seqs + 1]; rows from [num_seqs] on: padding",
         lambda i: i.problem.cu_seqlens_q),
    _ptr("seq_lens", "int32", 4, "int32 [num_seqs]", lambda i: i.problem.seq_lens),
    _ptr("k_scale", "float32", 4, "fp32 [num_kv_heads], or per token and head (scale_mode)",
         lambda i: i.problem.k_scale),
    _ptr("v_scale", "float32", 4, "likewise", lambda i: i.problem.v_scale),
    _ptr("causal_per_seq", "flags", 1, "[num_seqs] bool or int32 (nonzero: causal), or null",
         _flags),
    _ptr("sinks", "float32", 4, "fp32 [num_q_heads] natural-log sink logits, or null",
         lambda i: i.problem.sinks),
    _ptr("ws_o", "float32", 16, "fp32 [num_splits, num_tokens, num_q_heads, head_dim] when split",
         lambda i: i.ws_o, written=True),
    _ptr("ws_lse", "float32", 4,
         "fp32 [num_splits, num_tokens, num_q_heads] (log2) when split; mma.sync unsplit with "
         "the LSE asked for: [num_tokens, num_q_heads] (natural log)",
         lambda i: i.ws_lse, written=True),
    *_strides("q", "th", lambda i: i.problem.query, "query strides (elements): token, head"),
    *_strides("o", "th", lambda i: i.out, "output strides: token, head"),
    *_strides("k", "bsh", lambda i: i.problem.key_cache, "key cache strides: block, slot, head"),
    *_strides("v", "bsh", lambda i: i.problem.value_cache,
              "value cache strides: block, slot, head"),
    *_strides("bt", "sb", lambda i: i.problem.block_table, "block table strides: sequence, block"),
    Field("cu_stride", "i64", "stride of cu_seqlens_q", lambda i: i.problem.cu_seqlens_q.stride(0),
          families=_ALL),
    Field("sl_stride", "i64", "stride of seq_lens", lambda i: i.problem.seq_lens.stride(0),
          families=_ALL),
    Field("causal_stride", "i64", "stride of causal_per_seq, in flags (0 when null)",
          lambda i: 0 if _flags(i) is None else _flags(i).stride(0), families=_ALL),
    Field("causal_bytes", "i32", "bytes per causal_per_seq flag: 1 (bool), 4 (int32); 0 when null",
          lambda i: 0 if _flags(i) is None else _flags(i).element_size()),
    Field("out_align", "i32", "bytes: largest power of two <= 16 dividing out and its strides",
          families=_MMA, source="derived"),
    _size("num_tokens", "query rows, padding included", families=_ALL),
    _size("num_seqs", "sequences", launch_only=True, families=_ALL),
    _size("num_q_heads", "query heads"),
    _size("num_kv_heads", "KV heads"),
    Field("group", "i32", "num_q_heads / num_kv_heads", families=_MMA, source="derived"),
    _size("head_dim", "64, 128 or 256", families=_MMA),
    _size("block_size", "keys per cache page", families=_MMA),
    Field("block_shift", "i32", "log2(block_size): validation admits powers of two only",
          lambda i: i.problem.block_size.bit_length() - 1),
    _size("max_seqlen_q", "the longest sequence's query tokens", families=_MMA),
    Field("num_splits", "i32", "split-KV partials per sequence: the plan's",
          lambda i: i.num_splits, families=_ALL),
    Field("causal", "i32", "the launch-wide causal flag when causal_per_seq is null",
          lambda i: int(bool(i.problem.causal))),
    # Sliding window (SPEC section 3): row at position pos sees keys [pos - left, pos + right].
    Field("window_left", "i32", "-1: unbounded", lambda i: window_sides(i.problem)[0]),
    Field("window_right", "i32", "-1: unbounded; causal caps it at 0",
          lambda i: window_sides(i.problem)[1]),
    Field("softmax_scale", "f32", "the scale of q . k", lambda i: float(i.problem.softmax_scale),
          kernel_as="scale_log2"),
    # mma.sync's per-token-head scales: with them, k_scale / v_scale point at float32
    # [num_blocks, block_size, num_kv_heads] tensors read through these strides (any values:
    # vLLM's inline scales are a strided view of its page).
    Field("scale_mode", "i32", "ScaleMode: which kernels the launch runs",
          lambda i: SCALE_MODES["per_token_head" if i.problem.per_token_head_scales
                                else "per_head"],
          families=_MMA),
    *_token_scale_strides("ks", lambda i: i.problem.k_scale),
    *_token_scale_strides("vs", lambda i: i.problem.v_scale),
    Field("row_tiles", "i32", "ceil(max_seqlen_q x group / rows per CTA)", lambda i: i.row_tiles,
          families=_DSL, launch_only=True),
    Field("q_is_bf16", "i32", "1: bf16 query and output, 0: fp16", families=_DSL, source="entry",
          kernel_families=("tcgen05",)),
    Field("stream", "stream", "the CUDA stream", lambda i: i.stream, families=_DSL,
          launch_only=True),
)  # fmt: skip


def fields(family: str) -> tuple[Field, ...]:
    """The fields ``family``'s launch takes, in order."""
    if family not in LAUNCHES:
        raise ValueError(f"unknown kernel family {family!r}")
    return tuple(f for f in FIELDS if family in f.families)


def given(family: str) -> tuple[Field, ...]:
    """The fields of ``family``'s launch that the caller passes (:func:`launch_values`'s keys)."""
    return tuple(f for f in fields(family) if f.source == "given")


def record_hash(family: str) -> str:
    """12 hex digits of SHA-256 over ``family``'s fields (name, kind, element, source, in
    order) and, when it takes ``scale_mode``, that field's values (:data:`SCALE_MODES`): what a
    library built from this record exports."""
    taken = fields(family)
    text = ";".join(f"{f.name}:{f.kind}:{f.element}:{f.source}" for f in taken)
    if any(f.name == "scale_mode" for f in taken):
        text += "|" + ";".join(f"{mode}={value}" for mode, value in sorted(SCALE_MODES.items()))
    return hashlib.sha256(f"{family}|{text}".encode()).hexdigest()[:12]


def launch_values(family: str, inputs: LaunchInputs) -> dict[str, int | float]:
    """The value of each field ``family``'s caller passes, by name: pointers as addresses (0 for
    None), the others as the record computes them."""
    values: dict[str, int | float] = {}
    for f in given(family):
        value = f.value(inputs)
        if f.kind == "ptr":
            value = 0 if value is None else value.data_ptr()
        values[f.name] = value
    return values


def launch_arguments(family: str, inputs: LaunchInputs) -> dict[str, Any]:
    """The value of each field ``family``'s caller passes, by :attr:`Field.parameter` name:
    pointers as the tensors themselves (None stays None), what a Triton kernel takes."""
    return {f.parameter: f.value(inputs) for f in given(family)}


def refusal(library: str, built: str | None, family: str) -> str | None:
    """None when ``built`` (the hash a library exports; None: it exports none) is this record's
    for ``family``, else why ``library`` is refused, naming both hashes."""
    expected = record_hash(family)
    if built == expected:
        return None
    return (
        f"{library} was built from another launch record (hash {built or 'none'}, this package's "
        f"{family} record is {expected}): rebuild it from this package's source"
    )
