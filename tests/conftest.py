"""Shared test setup: Triton runs in its CPU interpreter unless a GPU is present, and
``backend="mma_sync"`` on CPU tensors runs csrc/'s kernels on the SIMT executor."""

import os
from types import ModuleType

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel is defined (at import of the kernel modules).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fp8_noncausal_attn as fna  # noqa: E402
from fp8_noncausal_attn.backends.cuda import extension, simt  # noqa: E402

# Read whenever a backend is asked, so it may be set after the imports, unlike Triton's.
os.environ.setdefault(simt.ENABLE_ENV, "1")


@pytest.fixture(autouse=True)
def fresh_backend_answers():
    """After each test (and after its monkeypatching is undone), every backend's availability
    is asked afresh: a test that stood in for a GPU leaves no answer behind."""
    yield
    fna.available_backends()


@pytest.fixture(params=["simt", "_C"])
def host_code(request, monkeypatch) -> ModuleType:
    """``_C``'s host code (its plan, tiles, dtype codes, limits and the bindings' checks), from
    each build present: the SIMT executor's (the same source compiled here by the host C++
    compiler, without the attention kernels, which are no host code) and ``_C`` where one is in
    the tree (CI places the release wheel's). CPU tensors' plans go to it for the test."""
    if request.param == "_C":
        module, why = extension.load()
    else:
        builds, why = simt.availability()
        module = simt.load_file(simt.build(units=())) if builds else None
    if module is None:
        pytest.skip(why)
    monkeypatch.setattr(simt, "loaded", lambda: module)
    return module


# The static SASS model (tools/sass_model) is a tool, not part of the package: its tests run only
# when asked for (tools/tests/, and the tests here marked sass_model).
SASS_MODEL_ENV = "FP8NCA_SASS_MODEL"


def pytest_collection_modifyitems(config, items):
    # Modules that compile (builds of minutes on a cold cache; the SIMT executor's too) first:
    # scripts/test.sh hands whole files to its workers in this order, so no long build starts
    # while the other worker is about to run out of files.
    compiling = {item.path for item in items if {"compile", "simt"} & set(item.keywords)}
    items.sort(key=lambda item: item.path not in compiling)
    skip_model = pytest.mark.skip(reason=f"a SASS-model test: set {SASS_MODEL_ENV}=1 to run it")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    run_model = os.environ.get(SASS_MODEL_ENV) == "1"
    for item in items:
        if "sass_model" in item.keywords and not run_model:
            item.add_marker(skip_model)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
