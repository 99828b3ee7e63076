"""Lane-level CPU emulation of the CUDA attention kernel's data movement (csrc/attention.cuh).

CI has no GPU, so the kernel's index maps are replayed here in float64, one lane at a time:
the paged cp.async tile copies (16-byte units, XOR-swizzled K rows, padded V rows, zero-filled
keys past the range), the Q fragments in shared memory, the permuted k-dimension of S = Q K^T,
the byte/half permutes feeding O = P V, the output dims each lane stores, the causal masks, the
key groups of warps the rows leave idle and their merge, the split-KV ranges and the log-sum-exp
merge. The mma.sync m16n8k16 fragment layouts are the PTX
ISA's. A wrong index anywhere gives a visibly wrong answer against the reference backend.
Keep this in step with attention.cuh and merge.cu when they change.
"""

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import TOLERANCE

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

BLOCK_M, THREADS = 64, 128  # params.h kBlockM, 4 warps


@dataclass(frozen=True)
class Config:
    """AttnConfig of attention.cuh."""

    head_dim: int
    elt: int  # bytes per cache element

    @property
    def block_n(self):
        return 32 if self.head_dim == 256 else 64

    @property
    def units(self):
        return self.head_dim * self.elt // 16

    @property
    def e(self):
        return 16 // self.elt

    @property
    def steps_per_unit(self):
        return self.e // 4

    @property
    def groups(self):
        return self.head_dim // (4 * self.e)

    @property
    def epw(self):
        return 4 // self.elt

    @property
    def k_row(self):
        return self.head_dim * self.elt

    @property
    def v_row(self):
        return self.head_dim * self.elt + 16

    def swizzle(self, row):
        return (row & 1) << 2 if self.units >= 8 else 0


