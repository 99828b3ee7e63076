"""Per-token-head cache writes (vLLM's fp8_per_token_head / int8_per_token_head): the reference
and Triton writes against each other, against vLLM's own write, and vLLM's page read through
``layouts.split_per_token_head_cache``."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import DEVICE, VLLM_BLOCK_SIZES

from fp8_noncausal_attn.backends import reference
from fp8_noncausal_attn.backends.triton import cache as triton_cache
from fp8_noncausal_attn.layouts import split_per_token_head_cache
from fp8_noncausal_attn.problem import CacheWrite
from fp8_noncausal_attn.scales import PER_TOKEN_HEAD_DTYPES, PER_TOKEN_HEAD_MIN_SCALE

WRITERS = (reference, triton_cache)
ORACLE = Path(__file__).parent / "helpers" / "vllm_pth_oracle.py"
NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE = 40, 2, 64, 6, 16
# vLLM's KV-cache dtype name -> the cache element type it stores.
VLLM_MODES = {"int8_per_token_head": torch.int8, "fp8_per_token_head": torch.float8_e4m3fn}


def drafter_rows(
    gen: torch.Generator, block_size: int = BLOCK_SIZE
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys spanning 1e-8 .. 1e2 per token (below the 1e-6 scale floor, FP8 subnormals, large),
    one all-zero token, values of order 0.05, a padding slot; shuffled slots of NUM_BLOCKS
    pages of ``block_size``."""
    key = torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    key = (key * torch.logspace(-8, 2, NUM_TOKENS)[:, None, None]).to(torch.bfloat16)
    key[1] = 0
    value = (torch.randn(NUM_TOKENS, NUM_KV_HEADS, HEAD_DIM, generator=gen) * 0.05).to(
        torch.bfloat16
    )
    slots = torch.randperm(NUM_BLOCKS * block_size, generator=gen)[:NUM_TOKENS]
    slots[3] = -1
    return key, value, slots


def vllm_page(cache_dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """One layer's page as vLLM packs it, [num_blocks, num_kv_heads, block_size, 2 * (d + 4)],
    NHD in memory (slots outside heads), filled with a byte pattern."""
    storage = torch.int8 if cache_dtype == torch.int8 else torch.uint8
    physical = (NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * (HEAD_DIM + 4))
    return torch.full(physical, 0x55, dtype=storage, device=device).transpose(1, 2)


def write(module, key, value, slots, kv_cache, cache_dtype):
    key_cache, value_cache, k_scale, v_scale = split_per_token_head_cache(kv_cache, cache_dtype)
    module.reshape_and_cache(CacheWrite(key, value, key_cache, value_cache, slots, k_scale,
                                        v_scale))  # fmt: skip
    return key_cache, value_cache, k_scale, v_scale


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float16])
def test_reference_and_triton_write_identical_pages(cache_dtype, query_dtype):
    gen = torch.Generator().manual_seed(1)
    key, value, slots = drafter_rows(gen)
    key = key.to(query_dtype).to(DEVICE)
    # Strided token rows, as vLLM's qkv split hands them over.
    value = torch.cat([value, value], dim=-1).to(query_dtype).to(DEVICE)[..., :HEAD_DIM]
    pages = []
    for module in WRITERS:
        kv_cache = vllm_page(cache_dtype, DEVICE)
        write(module, key, value, slots.to(DEVICE), kv_cache, cache_dtype)
        pages.append(kv_cache.cpu())
    assert torch.equal(pages[0], pages[1])
    # The write reached every real token: no slot still holds the fill pattern's scale bytes.
    _, _, k_scale, _ = split_per_token_head_cache(pages[0], cache_dtype)
    written = slots[slots >= 0]
    assert (k_scale.flatten(0, 1)[written] > 0).all()


