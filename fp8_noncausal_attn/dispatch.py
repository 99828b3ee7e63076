"""The backends, what each must provide, which one runs a call and why not the others (SPEC §4).

Preference order is speed: the compiled CUDA kernels, then Triton, then the PyTorch reference.
``"auto"`` takes the first that runs here and supports the call; it never picks Triton's CPU
interpreter, which exists for testing, so on a CPU it picks the reference.

Nothing here is called under ``torch.compile`` tracing: the API passes the backend name into its
opaque op, which resolves it when the graph runs.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Protocol

import torch

from .backends import cuda, reference
from .backends.triton import attention as triton_attention
from .problem import AttentionProblem

# Imported eagerly (each imports its compiled kernels lazily) so that torch.compile can trace
# the choice without stepping into importlib.
BACKENDS: dict[str, ModuleType] = {
    "cuda": cuda,
    "triton": triton_attention,
    "reference": reference,
}
# The public names of the backends (``backend=`` takes these and ``"auto"``).
BACKEND_NAMES = tuple(BACKENDS)


class Backend(Protocol):
    """The contract every backend module (``backends.reference``, ``backends.triton.attention``,
    ``backends.cuda``) implements. The plan is the seam: everything host-side is decided once
    per batch in :meth:`plan`; :meth:`run` only launches.

    Plan time (once per batch, host only, never a device value, never under tracing): the
    ``problem`` has the real index tensors (any strides, never copied), sizes, causal flags,
    softmax scale and ``max_seqlen_q/k``; its query, caches and scales may be stand-ins that carry
    only shape, dtype and device (``query.shape[0]`` is then the plan's bound on query rows).
    """

    def availability(self) -> tuple[bool, str]:
        """Whether the backend runs on this machine, and why (not)."""

    def unsupported_reason(self, problem: AttentionProblem) -> str | None:
        """Plan time: None when the backend supports ``problem``'s sizes, dtypes and device."""

    def plan(self, problem: AttentionProblem, workspace: Any) -> Any:
        """Plan time: what the launch needs (tiles, grid, splits, workspace views).

        ``workspace`` is a :class:`fp8_noncausal_attn.plan.Workspace` (take at most
        ``workspace.max_splits(problem.num_tokens)`` splits and the buffers from
        ``workspace.partials(num_splits, problem.num_tokens)``), or None on the one-shot path,
        where the launch allocates what it needs.
        """

    def run(
        self,
        problem: AttentionProblem,
        plan: Any,
        out: torch.Tensor,
        lse: torch.Tensor | None = None,
    ) -> None:
        """Run time, per layer: launch on the real tensors; ``out`` [num_tokens, num_q_heads,
        head_dim] is written in place, rows past ``cu_seqlens_q[-1]`` as zeros, and ``lse``
        (float32 [num_tokens, num_q_heads], any strides), when not None, with each row's
        natural-log log-sum-exp (-inf for those rows). ``problem``'s scales are float32
        ``[num_kv_heads]`` and its ``num_tokens`` at most the plan's."""

    def merge_states(
        self, outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor
    ) -> None:
        """Merge partial attention states (``reference.merge_states``' contract), for
        :func:`fp8_noncausal_attn.merge_attention_states`."""

    # Optional:
    # - ``run_unsupported_reason(problem, out) -> str | None``: run-time needs of the layer's own
    #   tensors (e.g. pointer alignment), checked before every run;
    # - ``PLAN_OPTIONS``: keywords of ``plan`` beyond the contract's, which
    #   ``PagedAttention.plan`` passes through, with ``check_plan_options(**options)`` (raises
    #   for a value no plan takes) and ``unused_options_reason(**options) -> str`` (why they
    #   go unused when another backend runs; "" for defaults);
    # - ``report_details(available, reason) -> dict``: more entries for available_backends().


# Each backend's availability() answer, asked once per process: it describes the machine (the
# extension, the driver, the GPU), and a call should not pay for it. available_backends()
# asks again and refreshes it.
_availability: dict[str, tuple[bool, str]] = {}


def availability(name: str) -> tuple[bool, str]:
    """``availability()`` of backend ``name``, remembered (see :func:`available_backends`)."""
    known = _availability.get(name)
    if known is None:
        known = _availability[name] = BACKENDS[name].availability()
    return known


def max_splits() -> int:
    """The largest split-KV count any backend plans (sizes the default workspace)."""
    return max(getattr(module, "MAX_SPLITS", 1) for module in BACKENDS.values())


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name``."""
    return BACKENDS[name]


def _auto_skips(name: str, device: torch.device) -> str | None:
    if name == "triton" and device.type != "cuda":
        return "auto does not pick Triton's CPU interpreter (a test tool, far slower than PyTorch)"
    return None


def auto_choice(device: torch.device, problem: AttentionProblem | None = None) -> tuple[str, str]:
    """The backend ``"auto"`` takes for tensors on ``device`` (and for ``problem``, when given,
    only a backend that supports it), with the reason."""
    passed_over = []
    for name, module in BACKENDS.items():
        runs, why = availability(name)
        skip = why if not runs else _auto_skips(name, device)
        if skip is None and problem is not None:
            skip = module.unsupported_reason(problem)
        if skip is None:
            chosen_because = f"fastest available for {device.type} tensors"
            if passed_over:
                chosen_because += " (" + "; ".join(passed_over) + ")"
            return name, chosen_because
        passed_over.append(f"{name}: {skip}")
    raise AssertionError("the reference backend runs every valid call")


def available_backends() -> dict[str, dict[str, object]]:
    """What runs here and why not the rest.

    Returns ``{name: {"available": bool, "reason": str}}`` for ``cuda``, ``triton`` and
    ``reference``, plus ``"auto": {"choice": name, "reason": str}`` for the current default
    device (CUDA when a GPU is visible, else CPU). ``cuda`` also has ``"families"``:
    ``{family: {"available", "status", "reason"}}`` for its kernel families (``mma_sync``, the
    default; ``wgmma`` and ``tcgen05``: compiled and SASS-checked, NEVER RUN ON HARDWARE,
    opt-in, never chosen by ``auto``), the one ``FP8NCA_CUDA_FAMILY`` asks for marked
    ``"requested": True``. Asks every backend afresh and updates the answers that calls use.
    """
    report: dict[str, dict[str, object]] = {}
    for name in BACKEND_NAMES:
        runs, why = _availability[name] = backend_module(name).availability()
        report[name] = {"available": runs, "reason": why}
        details = getattr(backend_module(name), "report_details", None)
        if details is not None:
            report[name].update(details(runs, why))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice, why = auto_choice(device)
    report["auto"] = {"choice": choice, "reason": why}
    return report


def resolve_backend(backend: str, problem: AttentionProblem) -> str:
    """Map the user's ``backend`` argument to a backend that can run ``problem``.

    Raises ValueError for an unknown name and RuntimeError, with the reason, when the named
    backend cannot run here or does not support this call.
    """
    if backend == "auto":
        return auto_choice(problem.query.device, problem)[0]
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKEND_NAMES}, got {backend!r}")
    module = backend_module(backend)
    runs, why = availability(backend)
    if not runs:
        raise RuntimeError(f"backend {backend!r} is not available here: {why}")
    reason = module.unsupported_reason(problem)
    if reason is not None:
        raise RuntimeError(f"backend {backend!r} does not support this call: {reason}")
    return backend


def check_plan_options(options: dict[str, Any]) -> None:
    """Raise ValueError, by name, for an option no backend takes or a value none accepts."""
    for key, value in options.items():
        owners = [m for m in BACKENDS.values() if key in getattr(m, "PLAN_OPTIONS", ())]
        if not owners:
            raise ValueError(f"no backend takes the plan option {key}=")
        for module in owners:
            module.check_plan_options(**{key: value})


def plan_options(backend: str, options: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The options ``backend``'s plan takes, and why the others go unused ("" if none)."""
    module = BACKENDS[backend]
    taken = getattr(module, "PLAN_OPTIONS", ())
    used = {key: value for key, value in options.items() if key in taken}
    reasons = []
    for key, value in options.items():
        if key in taken:
            continue
        for owner in BACKENDS.values():
            if key in getattr(owner, "PLAN_OPTIONS", ()):
                why = owner.unused_options_reason(**{key: value})
                if why:
                    reasons.append(f"{why}, {backend} runs")
    return used, "; ".join(reasons)
