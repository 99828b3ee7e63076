"""A non-causal DFlash drafter on FP8_NONCAUSAL inside vLLM's engine (``speculative_config``'s
``attention_backend``, FP8 e4m3 and e5m2 drafter caches, 4 and 8 speculative tokens, full
attention and a sliding window), against the reference run: CPU_ATTN on a bf16 cache holding
the same K/V rounded through the same FP8 format. The target runs on CPU_ATTN in both."""

from __future__ import annotations

import pytest

from fp8_noncausal_attn.synthetic import relative_error

from .checks import DRAFTS_EQUAL, matched, reference_rounds_to_nearest
from .models import SWA_WINDOW
from .scenarios import DRAFTER_CASES, DRAFTER_LAYER

ENGINE_RUNS = tuple(f"drafter_{case}{suffix}" for case in DRAFTER_CASES
                    for suffix in ("", "_ref"))  # fmt: skip
# Relative error (Frobenius) of a request's drafter attention output in one step, backend vs
# reference: the two compute on the same rounded values and differ in fp32 accumulation order and
# bf16 output rounding only. A reference without the FP8 rounding lands an order above. By how
# the reference's kernels round (checks.reference_rounds_to_nearest): to nearest, or by
# truncation (measured 4.2e-3, against 1.2e-2 and 5.6e-2 without the FP8 rounding).
ATTENTION_REL_ERROR = {True: 1e-3, False: 6e-3}


@pytest.mark.parametrize("case", list(DRAFTER_CASES))
def test_drafter_runs_non_causal_on_the_backend_and_matches_the_reference(engine_runs, case):
    fmt, k, sliding = DRAFTER_CASES[case]
    run, ref = engine_runs[f"drafter_{case}"], engine_runs[f"drafter_{case}_ref"]
    assert run.results["generate"] == ref.results["generate"]  # the target: CPU_ATTN in both
    (select,) = run.kind("select")
    assert select["selector"]["kv_cache_dtype"] == fmt
    assert select["selector"]["use_non_causal"] and not select["reference"]
    calls = run.kind("forward")
    assert calls and {c["layer"] for c in calls} == {DRAFTER_LAYER}
    assert all(c["causal"] is False and c["kernels"] == "reference" for c in calls)
    # Each step queries 1 + k rows per request.
    assert all(c["output"].shape[0] % (k + 1) == 0 for c in calls)
    if sliding:
        # vLLM hands the layer (w - 1, 0); the plan of a non-causal batch is symmetric.
        assert {c["window"] for c in calls} == {(SWA_WINDOW - 1, 0)}
        assert {p["window"] for p in run.kind("plan", causal=False)} == {
            (SWA_WINDOW - 1, SWA_WINDOW - 1)
        }
    bound = ATTENTION_REL_ERROR[reference_rounds_to_nearest(ref)]
    errors = [relative_error(c, r) for c, r in matched(calls, ref.kind("forward"), "output")]
    pairs = matched(run.kind("drafts"), ref.kind("drafts"), "drafts")
    equal = sum((d == r).sum().item() for d, r in pairs)
    total = sum(d.numel() for d, _ in pairs)
    print(f"{case}: {len(errors)} request steps, attention rel. error max {max(errors):.2e} "
          f"mean {sum(errors) / len(errors):.2e} (threshold {bound}); drafts "
          f"equal {equal}/{total} (threshold {DRAFTS_EQUAL:.0%})")  # fmt: skip
    assert max(errors) <= bound
    assert all(d.shape == (k,) for d, _ in pairs)
    assert equal >= DRAFTS_EQUAL * total
