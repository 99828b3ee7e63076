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
  saved there as one ``torch.save`` file, read back by the tests. With
  ``FP8NCA_ENGINE_RECORD_KV=1`` each forward also records its query and, per request, every
  key and value it attends to twice: as the model computed them (unquantised, kept as they are
  written) and as the cache holds them (dequantised with the cache's own scales).
  ``FP8NCA_ENGINE_BACKEND_PLANT`` (comma-separated, per-token-head caches only) plants errors
  in the backend: ``scales_dropped`` (forward reads the cache with scale 1),
  ``per_head_scales`` (the write keeps one scale per KV head over the tokens it writes, not one
  per token).
- ``FP8NCA_ENGINE_CPU=avx2`` (set in every process, by both entry points): vLLM sees the x86 CPU
  it needs at the least, AVX2 without AVX-512 or AMX (torch's CPU probes answer False), and
  chooses its CPU kernels (``vllm._C_AVX2``, CPU_ATTN's ISA) as on such a host.
"""

from __future__ import annotations

import itertools
import os

import torch

MODE_ENV, ROUND_ENV = "FP8NCA_ENGINE_MODE", "FP8NCA_ENGINE_ROUND"
RECORD_ENV, CAUSAL_ENV = "FP8NCA_ENGINE_RECORD", "FP8NCA_ENGINE_CAUSAL_REFERENCE"
RECORD_KV_ENV, BACKEND_PLANT_ENV = "FP8NCA_ENGINE_RECORD_KV", "FP8NCA_ENGINE_BACKEND_PLANT"
CPU_ENV, AVX2_ONLY = "FP8NCA_ENGINE_CPU", "avx2"
# torch's probes of the x86 extensions beyond AVX2 (vnni: AVX512-VNNI), which vLLM's CPU build
# chooses its kernels by.
AVX512_AND_AMX_PROBES = ("_is_avx512_supported", "_is_avx512_bf16_supported",
                         "_is_vnni_supported", "_is_amx_tile_supported",
                         "_is_amx_fp16_supported")  # fmt: skip
BACKEND_PLANTS = ("scales_dropped", "per_head_scales")
BACKEND = "FP8_NONCAUSAL"
# vLLM's kv_cache_dtype names of FP8 formats ("fp8" is e4m3).
ROUND_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}  # fmt: skip
PER_TOKEN_HEAD_FORMATS = ("fp8_per_token_head", "int8_per_token_head")
_counter = itertools.count()


def hide_avx512_and_amx() -> None:
    """With ``FP8NCA_ENGINE_CPU=avx2``, torch's probes say this CPU has neither AVX-512 nor AMX
    (vLLM reads them when it loads its kernels and whenever it chooses one)."""
    cpu = os.environ.get(CPU_ENV, "")
    if cpu not in ("", AVX2_ONLY):
        raise ValueError(f"{CPU_ENV} must be {AVX2_ONLY} or unset, got {cpu!r}")
    if cpu == AVX2_ONLY:
        for probe in AVX512_AND_AMX_PROBES:
            setattr(torch.cpu, probe, lambda: False)


def platform() -> str:
    hide_avx512_and_amx()
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


def round_trip(x: torch.Tensor, fmt: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, kv_heads, head] written in the cache format ``fmt`` and read back, float32
    (unchanged for a format not named here).

    An FP8 format: ``x / scale`` (``scale`` 0-d or per KV head) saturated and rounded to nearest
    even, times ``scale``. A per-token-head format, as vLLM's per-token-head write: each row's
    scale ``max(amax / high, 1e-6)``, codes ``x * (1 / scale)`` saturated, int8 rounded half
    away from zero, e4m3 to nearest even (``scale`` unused, as the backend ignores the layer's).
    """
    rows = x.float()
    if fmt in PER_TOKEN_HEAD_FORMATS:
        int8 = fmt == "int8_per_token_head"
        high = 127.0 if int8 else torch.finfo(torch.float8_e4m3fn).max
        scale = (rows.abs().amax(-1, keepdim=True) / high).clamp_min(1e-6)
        codes = rows * scale.reciprocal()
        if int8:
            codes = (codes.sign() * (codes.abs() + 0.5).floor()).clamp(-128, 127)
        else:
            codes = codes.clamp(-high, high).to(torch.float8_e4m3fn).float()
        return codes * scale
    fp8 = ROUND_DTYPES.get(fmt)
    if fp8 is None:
        return rows
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float()
    limit = torch.finfo(fp8).max
    return (rows / scale).clamp(-limit, limit).to(fp8).float() * scale


def layer_name(layer) -> str:
    return getattr(layer, "layer_name", None) or getattr(layer, "prefix", "?")


def batch_key(metadata) -> tuple:
    """(query_start_loc, seq_lens) of a batch: the same step of two runs has the same key."""
    return (tuple(metadata.query_start_loc.tolist()), tuple(metadata.seq_lens.tolist()))


def metadata_causal(metadata) -> object:
    causal = getattr(metadata, "causal", None)
    return causal.clone() if isinstance(causal, torch.Tensor) else causal


def context_slots(metadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of every key each request attends to, requests concatenated: its first
    ``seq_len`` positions through the batch's block table."""
    blocks, offsets = [], []
    for i, seq_len in enumerate(metadata.seq_lens.tolist()):
        positions = torch.arange(seq_len)
        blocks.append(metadata.block_table[i].cpu()[positions // block_size].long())
        offsets.append(positions % block_size)
    return torch.cat(blocks), torch.cat(offsets)


class UnquantisedKeysValues:
    """What each layer wrote into its cache, unquantised, by slot (grown as slots come)."""

    def __init__(self) -> None:
        self._rows: dict[str, list[torch.Tensor]] = {}

    def write(self, name: str, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor):
        keep = slots >= 0
        slots = slots[keep].long().cpu()
        if slots.numel() == 0:
            return
        rows = self._rows.setdefault(name, [key.new_zeros(0, *key.shape[1:]).cpu()] * 2)
        for i, new in enumerate((key, value)):
            if rows[i].shape[0] <= slots.max():
                grown = rows[i].new_zeros(int(slots.max()) + 1, *rows[i].shape[1:])
                grown[: rows[i].shape[0]] = rows[i]
                rows[i] = grown
            rows[i][slots] = new[: keep.shape[0]][keep].detach().cpu()

    def context(self, name: str, blocks, offsets, block_size: int) -> list[torch.Tensor]:
        """The keys and values at ``(blocks, offsets)`` (:func:`context_slots`), unquantised."""
        return [rows[blocks * block_size + offsets] for rows in self._rows[name]]


def _plant_in_backend(impl, plants: set[str]) -> None:
    """Plant ``plants`` (some of BACKEND_PLANTS) in the impl's per-token-head path."""
    if "scales_dropped" in plants:
        views, forward = impl._caches_and_scales, impl.forward

        def read_with_scale_one(self, layer, kv_cache):
            key_cache, value_cache, k_scale, v_scale = views(self, layer, kv_cache)
            return key_cache, value_cache, torch.ones_like(k_scale), torch.ones_like(v_scale)

        def forward_with_scale_one(self, *args, **kwargs):
            if self._per_token_head_dtype is None:
                return forward(self, *args, **kwargs)
            self._caches_and_scales = read_with_scale_one.__get__(self)
            try:
                return forward(self, *args, **kwargs)
            finally:
                del self._caches_and_scales

        impl.forward = forward_with_scale_one
    if "per_head_scales" in plants:
        from fp8_noncausal_attn.backends import reference

        per_token = reference.quantize_per_token_head

        def one_scale_per_head(x, cache_dtype):
            # x [tokens, kv_heads, head]: one more column holding the head's amax over all the
            # tokens makes every row's scale that head's, with the write's own rounding.
            head_max = x.float().abs().amax(dim=(0, 2)).expand(x.shape[:-1])
            stored, scale = per_token(torch.cat([x.float(), head_max[..., None]], -1),
                                      cache_dtype)  # fmt: skip
            return stored[..., :-1], scale

        reference.quantize_per_token_head = one_scale_per_head


def install_recorder() -> None:
    """Wrap the backend's impl forward and plan, and DFlash's propose, to record them."""
    hide_avx512_and_amx()  # a fork server's child: the platform was chosen in its parent
    if not os.environ.get(RECORD_ENV):
        return
    from fp8_noncausal_attn import vllm_backend
    from fp8_noncausal_attn.plan import PagedAttention

    impl = vllm_backend.Fp8NoncausalAttentionImpl
    if getattr(impl.forward, "_recorded", False):
        return
    plants = set(filter(None, os.environ.get(BACKEND_PLANT_ENV, "").split(",")))
    if not plants <= set(BACKEND_PLANTS):
        raise ValueError(f"{BACKEND_PLANT_ENV} must name some of {BACKEND_PLANTS}: {plants}")
    _plant_in_backend(impl, plants)
    forward, plan = impl.forward, PagedAttention.plan
    unquantised = UnquantisedKeysValues() if os.environ.get(RECORD_KV_ENV) == "1" else None
    if unquantised is not None:
        update = impl.do_kv_cache_update

        def recorded_update(self, layer, key, value, kv_cache, slot_mapping):
            unquantised.write(layer_name(layer), key, value, slot_mapping)
            return update(self, layer, key, value, kv_cache, slot_mapping)

        impl.do_kv_cache_update = recorded_update

    def recorded_forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs):  # fmt: skip
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                         *args, **kwargs)  # fmt: skip
        if attn_metadata is not None:
            n = attn_metadata.num_actual_tokens
            fields = {}
            if unquantised is not None:
                fields = _attended(self, layer, query[:n], kv_cache, attn_metadata, unquantised)
            record("forward", layer=layer_name(layer), causal=metadata_causal(attn_metadata),
                   output=output[:n], window=self.sliding_window,
                   k_scale=layer._k_scale, v_scale=layer._v_scale,
                   kernels=attn_metadata.plan.backend, key=batch_key(attn_metadata),
                   **fields)  # fmt: skip
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


def _attended(impl, layer, query, kv_cache, metadata, unquantised) -> dict:
    """A forward's query, softmax scale and each request's keys and values, unquantised and as
    the cache holds them (float32, dequantised with the cache's own scales)."""
    from fp8_noncausal_attn.scales import dequantize

    key_cache, value_cache, k_scale, v_scale = impl._caches_and_scales(layer, kv_cache)
    block_size = key_cache.shape[1]
    blocks, offsets = context_slots(metadata, block_size)
    keys, values = unquantised.context(layer_name(layer), blocks, offsets, block_size)

    def cached(cache, scale):
        # Gathered through a byte view: FP8 tensors have no advanced indexing on every build.
        rows = cache.view(torch.uint8)[blocks, offsets].view(cache.dtype)
        return dequantize(rows, scale[blocks, offsets] if scale.dim() == 3 else scale.float())

    return {
        "query": query, "softmax_scale": impl.scale, "keys": keys, "values": values,
        "cached_keys": cached(key_cache, k_scale), "cached_values": cached(value_cache, v_scale),
    }  # fmt: skip