@pytest.mark.parametrize("module", WRITERS, ids=["reference", "triton"])
@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_write_rounds_as_vllm_and_scales_each_token_and_head(module, cache_dtype):
    """Hand-made rows whose scale is exactly 1 (amax = the format's max), so the stored codes
    are the inputs rounded: int8 rounds half away from zero (2.5 -> 3, -2.5 -> -3; nearest even
    would give 2, -2), FP8 to nearest even (1.0625, a tie of e4m3, -> 1.0). An all-zero row
    gets the positive floor scale, never 0 or NaN, and stores zeros."""
    high = 127.0 if cache_dtype == torch.int8 else torch.finfo(cache_dtype).max
    key = torch.zeros(2, 3, HEAD_DIM)
    key[0, 0, :5] = torch.tensor([high, 2.5, -2.5, 1.0625, -0.5])
    key[0, 1] = torch.linspace(-4.0, 4.0, HEAD_DIM)  # amax 4: a different scale per head
    key[1, 2] = 1.0  # token 1: one head set, two heads all zero
    value = key.flip(0)
    kv_cache = torch.zeros(1, BLOCK_SIZE, 3, 2 * (HEAD_DIM + 4), dtype=torch.int8)
    kv_cache = kv_cache.transpose(1, 2)
    key_cache, _, k_scale, _ = write(
        module, key.to(torch.bfloat16).to(DEVICE), value.to(torch.bfloat16).to(DEVICE),
        torch.tensor([5, 2], device=DEVICE), kv_cache.to(DEVICE), cache_dtype,
    )  # fmt: skip
    stored = key_cache[0, 5, 0, :5].float().cpu().tolist()
    if cache_dtype == torch.int8:
        assert stored == [127.0, 3.0, -3.0, 1.0, -1.0]
    else:
        assert stored == [high, 2.5, -2.5, 1.0, -0.5]
    k_scale = k_scale.cpu()
    floor = np.float32(PER_TOKEN_HEAD_MIN_SCALE).item()
    over_high = [(np.float32(x) / np.float32(high)).item() for x in (4.0, 1.0)]
    assert k_scale[0, 5].tolist() == [1.0, over_high[0], floor]
    assert k_scale[0, 2].tolist() == [floor, floor, over_high[1]]
    assert (key_cache[0, 2, :2].float() == 0).all()


