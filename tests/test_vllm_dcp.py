"""Decode context parallelism through vLLM's own classes, the DCP group faked (SPEC §8).

Two DCP ranks run as two threads of this process over a fake ``GroupCoordinator``
(``all_gather`` / ``reduce_scatter`` by exchange between the threads) installed as vLLM's DCP
group. Each rank has vLLM's ``Attention`` layer on this backend (one KV head: vLLM's DCP for
GQA needs tp > the model's KV heads), its own metadata builder on a real
``CommonAttentionMetadata`` (global ``seq_lens``, its own block table), its shard of the FP8 cache
laid out as vLLM's ``cp_kv_cache_interleave_size`` says, and its query heads; the new tokens'
K/V are every rank's. Each rank's output must equal float64 attention of its heads over the
whole sequence, attention sinks on: for a batch of causal and bidirectional requests, context from
the FP8 cache and new tokens from the 16-bit K/V (as vLLM's FLASH_ATTN attends them); for a
bidirectional batch, attended in one call, every key from the FP8 cache (as without DCP). Every
slot of the shards that no token was written to holds NaN; pages of vLLM's default 16 and 64
slots.
"""

import threading

import pytest
import torch
from helpers import TOLERANCE, VLLM_BLOCK_SIZES

pytest.importorskip("vllm", reason="vLLM is not installed")

