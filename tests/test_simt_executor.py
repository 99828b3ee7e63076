"""The SIMT executor (csrc/simt/) running csrc/'s kernels on CPU tensors: its checks, shown to
fire on the real kernels' source with one bug planted at a time in a copy of it, and the
unchanged copy shown to pass the same comparison (so each of these tests can fail); and its CPU
twin's arithmetic primitives against their PTX ISA definitions, for every input that matters."""

import shutil

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, host_hooks
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
    "lse_written_without_its_pointer": (
        "mma_sync/epilogue.cuh",
        "if (t == 0 && p.ws_lse != nullptr) {",
        "if (t == 0) {",
        r"global write of 4 bytes at 0x[0-9a-f]+, outside every tensor the launch may write",
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


def test_the_package_constants_are_the_plan_codes():
    from fp8_noncausal_attn.backends.cuda import extension

    module = simt.loaded()
    assert (extension.MAX_SEQS, extension.MAX_SPLITS) == (module.MAX_SEQS, module.MAX_SPLITS)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine reports its _C instead")
def test_auto_never_picks_the_executor_and_says_what_it_is():
    report = fna.available_backends()
    assert report["mma_sync"]["available"]
    assert "SIMT executor" in report["mma_sync"]["reason"]
    assert "test tool" in report["mma_sync"]["reason"]
    assert report["auto"]["choice"] != "mma_sync"


def half_bits(values: torch.Tensor) -> np.ndarray:
    return values.to(torch.float16).view(torch.int16).numpy().astype(np.uint16)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_to_f16x2_conversions_are_exact_for_every_pair(fp8):
    """cvt.rn.f16x2.{e4m3x2,e5m2x2} on all 65536 byte pairs: each half is torch's conversion of
    its byte (the low byte to the low half), NaN bytes to NaN."""
    convert = {torch.float8_e4m3fn: "twin_cvt_e4m3x2", torch.float8_e5m2: "twin_cvt_e5m2x2"}
    words = np.arange(1 << 16, dtype=np.uint32)
    got = np.array(getattr(host_hooks.load(), convert[fp8])(words.tolist()), dtype=np.uint32)
    per_byte = torch.arange(256, dtype=torch.uint8).view(fp8).to(torch.float16)
    for half, byte in ((got & 0xFFFF, words & 0xFF), (got >> 16, words >> 8)):
        want = per_byte[torch.from_numpy(byte.astype(np.int64))]
        got_half = torch.from_numpy(half.astype(np.uint16).view(np.int16)).view(torch.float16)
        assert torch.equal(got_half.isnan(), want.isnan())
        finite = ~want.isnan()
        assert np.array_equal(half_bits(got_half[finite]), half_bits(want[finite]))


def bf16_words(values: torch.Tensor) -> np.ndarray:
    bits = values.to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16).astype(np.uint32)
    return bits[0::2] | bits[1::2] << 16


def test_fma_rn_bf16x2_rounds_once():
    """fma.rn.bf16x2 on random bf16 triples (subnormal and tie-producing ones among them): each
    half is a * b + c computed exactly and rounded to bf16 once, to nearest even."""
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(4096, generator=gen) * torch.exp2(torch.randint(-20, 20, (4096,)).float())
    b = torch.randn(4096, generator=gen).to(torch.bfloat16).float()
    c = (torch.randn(4096, generator=gen) * a.abs()).to(torch.bfloat16).float()
    a = a.to(torch.bfloat16).float()
    a[:8] = torch.tensor([1e-39, -1e-40, 3.0, 1.0 + 2**-7, 2**-126, 5.0, 0.0, -0.0])
    exact = a.double() * b.double() + c.double()
    # Rows whose exact value fits fp32 (so torch's fp32 -> bf16 rounding is the one rounding).
    fits = exact == exact.float().double()
    assert fits.float().mean() > 0.9
    words = [list(t) for t in zip(bf16_words(a), bf16_words(b), bf16_words(c), strict=True)]
    got = np.array(host_hooks.load().twin_fma_rn_bf16x2(words), dtype=np.uint32)
    got = np.stack([got & 0xFFFF, got >> 16], axis=1).reshape(-1).astype(np.uint16)
    want = exact.float().to(torch.bfloat16).view(torch.int16).numpy().astype(np.uint16)
    assert np.array_equal(got[fits.numpy()], want[fits.numpy()])


