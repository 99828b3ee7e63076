"""The engine runs of the tier (one spec each, for run_engine.py) and the models they load.

Backend runs name FP8_NONCAUSAL as a user would; each has a reference run with the same
arguments, ``FP8NCA_ENGINE_MODE=reference`` and a bfloat16 cache (CPU_ATTN refuses FP8 caches
on AVX2; ``auto`` would not do: a checkpoint with a ``kv_cache_scheme`` makes it ``fp8``). The
test platform then gives those layers CPU_ATTN over K/V rounded through the same FP8 format with
the same scales.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .models import (
    write_dflash_drafter,
    write_head_scale_target,
    write_target,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLUGIN_DIR = HERE / "plugin"  # the test plugin (engine_test_plugin.py and its dist-info)
# Planted errors that the comparisons must catch: references without the FP8 rounding, causal
# references, and a TP = 2 run from a checkpoint whose per-head scales are in reverse head order.
PLANTS = ("no_fp8_rounding", "causal_reference", "swapped_head_scales")
BLOCK_SIZE = 32  # CPU_ATTN takes multiples of 32, the backend powers of two from 8
MAX_TOKENS = 8
BACKEND = "FP8_NONCAUSAL"
# Drafter cases: (FP8 format, DFlash speculative tokens, sliding window drafter).
DRAFTER_CASES = {"e4m3_k4": ("fp8_e4m3", 4, False), "e5m2_k8_window": ("fp8_e5m2", 8, True)}
# Prompt lengths far enough apart (> MAX_TOKENS + 9) that a sequence length names one request
# and step in both runs, however the scheduler batched them.
DRAFTER_PROMPTS = [24, 72, 120]


def prompts(sizes: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in sizes]


def _common(model: Path) -> dict:
    return {"model": str(model), "dtype": "bfloat16", "max_model_len": 512,
            "block_size": BLOCK_SIZE, "max_num_seqs": 8}  # fmt: skip


def _reference(fmt: str, plants: frozenset[str]) -> dict[str, str]:
    rounding = "" if "no_fp8_rounding" in plants else fmt
    causal = "1" if "causal_reference" in plants else "0"
    return {"FP8NCA_ENGINE_MODE": "reference", "FP8NCA_ENGINE_ROUND": rounding,
            "FP8NCA_ENGINE_CAUSAL_REFERENCE": causal}  # fmt: skip


def engine_specs(
    models: Path, plants: frozenset[str] = frozenset()
) -> dict[str, tuple[dict, dict]]:
    """name -> (run_engine.py spec, extra environment), in the order the tests read them;
    ``plants``: some of PLANTS."""
    if not plants <= set(PLANTS):
        raise ValueError(f"FP8NCA_ENGINE_PLANT must name some of {PLANTS}, got {sorted(plants)}")
    target = write_target(models / "target")
    head_scales = write_head_scale_target(models / "head_scales")
    swapped = write_head_scale_target(models / "head_scales_swapped", swap=True)
    drafters = {False: write_dflash_drafter(models / "dflash"),
                True: write_dflash_drafter(models / "dflash_window", sliding=True)}  # fmt: skip
    specs: dict[str, tuple[dict, dict]] = {}
    for name, (fmt, k, sliding) in DRAFTER_CASES.items():
        for reference in (False, True):
            speculative = {"method": "dflash", "model": str(drafters[sliding]),
                           "num_speculative_tokens": k, "attention_backend": BACKEND,
                           "kv_cache_dtype": "bfloat16" if reference else fmt}  # fmt: skip
            spec = {"llm": _common(target) | {"speculative_config": speculative},
                    "prompts": prompts(DRAFTER_PROMPTS, seed=k), "max_tokens": MAX_TOKENS,
                    "phases": ["generate"]}  # fmt: skip
            specs[f"drafter_{name}" + ("_ref" if reference else "")] = (
                spec,
                _reference(fmt, plants) if reference else {},
            )
    # Every layer on the backend, per-KV-head scales from the checkpoint: teacher-forced prompt
    # logprobs, then (backend only) a small KV cache and token budget for chunked prefill,
    # preemption, prefix caching and aborts against one request at a time.
    every_layer = _common(head_scales) | {"attention_backend": BACKEND, "kv_cache_dtype": "fp8"}
    long_prompts = prompts([61, 120, 77, 95, 110, 66], seed=7)
    # 17 blocks: one is vLLM's null block, 16 hold one max_model_len request.
    features = {"max_num_batched_tokens": 128, "num_gpu_blocks_override": 17,
                "enable_prefix_caching": True, "disable_log_stats": False}  # fmt: skip
    specs["every_layer"] = (
        {"llm": every_layer | features, "prompts": long_prompts, "max_tokens": 24,
         "phases": ["prompt_logprobs", "one_at_a_time", "all_at_once", "aborts"]}, {},
    )  # fmt: skip
    specs["every_layer_ref"] = (
        {"llm": every_layer | {"kv_cache_dtype": "bfloat16"}, "prompts": long_prompts,
         "max_tokens": 1, "phases": ["prompt_logprobs"]}, _reference("fp8_e4m3", plants),
    )  # fmt: skip
    specs["every_layer_tp2"] = (
        {"llm": every_layer | {"tensor_parallel_size": 2} | (
            {"model": str(swapped)} if "swapped_head_scales" in plants else {}),
         "prompts": long_prompts,
         "max_tokens": 1, "phases": ["prompt_logprobs"]},
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )  # fmt: skip
    return specs
