"""One launch of every kernel kind, for compute-sanitizer:
``python -m tools.gpu_check.sanitize BACKEND...`` (run under memcheck, racecheck, synccheck).

For each backend named: the attention kernel on a batch that reaches the boundaries
(launches.CASE), the same with the keys split three ways and the LSE returned (the split merge
kernel), and the backend's state merge and cache write (the CUDA families share _C's). Every
result is compared with the reference; exits 1 if any is off (the sanitizer's own findings
exit 3).
"""

from __future__ import annotations

import math
import sys

import torch

import fp8_noncausal_attn as fna
from fp8_noncausal_attn import registry
from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.synthetic import relative_error
from fp8_noncausal_attn.validation import validate_attention

from .backends import backend_request
from .launches import TOLERANCE, attention, case, error_against_reference

SPLITS = 3


def split_launch(name: str, problem_case) -> tuple[torch.Tensor, torch.Tensor]:
    """Backend ``name``'s attention with SPLITS key splits forced and the LSE returned."""
    problem = validate_attention(
        *problem_case.args(), **problem_case.kwargs(), softmax_scale=None, out=None,
        validate=False,
    )  # fmt: skip
    out = torch.full_like(problem_case.query, math.nan)
    lse = torch.full(problem_case.query.shape[:2], math.nan, device="cuda")
    chain, _ = registry.plan_batch(backend_request(name)[0], problem.batch, num_splits=SPLITS)
    registry.run(chain, problem, out, lse)
    return out, lse


def merge_error(name: str, problem_case) -> float:
    """Merge two halves of the heads' states (each state the whole answer, LSE shifted) on
    ``api_backend`` and compare with the reference merge."""
    out, lse = fna.paged_attention(
        *problem_case.args(), **problem_case.kwargs(), return_lse=True, backend="reference"
    )
    outs = torch.stack([out, out.flip(1)])
    lses = torch.stack([lse, lse.flip(1) - 1.0])
    got, _ = fna.merge_attention_states(outs, lses, backend=backend_request(name)[0])
    expected = torch.empty_like(out)
    reference.merge_states(outs, lses, expected, torch.empty_like(lse))
    return relative_error(got, expected)


def cache_write_error(name: str, problem_case) -> float:
    """Write fresh rows into a copy of the caches with backend ``name``'s cache write and
    compare with the reference writer."""
    tokens, heads, dim = 40, problem_case.key_cache.shape[2], problem_case.key_cache.shape[3]
    key = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    slots = torch.randperm(problem_case.key_cache.shape[0] * problem_case.key_cache.shape[1],
                           device="cuda")[:tokens]  # fmt: skip
    slots[::7] = -1  # skipped rows
    results = []
    writer_of = registry.REGISTRY[backend_request(name)[0]].reshape_and_cache
    for writer in (writer_of, reference.reshape_and_cache):
        caches = problem_case.key_cache.clone(), problem_case.value_cache.clone()
        writer(CacheWrite(key, value, *caches, slots, problem_case.k_scale, problem_case.v_scale))
        results.append(torch.cat([c.view(torch.uint8).flatten() for c in caches]))
    return float((results[0] != results[1]).float().mean())


def main(names: list[str]) -> int:
    problem_case = case()
    errors: dict[str, float] = {}
    for name in names:
        errors[f"{name} attention"] = error_against_reference(
            name, problem_case, attention(name, problem_case)
        )
        out, lse = split_launch(name, problem_case)
        errors[f"{name} split x{SPLITS} + merge"] = error_against_reference(name, problem_case, out)
        errors[f"{name} merge_attention_states"] = merge_error(name, problem_case)
        errors[f"{name} reshape_and_cache (bytes differing)"] = cache_write_error(
            name, problem_case
        )
    torch.cuda.synchronize()
    failures = 0
    for what, error in errors.items():
        ok = math.isfinite(error) and error <= TOLERANCE
        failures += not ok
        print(f"{what}: {error:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
