"""The launch record of the DSL families: the one definition of their launch arguments.

Every other form is produced from :data:`FIELDS`: the C prototype of ``fp8nca_<family>_run``
and the arguments each variant's entry forwards to its kernel (dsl/build.py writes both into
the library's C entry), the fake arguments ``cute.compile`` traces the kernels with, and the
argument list the library reports (``fp8nca_<family>_arguments()``), from which the package
builds its ctypes call (fp8_noncausal_attn/backends/cuda/dsl.py). The kernels' ``__call__``
parameters, the arguments ``__call__`` passes its ``kernel`` and the ``kernel``'s parameters
are checked against it (tests/test_dsl_launch.py): a pointer field ``x`` is the parameter
``x_ptr``, any other field keeps its name unless ``kernel_as`` renames it in ``kernel``.

Pure Python (no DSL import): the package build and the tests read it without the DSL.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass


@dataclass(frozen=True)
class Field:
    """One launch argument.

    ``kind``: ``ptr`` (a device pointer), ``i64``, ``i32``, ``f32`` or ``stream``. A pointer's
    ``element`` is what it points to (``query``: the 16-bit query / output dtype, ``cache``: the
    FP8 cache dtype, or ``int32`` / ``float32`` / ``uint8``) and ``align`` the alignment in bytes
    its kernels assume. ``entry`` marks an argument the library's entry fixes per variant
    instead of taking it from the caller; ``kernel_families`` names the families whose kernel
    reads it (every family's entry takes every field).
    ``launch_only`` fields size the grid or pick the stream and are not passed to ``kernel``;
    ``kernel_as`` names the ``kernel`` parameter that takes a field ``__call__`` transforms
    first (the softmax scale in log2 units) or renames.
    """

    name: str
    kind: str
    doc: str
    element: str = ""
    align: int = 0
    entry: bool = False
    kernel_families: tuple[str, ...] = ("wgmma", "tcgen05")
    launch_only: bool = False
    kernel_as: str = ""

    @property
    def c_type(self) -> str:
        return C_TYPES[self.kind]

    @property
    def parameter(self) -> str:
        """The kernel ``__call__`` parameter that takes it."""
        return f"{self.name}_ptr" if self.kind == "ptr" else self.name

    @property
    def kernel_parameter(self) -> str:
        """The ``kernel`` parameter that takes it."""
        return self.kernel_as or self.parameter


C_TYPES = {"ptr": "void *", "i64": "int64_t", "i32": "int32_t", "f32": "float",
           "stream": "cudaStream_t"}  # fmt: skip


def _ptr(name: str, element: str, align: int, doc: str) -> Field:
    return Field(name, "ptr", doc, element, align)


def _strides(tensor: str, dims: str, doc: str) -> tuple[Field, ...]:
    return tuple(Field(f"{tensor}_stride_{d}", "i64", doc) for d in dims)


FIELDS = (
    _ptr("q", "query", 16, "[num_tokens, num_q_heads, head_dim] 16-bit"),
    _ptr("k", "cache", 16, "[num_blocks, page_size, num_kv_heads, head_dim] FP8"),
    _ptr("v", "cache", 16, "the shape of k, own strides"),
    _ptr("out", "query", 16, "[num_tokens, num_q_heads, head_dim], the query dtype"),
    _ptr("block_table", "int32", 4, "int32 [num_seqs, max_blocks]"),
    _ptr("cu_seqlens_q", "int32", 4, "int32 [num_seqs + 1], contiguous"),
    _ptr("seq_lens", "int32", 4, "int32 [num_seqs], contiguous"),
    _ptr("k_scale", "float32", 4, "fp32 [num_kv_heads]"),
    _ptr("v_scale", "float32", 4, "fp32 [num_kv_heads]"),
    _ptr("causal_flags", "uint8", 1, "bytes of the per-sequence causal flags, or null"),
    _ptr("sinks", "float32", 4, "fp32 [num_q_heads] natural-log sink logits; -inf: none"),
    _ptr("ws_o", "float32", 16, "fp32 [num_splits, num_tokens, num_q_heads, head_dim]"),
    _ptr("ws_lse", "float32", 4, "fp32 [num_splits, num_tokens, num_q_heads], log2"),
    *_strides("q", "th", "query strides (elements): token, head"),
    *_strides("o", "th", "output strides: token, head"),
    *_strides("k", "bsh", "key cache strides: block, slot, head"),
    *_strides("v", "bsh", "value cache strides: block, slot, head"),
    *_strides("bt", "sb", "block table strides: sequence, block"),
    Field("causal_stride", "i64", "stride of the per-sequence flags, in flags"),
    Field("causal_width", "i32", "bytes per flag: 0 (no flags), 1 (bool) or 4 (int32)"),
    Field(
        "causal",
        "i32",
        "the launch-wide causal flag when causal_width is 0",
        kernel_as="causal_global",
    ),  # fmt: skip
    Field("window_left", "i32", "-1: unbounded (SPEC section 3)"),
    Field("window_right", "i32", "-1: unbounded; causal caps it at 0"),
    Field("page_shift", "i32", "log2 of the page size: 4..8"),
    Field("num_tokens", "i32", "query rows, padding included"),
    Field("num_seqs", "i32", "sequences", launch_only=True),
    Field("num_q_heads", "i32", "query heads"),
    Field("num_kv_heads", "i32", "KV heads"),
    Field("row_tiles", "i32", "ceil(max_seqlen_q x group / rows per CTA)", launch_only=True),
    Field("num_splits", "i32", "split-KV partials per sequence"),
    Field(
        "q_is_bf16",
        "i32",
        "1: bf16 query and output, 0: fp16",
        entry=True,
        kernel_families=("tcgen05",),
    ),  # fmt: skip
    Field("softmax_scale", "f32", "the scale of q . k", kernel_as="scale_log2"),
    Field("stream", "stream", "the CUDA stream", launch_only=True),
)


FAMILIES = ("wgmma", "tcgen05")


def fields(family: str) -> tuple[Field, ...]:
    """The parameters of ``family``'s entry (``__call__``), in order: every field."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    return FIELDS


def kernel_fields(family: str) -> tuple[Field, ...]:
    """The fields ``family``'s ``kernel`` reads, in the order of :data:`KERNEL_ARGS`."""
    return tuple(f for f in fields(family) if not f.launch_only and family in f.kernel_families)


# The tuple each family's kernel takes its launch values in (a named tuple: the DSL passes its
# items as kernel parameters, in order), with the kernel's names.
KERNEL_ARGS = {
    family: namedtuple(
        f"{family.capitalize()}Args", [f.kernel_parameter for f in kernel_fields(family)]
    )
    for family in FAMILIES
}


def kernel_args(family: str, given: dict):
    """The family's :data:`KERNEL_ARGS` from ``given`` (an entry's locals: each field by its
    kernel name when the entry computed that, else by its parameter name)."""
    return KERNEL_ARGS[family](*(
        given[f.kernel_parameter] if f.kernel_parameter in given else given[f.parameter]
        for f in kernel_fields(family)
    ))  # fmt: skip


def c_arguments(family: str) -> tuple[Field, ...]:
    """The arguments of ``fp8nca_<family>_run`` after the variant index, in order."""
    return tuple(f for f in fields(family) if not f.entry)


def c_prototype(family: str) -> str:
    """``"void *q, void *k, ..., cudaStream_t stream"``: the C parameters of ``run``."""
    return ", ".join(f"{f.c_type} {f.name}" for f in c_arguments(family))


def forwarded(family: str, entry_values: dict[str, str]) -> str:
    """The C arguments an entry passes its kernel's wrapper: the caller's, with each
    entry-fixed field given by ``entry_values`` (C expressions)."""
    return ", ".join(
        f"{entry_values[f.name]} /* {f.name} */" if f.entry else f.name for f in fields(family)
    )
