"""Shared test setup: Triton runs in its CPU interpreter unless a GPU is present."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any Triton kernel is defined (at import of the kernel modules).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# SPEC §7: relative error against the fp32 reference on the same cache.
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 5e-3}


# The static SASS model (tools/sass_model) is a tool, not part of the package: its tests run only
# when asked for (tools/tests/, and the tests here marked sass_model).
SASS_MODEL_ENV = "FP8NCA_SASS_MODEL"


def pytest_collection_modifyitems(config, items):
    skip_model = pytest.mark.skip(reason=f"a SASS-model test: set {SASS_MODEL_ENV}=1 to run it")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    run_model = os.environ.get(SASS_MODEL_ENV) == "1"
    for item in items:
        if "sass_model" in item.keywords and not run_model:
            item.add_marker(skip_model)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
