"""The engine runs of the tier (one spec each, for run_engine.py) and the models they load.

Backend runs name FP8_NONCAUSAL as a user would; each has a reference run with the same
arguments, ``FP8NCA_ENGINE_MODE=reference`` and a bfloat16 cache (CPU_ATTN refuses FP8 caches
on AVX2; ``auto`` would not do: a checkpoint with a ``kv_cache_scheme`` makes it ``fp8``). The
test platform then gives those layers CPU_ATTN over K/V rounded through the same FP8 format with
the same scales. The per-token-head reference runs, whose targets keep a quantised cache, run
with vLLM seeing an AVX2 CPU (``FP8NCA_ENGINE_CPU=avx2``) on every host, and so do their backend
runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from .models import (
    NUM_LAYERS,
    write_dflash_drafter,
    write_head_scale_target,
    write_target,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLUGIN_DIR = HERE / "plugin"  # the test plugin (engine_test_plugin.py and its dist-info)


def _plugin():
    """The test plugin's module (it lives on the engine processes' PYTHONPATH, not ours)."""
    spec = importlib.util.spec_from_file_location("engine_test_plugin",
                                                  PLUGIN_DIR / "engine_test_plugin.py")  # fmt: skip
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLUGIN = _plugin()
# Planted errors that the comparisons must catch: references without the FP8 rounding, causal
# references, a TP = 2 run from a checkpoint whose per-head scales are in reverse head order, and
# in the backend on per-token-head caches (engine_test_plugin.BACKEND_PLANTS): forward reading
# the cache with scale 1, the write keeping one scale per KV head instead of one per token.
PLANTS = ("no_fp8_rounding", "causal_reference", "swapped_head_scales") + PLUGIN.BACKEND_PLANTS
BLOCK_SIZE = 32  # CPU_ATTN takes multiples of 32, the backend powers of two from 8
MAX_TOKENS = 8
BACKEND = "FP8_NONCAUSAL"
# Drafter cases: (FP8 format, DFlash speculative tokens, sliding window drafter).
DRAFTER_CASES = {"e4m3_k4": ("fp8_e4m3", 4, False), "e5m2_k8_window": ("fp8_e5m2", 8, True)}
# Per-token-head cases: (the target's kv_cache_dtype, the drafter's in speculative_config, None:
# inherited, DFlash speculative tokens). "fp8": the target on fp8 with its checkpoint's per-head
# scales, the drafter alone on fp8_per_token_head (the recipe for drafters without scales);
# "int8": every layer, target and drafter, on int8_per_token_head.
PER_TOKEN_HEAD_CASES = {"fp8": ("fp8", "fp8_per_token_head", 4),
                        "int8": ("int8_per_token_head", None, 8)}  # fmt: skip
# The DFlash drafter's one layer, numbered after the target's.
DRAFTER_LAYER = f"model.layers.{NUM_LAYERS}.self_attn.attn"
# How the engine runs: eager, with its engine core in the run's process
# (VLLM_ENABLE_V1_MULTIPROCESSING=0; with TP = 2 the executor still spawns the two workers).
# vLLM's default, engine core and worker spawned and the model compiled by torch.compile, cost
# several times more here (one drafter run alone: 74 s vs 12 s; a backend/reference pair of it
# was 60 % of the tier's engine time) and runs the backend through the same custom op. A
# backend run and its reference run always alike: a compiled run against an eager reference
# differs by 1e-2 in the drafter's attention (vLLM's custom ops are off under torch.compile, so
# the layers before attention round differently).
IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# Prompt lengths far enough apart (> MAX_TOKENS + 9) that a sequence length names one request
# and step in both runs, however the scheduler batched them.
DRAFTER_PROMPTS = [24, 72, 120]


def prompts(sizes: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 1000, (n,), generator=gen).tolist() for n in sizes]


def _common(model: Path) -> dict:
    return {"model": str(model), "dtype": "bfloat16", "max_model_len": 512,
            "block_size": BLOCK_SIZE, "max_num_seqs": 8, "enforce_eager": True}  # fmt: skip


def _reference(fmt: str, plants: frozenset[str]) -> dict[str, str]:
    """A reference run's environment: ``fmt`` as engine_test_reference's FP8NCA_ENGINE_ROUND."""
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
            llm = _common(target) | {"speculative_config": speculative}
            spec = {"llm": llm, "prompts": prompts(DRAFTER_PROMPTS, seed=k),
                    "max_tokens": MAX_TOKENS, "phases": ["generate"]}  # fmt: skip
            env = _reference(fmt, plants) if reference else {}
            specs[f"drafter_{name}" + ("_ref" if reference else "")] = (spec, env)
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
    # Per-token-head caches: each backend run records what its layers attend to (unquantised
    # and as cached) for the float64 comparisons. Its reference run gives only the drafter a
    # bf16 cache (the reference over K/V rounded through the drafter's format): the target runs
    # on the backend in both, so the drafter sees the same inputs in both.
    for name, (target_dtype, drafter_dtype, k) in PER_TOKEN_HEAD_CASES.items():
        model = head_scales if target_dtype == "fp8" else target
        for reference in (False, True):
            speculative = {"method": "dflash", "model": str(drafters[False]),
                           "num_speculative_tokens": k, "attention_backend": BACKEND}  # fmt: skip
            if reference or drafter_dtype is not None:
                speculative["kv_cache_dtype"] = "bfloat16" if reference else drafter_dtype
            llm = _common(model) | {"attention_backend": BACKEND, "kv_cache_dtype": target_dtype,
                                    "speculative_config": speculative}  # fmt: skip
            spec = {"llm": llm, "prompts": prompts(DRAFTER_PROMPTS, seed=10 + k),
                    "max_tokens": MAX_TOKENS, "phases": ["generate"]}  # fmt: skip
            # vLLM sees an AVX2 CPU in both runs: the reference's kernels, chosen beside the
            # target's quantised cache, must be those of its 16-bit one on any x86 host, and the
            # backend run takes the same kernels for the rest of the model (on a host with
            # AVX512-BF16 its own would give the drafter other inputs than the reference's).
            avx2 = {PLUGIN.CPU_ENV: PLUGIN.AVX2_ONLY}
            if reference:
                rounding = _reference(drafter_dtype or target_dtype, plants)
                specs[f"per_token_head_{name}_ref"] = (spec, rounding | avx2)
            else:
                planted = ",".join(sorted(plants & set(PLUGIN.BACKEND_PLANTS)))
                env = {PLUGIN.RECORD_KV_ENV: "1", PLUGIN.BACKEND_PLANT_ENV: planted}
                specs[f"per_token_head_{name}"] = (spec, env | avx2)
    return {name: (spec, env | IN_PROCESS) for name, (spec, env) in specs.items()}
