"""Backends and GPUs stood in for through the public registry
(``fp8_noncausal_attn.registry.REGISTRY``) and the CUDA extension's public entry points, so that
the choice of a backend and the CUDA families' host code run on a CPU."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import registry
from fp8_noncausal_attn.backends.cuda import extension, simt
from fp8_noncausal_attn.backends.protocol import Refused


def replace_kernels(monkeypatch, name: str, kernels) -> None:
    """Backend ``name`` served by ``kernels`` (a :class:`~fp8_noncausal_attn.backends.protocol.
    Backend`) for the rest of the test: its registry entry patched, its cache write and merge
    kept; every backend's availability asked afresh."""
    entry = registry.REGISTRY[name]
    monkeypatch.setitem(registry.REGISTRY, name, dataclasses.replace(entry, kernels=kernels))
    fna.available_backends()


class RecordingBackend:
    """A backend that takes every batch and layer on any device, and records what it is asked
    to plan (``plans``: batches) and run (``runs``: ``(problem, plan, out, lse)``).
    ``refuse(batch)`` (None: none) gives the reason its ``plan()`` refuses a batch."""

    def __init__(self, refuse=None) -> None:
        self.plans: list = []
        self.runs: list = []
        self._refuse = refuse

    def availability(self) -> tuple[bool, str]:
        return True, "a recording test backend"

    def plan(self, batch, workspace=None, num_splits=None) -> int:
        self.plans.append(batch)
        why = None if self._refuse is None else self._refuse(batch)
        if why is not None:
            raise Refused(why)
        return len(self.plans)

    def run_unsupported_reason(self, problem, out) -> None:
        return None

    def run(self, problem, plan, out, lse=None) -> None:
        self.runs.append((problem, plan, out, lse))


class Available:
    """``kernels`` reporting themselves available here (a mocked GPU), everything else theirs."""

    def __init__(self, kernels) -> None:
        self._kernels = kernels

    def availability(self) -> tuple[bool, str]:
        return True, "mocked GPU"

    def __getattr__(self, name):
        return getattr(self._kernels, name)


def gpu_stand_in(monkeypatch, ext) -> None:
    """CPU tensors stand for device ones: their plans and launches go to ``ext`` (a stand-in
    for ``_C``'s calls) as CUDA tensors' go to ``_C``, with the device's index and current
    stream, instead of to the SIMT executor."""

    @contextlib.contextmanager
    def launching(device, **writes):
        with torch.cuda.device(device):
            yield ext, device.index, torch.cuda.current_stream(device).cuda_stream

    monkeypatch.setattr(simt, "loaded", lambda: ext)
    monkeypatch.setattr(extension, "launching", launching)


def mock_extension(monkeypatch, ext) -> None:
    """A GPU on which ``_C`` (here ``ext``, a stand-in for its calls) runs, with CPU tensors
    standing for device ones: the extension's loading, availability and device check mocked,
    every backend's availability asked afresh. ``auto`` still picks the reference for CPU tensors
    (see :func:`auto_takes_cpu_tensors`); launches on them reach ``ext`` (:func:`gpu_stand_in`)."""
    monkeypatch.setattr(extension, "load", lambda: (ext, ""))
    gpu_stand_in(monkeypatch, ext)
    monkeypatch.setattr(extension, "availability", lambda: (True, "mocked GPU"))
    monkeypatch.setattr(extension, "device_reason", lambda device: None)
    fna.available_backends()


def auto_takes_cpu_tensors(monkeypatch, name: str) -> None:
    """``auto`` may pick backend ``name`` for CPU tensors (standing for device ones), through its
    registry entry: for attention, the cache write and the merge alike."""
    entry = registry.REGISTRY[name]
    on_cpu = dataclasses.replace(entry, auto_devices=(*entry.auto_devices, "cpu"))
    monkeypatch.setitem(registry.REGISTRY, name, on_cpu)


def plan_and_run(kernels, problem, out, num_splits=None, lse=None) -> None:
    """Plan ``problem``'s batch on backend module ``kernels`` (``num_splits`` forces the split
    count; no workspace) and run it into ``out`` (and ``lse``), past the registry's choice and
    its run-time refusals: a test of one kernel family's own plan and launch."""
    kernels.run(problem, kernels.plan(problem.batch, None, num_splits), out, lse)
