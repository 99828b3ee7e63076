"""The host entry both DSL families share: ``__call__`` takes the launch record's fields
(fp8_noncausal_attn/launch_record.py through dsl/common/launch.py), packs the ones the kernel
reads into the family's :data:`launch.KERNEL_ARGS` tuple and launches the family's ``kernel``
over the grid (row tiles, KV heads, sequences x splits).

Its parameter list is generated from the record, not written out: ``cute.jit`` reads the
parameters (names and DSL types) of the function it wraps with ``inspect.signature``, which
returns a ``__signature__`` the function carries, and calls that function with the arguments
bound to it, in order. So ``__call__`` is written over ``*values`` and
:func:`takes_the_records_fields` gives the wrapped function the record's signature; the DSL
traces, compiles and exports (``export_to_c``: the C prototype's names) that signature."""

import inspect
import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

from dsl.common import launch

LOG2_E = math.log2(math.e)
# The DSL type of each record field kind (launch_record.Field.kind).
DSL_TYPES = {"ptr": cute.Pointer, "i64": cutlass.Int64, "i32": cutlass.Int32,
             "f32": cutlass.Float32, "stream": cuda.CUstream}  # fmt: skip


def entry_signature() -> inspect.Signature:
    """``(self, q_ptr: cute.Pointer, ..., stream: cuda.CUstream)``: one positional parameter
    per field of :data:`launch.FIELDS`, in order, named ``Field.parameter``, of its kind's DSL
    type."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    return inspect.Signature([
        inspect.Parameter("self", positional),
        *(inspect.Parameter(f.parameter, positional, annotation=DSL_TYPES[f.kind])
          for f in launch.FIELDS),
    ])  # fmt: skip


def takes_the_records_fields(jit_function):
    """Give the function ``cute.jit`` wrapped (``__wrapped__``: the one the DSL reads the
    signature of and traces) :func:`entry_signature`. Applied above ``@cute.jit``, which must
    be the innermost decorator of a function the DSL preprocesses."""
    jit_function.__wrapped__.__signature__ = entry_signature()
    return jit_function


class LaunchEntry:
    """Base of a family's kernel class, which sets ``family`` and ``threads`` and provides
    ``kernel_objects()`` (the compile-time objects its ``kernel`` takes first: tiled MMAs,
    shared-memory layouts) and ``kernel(*objects, args)``."""

    family: str
    threads: int

    @takes_the_records_fields
    @cute.jit
    def __call__(self, *values):
        given = dict(zip((f.parameter for f in launch.FIELDS), values, strict=True))
        # The kernels run the softmax in log2 units.
        given["scale_log2"] = given["softmax_scale"] * LOG2_E
        args = launch.kernel_args(self.family, given)
        self.kernel(*self.kernel_objects(), args).launch(
            grid=(given["row_tiles"], given["num_kv_heads"],
                  given["num_seqs"] * given["num_splits"]),
            block=[self.threads, 1, 1],
            cluster=[1, 1, 1],
            stream=given["stream"],
        )  # fmt: skip
