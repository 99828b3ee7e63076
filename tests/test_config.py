"""The target/drafter KV-cache dtype split (SPEC §6), with vLLM 0.33's speculative-config rules."""

import subprocess
import sys

import pytest

from fp8_noncausal_attn.config import (
    AUTO_BACKEND,
    BACKEND_NAME,
    normalize_cli_key,
    normalize_cli_options,
    resolve_drafter_kv_cache,
    resolve_drafter_kv_cache_from_cli,
)

HOPPER, BLACKWELL, AMPERE, ADA = (9, 0), (10, 0), (8, 0), (8, 9)


def test_neither_the_package_nor_config_imports_vllm():
    code = (
        "import sys, fp8_noncausal_attn, fp8_noncausal_attn.config; "
        "print(any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL, ADA])
@pytest.mark.parametrize("target", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_unset_override_inherits_the_targets_fp8_and_runs_on_our_backend(capability, target):
    plan = resolve_drafter_kv_cache(target, None, drafter_non_causal=True,
                                    device_capability=capability)  # fmt: skip
    assert plan.kv_cache_dtype == target
    assert plan.backend == BACKEND_NAME
    assert "inherited" in plan.reason and "non-causal" in plan.reason
    assert plan.speculative_config == {"kv_cache_dtype": target, "attention_backend": BACKEND_NAME}


def test_bfloat16_override_is_the_fallback_recipe_on_the_same_backend():
    plan = resolve_drafter_kv_cache("fp8", "bfloat16", drafter_non_causal=True,
                                    device_capability=HOPPER)  # fmt: skip
    assert plan.kv_cache_dtype == "bfloat16"
    assert plan.backend == BACKEND_NAME
    assert "speculative_config.kv_cache_dtype='bfloat16'" in plan.reason


def test_auto_override_means_the_model_dtype_not_the_targets_dtype():
    # vLLM 0.33 replaces the drafter's cache dtype with any non-None value; "auto" is the
    # model's dtype there (vLLM sets it for GLM drafters to keep them off the target's FP8).
    plan = resolve_drafter_kv_cache("fp8", "auto", drafter_non_causal=True,
                                    device_capability=BLACKWELL)  # fmt: skip
    assert plan.kv_cache_dtype == "auto"
    assert plan.backend == BACKEND_NAME


def test_unsupported_device_falls_back_to_the_model_dtype_with_the_reason():
    plan = resolve_drafter_kv_cache("fp8", None, drafter_non_causal=True,
                                    device_capability=AMPERE)  # fmt: skip
    assert plan.kv_cache_dtype == "bfloat16"
    assert plan.backend == AUTO_BACKEND
    assert "compute capability >= 8.9" in plan.reason and "falls back" in plan.reason
    assert plan.speculative_config == {"kv_cache_dtype": "bfloat16"}
    fp16 = resolve_drafter_kv_cache("fp8_e5m2", None, drafter_non_causal=False,
                                    device_capability=AMPERE, model_dtype="float16")  # fmt: skip
    assert fp16.kv_cache_dtype == "float16"


def test_sixteen_bit_cache_on_an_unsupported_device_keeps_its_dtype():
    plan = resolve_drafter_kv_cache("auto", None, drafter_non_causal=True,
                                    device_capability=AMPERE)  # fmt: skip
    assert (plan.kv_cache_dtype, plan.backend) == ("auto", AUTO_BACKEND)


def test_dtypes_our_kernels_do_not_run_are_left_to_vllm():
    plan = resolve_drafter_kv_cache("int4_per_token_head", None, drafter_non_causal=False,
                                    device_capability=HOPPER)  # fmt: skip
    assert (plan.kv_cache_dtype, plan.backend) == ("int4_per_token_head", AUTO_BACKEND)
    assert "supports kv-cache dtypes" in plan.reason


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "int8_per_token_head"])
def test_a_drafter_only_per_token_head_cache_runs_here(dtype):
    """The target on fp8, the drafter alone on a per-token-head cache (no checkpoint scales):
    this backend runs the drafter, and says why."""
    plan = resolve_drafter_kv_cache("fp8", dtype, drafter_non_causal=True,
                                    device_capability=HOPPER)  # fmt: skip
    assert (plan.kv_cache_dtype, plan.backend) == (dtype, BACKEND_NAME)
    assert plan.speculative_config == {"kv_cache_dtype": dtype, "attention_backend": BACKEND_NAME}
    assert "a scale per token and KV head" in plan.reason
    assert f"set by speculative_config.kv_cache_dtype='{dtype}'" in plan.reason


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"model_dtype": "float32"}, "model_dtype"),
        ({"drafter_kv_cache_dtype": ""}, "drafter_kv_cache_dtype"),
        ({"target_kv_cache_dtype": None}, "target_kv_cache_dtype"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, match):
    call = {"target_kv_cache_dtype": "fp8", "drafter_non_causal": True,
            "device_capability": HOPPER} | kwargs  # fmt: skip
    with pytest.raises(ValueError, match=match):
        resolve_drafter_kv_cache(**call)


@pytest.mark.parametrize(
    "key",
    [
        "--speculative-config.kv-cache-dtype",
        "--speculative_config.kv_cache_dtype",
        "speculative-config.kv_cache_dtype",
        "speculative_config.kv-cache-dtype",
    ],
)
def test_dotted_cli_keys_accept_dashes_or_underscores(key):
    assert normalize_cli_key(key) == "speculative_config.kv_cache_dtype"


def test_cli_options_flatten_json_dicts_and_dotted_keys():
    whole_json = {"--speculative-config": '{"method": "dflash", "kv-cache-dtype": "bfloat16"}'}
    assert normalize_cli_options(whole_json) == {
        "speculative_config.method": "dflash",
        "speculative_config.kv_cache_dtype": "bfloat16",
    }
    whole_dict = {"speculative_config": {"kv_cache_dtype": "fp8"}, "--kv-cache-dtype": "fp8"}
    assert normalize_cli_options(whole_dict) == {
        "speculative_config.kv_cache_dtype": "fp8",
        "kv_cache_dtype": "fp8",
    }
    dotted_wins = {
        "--speculative-config": '{"kv_cache_dtype": "fp8"}',
        "--speculative-config.kv-cache-dtype": "bfloat16",
    }
    assert normalize_cli_options(dotted_wins)["speculative_config.kv_cache_dtype"] == "bfloat16"


def test_one_key_under_two_spellings_with_different_values_is_refused():
    with pytest.raises(ValueError, match="speculative_config.kv_cache_dtype"):
        normalize_cli_options({
            "--speculative-config.kv-cache-dtype": "bfloat16",
            "speculative_config.kv_cache_dtype": "fp8",
        })  # fmt: skip


def test_resolution_from_cli_options():
    inherit = resolve_drafter_kv_cache_from_cli(
        {"--kv-cache-dtype": "fp8", "--speculative-config": '{"method": "dflash"}'},
        drafter_non_causal=True, device_capability=HOPPER,
    )  # fmt: skip
    assert (inherit.kv_cache_dtype, inherit.backend) == ("fp8", BACKEND_NAME)
    fallback = resolve_drafter_kv_cache_from_cli(
        {"--kv-cache-dtype": "fp8", "--speculative-config.kv-cache-dtype": "bfloat16"},
        drafter_non_causal=True, device_capability=BLACKWELL,
    )  # fmt: skip
    assert fallback.kv_cache_dtype == "bfloat16"
    default_target = resolve_drafter_kv_cache_from_cli(
        {}, drafter_non_causal=True, device_capability=HOPPER
    )
    assert default_target.kv_cache_dtype == "auto"
