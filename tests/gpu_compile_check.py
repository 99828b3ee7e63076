"""Compile every shipped Triton kernel variant for a GPU target, with no GPU present.

Run in a subprocess without TRITON_INTERPRET (the interpreter replaces kernels with Python
functions), by ``test_triton_compile.py``: what the interpreter accepts but a GPU compiler rejects
fails here. Each variant's launch parameters come from the launcher's own ``launch_plan``.
"""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from fp8_noncausal_attn import triton_attention, triton_cache
from fp8_noncausal_attn.synthetic import make_case
from fp8_noncausal_attn.validation import validate_attention

TRITON_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e5m2: "fp8e5",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int16: "i16",
    torch.bool: "i1",
}


def signature(kernel, pointer_dtypes, constexprs):
    """Pointers named in ``pointer_dtypes``, constexprs as given, every other argument i32."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_dtypes:
            sig[name] = "*" + TRITON_TYPES[pointer_dtypes[name]]
        elif name == "softmax_scale_log2":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_variant(kernel, pointer_dtypes, constexprs, cc, num_warps=4, num_stages=2):
    source = ASTSource(kernel, signature(kernel, pointer_dtypes, constexprs), constexprs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", cc, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    assert compiled.asm["cubin"], "no cubin produced"
    return compiled


def attention_variants():
    """(cache dtype, query dtype, head_dim, mask mode, split) covering every value of each."""
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    sixteen = (torch.bfloat16, torch.float16)
    for cache_dtype in fp8 + sixteen:
        for query_dtype in sixteen:
            yield cache_dtype, query_dtype, 128, 2, True
    for head_dim in (64, 256):
        yield torch.float8_e4m3fn, torch.bfloat16, head_dim, 0, False
    yield torch.float8_e4m3fn, torch.float16, 128, 1, False


def compile_attention(cc):
    for cache_dtype, query_dtype, head_dim, mask_mode, split in attention_variants():
        case = make_case(
            [8, 8], [40, 300], num_q_heads=32, num_kv_heads=8, head_dim=head_dim,
            cache_dtype=cache_dtype, query_dtype=query_dtype, scales="none",
        )  # fmt: skip
        problem = validate_attention(
            *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
        )
        plan = triton_attention.launch_plan(problem, num_splits=4 if split else 1)
        pointers = {
            "out_ptr": query_dtype, "part_out_ptr": torch.float32, "part_lse_ptr": torch.float32,
            "q_ptr": query_dtype, "k_cache_ptr": cache_dtype, "v_cache_ptr": cache_dtype,
            "block_table_ptr": torch.int32, "cu_seqlens_q_ptr": torch.int32,
            "seq_lens_ptr": torch.int32, "k_scale_ptr": torch.float32,
            "v_scale_ptr": torch.float32,
            "causal_ptr": torch.bool if mask_mode == 2 else torch.int32,
        }  # fmt: skip
        constexprs = {
            "GROUP": problem.group_size, "HEAD_DIM": head_dim, "BLOCK_SIZE": problem.block_size,
            "BLOCK_M": plan["block_m"], "BLOCK_N": plan["block_n"], "MASK_MODE": mask_mode,
            "SPLIT": split, "DOT_FP32": triton_attention.needs_fp32_dots(problem),
        }  # fmt: skip
        compile_variant(
            triton_attention._paged_attention_kernel, pointers, constexprs, cc,
            plan["num_warps"], plan["num_stages"],
        )  # fmt: skip
        if split:
            compile_variant(
                triton_attention._merge_splits_kernel,
                {"out_ptr": query_dtype, "part_out_ptr": torch.float32,
                 "part_lse_ptr": torch.float32},
                {"HEAD_DIM": head_dim, "SPLITS_POW2": 4}, cc,
            )  # fmt: skip
        print(f"cc{cc} attention {cache_dtype} {query_dtype} d{head_dim} mask{mask_mode} ok")


def compile_cache_writes(cc):
    for cache_dtype, code in triton_cache._FORMATS.items():
        for query_dtype in (torch.bfloat16, torch.float16):
            storage = triton_cache._STORAGE[code]
            pointers = {
                "key_ptr": query_dtype, "value_ptr": query_dtype, "key_cache_ptr": storage,
                "value_cache_ptr": storage, "slot_mapping_ptr": torch.int64,
                "k_scale_ptr": torch.float32, "v_scale_ptr": torch.float32,
            }  # fmt: skip
            constexprs = {
                "BLOCK_SIZE": 16, "HEAD_DIM": 128, "FORMAT": code,
                "FMAX": float(torch.finfo(cache_dtype).max),
            }  # fmt: skip
            compile_variant(triton_cache._reshape_and_cache_kernel, pointers, constexprs, cc)
            print(f"cc{cc} cache write {cache_dtype} from {query_dtype} ok")


if __name__ == "__main__":
    target_cc = int(sys.argv[1])
    compile_attention(target_cc)
    compile_cache_writes(target_cc)
