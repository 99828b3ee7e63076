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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