def raw_bytes(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """The tensor's whole storage as uint8, and the byte offset of element [0, ...]."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage.numpy(), t.storage_offset() * t.element_size()


def decode(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Little-endian uint8 array of ``dtype`` elements -> float64."""
    return torch.from_numpy(np.ascontiguousarray(words)).view(dtype).double().numpy()


def pair(word: int, dtype: torch.dtype) -> tuple[float, float]:
    """A register holding two values (two FP8 bytes in its low 16 bits, or two halves)."""
    nbytes = 2 if dtype.itemsize == 1 else 4
    raw = bytearray(int(word).to_bytes(4, "little")[:nbytes])
    lo, hi = decode(np.frombuffer(raw, np.uint8), dtype)
    return float(lo), float(hi)


def prmt(a: int, b: int, sel: int) -> int:
    src = int(a).to_bytes(4, "little") + int(b).to_bytes(4, "little")
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def mma(acc, a, b0, b1):
    """mma.sync m16n8k16 row.col: acc[lane][4] += A (a[lane][4 regs] pairs) x B (b0/b1 pairs)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        A[g, 2 * t : 2 * t + 2] = a[lane][0]
        A[g + 8, 2 * t : 2 * t + 2] = a[lane][1]
        A[g, 2 * t + 8 : 2 * t + 10] = a[lane][2]
        A[g + 8, 2 * t + 8 : 2 * t + 10] = a[lane][3]
        B[2 * t : 2 * t + 2, g] = b0[lane]
        B[2 * t + 8 : 2 * t + 10, g] = b1[lane]
    C = A @ B
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        acc[lane] += [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]


def run_cta(pb, cfg, m_tile, kvh, seq, split, num_splits, out, ws_o, ws_lse):
    """paged_attention_kernel for one CTA; pb holds the problem's arrays."""
    d, group, bn = cfg.head_dim, pb["group"], cfg.block_n
    q_start, q_len = pb["cu"][seq], pb["cu"][seq + 1] - pb["cu"][seq]
    rows, row0 = q_len * group, m_tile * BLOCK_M
    if row0 >= rows:
        return
    kv_len, causal = pb["seq_lens"][seq], pb["causal"][seq]
    pos0 = kv_len - q_len
    last_row = min(row0 + BLOCK_M, rows) - 1
    n_keys = pos0 + last_row // group + 1 if causal else kv_len
    min_limit = pos0 + row0 // group if causal else kv_len - 1
    n_tiles = -(-n_keys // bn)
    per_split = -(-n_tiles // num_splits)
    t_begin, t_end = split * per_split, min(n_tiles, split * per_split + per_split)
    # Key groups: warp -> (row warp wm, key group ng, its n-tiles).
    row_warps = -(-min(BLOCK_M, rows - row0) // 16)
    n_groups = {1: min(4, bn // 16), 2: 2}.get(row_warps, 1)
    m_span = 4 // n_groups
    wm = [warp % m_span for warp in range(4)]
    ng = [warp // m_span for warp in range(4)]
    n_per = bn // 8 // n_groups
    jr = [range(ng[w] * n_per, ng[w] * n_per + n_per) for w in range(4)]

    def active(warp):
        return row0 + 16 * wm[warp] < rows

    def row_of(warp, g, h):
        return min(row0 + 16 * wm[warp] + g + 8 * h, rows - 1)

    def row_ok(warp, g, h):
        return row0 + 16 * wm[warp] + g + 8 * h < rows

    def limit(warp, g, h):
        return pos0 + row_of(warp, g, h) // group if causal else kv_len - 1

    # Q fragments: per (warp, k-step, lane) four registers of two values each.
    qf = np.zeros((4, d // 16, 32, 4, 2))
    for warp in range(4):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for h in range(2):
                tok = q_start + row_of(warp, g, h) // group
                head = kvh * group + row_of(warp, g, h) % group
                for c in range(cfg.groups):
                    for kk in range(cfg.steps_per_unit):
                        dim = c * 4 * cfg.e + cfg.e * t + 4 * kk
                        v = pb["q"][tok, head, dim : dim + 4] if row_ok(warp, g, h) else 0.0
                        ks = c * cfg.steps_per_unit + kk
                        qf[warp, ks, lane, h] = v[:2] if row_ok(warp, g, h) else 0.0
                        qf[warp, ks, lane, 2 + h] = v[2:] if row_ok(warp, g, h) else 0.0

    k_smem = np.zeros(bn * cfg.k_row, np.uint8)
    v_smem = np.zeros(bn * cfg.v_row, np.uint8)

    def load_tile(tile):
        for idx in range(bn * cfg.units):
            r, u = idx // cfg.units, idx % cfg.units
            key = tile * bn + r
            kdst = r * cfg.k_row + (u ^ cfg.swizzle(r)) * 16
            vdst = r * cfg.v_row + u * 16
            if key < n_keys:
                page = pb["block_table"][seq, key // pb["block_size"]]
                off = key % pb["block_size"]
                for smem, dst, (data, base), st in (
                    (k_smem, kdst, pb["k_raw"], pb["k_strides"]),
                    (v_smem, vdst, pb["v_raw"], pb["v_strides"]),
                ):
                    src = base + (page * st[0] + off * st[1] + kvh * st[2]) * cfg.elt + u * 16
                    smem[dst : dst + 16] = data[src : src + 16]
            else:
                k_smem[kdst : kdst + 16] = 0
                v_smem[vdst : vdst + 16] = 0

    def word(smem, addr):
        return int(smem[addr : addr + 4].view(np.uint32)[0])

    kv_dtype = pb["kv_dtype"]
    scale_log2 = pb["softmax_scale"] * pb["k_scale"][kvh] * 1.4426950408889634
    o = np.zeros((4, 32, d // 8, 4))
    m_i = np.full((4, 32, 2), -math.inf)
    l_i = np.zeros((4, 32, 2))
    for tile in range(t_begin, t_end):
        load_tile(tile)
        for warp in range(4):
            if not active(warp):
                continue
            s = np.zeros((32, bn // 8, 4))
            for c in range(cfg.groups):
                for j in jr[warp]:
                    kw = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        r = 8 * j + g
                        addr = r * cfg.k_row + ((4 * c + t) ^ cfg.swizzle(r)) * 16
                        kw.append([word(k_smem, addr + 4 * i) for i in range(4)])
                    for kk in range(cfg.steps_per_unit):
                        if cfg.elt == 1:
                            b0 = [pair(w[kk] & 0xFFFF, kv_dtype) for w in kw]
                            b1 = [pair(w[kk] >> 16, kv_dtype) for w in kw]
                        else:
                            b0 = [pair(w[2 * kk], kv_dtype) for w in kw]
                            b1 = [pair(w[2 * kk + 1], kv_dtype) for w in kw]
                        acc = s[:, j]
                        mma(acc, qf[warp, c * cfg.steps_per_unit + kk], b0, b1)
            n0 = tile * bn
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if n0 + bn - 1 > min_limit:
                    for j in jr[warp]:
                        for e in range(4):
                            if n0 + 8 * j + 2 * t + (e & 1) > limit(warp, g, e >> 1):
                                s[lane, j, e] = -math.inf
            for h in range(2):
                cols = s[:, jr[warp].start : jr[warp].stop, 2 * h : 2 * h + 2]
                for quad in range(8):
                    lanes = slice(4 * quad, 4 * quad + 4)
                    m_new = max(m_i[warp, 4 * quad, h], cols[lanes].max())
                    m_scaled = 0.0 if m_new == -math.inf else m_new * scale_log2
                    alpha = 2.0 ** (m_i[warp, 4 * quad, h] * scale_log2 - m_scaled)
                    m_i[warp, lanes, h] = m_new
                    cols[lanes] = np.exp2(cols[lanes] * scale_log2 - m_scaled)
                    l_i[warp, lanes, h] = l_i[warp, lanes, h] * alpha + cols[lanes].sum((1, 2))
                    o[warp, lanes, :, 2 * h : 2 * h + 2] *= alpha
            for kk in range(jr[warp].start // 2, jr[warp].stop // 2):
                a = [
                    [s[ln, 2 * kk, 0:2], s[ln, 2 * kk, 2:4], s[ln, 2 * kk + 1, 0:2],
                     s[ln, 2 * kk + 1, 2:4]]
                    for ln in range(32)
                ]  # fmt: skip
                for J in range(d // (8 * cfg.epw)):
                    ws = []
                    for lane in range(32):
                        g, t = lane >> 2, lane & 3
                        base = (16 * kk + 2 * t) * cfg.v_row + (8 * J + g) * 4
                        ws.append([word(v_smem, base + dr * cfg.v_row) for dr in (0, 1, 8, 9)])
                    if cfg.elt == 1:
                        for i in (0, 2):
                            sel = i | ((4 + i) << 4) | ((i + 1) << 8) | ((5 + i) << 12)
                            x01 = [prmt(w[0], w[1], sel) for w in ws]
                            x23 = [prmt(w[2], w[3], sel) for w in ws]
                            for n, shift in ((4 * J + i, 0), (4 * J + i + 1, 16)):
                                b0 = [pair((x >> shift) & 0xFFFF, kv_dtype) for x in x01]
                                b1 = [pair((x >> shift) & 0xFFFF, kv_dtype) for x in x23]
                                mma(o[warp, :, n], a, b0, b1)
                    else:
                        for n, sel in ((2 * J, 0x5410), (2 * J + 1, 0x7632)):
                            b0 = [pair(prmt(w[0], w[1], sel), kv_dtype) for w in ws]
                            b1 = [pair(prmt(w[2], w[3], sel), kv_dtype) for w in ws]
                            mma(o[warp, :, n], a, b0, b1)
    l_row = np.stack(
        [l_i[:, 4 * (lane >> 2) : 4 * (lane >> 2) + 4].sum(1) for lane in range(32)], 1
    )
    if n_groups > 1:
        # Merge the key groups of each row warp into group 0 at the joint max.
        for w0 in range(m_span):
            members = [w0 + gg * m_span for gg in range(n_groups)]
            m_tot = m_i[members].max(0)
            m_scaled = np.where(m_tot == -math.inf, 0.0, m_tot * scale_log2)
            f = np.exp2(m_i[members] * scale_log2 - m_scaled)
            o[w0] = sum(
                o[w] * np.repeat(f[k], 2, axis=1)[:, None, :] for k, w in enumerate(members)
            )
            l_row[w0] = (l_row[members] * f).sum(0)
            m_i[w0] = m_tot
    for warp in range(4):
        if not active(warp) or ng[warp] > 0:
            continue
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for h in range(2):
                total = l_row[warp, lane, h]
                if not row_ok(warp, g, h):
                    continue
                tok = q_start + row_of(warp, g, h) // group
                head = kvh * group + row_of(warp, g, h) % group
                inv = pb["v_scale"][kvh] / total if total > 0 else 0.0
                for J in range(d // (8 * cfg.epw)):
                    dim = 8 * cfg.epw * J + 2 * cfg.epw * t
                    vals = [o[warp, lane, cfg.epw * J + i, 2 * h] for i in range(cfg.epw)]
                    vals += [o[warp, lane, cfg.epw * J + i, 2 * h + 1] for i in range(cfg.epw)]
                    target = out if num_splits == 1 else ws_o[split]
                    target[tok, head, dim : dim + 2 * cfg.epw] = np.array(vals) * inv
                if num_splits > 1 and t == 0:
                    lse = (
                        m_i[warp, lane, h] * scale_log2 + math.log2(total)
                        if total > 0
                        else -math.inf
                    )
                    ws_lse[split, tok, head] = lse


def emulate(problem, num_splits):
    """The whole launch (attention kernel grid, then merge.cu when split) on the CPU."""
    cfg = Config(problem.head_dim, problem.key_cache.element_size())
    num_seqs = problem.num_seqs
    causal = (
        problem.causal_per_seq.tolist()
        if problem.causal_per_seq is not None
        else [problem.causal] * num_seqs
    )
    pb = {
        "group": problem.group_size,
        "cu": problem.cu_seqlens_q.tolist(),
        "seq_lens": problem.seq_lens.tolist(),
        "causal": causal,
        "q": problem.query.double().numpy(),
        "k_raw": raw_bytes(problem.key_cache),
        "v_raw": raw_bytes(problem.value_cache),
        "k_strides": problem.key_cache.stride()[:3],
        "v_strides": problem.value_cache.stride()[:3],
        "block_table": problem.block_table.numpy(),
        "block_size": problem.block_size,
        "kv_dtype": problem.key_cache.dtype,
        "softmax_scale": problem.softmax_scale,
        "k_scale": problem.k_scale.double().numpy(),
        "v_scale": problem.v_scale.double().numpy(),
    }
    shape = (problem.num_tokens, problem.num_q_heads, problem.head_dim)
    out = np.zeros(shape)
    ws_o = np.full((num_splits, *shape), np.nan)
    ws_lse = np.full((num_splits, *shape[:2]), np.nan)
    m_tiles = -(-problem.max_seqlen_q * problem.group_size // BLOCK_M)
    for z in range(num_seqs * num_splits):
        for kvh in range(problem.num_kv_heads):
            for m_tile in range(m_tiles):
                seq, split = z // num_splits, z % num_splits
                run_cta(pb, cfg, m_tile, kvh, seq, split, num_splits, out, ws_o, ws_lse)
    if num_splits > 1:
        lse = ws_lse[:, : pb["cu"][-1]]
        weights = np.exp2(lse - lse.max(0))
        merged = (weights[..., None] * ws_o[:, : pb["cu"][-1]]).sum(0)
        out[: pb["cu"][-1]] = merged / weights.sum(0)[..., None]
    return torch.from_numpy(out)


CASES = {
    # head_dim 64, FP8, GQA 4, mixed mask, rows past q_len, a partial last page
    "d64_e4m3_mixed": dict(
        q_lens=[3, 8], kv_lens=[70, 9], num_q_heads=8, num_kv_heads=2, head_dim=64,
        cache_dtype=torch.float8_e4m3fn, causal=[True, False], splits=1,
    ),
    # head_dim 128, e5m2 in vLLM's combined layout, MQA 6, split-KV with an empty split
    "d128_e5m2_vllm_split": dict(
        q_lens=[5, 1], kv_lens=[130, 40], num_q_heads=6, num_kv_heads=1, head_dim=128,
        cache_dtype=torch.float8_e5m2, causal=[True, True], layout="vllm", splits=3,
    ),
    # head_dim 128, bf16 cache, 40 and 64 rows (3 and 4 row warps: no key groups), causal
    "d128_bf16_rows": dict(
        q_lens=[16, 10], kv_lens=[40, 75], num_q_heads=8, num_kv_heads=2, head_dim=128,
        cache_dtype=torch.bfloat16, causal=True, block_size=32, splits=1,
    ),
    # head_dim 256, fp16 cache, page size 8, bidirectional block with q_len == kv_len, split
    "d256_fp16_split": dict(
        q_lens=[7, 0], kv_lens=[7, 3], num_q_heads=4, num_kv_heads=2, head_dim=256,
        cache_dtype=torch.float16, query_dtype=torch.float16, causal=False, block_size=8,
        splits=2,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernel_matches_reference(name):
    spec = dict(CASES[name])
    splits = spec.pop("splits")
    case = make_case(spec.pop("q_lens"), spec.pop("kv_lens"), seed=3, **spec)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    out = emulate(problem, splits).to(case.query.dtype)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    # Both are rounded to the query dtype once; an index error would be off by O(1).
    assert relative_error(out, ref) <= TOLERANCE[case.query.dtype]