def run_vllm_write(tmp_path: Path, rows: dict) -> dict:
    """vLLM's write of ``rows`` (block size -> key, value, slots) into pages of each block size
    (tests/helpers/vllm_pth_oracle.py in one child process)."""
    gen = torch.Generator().manual_seed(2)
    fill = torch.randint(-128, 128, (1 << 20,), generator=gen, dtype=torch.int8)
    rows = {
        block_size: dict(key=key, value=value, slot_mapping=slots)
        for block_size, (key, value, slots) in rows.items()
    }
    inputs = dict(rows=rows, num_blocks=NUM_BLOCKS, fill=fill)
    torch.save(inputs, tmp_path / "in.pt")
    # vLLM keeps Triton on without a GPU driver only when the visible-device list is empty.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    # -P: the script's own folder (tests/helpers, with its vllm.py) must not shadow vLLM.
    done = subprocess.run(
        [sys.executable, "-P", str(ORACLE), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(tmp_path / "out.pt")


@pytest.fixture(scope="module")
def vllm_pages(tmp_path_factory):
    """vLLM's writes, in pages of each of vLLM's default block sizes: block size -> (key, value,
    slots, results)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (pip install --no-deps -r requirements-vllm.txt)")
    rows = {size: drafter_rows(torch.Generator().manual_seed(3), size) for size in VLLM_BLOCK_SIZES}
    results = run_vllm_write(tmp_path_factory.mktemp("vllm_pth"), rows)
    return {size: (*rows[size], results) for size in VLLM_BLOCK_SIZES}


@pytest.fixture(params=VLLM_BLOCK_SIZES, ids=lambda size: f"block{size}")
def vllm_written(request, vllm_pages):
    """(block_size, key, value, slots, results): vLLM's write in pages of one block size."""
    return request.param, *vllm_pages[request.param]


def our_page(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The backing buffer as vLLM's view left it before its write (up to 0.33, every inline
    scale 1.0: ``TritonAttentionImpl._ensure_scale_caches``; from 0.34 as allocated), and the
    layer view vLLM used on it."""
    raw = case["viewed"].clone()
    size, stride, offset = case["view"]
    return raw, torch.as_strided(raw, size, stride, offset)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize("mode", VLLM_MODES)
def test_our_views_read_vllms_page(vllm_written, mode, layout):
    """A page written by vLLM reads back, through our no-copy views, as vLLM's own views read it."""
    block_size, *_, results = vllm_written
    case = results[(block_size, mode, layout)]
    size, stride, offset = case["view"]
    kv_cache = torch.as_strided(case["raw"], size, stride, offset)
    views = split_per_token_head_cache(kv_cache, VLLM_MODES[mode])
    key_cache, value_cache, k_scale, v_scale = views
    assert torch.equal(key_cache.view(torch.uint8), case["key_cache"])
    assert torch.equal(value_cache.view(torch.uint8), case["value_cache"])
    assert torch.equal(k_scale.view(torch.int32), case["k_scale"].view(torch.int32))
    assert torch.equal(v_scale.view(torch.int32), case["v_scale"].view(torch.int32))
    for view in views:
        assert view.untyped_storage().data_ptr() == case["raw"].untyped_storage().data_ptr()


@pytest.mark.parametrize("module", WRITERS, ids=["reference", "triton"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_int8_write_gives_vllms_page_byte_for_byte(vllm_written, module, layout):
    block_size, key, value, slots, results = vllm_written
    case = results[(block_size, "int8_per_token_head", layout)]
    raw, kv_cache = our_page(case)
    write(module, key, value, slots, kv_cache, torch.int8)
    assert torch.equal(raw, case["raw"])  # data, scales, and every byte around them


@pytest.mark.parametrize("module", WRITERS, ids=["reference", "triton"])
@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
def test_fp8_write_gives_vllms_page_but_for_the_interpreters_cast(vllm_written, module, layout):
    """vLLM's kernel stores ``clamp(x * (1 / scale))`` into an e4m3 pointer: on a GPU Triton
    rounds that to nearest even (``cvt.rn.satfinite.e4m3x2.f32``), in its CPU interpreter it
    rounds half up and drops the carry into the exponent. So: our scale bits equal vLLM's, our
    bytes are vLLM's float32 values rounded to nearest even, and vLLM's interpreted bytes are
    exactly the interpreter's rounding of those same values."""
    from triton.language import float8e4nv, float32
    from triton.runtime.interpreter import _convert_float, _ir

    block_size, key, value, slots, results = vllm_written
    case = results[(block_size, "fp8_per_token_head", layout)]
    before_rounding = results[(block_size, "fp8_before_rounding")]
    raw, kv_cache = our_page(case)
    ours = write(module, key, value, slots, kv_cache, torch.float8_e4m3fn)
    written = slots[slots >= 0]
    for name, view, vllm_view in zip(
        ("key", "value", "k_scale", "v_scale"),
        ours,
        (case["key_cache"], case["value_cache"], case["k_scale"], case["v_scale"]),
        strict=True,
    ):
        got, precise = view.flatten(0, 1)[written], before_rounding[name].flatten(0, 1)[written]
        vllm_got = vllm_view.flatten(0, 1)[written]
        if "scale" in name:
            assert torch.equal(got.view(torch.int32), vllm_got.view(torch.int32))
            assert torch.equal(got.view(torch.int32), precise.view(torch.int32))
            continue
        assert torch.equal(got.view(torch.uint8), precise.to(torch.float8_e4m3fn).view(torch.uint8))
        interpreted = _convert_float(precise.numpy(), float32, float8e4nv, _ir.ROUNDING_MODE.RTNE)
        assert np.array_equal(np.asarray(interpreted).view(np.uint8), vllm_got.numpy())
        assert not torch.equal(got.view(torch.uint8), vllm_got)  # the difference is real
    # Every other byte is vLLM's: scales, padding, untouched slots. Put our codes into a copy of
    # vLLM's page; it must then be ours.
    expected = case["raw"].clone()
    expected_views = split_per_token_head_cache(
        torch.as_strided(expected, *case["view"]), torch.float8_e4m3fn
    )
    blocks, offsets = written // block_size, written % block_size
    for mine, theirs in zip(ours[:2], expected_views[:2], strict=True):
        theirs.view(torch.uint8)[blocks, offsets] = mine.view(torch.uint8)[blocks, offsets]
    assert torch.equal(raw, expected)


@pytest.mark.parametrize("cache_dtype", PER_TOKEN_HEAD_DTYPES)
def test_a_row_holding_nan_is_written_as_the_reference_writes_it(cache_dtype):
    """A row with a NaN gets a NaN scale, and its int8 codes are 0 (NaN has no int8 code), not
    the clamp's -128: Triton tests for NaN before it clamps (min / max drop a NaN on a GPU)."""
    gen = torch.Generator().manual_seed(4)
    key, value, slots = drafter_rows(gen)
    key[5, 1, 7] = float("nan")
    value[9, 0, 0] = float("nan")
    pages = []
    for module in WRITERS:
        kv_cache = vllm_page(cache_dtype, DEVICE)
        written = write(module, key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE), kv_cache,
                        cache_dtype)  # fmt: skip
        pages.append(kv_cache.cpu())
    key_cache, _, k_scale, _ = (t.cpu() for t in written)
    block, slot = divmod(int(slots[5]), BLOCK_SIZE)
    assert k_scale[block, slot, 1].isnan()
    if cache_dtype == torch.int8:
        assert (key_cache[block, slot, 1] == 0).all()
    assert torch.equal(pages[0], pages[1])
