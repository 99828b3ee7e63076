"""Log-sum-exp cases and key shards (decode context parallelism, cascades) shared by the LSE and
merge tests and the kernel emulations."""

import math

import torch

from fp8_noncausal_attn import registry
from fp8_noncausal_attn.problem import AttentionProblem, Batch
from fp8_noncausal_attn.scales import normalize_scale
from fp8_noncausal_attn.synthetic import make_case, relative_error

from . import DEVICE, TOLERANCE

# Absolute LSE error against float64: fp32 scores of LSEs up to ~40 (the reference, Triton's
# fp32 interpreter dots); the GPU kernels round P to 16 bits and use ex2.approx, but their LSE
# comes from fp32 row maxima and sums.
LSE_TOLERANCE = {"cpu": 1e-4, "cuda": 2e-3}[DEVICE]


def lse_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| over the rows where want is finite; inf when the -inf rows (empty
    states) differ or a finite row is not finite."""
    got, want = got.double().cpu(), want.double().cpu()
    empty = want == -math.inf
    if not torch.equal(got[empty], want[empty]) or not torch.isfinite(got[~empty]).all():
        return math.inf
    return float((got[~empty] - want[~empty]).abs().max()) if (~empty).any() else 0.0


def check_state(out, lse, exact_out, exact_lse, dtype):
    assert relative_error(exact_out, out) < TOLERANCE[dtype]
    assert lse.dtype == torch.float32 and lse.shape == exact_out.shape[:2]
    assert lse_error(lse, exact_lse) < LSE_TOLERANCE


# Key counts of lse_case's two sequences (3 and 4 query rows): 300 keys are three of the
# interpreter's key tiles. Sharded, dcp3_interleave16 and dcp4_interleave8 leave the first
# sequence with no key on their last rank, and with fewer keys than query rows on another.
KV_LENS = [21, 300]


def lse_case(cache_dtype, query_dtype, causal, seed=3):
    return make_case(
        [3, 4], KV_LENS, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
        cache_dtype=cache_dtype, query_dtype=query_dtype, causal=causal, padded_rows=2,
        device=DEVICE, seed=seed,
    )  # fmt: skip


def interleaved_shards(kv_len: int, ranks: int, interleave: int) -> list[list[int]]:
    """The keys each decode-context-parallel rank holds: position j lives on rank
    (j // interleave) % ranks (vLLM's cp_kv_cache_interleave_size layout)."""
    return [[j for j in range(kv_len) if (j // interleave) % ranks == r] for r in range(ranks)]


def shard_problem(case, shard_keys, causal=False, sinks=None):
    """An AttentionProblem over the keys ``shard_keys[seq]`` (positions of sequence seq) only:
    their K/V bytes copied into a fresh paged cache, in that order. Built without validation so
    that a shard may hold fewer keys than the sequence has query rows, or none (the kernels'
    empty state); the public API refuses such a call (SPEC §3)."""
    block_size = case.key_cache.shape[1]
    lengths = [len(keys) for keys in shard_keys]
    pages = [-(-n // block_size) for n in lengths]
    width = max(max(pages), 1)
    num_blocks = sum(pages) + 1
    key_cache = torch.zeros((num_blocks, *case.key_cache.shape[1:]), dtype=case.key_cache.dtype)
    value_cache = torch.zeros_like(key_cache)
    block_table = torch.zeros((len(lengths), width), dtype=torch.int32)
    as_bytes = torch.uint8 if key_cache.element_size() == 1 else torch.int16
    old_caches = (case.key_cache.cpu().view(as_bytes), case.value_cache.cpu().view(as_bytes))
    old_table = case.block_table.cpu()
    page = 0
    for seq, keys in enumerate(shard_keys):
        for slot, j in enumerate(keys):
            if slot % block_size == 0:
                block_table[seq, slot // block_size] = page
                page += 1
            src = old_table[seq, j // block_size].item(), j % block_size
            dst = block_table[seq, slot // block_size].item(), slot % block_size
            for new, old in zip((key_cache, value_cache), old_caches, strict=True):
                new.view(as_bytes)[dst] = old[src]
    device = case.query.device
    num_tokens, num_q_heads, head_dim = case.query.shape
    num_kv_heads = key_cache.shape[2]
    batch = Batch(
        block_table=block_table.to(device), cu_seqlens_q=case.cu_seqlens_q,
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device), causal=causal,
        causal_per_seq=None, softmax_scale=head_dim**-0.5, max_seqlen_q=max(case.q_lens),
        max_seqlen_k=max(max(lengths), 1), window=(-1, -1), num_tokens=num_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, query_dtype=case.query.dtype, cache_dtype=key_cache.dtype,
        device=device,
    )  # fmt: skip
    return AttentionProblem(
        batch, case.query, key_cache.to(device), value_cache.to(device),
        normalize_scale(case.k_scale, "k_scale", num_kv_heads, device, False),
        normalize_scale(case.v_scale, "v_scale", num_kv_heads, device, False), sinks,
    )  # fmt: skip


def run_backend(name, problem):
    """(out, lse) of ``problem`` on backend ``name``, both pre-filled with NaN."""
    out = torch.full_like(problem.query, math.nan)
    lse = torch.full(problem.query.shape[:2], math.nan, device=problem.query.device)
    chain, _ = registry.plan_batch(name, problem.batch)
    registry.run(chain, problem, out, lse)
    return out, lse


def shard_layouts(kv_lens):
    """name -> per-shard list of each sequence's keys (disjoint, covering every key)."""
    layouts = {}
    # Uneven contiguous shards, one of them empty for the second sequence.
    cuts = [(0, 5, 5, kv_lens[0]), (0, 31, kv_lens[1], kv_lens[1])]
    layouts["uneven_with_empty"] = [[list(range(c[k], c[k + 1])) for c in cuts] for k in range(3)]
    for ranks, interleave in ((2, 1), (3, 16), (4, 8)):
        per_seq = [interleaved_shards(kv, ranks, interleave) for kv in kv_lens]
        layouts[f"dcp{ranks}_interleave{interleave}"] = [
            [per_seq[s][r] for s in range(len(kv_lens))] for r in range(ranks)
        ]
    return layouts


LAYOUTS = shard_layouts(KV_LENS)
