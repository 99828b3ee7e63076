"""Compiling the Triton kernels exactly as their launchers launch them, with no GPU.

The launchers' own calls are captured (the JIT functions are swapped for recorders while the
launcher runs on CPU tensors), then each captured call goes through the JIT's own binder and
argument packing for the target backend, so the compiled kernel gets the specialisation a real
launch gets: 16-byte divisibility (``tt.divisibility``) of aligned pointers and of integer
arguments that are multiples of 16, constexprs as passed, ``num_warps`` / ``num_stages`` from the
launch plan.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .cubins import Kernel, Resources, read_cubin, read_resources


@dataclass
class Launch:
    """One captured launch: the JIT function, its grid and its arguments."""

    fn: Any
    grid: Any
    args: tuple
    kwargs: dict


class _Recorder:
    def __init__(self, fn: Any, launches: list[Launch]):
        self.fn = fn
        self._launches = launches

    def __getitem__(self, grid: Any):
        def record(*args: Any, **kwargs: Any) -> None:
            self._launches.append(Launch(self.fn, grid, args, kwargs))

        return record


@contextlib.contextmanager
def captured_launches(module: ModuleType, *names: str) -> Iterator[list[Launch]]:
    """While active, launches of ``module.<name>[grid](...)`` are recorded instead of run."""
    launches: list[Launch] = []
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, _Recorder(fn, launches))
        yield launches
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


@dataclass
class Compiled:
    """A compiled launch: Triton's compiled kernel and the JIT's argument attributes; its
    cubin's kernel is read on demand (:meth:`kernel` disassembles it, :meth:`resources` does
    not)."""

    launch: Launch
    compiled: Any
    attrs: dict

    def kernel(self) -> Kernel:
        """The cubin's one kernel with its SASS and resource usage."""
        return self._read(read_cubin)

    def resources(self) -> Resources:
        """The cubin's one kernel's registers, stack and local memory, without its SASS."""
        return self._read(read_resources)

    def _read(self, reader):
        with tempfile.TemporaryDirectory(prefix="sass_model_triton_") as tmp:
            path = Path(tmp) / f"{self.launch.fn.__name__}.cubin"
            path.write_bytes(self.compiled.asm["cubin"])
            (kernel,) = reader(path)
        return kernel


def compile_launch(launch: Launch, cc: int) -> Compiled:
    """Compiles one captured launch for ``sm_<cc>`` with the JIT's launch-time specialisation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    source = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(source, target=target, options=options.__dict__)
    return Compiled(launch, compiled, attrs)
