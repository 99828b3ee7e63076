"""A GPU stood in for on the CPU, for the CUDA kernel families' host code: ``_C`` (its planner,
launch and split merge), the CUTLASS-DSL families' libraries (:class:`FakeLibrary`) and the
device; CPU tensors stand for device ones. The mocks go through the extension's and the DSL
loader's public entry points and the registry's answers (:mod:`helpers.backends`)."""

import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import torch

import fp8_noncausal_attn as fna
from dsl import build
from dsl.tcgen05 import traits as tcgen05_traits
from dsl.wgmma import traits as wgmma_traits
from fp8_noncausal_attn.backends.cuda import dsl as dsl_families
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.validation import validate_attention

from .backends import mock_extension

DEFAULT_TABLES = {
    "wgmma": [f"{v.name}@{a}" for a in wgmma_traits.ARCHS for v in build.WGMMA_VARIANTS],
    "tcgen05": [f"{v.name}@{a}" for a in tcgen05_traits.ARCHS for v in build.VARIANTS],
}


DEFAULT_TABLES = {
    "wgmma": [f"{v.name}@{a}" for a in wgmma_traits.ARCHS for v in build.WGMMA_VARIANTS],
    "tcgen05": [f"{v.name}@{a}" for a in tcgen05_traits.ARCHS for v in build.VARIANTS],
}


class FakeLibrary:
    """A family's library as the loader sees it, with a recording (or emulating) launch and a
    recording load that returns ``load_status``."""

    def __init__(self, names: list[str], launch=None, load_status: int = 0) -> None:
        self.path = Path("/fake/libfp8nca.so")
        self.variants = tuple(dsl_families.parse_variant(i, n) for i, n in enumerate(names))
        self.calls: list[tuple[int, dict]] = []
        self.loads: list[int] = []
        self._launch = launch
        self._load_status = load_status

    def load(self, index: int) -> int:
        self.loads.append(index)
        return self._load_status

    def launch(self, index: int, arguments: dict) -> int:
        self.calls.append((index, arguments))
        return self._launch(index, arguments) if self._launch else 0


def merge_reference(ws_o, ws_lse, out, sinks=None):
    """The split-KV merge formula of csrc/cascade/merge_row.h in PyTorch (the ``_C`` merge
    kernel extension.merge_splits runs, which a mocked GPU cannot): weights 2^(lse - top)
    over log2 LSEs with top = max(LSE, sink), each split's O already normalised; natural-log
    sinks join the denominator once; a split with LSE -inf is never read (a NaN one is); a row
    no split saw gets zeros."""
    top = ws_lse.amax(0)
    sink = None
    if sinks is not None:
        sink = (sinks.float() * math.log2(math.e)).expand_as(top)
        top = torch.maximum(top, sink)
    top = torch.where(top == -math.inf, 0.0, top)
    weights = torch.exp2(ws_lse - top).unsqueeze(-1)
    total = weights.sum(0)
    if sink is not None:
        total = total + torch.exp2(sink - top).unsqueeze(-1)
    merged = torch.where(weights != 0, weights * ws_o, 0.0).sum(0)
    out.copy_(torch.where(total > 0, merged / total, 0.0))


def mock_gpu(monkeypatch, capability=(9, 0), libraries=None, mma_calls=None, split_calls=None):
    """A GPU of ``capability`` with ``_C`` (its split merge by :func:`merge_reference`; its
    split planner takes a forced count, else 1, and records its calls in ``split_calls``; its
    launches are recorded in ``mma_calls``) and the families' libraries (``{family: library}``)
    mocked; CPU tensors stand for device ones."""

    def plan_splits(num_splits, **kwargs):
        (split_calls if split_calls is not None else []).append(kwargs)
        return max(num_splits, 1)

    ext = SimpleNamespace(
        MAX_SEQS=1 << 20,
        plan=lambda num_splits=0, **kwargs: {
            "num_splits": max(num_splits, 1),
            "launch": "plan",
            "kernel_name": "paged_attention_kernel",
        },
        plan_splits=plan_splits,
        paged_attention=lambda **kwargs: (mma_calls if mma_calls is not None else []).append(
            kwargs
        ),
    )
    libraries = libraries or {}
    monkeypatch.setattr(extension, "merge_splits", lambda problem, ws_o, ws_lse, out: (
        merge_reference(ws_o, ws_lse, out, problem.sinks)))  # fmt: skip
    monkeypatch.setattr(mma_sync, "resident_ctas", lambda problem: 132)
    monkeypatch.setattr(dsl_families, "device_capability", lambda device: capability)
    monkeypatch.setattr(dsl_families, "resident_ctas", lambda device: 132)
    monkeypatch.setattr(
        dsl_families,
        "load_library",
        lambda family: (libraries[family], "") if family in libraries else (None, "not built"),
    )
    monkeypatch.setattr(torch.cuda, "device", lambda device: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(
        cuda_stream=0))  # fmt: skip
    mock_extension(monkeypatch, ext)  # last: the backends' availability is asked then
    # available_backends() planned its probe batches: the records start after it.
    for library in libraries.values():
        library.loads.clear()
    if split_calls is not None:
        split_calls.clear()


def problem_of(case, **overrides):
    kwargs = case.kwargs() | overrides
    return validate_attention(
        *case.args(), **kwargs, softmax_scale=None, out=None, validate=False
    )  # fmt: skip


def attention(case, **kwargs):
    return fna.PagedAttention(
        num_q_heads=case.query.shape[1], num_kv_heads=case.key_cache.shape[2],
        head_dim=case.query.shape[2], block_size=case.key_cache.shape[1],
        query_dtype=case.query.dtype, cache_dtype=case.key_cache.dtype, device="cpu",
        max_num_seqs=8, max_num_tokens=64, **kwargs,
    )  # fmt: skip


def plan_case(attn, case, backend="mma_sync", **kwargs):
    return attn.plan(case.cu_seqlens_q, case.seq_lens, case.block_table, causal=case.causal,
                     backend=backend, **kwargs)  # fmt: skip


def layer_args(case):
    return case.query, case.key_cache, case.value_cache, case.k_scale, case.v_scale
