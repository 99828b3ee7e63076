"""The SIMT executor (csrc/simt/) running csrc/'s kernels on CPU tensors: its checks, shown to
fire on the real kernels' source with one bug planted at a time in a copy of it, and the
unchanged copy shown to pass the same comparison (so each of these tests can fail)."""

import shutil

import pytest
import torch
from helpers import TOLERANCE
from helpers.oracle import float64_attention

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends.cuda import simt
from fp8_noncausal_attn.synthetic import make_case, relative_error

pytestmark = pytest.mark.simt

# One head dim's per-head kernels: a planted copy rebuilds this unit only.
UNIT = "attention_d64"


def planted_case():
    """Two sequences (a causal one), GQA 2: six rows per KV head, so one row warp and four key
    groups (the merge's barriers run), over several key tiles (the cp.async pipeline turns)."""
    return make_case([3, 1], [300, 90], num_q_heads=4, num_kv_heads=2, head_dim=64,
                     causal=[True, False], seed=5)  # fmt: skip


def use_copy(tmp_path, monkeypatch, change: tuple[str, str, str] | None) -> None:
    """Builds the executor from a copy of csrc/ with ``change`` = (file, old, new) applied
    (``old`` must occur once), and makes it the one CPU tensors run on."""
    csrc = tmp_path / "csrc"
    shutil.copytree(simt.CSRC, csrc)
    if change is not None:
        path, old, new = change
        source = csrc / path
        text = source.read_text()
        assert text.count(old) == 1, f"the planted change's anchor is not unique in {path}"
        source.write_text(text.replace(old, new))
    module = simt.load_file(simt.build(csrc, units=(UNIT,)))
    monkeypatch.setattr(simt, "loaded", lambda: module)


def run_and_compare(case) -> float:
    out = fna.paged_attention(*case.args(), **case.kwargs(), backend="mma_sync")
    return relative_error(out, float64_attention(case).to(out.dtype))


# (file under csrc/, text, its replacement, what the executor reports; None: the output differs
# from the oracle beyond the tolerance).
PLANTED = {
    "missing_syncthreads": (
        "mma_sync/kernel.cuh",
        "    hw::cp_async_wait<S.stages - 2>();\n    __syncthreads();\n",
        "    hw::cp_async_wait<S.stages - 2>();\n",
        r"shared-memory race|has not completed",
    ),
    "cp_async_wait_one_group_short": (
        "mma_sync/kernel.cuh",
        "hw::cp_async_wait<S.stages - 2>();",
        "hw::cp_async_wait<S.stages - 1>();",
        r"a read of shared memory offset \d+ that a cp.async of thread \d+ .* has not completed",
    ),
    "shuffle_to_the_wrong_lane": (
        "mma_sync/softmax.cuh",
        "    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 1);",
        "    st.l[h] += __shfl_xor_sync(0xffffffffu, st.l[h], 4);",
        None,
    ),
    "wrong_fragment_index": (
        "mma_sync/mainloop.cuh",
        "mma16816(o[2 * jp], a, b[0], b[1], VT());",
        "mma16816(o[2 * jp], a, b[0], b[2], VT());",
        None,
    ),
    "global_write_one_row_past_the_output": (
        "mma_sync/epilogue.cuh",
        "QT* orow = static_cast<QT*>(p.out) + tok * p.o_stride_t + head * p.o_stride_h;",
        "QT* orow = static_cast<QT*>(p.out) + (tok + 1) * p.o_stride_t + head * p.o_stride_h;",
        r"global write of 4 bytes at 0x[0-9a-f]+, outside every tensor the launch may write "
        r"\(out \[",
    ),
    "shared_write_past_the_allocation": (
        "mma_sync/kernel.cuh",
        "uint8_t* wide = kv_smem + S.stages * S.stage_bytes;",
        "uint8_t* wide = kv_smem + (S.stages + 1) * S.stage_bytes;",
        r"write of \d+ bytes at shared memory offset \d+, outside the launch's \d+ bytes",
    ),
    "warps_leaving_before_a_barrier": (
        "mma_sync/softmax.cuh",
        "  __syncthreads();\n  if (role.ng > 0) return false;\n",
        "  if (role.ng > 0) return false;\n  __syncthreads();\n",
        r"waits at __syncthreads \(softmax.cuh:\d+\) while this thread has exited",
    ),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bug_is_caught(tmp_path, monkeypatch, name):
    path, old, new, report = PLANTED[name]
    use_copy(tmp_path, monkeypatch, (path, old, new))
    case = planted_case()
    if report is None:
        assert run_and_compare(case) > TOLERANCE[torch.bfloat16]
        return
    with pytest.raises(RuntimeError, match=report) as caught:
        run_and_compare(case)
    # Every report names the kernel, the CTA and the thread.
    assert "paged_attention_kernel<64, __nv_bfloat16, 2>, CTA (" in str(caught.value)
    assert "), thread " in str(caught.value)


def test_the_unchanged_copy_passes(tmp_path, monkeypatch):
    use_copy(tmp_path, monkeypatch, None)
    assert run_and_compare(planted_case()) <= TOLERANCE[torch.bfloat16]


def test_a_launch_may_write_only_its_outputs(monkeypatch):
    """The real kernels, with ``out`` left off the tensors the launch may write."""
    writable = simt.writable

    def without_out(module, **tensors):
        return writable(module, **{k: v for k, v in tensors.items() if k != "out"})

    monkeypatch.setattr(simt, "writable", without_out)
    with pytest.raises(RuntimeError, match="outside every tensor the launch may write"):
        run_and_compare(planted_case())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine reports its _C instead")
def test_auto_never_picks_the_executor_and_says_what_it_is():
    report = fna.available_backends()
    assert report["mma_sync"]["available"]
    assert "SIMT executor" in report["mma_sync"]["reason"]
    assert "test tool" in report["mma_sync"]["reason"]
    assert report["auto"]["choice"] != "mma_sync"
