"""Tiny random models in Hugging Face layout, written by the tests (no hub): a Qwen3 target, the
same target as a compressed-tensors checkpoint with per-KV-head (``attn_head``) K/V scales, and
non-causal DFlash drafters (full attention or a sliding window)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB, HIDDEN, INTERMEDIATE, HEAD_DIM = 1024, 256, 512, 128
NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS = 8, 4, 2
MASK_TOKEN = VOCAB - 1
SWA_WINDOW = 4
# V magnitude per KV head (scales its v_proj rows): a head's V scale fits only that head, so a
# rank applying another head's scale saturates or underflows.
V_MAGNITUDE = (1.0, 4.0, 16.0, 64.0)


def _qwen3_config(**extra) -> dict:
    return {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS, "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False,
        "bos_token_id": 0, "eos_token_id": VOCAB - 2,
    } | extra  # fmt: skip


def _layer(gen: torch.Generator, prefix: str) -> dict[str, torch.Tensor]:
    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    v = w(NUM_KV_HEADS, HEAD_DIM, HIDDEN) * torch.tensor(V_MAGNITUDE)[:, None, None]
    return {
        f"{prefix}.self_attn.q_proj.weight": w(NUM_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.k_proj.weight": w(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.v_proj.weight": v.reshape(NUM_KV_HEADS * HEAD_DIM, HIDDEN),
        f"{prefix}.self_attn.o_proj.weight": w(HIDDEN, NUM_HEADS * HEAD_DIM),
        f"{prefix}.self_attn.q_norm.weight": 1 + w(HEAD_DIM, std=0.1),
        f"{prefix}.self_attn.k_norm.weight": 1 + w(HEAD_DIM, std=0.1),
        f"{prefix}.mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
        f"{prefix}.mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        f"{prefix}.input_layernorm.weight": 1 + w(HIDDEN, std=0.1),
        f"{prefix}.post_attention_layernorm.weight": 1 + w(HIDDEN, std=0.1),
    }


def _save(folder: Path, config: dict, weights: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.to(torch.bfloat16).contiguous() if v.is_floating_point() and
               not k.endswith(("_scale", "confidence_head.proj.weight",
                               "confidence_head.proj.bias")) else v.contiguous()
               for k, v in weights.items()}, str(folder / "model.safetensors"))  # fmt: skip
    return folder


def target_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=gen)}
    for i in range(NUM_LAYERS):
        weights |= _layer(gen, f"model.layers.{i}")
    weights["model.norm.weight"] = torch.ones(HIDDEN)
    weights["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05
    return weights


def write_target(folder: Path) -> Path:
    return _save(folder, _qwen3_config(), target_weights())


def head_scales(layer: int, swap: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's per-KV-head K and V scales of ``layer``, [NUM_KV_HEADS] fp32 each: K
    after k_norm is O(1) per element, V O(V_MAGNITUDE); each maps its head's largest values
    near the middle of e4m3's range. ``swap`` reverses the heads (a planted error)."""
    k = torch.tensor([0.012, 0.014, 0.016, 0.018]) * (1 + 0.1 * layer)
    v = torch.tensor(V_MAGNITUDE) * 0.005
    return (k.flip(0), v.flip(0)) if swap else (k, v)


def write_head_scale_target(folder: Path, swap: bool = False) -> Path:
    """The target with a compressed-tensors ``attn_head`` KV-cache scheme (no weight quantisation:
    ``config_groups`` empty), scales ``[num_kv_heads, 1, 1]`` per layer."""
    weights = target_weights()
    for i in range(NUM_LAYERS):
        k, v = head_scales(i, swap)
        weights[f"model.layers.{i}.self_attn.k_scale"] = k.reshape(-1, 1, 1)
        weights[f"model.layers.{i}.self_attn.v_scale"] = v.reshape(-1, 1, 1)
    quantization = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
        "ignore": ["lm_head"],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head",
                            "dynamic": False, "symmetric": True},
    }  # fmt: skip
    return _save(folder, _qwen3_config(quantization_config=quantization), weights)


def write_dflash_drafter(folder: Path, sliding: bool = False, seed: int = 1) -> Path:
    """A 1-layer non-causal DFlash drafter (embeddings and lm_head shared from the target);
    ``sliding``: a non-causal window of SWA_WINDOW keys."""
    gen = torch.Generator().manual_seed(seed)
    dflash = {"mask_token_id": MASK_TOKEN, "target_layer_ids": [0, 1]}
    if sliding:
        dflash |= {"swa_window_size": SWA_WINDOW, "causal": False}
    config = _qwen3_config(
        architectures=["DFlashDraftModel"], num_hidden_layers=1, dflash_config=dflash,
        layer_types=["sliding_attention" if sliding else "full_attention"],
    )  # fmt: skip
    weights = _layer(gen, "layers.0")
    weights["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.02
    weights["hidden_norm.weight"] = torch.ones(HIDDEN)
    weights["norm.weight"] = torch.ones(HIDDEN)
    return _save(folder, config, weights)


DSPARK_BLOCK, MARKOV_RANK = 4, 16


def write_dspark_drafter(folder: Path, seed: int = 2) -> Path:
    """A 1-layer Qwen3 DSpark drafter (a DFlash backbone with Markov and confidence heads)."""
    gen = torch.Generator().manual_seed(seed)
    config = _qwen3_config(
        architectures=["Qwen3DSparkModel"], num_hidden_layers=1,
        layer_types=["full_attention"], block_size=DSPARK_BLOCK, markov_rank=MARKOV_RANK,
        enable_confidence_head=True, confidence_head_with_markov=True, sample_from_anchor=True,
        dflash_config={"mask_token_id": MASK_TOKEN, "target_layer_ids": [0, 1]},
    )  # fmt: skip
    weights = _layer(gen, "layers.0")
    weights["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=gen) * 0.02
    weights["hidden_norm.weight"] = torch.ones(HIDDEN)
    weights["norm.weight"] = torch.ones(HIDDEN)
    weights["markov_head.markov_w1.weight"] = torch.randn(VOCAB, MARKOV_RANK, generator=gen)
    weights["markov_head.markov_w2.weight"] = torch.randn(VOCAB, MARKOV_RANK, generator=gen)
    # fp32, as DSpark checkpoints keep it; without it vLLM silently drops the head.
    weights["confidence_head.proj.weight"] = torch.randn(1, HIDDEN + MARKOV_RANK, generator=gen)
    weights["confidence_head.proj.bias"] = torch.zeros(1)
    return _save(folder, config, weights)
