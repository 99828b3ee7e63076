"""The DSL families' forms of the launch record (fp8_noncausal_attn/launch_record.py through
dsl/common/launch.py) against the record: the C entry dsl/build.py writes (with the record's
hash), the package's ctypes call and launch values, and the kernels' own parameter lists and
reads (from their source, without the DSL)."""

import ast
import ctypes
import dataclasses
from pathlib import Path

import pytest

from dsl import build
from dsl.common import launch
from fp8_noncausal_attn.backends.cuda import dsl as dsl_families

ROOT = Path(__file__).resolve().parent.parent
KERNELS = {
    "wgmma": ROOT / "dsl" / "wgmma" / "kernel.py",
    "tcgen05": ROOT / "dsl" / "tcgen05" / "kernel.py",
}
FAMILIES = ("wgmma", "tcgen05")


def kernel_class(family: str) -> ast.ClassDef:
    tree = ast.parse(KERNELS[family].read_text())
    (found,) = (n for n in tree.body if isinstance(n, ast.ClassDef) and "PagedAttention" in n.name)
    return found


def method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    (found,) = (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
    return found


def parameters(function: ast.FunctionDef) -> list[tuple[str, str]]:
    return [(a.arg, ast.unparse(a.annotation)) for a in function.args.args[1:]]


ENTRY = ROOT / "dsl" / "common" / "entry.py"


def entry_call() -> ast.FunctionDef:
    (cls,) = (n for n in ast.parse(ENTRY.read_text()).body if isinstance(n, ast.ClassDef))
    return method(cls, "__call__")


def test_the_shared_entry_takes_the_records_fields():
    """``LaunchEntry.__call__`` (both families'): the signature the DSL reads
    (``inspect.signature`` of the function ``cute.jit`` wraps) is one parameter per field, in
    order, of the field's DSL type; the function itself takes ``*values`` and packs the
    kernel's share with ``launch.kernel_args``."""
    pytest.importorskip("cutlass")
    import inspect

    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute

    from dsl.common import entry

    dsl_types = {"ptr": cute.Pointer, "i64": cutlass.Int64, "i32": cutlass.Int32,
                 "f32": cutlass.Float32, "stream": cuda.CUstream}  # fmt: skip
    expected = [("self", inspect.Parameter.empty)]
    expected += [(f.parameter, dsl_types[f.kind]) for f in launch.FIELDS]
    for function in (entry.LaunchEntry.__call__, entry.LaunchEntry.__call__.__wrapped__):
        taken = inspect.signature(function).parameters.values()
        assert [(p.name, p.annotation) for p in taken] == expected
    call = entry_call()
    assert not call.args.args[1:] and call.args.vararg.arg == "values"
    assert [ast.unparse(d) for d in call.decorator_list] == ["takes_the_records_fields", "cute.jit"]
    source = ast.unparse(call)
    assert "launch.kernel_args(self.family, given)" in source
    assert "self.kernel(*self.kernel_objects(), args)" in source


@pytest.mark.parametrize("family", FAMILIES)
def test_each_kernel_takes_the_records_kernel_fields(family):
    """A family's kernel class inherits the entry and names its family; its ``kernel`` takes
    the compile-time objects ``kernel_objects`` returns, then ``args`` (the family's
    ``launch.KERNEL_ARGS``: the record's kernel fields under their kernel names, in order)."""
    cls = kernel_class(family)
    assert "LaunchEntry" in [ast.unparse(b) for b in cls.bases]
    assigned = {
        ast.unparse(n.targets[0]): ast.literal_eval(n.value)
        for n in cls.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
    }
    assert assigned["family"] == family
    kernel = method(cls, "kernel")
    assert parameters(kernel)[-1] == ("args", "Args")
    (returned,) = (n for n in ast.walk(method(cls, "kernel_objects")) if isinstance(n, ast.Return))
    assert len(returned.value.elts) == len(parameters(kernel)) - 1
    fields = launch.KERNEL_ARGS[family]._fields
    assert fields == tuple(f.kernel_parameter for f in launch.kernel_fields(family))
    # The launch values the kernel, its roles and the shared device code (dsl/common: the CTA's
    # work, the index reads) read are the tuple's, every one: a field passed but never read
    # (a stride ignored) shows here.
    files = [*KERNELS[family].parent.glob("*.py"), *(ROOT / "dsl" / "common").glob("*.py")]
    read = {
        n.attr for path in sorted(files) for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == "args"
    }  # fmt: skip
    assert read == set(fields), (read - set(fields), set(fields) - read)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_c_entry_and_the_ctypes_call_are_the_records(family):
    """The run prototype and the arguments list the library reports (both written from the
    record) parse to the record's C arguments; entry-fixed fields are not among them. The
    library exports the record's hash for its family."""
    source = build.entry_source([("sym", "name@arch", "args")], family)
    record_hash = launch.record.record_hash(family)
    assert f'fp8nca_{family}_launch_record(void) {{ return "{record_hash}"; }}' in source
    prototype = launch.c_prototype(family)
    assert f"int fp8nca_{family}_run(int i, {prototype}) {{" in source
    assert f'fp8nca_{family}_arguments(void) {{ return "{prototype}"; }}' in source
    parsed = dsl_families.parse_arguments(prototype)
    assert [name for name, _ in parsed] == [f.name for f in launch.c_arguments(family)]
    kinds = {"ptr": ctypes.c_void_p, "i64": ctypes.c_int64, "i32": ctypes.c_int32,
             "f32": ctypes.c_float, "stream": ctypes.c_void_p}  # fmt: skip
    assert [kind for _, kind in parsed] == [kinds[f.kind] for f in launch.c_arguments(family)]
    assert all(f.source == "given" for f in launch.c_arguments(family))


@pytest.mark.parametrize("variant", [build.VARIANTS[0], build.VARIANTS[1], build.WGMMA_VARIANTS[0]])
def test_each_entry_forwards_every_field_and_fixes_its_own(variant):
    """A variant's entry passes its kernel's wrapper every field in order: the caller's
    arguments, and its own query-dtype flag where the record says the entry fixes it."""
    flag = str(int(variant.q_dtype == "bfloat16"))
    forwarded = build.forward(variant).split(", ")
    assert [a.split(" ")[0] for a in forwarded] == [
        flag if f.source == "entry" else f.name for f in launch.FIELDS
    ]


def test_a_malformed_argument_list_is_refused():
    with pytest.raises(ValueError, match="unexpected run parameter"):
        dsl_families.parse_arguments("void *q, double scale")
    with pytest.raises(ValueError, match="unexpected run parameter"):
        dsl_families.parse_arguments("void *q, int64_t")


def test_the_launch_fills_every_argument_the_library_takes():
    """The record's launch values give a value to each C argument of both families and nothing
    else, each index tensor's strides among them (a strided case: every stride 2)."""
    from fp8_noncausal_attn.synthetic import make_case
    from fp8_noncausal_attn.validation import validate_attention

    case = make_case([3, 2], [40, 9], causal=[True, False], index_step=2, seed=5)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    for family in FAMILIES:
        with_sinks = dataclasses.replace(problem, sinks=problem.k_scale)
        inputs = launch.record.LaunchInputs(with_sinks, problem.query, 1, row_tiles=1)
        values = launch.record.launch_values(family, inputs)
        assert list(values) == [f.name for f in launch.c_arguments(family)]
        assert values["causal_bytes"] == 1 and values["causal_per_seq"] != 0
        assert values["k_stride_s"] == problem.key_cache.stride(1)
        strides = ("bt_stride_b", "cu_stride", "sl_stride", "causal_stride")
        assert [values[name] for name in strides] == [2, 2, 2, 2]
        assert values["bt_stride_s"] == problem.block_table.stride(0)
