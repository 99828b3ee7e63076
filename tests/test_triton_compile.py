"""Every Triton kernel variant compiles for sm_90 and sm_100 as launched, without spills.

``helpers/gpu_compile_check.py`` captures the launchers' own launches and compiles them with the
JIT's launch-time specialisation (no GPU needed); a variant with stack or local memory fails it.
scripts/test_triton_device.sh runs it again under the GPU machine's older Triton.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

from fp8_noncausal_attn.scales import PER_TOKEN_HEAD_DTYPES, SIXTEEN_BIT_DTYPES

# Compiles kernels or packages and reads what they hold (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.compile

TESTS = Path(__file__).parent
# The Triton version the check must compile with, when set (scripts/test_triton_device.sh sets
# the GPU machine's); unset, the Triton of this interpreter.
TRITON_VERSION_ENV = "FP8NCA_TRITON_VERSION"


def expected_kernels() -> int:
    """Attention variants (plus the merge when split) and cache writes the check compiles."""
    from helpers import gpu_compile_check as check

    from fp8_noncausal_attn.scales import CACHE_DTYPES, PER_TOKEN_HEAD_DTYPES

    attention = sum(2 if v[4] else 1 for v in check.drafter_variants())  # v[4]: split
    # unsplit kernel; split kernel and merge; unsplit per-token-head kernel; two merge_states
    lse = 1 + 2 + 1 + 2
    # Cache writes: per-head and per-token-head scales, each from two 16-bit input dtypes.
    return attention + lse + 2 * (len(CACHE_DTYPES) + len(PER_TOKEN_HEAD_DTYPES))


@pytest.mark.parametrize("cc", [90, 100])
def test_triton_kernels_compile_for_gpu_target_without_spills(cc):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), str(TESTS), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(TESTS / "helpers" / "gpu_compile_check.py"), str(cc)],
        env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith(f"cc{cc} ")]
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    expected_version = os.environ.get(TRITON_VERSION_ENV, triton.__version__)
    assert result.stdout.splitlines()[0] == f"triton {expected_version}"
    assert len(lines) == expected_kernels()
    assert all(line.endswith(" ok") and "stack=0 local=0" in line for line in lines)
    arch = "sm_100a" if cc == 100 else "sm_90a"
    assert all(f": {arch} " in line for line in lines)
    # The JIT's specialisation is applied: aligned pointers are marked 16-byte divisible.
    assert all(int(re.search(r"div16=(\d+)", line).group(1)) >= 3 for line in lines)
    # The IEEE fp32-dot variants (a 16-bit cache of the other dtype) are among them, and every
    # query tile size.
    assert sum("torch.bfloat16 torch.float16" in line for line in lines) >= 3
    assert {re.search(r"block_m=(\d+)", line).group(1) for line in lines if "block_m" in line} == {
        "16", "32", "64", "128",
    }  # fmt: skip
    # Every combination of the window and sink flags of both kernels.
    kernel_flags = {
        re.search(r"WINDOW=(\d) SINKS=(\d)", line).groups()
        for line in lines
        if "_paged_attention_kernel" in line
    }
    assert kernel_flags == {("0", "0"), ("1", "0"), ("0", "1"), ("1", "1")}
    merge_flags = {re.search(r"SINKS=(\d)", line).group(1) for line in lines if "_merge" in line}
    assert merge_flags == {"0", "1"}
    # The LSE outputs: the unsplit kernel's, the split launch's merge's, merge_states'.
    assert sum("RETURN_LSE=1" in line for line in lines) == 5
    assert sum(line.startswith(f"cc{cc} merge_states ") for line in lines) == 2
    # The per-token-head scale reads: each of their cache dtypes x query dtype, split and not,
    # with a window and sinks, with the LSE.
    token_head = [line for line in lines if "PER_TOKEN_SCALES=1" in line]
    attention_lines = [line for line in token_head if line.startswith(f"cc{cc} attention ")]
    dtypes = {re.search(r"_kernel (\S+) (\S+) ", line).groups() for line in attention_lines}
    assert dtypes == {(str(kv), str(q)) for kv in PER_TOKEN_HEAD_DTYPES for q in SIXTEEN_BIT_DTYPES}
    assert {"split=True" in line for line in token_head} == {True, False}
    assert any("WINDOW=1 SINKS=1" in line for line in token_head)
    assert sum("RETURN_LSE=1" in line for line in token_head) == 1
