"""DSpark on FP8_NONCAUSAL, outside the engine: ``main(MODELS, OUT.pt)``, run by the fork server
(run_engine.py) or as ``python dspark_check.py MODELS OUT.pt``.

vLLM 0.32's V1 runner refuses ``dspark`` and its V2 runner needs Triton with a GPU backend, so
this builds the drafter with V2's own loader (``load_dspark_model``: the target's embeddings and
lm_head shared) on the CPU platform of the test plugin, writes a request's context K/V through
the drafter's ``precompute_and_store_context_kv`` into an FP8 e4m3 paged cache (pages shuffled),
runs one draft block through the model (vLLM's Attention layer, the backend's builder and impl)
and saves the layer's query, output and cache for the test to check against bidirectional
attention.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

CONTEXT, BLOCK_PAGES = 45, 8


def main(models: str, out: str) -> None:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.gpu.spec_decode.dspark.utils import load_dspark_model

    from fp8_noncausal_attn.vllm_backend import (
        Fp8NoncausalAttentionImpl,
        Fp8NoncausalMetadataBuilder,
    )

    load_general_plugins()
    # What VllmConfig checks before it lets a config name dspark: Model Runner V2 (chosen by
    # VLLM_USE_V2_MODEL_RUNNER=1, set by the test) and Triton with a backend, which the CPU build
    # lacks. Nothing here runs V2's runner or a Triton kernel: only its model loader.
    import vllm.config.vllm

    vllm.config.vllm.HAS_TRITON = True
    # As vLLM's CPU model runner does before it loads a model.
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()
    models = Path(models)
    args = EngineArgs(
        model=str(models / "target"), dtype="bfloat16", skip_tokenizer_init=True, block_size=32,
        max_model_len=512, max_num_seqs=4,
        speculative_config={"method": "dspark", "model": str(models / "dspark"),
                            "num_speculative_tokens": 3, "attention_backend": "FP8_NONCAUSAL",
                            "kv_cache_dtype": "fp8_e4m3"},
    )  # fmt: skip
    vllm_config = args.create_engine_config()
    gen = torch.Generator().manual_seed(5)
    with set_current_vllm_config(vllm_config), tempfile.TemporaryDirectory() as tmp:
        init_distributed_environment(1, 0, f"file://{tmp}/dist", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        torch.set_default_dtype(torch.bfloat16)
        target = get_model(vllm_config=vllm_config)
        drafter = load_dspark_model(target, vllm_config)
        (name,) = drafter.get_draft_kv_cache_layer_names()
        layer = drafter.model.layers[0].self_attn.attn
        assert isinstance(layer.impl, Fp8NoncausalAttentionImpl), type(layer.impl)
        # load_dspark_model's draft config is a copy of this one sharing its compilation config,
        # whose static forward context registers the drafter's layer (what the builder reads).
        draft_config = vllm_config
        spec = layer.get_kv_cache_spec(draft_config)
        block_size = spec.block_size
        num_blocks = 16
        layer.kv_cache = torch.zeros(num_blocks, spec.num_kv_heads, block_size,
                                     2 * spec.head_size, dtype=torch.uint8)  # fmt: skip
        block = drafter.config.block_size
        seq_len = CONTEXT + block
        pages = torch.randperm(num_blocks, generator=gen)[:BLOCK_PAGES].to(torch.int32)
        positions = torch.arange(seq_len)
        slots = pages[positions // block_size].long() * block_size + positions % block_size
        # The context: the target's hidden states of two layers, through the drafter's fc.
        states = torch.randn(CONTEXT, 2 * drafter.config.hidden_size, generator=gen)
        context = drafter.combine_hidden_states(states.to(torch.bfloat16))
        drafter.precompute_and_store_context_kv(context, positions[:CONTEXT], slots[:CONTEXT])
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor([0, block], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, block], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32), num_reqs=1,
            num_actual_tokens=block, max_query_len=block, max_seq_len=seq_len,
            block_table_tensor=pages[None, :], slot_mapping=slots[CONTEXT:], causal=False,
        )  # fmt: skip
        builder = Fp8NoncausalMetadataBuilder(spec, [name], draft_config, torch.device("cpu"))
        meta = builder.build(0, common)
        seen = {}
        forward = layer.impl.forward

        def capture(impl_layer, query, key, value, kv_cache, attn_metadata, output, *a, **k):
            result = forward(impl_layer, query, key, value, kv_cache, attn_metadata, output,
                             *a, **k)  # fmt: skip
            seen.update(query=query.clone(), output=output.clone())
            return result

        layer.impl.forward = capture
        embeds = torch.randn(block, drafter.config.hidden_size, generator=gen)
        with set_forward_context({name: meta}, draft_config,
                                 slot_mapping={name: common.slot_mapping}):  # fmt: skip
            hidden = drafter.model(None, positions[CONTEXT:], embeds.to(torch.bfloat16))
        torch.save({
            "query": seen["query"], "output": seen["output"], "kv_cache": layer.kv_cache,
            "pages": pages, "seq_len": seq_len, "block": block, "scale": layer.impl.scale,
            "k_scale": layer._k_scale, "v_scale": layer._v_scale, "plan_causal": meta.causal,
            "num_heads": layer.impl.num_heads, "hidden_finite": bool(hidden.isfinite().all()),
            "kernels": meta.plan.backend,
        }, out)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
