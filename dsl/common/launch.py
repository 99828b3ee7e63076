"""The DSL families' forms of the launch record (fp8_noncausal_attn/launch_record.py, the one
definition of the launch arguments of every kernel family).

From the record's fields of a DSL family come: the C prototype of ``fp8nca_<family>_run`` and the
arguments each variant's entry forwards to its kernel (dsl/build.py writes both into the
library's C entry, with the record's hash), the fake arguments ``cute.compile`` traces the kernels
with, and the argument list the library reports (``fp8nca_<family>_arguments()``), from which the
package builds its ctypes call (fp8_noncausal_attn/backends/cuda/dsl.py), the parameters of the
kernels' ``__call__`` (dsl/common/entry.py generates its signature from :data:`FIELDS`) and the
tuple ``__call__`` passes its ``kernel``. The ``kernel``'s parameters are checked against it
(tests/test_dsl_launch.py): a pointer field ``x`` is the parameter ``x_ptr``, any other field
keeps its name unless ``kernel_as`` renames it in ``kernel``.

Pure Python (no DSL import): the package build and the tests read it without the DSL.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import namedtuple
from pathlib import Path

_RECORD = "fp8_noncausal_attn.launch_record"


def _record():
    """The package's launch record module, the very one the package imports (one ``Field``
    class): loaded from its file when the package is not imported yet, because importing the
    package imports torch, which the DSL build does not need."""
    if _RECORD not in sys.modules:
        path = Path(__file__).resolve().parents[2] / "fp8_noncausal_attn" / "launch_record.py"
        spec = importlib.util.spec_from_file_location(_RECORD, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[_RECORD] = module
        spec.loader.exec_module(module)
    return sys.modules[_RECORD]


record = _record()
FAMILIES = record.DSL_FAMILIES
C_TYPES = {"ptr": "void *", "i64": "int64_t", "i32": "int32_t", "f32": "float",
           "stream": "cudaStream_t"}  # fmt: skip


def fields(family: str) -> tuple:
    """The parameters of ``family``'s entry (``__call__``), in order: the record's fields of
    the family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown DSL family {family!r}")
    return record.fields(family)


# Both families' entries take the same fields (dsl/common/entry.py is their one ``__call__``).
FIELDS = fields(FAMILIES[0])
assert all(fields(family) == FIELDS for family in FAMILIES)


def kernel_fields(family: str) -> tuple:
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


def c_arguments(family: str) -> tuple:
    """The arguments of ``fp8nca_<family>_run`` after the variant index, in order: the record's
    ``given`` fields of the family."""
    return record.given(family)


def c_prototype(family: str) -> str:
    """``"void *q, void *k, ..., cudaStream_t stream"``: the C parameters of ``run``."""
    return ", ".join(f"{C_TYPES[f.kind]} {f.name}" for f in c_arguments(family))


def forwarded(family: str, entry_values: dict[str, str]) -> str:
    """The C arguments an entry passes its kernel's wrapper: the caller's, with each
    entry-fixed field given by ``entry_values`` (C expressions)."""
    return ", ".join(
        f"{entry_values[f.name]} /* {f.name} */" if f.source == "entry" else f.name
        for f in fields(family)
    )