import vllm.distributed.parallel_state as parallel_state  # noqa: E402
from helpers.vllm import (  # noqa: E402
    count_batch_plans,
    cpu_vllm_config,
    drafter_config,
    nan_filled,
)
from vllm.config import (  # noqa: E402
    CacheConfig,
    ParallelConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.attention.attention import Attention  # noqa: E402
from vllm.utils.torch_utils import set_default_torch_dtype  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from fp8_noncausal_attn import vllm_backend  # noqa: E402
from fp8_noncausal_attn.scales import quantize_per_token_head  # noqa: E402
from fp8_noncausal_attn.synthetic import relative_error  # noqa: E402
from fp8_noncausal_attn.vllm_backend import Fp8NoncausalMetadataBuilder  # noqa: E402

HEAD_SIZE = 64
LAYER_NAME = "drafter.layers.0.self_attn.attn"

RANKS = 2
HEADS = 4  # query heads per rank; the group's 8 share the rank's one KV head
# A draft block, a decode, a fresh prefill (no context: empty shards everywhere), a short one.
Q_LENS, CONTEXT = [8, 1, 5, 3], [40, 33, 0, 3]
CAUSAL = [False, True, True, False]
# The batches: per-request flags (the shard's context, then the new tokens: two calls), and
# vLLM's ``causal=False`` of a bidirectional drafter (the whole shard: one call).
BATCHES = {"mixed": CAUSAL, "bidirectional": [False] * len(CAUSAL)}
SINKS = [30.0, -40.0, 1.0, 4.0, -2.0, 0.0, 8.0, -60.0]  # one per query head of the group


def test_the_backend_declares_dcp_and_the_lse_for_decode():
    """vLLM's selector accepts DCP for the drafter configuration; the impl says it returns the
    natural-log LSE (vLLM's DCP combine reads lse_base_on_e)."""
    from fp8_noncausal_attn.vllm_backend import (
        Fp8NoncausalAttentionBackend,
        Fp8NoncausalAttentionImpl,
    )

    assert Fp8NoncausalAttentionBackend.validate_configuration(**drafter_config(use_dcp=True)) == []
    assert Fp8NoncausalAttentionBackend.supports_dcp()
    impl = Fp8NoncausalAttentionImpl
    assert impl.can_return_lse_for_decode and impl.lse_base_on_e
    assert impl.supports_mtp_with_cp_non_trivial_interleave_size


class ThreadGroup:
    """vLLM's DCP ``GroupCoordinator`` for ranks that are threads of one process."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._local = threading.local()
        self._barrier = threading.Barrier(world_size)
        self._slots = [None] * world_size

    @property
    def rank_in_group(self) -> int:
        return self._local.rank

    def set_rank(self, rank: int) -> None:
        self._local.rank = rank

    def _exchange(self, tensor):
        self._slots[self.rank_in_group] = tensor
        self._barrier.wait()
        tensors = list(self._slots)
        self._barrier.wait()
        return tensors

    def all_gather(self, tensor, dim=-1):
        return torch.cat(self._exchange(tensor), dim=dim)

    def reduce_scatter(self, tensor, dim=-1):
        total = sum(part.float() for part in self._exchange(tensor)).to(tensor.dtype)
        return total.chunk(self.world_size, dim=dim)[self.rank_in_group].contiguous()


def owner(position: int, interleave: int) -> tuple[int, int]:
    """(rank, local index) of a sequence position under vLLM's interleaved DCP layout."""
    rank = (position // interleave) % RANKS
    local = (position // (interleave * RANKS)) * interleave + position % interleave
    return rank, local


@pytest.mark.parametrize("block_size", VLLM_BLOCK_SIZES, ids=lambda size: f"block{size}")
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(
    "interleave,kv_cache_dtype", [(1, "fp8"), (16, "fp8"), (16, "int8_per_token_head")]
)
def test_dcp_ranks_match_float64_attention(
    monkeypatch, interleave, kv_cache_dtype, batch, block_size
):
    group = ThreadGroup(RANKS)
    monkeypatch.setattr(parallel_state, "_DCP", group)
    gen = torch.Generator().manual_seed(21)
    seq_lens = [c + q for c, q in zip(CONTEXT, Q_LENS, strict=True)]
    keys = [torch.randn(n, 1, HEAD_SIZE, generator=gen).to(torch.bfloat16) for n in seq_lens]
    values = [torch.randn(n, 1, HEAD_SIZE, generator=gen).to(torch.bfloat16) for n in seq_lens]
    tokens = sum(Q_LENS)
    query = torch.randn(tokens, RANKS * HEADS, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    # This TP rank's KV head: the model's second, whose scale differs 30x from the first's.
    model_k_scale, model_v_scale = torch.tensor([0.001, 0.03]), torch.tensor([0.002, 0.05])
    k_scale, v_scale = model_k_scale[1:], model_v_scale[1:]
    starts = torch.tensor([0, *torch.cumsum(torch.tensor(Q_LENS), 0).tolist()], dtype=torch.int32)
    new_k = torch.cat([k[c:] for k, c in zip(keys, CONTEXT, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(values, CONTEXT, strict=True)])

    plans = count_batch_plans(monkeypatch)
    ranks = []
    for rank in range(RANKS):
        group.set_rank(rank)
        config = cpu_vllm_config(
            cache_config=CacheConfig(block_size=block_size),
            parallel_config=ParallelConfig(cp_kv_cache_interleave_size=interleave),
        )
        layer = make_layer(
            config,
            torch.tensor(SINKS[rank * HEADS : (rank + 1) * HEADS]),
            kv_cache_dtype=kv_cache_dtype,
        )
        layer.register_buffer("_k_scale", k_scale.clone())
        layer.register_buffer("_v_scale", v_scale.clone())
        with set_default_torch_dtype(torch.bfloat16):
            spec = layer.attn_backend.customize_spec(layer.get_kv_cache_spec(config))
            builder = Fp8NoncausalMetadataBuilder(spec, [LAYER_NAME], config, "cpu")
        assert builder.dcp is not None and builder.dcp.world_size == RANKS
        # This rank's shard: local pages in order, the context written through the impl.
        # A per-token-head page holds each token's scale after its K and after its V.
        content = spec.state_content_bytes or 2 * HEAD_SIZE
        kv_cache = nan_filled((32, 1, block_size, content), spec.dtype)
        table = torch.zeros(len(Q_LENS), 8, dtype=torch.int32)
        page = 0
        slots_of = []
        for s, n in enumerate(seq_lens):
            local = [owner(j, interleave) for j in range(n)]
            count = sum(1 for r, _ in local if r == rank)
            for p in range(-(-count // block_size)):
                table[s, p] = page
                page += 1
            slots_of.append([
                int(table[s, i // block_size]) * block_size + i % block_size if r == rank else -1
                for r, i in local
            ])  # fmt: skip
        context_rows = [(s, j) for s, c in enumerate(CONTEXT) for j in range(c)]
        context_slots = torch.tensor([slots_of[s][j] for s, j in context_rows], dtype=torch.long)
        context_k = torch.stack([keys[s][j] for s, j in context_rows])
        context_v = torch.stack([values[s][j] for s, j in context_rows])
        layer.impl.do_kv_cache_update(layer, context_k, context_v, kv_cache, context_slots)
        new_slots = torch.tensor(
            [slots_of[s][c + i] for s, (c, q) in enumerate(zip(CONTEXT, Q_LENS, strict=True))
             for i in range(q)], dtype=torch.long,
        )  # fmt: skip
        common = CommonAttentionMetadata(
            query_start_loc=starts.clone(), query_start_loc_cpu=starts.clone(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(Q_LENS),
            num_actual_tokens=tokens, max_query_len=max(Q_LENS), max_seq_len=max(seq_lens),
            block_table_tensor=table, slot_mapping=new_slots,
            causal=torch.tensor(CAUSAL, dtype=torch.int32) if batch == "mixed" else False,
        )  # fmt: skip
        layer.impl.do_kv_cache_update(layer, new_k, new_v, kv_cache, new_slots)
        meta = builder.build(0, common)
        assert (meta.dcp.new_tokens is None) == (batch == "bidirectional")
        ranks.append((layer, meta, kv_cache))

    outputs = [None] * RANKS
    errors = []

    def run(rank):
        try:
            group.set_rank(rank)
            layer, meta, kv_cache = ranks[rank]
            out = torch.full((tokens, HEADS, HEAD_SIZE), float("nan"), dtype=torch.bfloat16)
            q = query[:, rank * HEADS : (rank + 1) * HEADS].contiguous()
            layer.impl.forward(layer, q, new_k, new_v, kv_cache, meta, out)
            outputs[rank] = out
        except Exception as error:  # surfaced below: a thread's failure must fail the test
            errors.append(error)
            group._barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    # Each rank's builder planned the shard's call and, for a mixed batch, the new tokens' call,
    # for the LSE they return and the layer's scales; forward planned nothing more.
    calls = 1 if batch == "bidirectional" else 2
    assert len(plans) == RANKS * calls
    scale_mode = "per_token_head" if kv_cache_dtype == "int8_per_token_head" else "per_head"
    assert all(plan.return_lse for plan in plans)
    assert {plan.scale_mode for plan in plans[::calls]} == {scale_mode}

    if kv_cache_dtype == "int8_per_token_head":  # scales per token and head, from the write
        k_scale = v_scale = None
    exact = float64_attention(query, keys, values, k_scale, v_scale, batch)
    for rank in range(RANKS):
        heads = slice(rank * HEADS, (rank + 1) * HEADS)
        for h in range(HEADS):  # per head: the +30 sink shrinks head 0 by ~e^-20
            error = relative_error(outputs[rank][:, h], exact[:, heads][:, h])
            assert error <= TOLERANCE[torch.bfloat16], (rank, h, error)
    # Negative control: the other KV head's scales (a misaligned slice) give a wrong answer.
    wrong = float64_attention(query, keys, values, model_k_scale[:1], model_v_scale[:1], batch)
    if k_scale is None:  # or scales dropped (all ones) instead of each token's
        wrong = float64_attention(query, keys, values, None, None, batch, dropped=True)
    assert relative_error(wrong, exact) > 0.1


def make_layer(config, sinks=None, num_kv_heads=1, kv_cache_dtype="fp8", **kwargs):
    """vLLM's Attention layer on this backend, as vLLM's model loader builds it: this rank's
    query heads, one KV head, an FP8 cache (or ``kv_cache_dtype``), the sinks of its heads."""
    vllm_backend.register()
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        return Attention(
            HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, num_kv_heads=num_kv_heads,
            cache_config=CacheConfig(cache_dtype=kv_cache_dtype), prefix=LAYER_NAME, sinks=sinks,
            attn_backend=AttentionBackendEnum["FP8_NONCAUSAL"].get_class(), **kwargs,
        )  # fmt: skip


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"per_layer_sliding_window": 6}, NotImplementedError, "sliding windows under decode"),
        ({"num_kv_heads": 2}, ValueError, "one KV head per rank, got 2"),
    ],
)
@pytest.mark.parametrize("block_size", VLLM_BLOCK_SIZES, ids=lambda size: f"block{size}")
def test_what_dcp_cannot_run_is_refused_by_the_builder(
    monkeypatch, kwargs, error, match, block_size
):
    group = ThreadGroup(RANKS)
    group.set_rank(0)
    monkeypatch.setattr(parallel_state, "_DCP", group)
    config = cpu_vllm_config(cache_config=CacheConfig(block_size=block_size))
    layer = make_layer(config, **kwargs)
    with set_default_torch_dtype(torch.bfloat16), pytest.raises(error, match=match):
        spec = layer.get_kv_cache_spec(config)
        Fp8NoncausalMetadataBuilder(spec, [LAYER_NAME], config, "cpu")


@pytest.mark.parametrize("block_size", VLLM_BLOCK_SIZES, ids=lambda size: f"block{size}")
@pytest.mark.parametrize("micro_batching", [{"enable_dbo": True}, {"ubatch_size": 2}])
def test_dcp_with_micro_batches_is_refused_by_the_builder(monkeypatch, micro_batching, block_size):
    """vLLM's micro-batch metadata (split_attn_metadata) drops the per-request causal flags, so
    a bidirectional request would run causal: refused, as vLLM's V2 runner refuses it."""
    group = ThreadGroup(RANKS)
    group.set_rank(0)
    monkeypatch.setattr(parallel_state, "_DCP", group)
    config = cpu_vllm_config(
        cache_config=CacheConfig(block_size=block_size),
        # vLLM micro-batches only with an expert-parallel all2all backend.
        parallel_config=ParallelConfig(all2all_backend="deepep_low_latency", **micro_batching),
    )
    if not config.parallel_config.use_ubatching:
        pytest.skip("vLLM's platform here turns micro-batching off (its CPU platform does)")
    layer = make_layer(config)
    with set_default_torch_dtype(torch.bfloat16):
        spec = layer.get_kv_cache_spec(config)
        with pytest.raises(NotImplementedError, match="dual batch overlap with context"):
            Fp8NoncausalMetadataBuilder(spec, [LAYER_NAME], config, "cpu")
        group.world_size = 1  # without DCP, micro-batches are vLLM's own business
        assert Fp8NoncausalMetadataBuilder(spec, [LAYER_NAME], config, "cpu").dcp is None


def real_rows(rows, scale, context, dropped=False):
    """[n, 1, d] rows as attention reads them, float64 [n, d]: the first ``context`` from the FP8
    cache (rounded by the scale, times it; ``scale`` None: an int8 per-token-head cache, each
    row's own scale, ``dropped``: not applied), the rest as given."""
    if scale is None:
        stored, row_scale = quantize_per_token_head(rows[:context], torch.int8)
        cached = stored.double() * (1.0 if dropped else row_scale.double()[..., None])
    else:
        cached = (rows[:context].float() / scale).to(torch.float8_e4m3fn).double() * scale.double()
    return torch.cat([cached, rows[context:].double()])[:, 0]


def float64_attention(query, keys, values, k_scale, v_scale, batch, dropped=False):
    """Every head of the group over each whole sequence in float64, masked as ``BATCHES[batch]``
    says: context keys as the cache holds them (:func:`real_rows`), new tokens' keys as given
    (16-bit) in the mixed batch, as the cache holds them in the bidirectional one."""
    out, start = [], 0
    for c, q_len, causal, k, v in zip(CONTEXT, Q_LENS, BATCHES[batch], keys, values, strict=True):
        cached = c if batch == "mixed" else c + q_len
        kr, vr = real_rows(k, k_scale, cached, dropped), real_rows(v, v_scale, cached, dropped)
        q = query[start : start + q_len].double()
        start += q_len
        scores = torch.einsum("ihd,jd->hij", q, kr) * HEAD_SIZE**-0.5
        if causal:
            position = (c + torch.arange(q_len))[:, None]
            scores = scores.masked_fill(torch.arange(c + q_len)[None, :] > position, -torch.inf)
        sink = torch.tensor(SINKS, dtype=torch.float64)[:, None, None]
        shift = torch.maximum(scores.amax(-1, keepdim=True), sink)
        weights = (scores - shift).exp()
        probs = weights / (weights.sum(-1, keepdim=True) + (sink - shift).exp())
        out.append(torch.einsum("hij,jd->ihd", probs, vr))
    return torch.cat(out)
