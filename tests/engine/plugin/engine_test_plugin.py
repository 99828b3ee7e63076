"""The engine tier's only scaffolding, loaded by vLLM in every process (API, engine core, TP
workers) from this folder on PYTHONPATH (no install: the dist-info beside it declares the entry
points).

- ``platform``: :class:`engine_test_platform.EngineTestPlatform`, vLLM's CPU platform except
  that a layer asking for FP8_NONCAUSAL gets it (validated with vLLM's own
  ``validate_configuration``, as the CUDA platform does): the CPU platform alone returns
  CPU_ATTN whatever is asked. With ``FP8NCA_ENGINE_MODE=reference`` such a layer gets
  :class:`engine_test_reference.RoundedCpuAttentionBackend`, the reference.
- ``install_recorder``: with ``FP8NCA_ENGINE_RECORD`` set (a folder), every forward of an
  FP8_NONCAUSAL (or reference) layer, every plan the backend makes and every DFlash draft is
  saved there as one ``torch.save`` file, read back by the tests.
"""

from __future__ import annotations

import itertools
import os

import torch

MODE_ENV, ROUND_ENV = "FP8NCA_ENGINE_MODE", "FP8NCA_ENGINE_ROUND"
RECORD_ENV, CAUSAL_ENV = "FP8NCA_ENGINE_RECORD", "FP8NCA_ENGINE_CAUSAL_REFERENCE"
BACKEND = "FP8_NONCAUSAL"
ROUND_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_counter = itertools.count()


def platform() -> str:
    # vLLM imports the class after the plugins have answered (its module imports vllm.platforms).
    return "engine_test_platform.EngineTestPlatform"


def record(kind: str, **fields) -> None:
    """Save one record (tensors moved to the CPU) into the record folder, if one is set."""
    folder = os.environ.get(RECORD_ENV)
    if not folder:
        return
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    fields = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
              for k, v in fields.items()}  # fmt: skip
    name = f"{kind}-{os.getpid()}-{next(_counter):06d}.pt"
    torch.save({"kind": kind, "rank": rank, **fields}, os.path.join(folder, name))


def layer_name(layer) -> str:
    return getattr(layer, "layer_name", None) or getattr(layer, "prefix", "?")


def batch_key(metadata) -> tuple:
    """(query_start_loc, seq_lens) of a batch: the same step of two runs has the same key."""
    return (tuple(metadata.query_start_loc.tolist()), tuple(metadata.seq_lens.tolist()))


def metadata_causal(metadata) -> object:
    causal = getattr(metadata, "causal", None)
    return causal.clone() if isinstance(causal, torch.Tensor) else causal


def install_recorder() -> None:
    """Wrap the backend's impl forward and plan, and DFlash's propose, to record them."""
    if not os.environ.get(RECORD_ENV):
        return
    from fp8_noncausal_attn import vllm_backend
    from fp8_noncausal_attn.plan import PagedAttention

    impl = vllm_backend.Fp8NoncausalAttentionImpl
    if getattr(impl.forward, "_recorded", False):
        return
    forward, plan = impl.forward, PagedAttention.plan

    def recorded_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs):  # fmt: skip
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs)  # fmt: skip
        if attn_metadata is not None:
            n = attn_metadata.num_actual_tokens
            record("forward", layer=layer_name(layer), causal=metadata_causal(attn_metadata),
                   output=output[:n], window=self.sliding_window,
                   k_scale=layer._k_scale, v_scale=layer._v_scale,
                   kernels=attn_metadata.plan.backend, key=batch_key(attn_metadata))  # fmt: skip
        return result

    def recorded_plan(self, *args, **kwargs):
        result = plan(self, *args, **kwargs)
        causal = kwargs.get("causal")
        record("plan", window=kwargs.get("window"),
               causal=causal.clone() if isinstance(causal, torch.Tensor) else causal)  # fmt: skip
        return result

    recorded_forward._recorded = True
    impl.forward = recorded_forward
    PagedAttention.plan = recorded_plan

    from vllm.v1.spec_decode.dflash import DFlashProposer

    propose = DFlashProposer.propose

    def recorded_propose(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        # The target's batch (common_attn_metadata, the 7th argument) keys the step.
        metadata = kwargs.get("common_attn_metadata", args[6] if len(args) > 6 else None)
        record("drafts", drafts=drafts, key=batch_key(metadata))
        return drafts

    DFlashProposer.propose = recorded_propose
