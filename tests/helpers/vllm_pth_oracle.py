"""vLLM's own per-token-head cache write, run in a child process (see
test_per_token_head_cache.py).

Usage: ``python tests/helpers/vllm_pth_oracle.py INPUT.pt OUTPUT.pt``, with
``TRITON_INTERPRET=1`` and ``CUDA_VISIBLE_DEVICES=""`` on a CPU machine (vLLM disables Triton
when it counts no GPU driver, unless the visible-device list is empty). For each block size of
the input, mode and page layout it allocates one layer's cache as vLLM's worker does
(``customize_spec``, ``create_kv_cache_views``), views it with vLLM's own
``TritonAttentionImpl._pth_key_value_caches`` and writes it with
``triton_reshape_and_cache_flash_per_token_head_quant``. Saved per case (keyed ``(block_size,
mode, layout)``): the backing buffer as vLLM's view left it (up to 0.33 every inline scale 1.0,
from 0.34 untouched) and after the write, the layer view's geometry, vLLM's own K/V/scale views'
contents; per block size, for FP8, the float32 values vLLM's kernel rounds to FP8 (its kernel
launched on float32 destinations).
"""

import sys

import torch
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
    FP8_MAX,
    FP8_MIN,
    _reshape_cache_per_token_head,
    triton_reshape_and_cache_flash_per_token_head_quant,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    KVQuantMode,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

MODES = {
    "int8_per_token_head": (KVQuantMode.INT8_PER_TOKEN_HEAD, torch.int8),
    "fp8_per_token_head": (KVQuantMode.FP8_PER_TOKEN_HEAD, torch.uint8),
}
# Layer-outermost HND and NHD pages, and block-outermost NHD pages (layers interleaved).
LAYOUTS = ("LBHNC", "LBNHC", "BLNHC")


def layer_cache(spec, num_blocks: int, layout: KVCacheLayout, fill: torch.Tensor):
    """The second of two layers' cache views over one backing buffer, as vLLM's worker makes it."""
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        placement = KVCacheTensor(
            size=2 * page * num_blocks,
            layers=["a", "b"],
            layer_stride=page * num_blocks,
            block_stride=page,
        )
    else:
        placement = KVCacheTensor(
            size=2 * page * num_blocks, layers=["a", "b"], layer_stride=page, block_stride=2 * page
        )
    raw = fill[: placement.size].clone()
    views = create_kv_cache_views(raw, spec, num_blocks, layout, placement)
    return raw, views[1]


def main(src: str, dst: str) -> None:
    inputs = torch.load(src)
    results = {}
    for block_size, rows in inputs["rows"].items():
        write_pages(rows, inputs["num_blocks"], block_size, inputs["fill"], results)
    torch.save(results, dst)


def write_pages(rows: dict, num_blocks: int, block_size: int, fill, results: dict) -> None:
    """vLLM's write of ``rows`` (key, value, slot_mapping) into pages of ``block_size`` slots:
    adds this block size's cases to ``results``."""
    key, value, slots = rows["key"], rows["value"], rows["slot_mapping"]
    _, num_kv_heads, head_size = key.shape
    for mode_name, (mode, dtype) in MODES.items():
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            dtype=dtype,
            kv_quant_mode=mode,
        )
        spec = TritonAttentionBackend.customize_spec(spec)
        for layout_name in LAYOUTS:
            raw, kv_cache = layer_cache(spec, num_blocks, KVCacheLayout[layout_name], fill)
            impl = TritonAttentionImpl(
                num_kv_heads, head_size, head_size**-0.5, num_kv_heads, None, None, mode_name
            )
            assert impl.fp8_dtype == torch.float8_e4m3fn
            key_cache, value_cache = impl._pth_key_value_caches(kv_cache)
            viewed = raw.clone()
            triton_reshape_and_cache_flash_per_token_head_quant(
                key,
                value,
                key_cache,
                value_cache,
                impl._k_scale_cache,
                impl._v_scale_cache,
                slots,
                kv_quant_mode=mode,
            )
            results[(block_size, mode_name, layout_name)] = {
                "viewed": viewed,
                "raw": raw,
                "view": (tuple(kv_cache.shape), kv_cache.stride(), kv_cache.storage_offset()),
                "key_cache": key_cache[..., :head_size].view(torch.uint8).clone(),
                "value_cache": value_cache[..., :head_size].view(torch.uint8).clone(),
                "k_scale": impl._k_scale_cache.clone(),
                "v_scale": impl._v_scale_cache.clone(),
            }
    # vLLM's kernel itself, its destinations float32: the values its store rounds to e4m3.
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    out = [torch.zeros(shape) for _ in range(2)] + [torch.zeros(shape[:3]) for _ in range(2)]
    _reshape_cache_per_token_head[(key.shape[0], num_kv_heads)](
        key,
        value,
        *out,
        slots,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *out[0].stride()[:3],
        *out[1].stride()[:3],
        *out[2].stride(),
        *out[3].stride(),
        block_size=block_size,
        head_size=head_size,
        head_size_v=head_size,
        HEAD_SIZE_PADDED=head_size,
        QUANT_MAX=FP8_MAX,
        QUANT_MIN=FP8_MIN,
        IS_INT_QUANT=False,
    )
    names = ("key", "value", "k_scale", "v_scale")
    results[(block_size, "fp8_before_rounding")] = dict(zip(names, out, strict=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