def test_ex2_approx_ftz_is_exp2_with_subnormals_flushed():
    """ex2.approx.ftz.f32 within its 2 ulp of 2^x; results below 2^-126 flushed to zero, and a
    subnormal input read as zero (2^0 = 1)."""
    x = torch.cat([torch.linspace(-140.0, 20.0, 4001), torch.tensor([1e-40, -1e-40, -126.0])])
    got = torch.tensor(host_hooks.load().twin_ex2_approx_ftz(x.tolist()), dtype=torch.float64)
    want = torch.exp2(x.double())
    normal = want >= 2.0**-126
    assert ((got[normal] - want[normal]).abs() <= 2 * 2.0**-23 * want[normal]).all()
    assert (got[~normal] == 0).all()
    assert got[-3] == 1.0 and got[-2] == 1.0 and got[-1] == 2.0**-126


def test_byte_perm_twin_matches_the_kernels_host_byte_moves():
    """prmt.b32 on the selectors the kernels use: the device branches of fp8_bits.h (e5m2 and
    int8 byte moves) equal their host branches, and dequantize_tile's pairs (bytes 0, 2 and
    1, 3) are what its comment says. A wrong selector or byte order fails here."""
    hk = host_hooks.load()
    rng = np.random.default_rng(4)
    for w in rng.integers(0, 2**32, 200, dtype=np.uint64).tolist():
        assert [hk.twin_byte_perm(w, 0, 0x1404), hk.twin_byte_perm(w, 0, 0x3424)] == list(
            hk.e5m2x4_to_f16x2(w)
        )
        biased = [hk.twin_byte_perm(w ^ 0x80808080, 0x64646464, s) for s in (0x4140, 0x4342)]
        assert biased == list(hk.int8x4_to_biased_f16x2(w)[:2])
        # Selector nibbles 0 in the upper bytes repeat byte 0: fp8x2_to reads the low 16 bits.
        assert hk.twin_byte_perm(w, 0, 0x20) & 0xFFFF == (w & 0xFF) | (w >> 16 & 0xFF) << 8
        assert hk.twin_byte_perm(w, 0, 0x31) & 0xFFFF == (w >> 8 & 0xFF) | (w >> 24) << 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_mma_m16n8k16_places_the_fragments_as_the_isa_does(dtype):
    """One warp of the executor's mma.sync, its fragments placed by the PTX ISA's figures: D is
    A B + C in float64 rounded once to float32 (a layout error moves whole rows or columns)."""
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    bits = [t.view(torch.int16).numpy().astype(np.uint16).reshape(-1).tolist() for t in (a, b)]
    got = torch.tensor(host_hooks.load().twin_mma_m16n8k16(*bits, c.reshape(-1).tolist(),
                                                            dtype == torch.bfloat16))  # fmt: skip
    want = (a.double() @ b.double() + c.double()).float()
    assert torch.equal(got.reshape(16, 8), want)


def test_ldmatrix_x4_trans_hands_each_lane_a_column_pair():
    """ldmatrix.x4.trans: lane l receives in register i elements (2 (l % 4), l / 4) and
    (2 (l % 4) + 1, l / 4) of matrix i, the first in the low half (PTX ISA)."""
    matrices = np.random.default_rng(3).integers(0, 1 << 16, (4, 8, 8), dtype=np.uint16)
    got = np.array(host_hooks.load().twin_ldmatrix_x4_trans(matrices.reshape(-1).tolist()))
    got = got.reshape(32, 4)
    for lane in range(32):
        row, col = 2 * (lane % 4), lane // 4
        for i in range(4):
            want = int(matrices[i, row, col]) | int(matrices[i, row + 1, col]) << 16
            assert got[lane, i] == want, (lane, i)
