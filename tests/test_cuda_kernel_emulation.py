"""Lane-level CPU emulation of the mma.sync CUDA kernels, driven by the kernels' own index maps.

CI has no GPU, so the kernels' data movement is replayed here in float64, one lane at a time.
The index maps are not copied: the test extension ``fp8nca_host_hooks`` (helpers/host_hooks.py)
runs csrc/mma_sync/index_maps.h and csrc/common/index_tensors.h compiled for the CPU (the same
``__host__ __device__`` functions the kernels call), so a wrong map in the kernel source gives a
visibly wrong answer here: the paged cp.async tile copies (16-byte units, XOR-swizzled K rows,
padded V rows, zero-filled keys past the range), the once-per-CTA dequantisation of FP8 tiles
into 16-bit tiles, the Q fragments, the permuted k-dimension of S = Q K^T, the ldmatrix row
addresses feeding O = P V, the output dims each lane stores, the index tensors read through
their strides (int32 or bool causal flags included), each row's visible key range (causal or
bidirectional, sliding window), the key tiles a CTA's window touches and which of them need the
mask, the key groups of warps the rows leave idle and their merge, the split-KV ranges over the
windowed tiles, the attention sink in the unsplit epilogue and the log-sum-exp merge (which adds
the sink once), and per-token-head scales (their copy into each V row's pad, the K scale on the
score columns, the V scale on the dequantised values, int8 by byte moves). Only the mma.sync
m16n8k16 fragment layouts and ldmatrix (the PTX ISA's), the (exact) FP8 -> 16-bit conversion and
the fp32 products of the per-token-head scales are modelled in Python.
"""

import functools
import math

import numpy as np
import pytest
import torch
from helpers import TOLERANCE, host_hooks, replaced
from helpers.lse import LAYOUTS, lse_case, run_backend, shard_problem
from helpers.token_heads import token_head_problem

import fp8_noncausal_attn as fna
from fp8_noncausal_attn.backends.cuda import extension, mma_sync
from fp8_noncausal_attn.launch_record import MMA_SYNC, LaunchInputs, launch_values
from fp8_noncausal_attn.masking import visible_range
from fp8_noncausal_attn.synthetic import make_case, relative_error
from fp8_noncausal_attn.validation import validate_attention

# Replays kernels in numpy from their own index maps (scripts/test.sh --quick leaves it out).
pytestmark = pytest.mark.emulation

LOG2E = 1.4426950408889634


def host():
    """The kernels' maps compiled for the CPU (the test extension, built on first use)."""
    return host_hooks.load()


@functools.cache
def tables(head_dim: int, elt: int, block_m: int = 64) -> dict:
    return host().mma_sync_tables(head_dim, elt, block_m)


def raw_bytes(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """The tensor's whole storage as uint8, and the byte offset of element [0, ...]."""
    storage = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return storage.numpy(), t.storage_offset() * t.element_size()


def decode(words: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Little-endian uint8 array of ``dtype`` elements -> float64."""
    return torch.from_numpy(np.ascontiguousarray(words)).view(dtype).double().numpy()


def pair(word: int, dtype: torch.dtype) -> tuple[float, float]:
    """A register holding two 16-bit values of ``dtype``."""
    raw = bytearray(int(word).to_bytes(4, "little"))
    lo, hi = decode(np.frombuffer(raw, np.uint8), dtype)
    return float(lo), float(hi)


def ldmatrix_x4_trans(smem: np.ndarray, row_addresses: list[int], dtype: torch.dtype):
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 (PTX ISA): lane 8m + r gives the address
    of row r of 8x8 matrix m; register m of lane (g, t) receives elements (2t, g) and (2t + 1, g)
    of matrix m. Returns, per register, the 32 lanes' value pairs."""
    matrices = [
        [decode(smem[a : a + 16], dtype) for a in row_addresses[8 * m : 8 * m + 8]]
        for m in range(4)
    ]
    return [
        [(mat[2 * (ln & 3)][ln >> 2], mat[2 * (ln & 3) + 1][ln >> 2]) for ln in range(32)]
        for mat in matrices
    ]


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


def run_cta(pb, T, m_tile, kvh, seq, split, num_splits, out, ws_o, ws_lse, lse=None):
    """paged_attention_kernel for one CTA; pb holds the problem's arrays, T the kernel's maps
    for tiles as copied (the cache's format). Unsplit, ``lse`` (or None) is the LSE output of
    paged_attention_kernel_lse's epilogue. With per-token-head scales (``pb["token_scales"]``)
    it is paged_attention_kernel_pth: each key's scales copied with its tile into its V row's
    pad, the K scale on its score column, the V scale on its row of the dequantised tile."""
    hk = host()
    d, elt, group, bn = T["head_dim"], T["elt"], pb["group"], T["block_n"]
    C = tables(d, 2, T["block_m"])  # the 16-bit tiles the MMAs read
    warps = T["warps"]
    q_start, q_len, kv_len, causal = pb["seqs"][seq]
    rows, row0 = q_len * group, m_tile * T["block_m"]
    if row0 >= rows:
        return
    rows_in_tile = min(T["block_m"], rows - row0)
    left, right = pb["window"]
    keys = hk.cta_keys(left, right, causal, kv_len, q_len, row0, row0 + rows_in_tile - 1, group, bn)
    n_keys = keys[1]
    t_begin, t_end = hk.split_tiles(hk.cta_tiles(keys, bn), num_splits, split)
    # Key groups: warp -> (row warp wm, key group ng, its n-tiles).
    n_groups = hk.key_groups(d, elt, rows_in_tile, T["block_m"])
    m_span = warps // n_groups
    wm = [warp % m_span for warp in range(warps)]
    ng = [warp // m_span for warp in range(warps)]
    n_per = T["nt"] // n_groups
    jr = [range(ng[w] * n_per, ng[w] * n_per + n_per) for w in range(warps)]

    def active(warp):
        return row0 + 16 * wm[warp] < rows

    def row_of(warp, g, h):
        return min(row0 + 16 * wm[warp] + g + 8 * h, rows - 1)

    def row_ok(warp, g, h):
        return row0 + 16 * wm[warp] + g + 8 * h < rows

    row_keys = {
        (w, g, h): hk.row_keys(left, right, causal, kv_len, q_len, row_of(w, g, h), group)
        for w in range(warps)
        for g in range(8)
        for h in range(2)
    }

    # Q fragments: per (warp, k-step, lane) four registers of two values each. Where the kernel
    # dequantises K by bit moves its 16-bit K rows (and so the Q fragments) hold the dims of each
    # group of 4 in bf16_k_dim order.
    bit_k = elt == 1 and hk.bit_dequant_k(
        extension.DTYPE_CODES[pb["q_dtype"]], extension.DTYPE_CODES[pb["kv_dtype"]]
    )
    order = [hk.bf16_k_dim(p) for p in range(16)] if bit_k else list(range(16))

    def order_q(dim):
        return hk.bf16_k_dim(dim) if bit_k else dim

    qf = np.zeros((warps, d // 16, 32, 4, 2))
    for warp in range(warps):
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for h in range(2):
                if not row_ok(warp, g, h):
                    continue
                tok = q_start + row_of(warp, g, h) // group
                head = kvh * group + row_of(warp, g, h) % group
                for c in range(C["groups"]):
                    for kk in range(C["steps_per_unit"]):
                        dim = C["qk_dim"][c][kk][t]
                        v = pb["q"][tok, head, [order_q(dim + i) for i in range(4)]]
                        ks = c * C["steps_per_unit"] + kk
                        qf[warp, ks, lane, h] = v[:2]
                        qf[warp, ks, lane, 2 + h] = v[2:]

    k_smem = np.zeros(bn * T["k_row"], np.uint8)
    v_smem = np.zeros(bn * T["v_row"], np.uint8)
    token_scales = pb["token_scales"]

    block_shift = pb["block_size"].bit_length() - 1

    def load_tile(tile):
        n0 = tile * bn
        for r, u, kdst, vdst in T["copy"]:
            key = n0 + r
            if key < n_keys:
                # The kernel's page of the key: the tile's tile_page-th, at page_key in it.
                page_index = (n0 >> block_shift) + hk.tile_page(r, block_shift)
                page = pb["block_table"][seq, page_index]
                off = hk.page_key(n0, r, pb["block_size"])
                for smem, dst, (data, base), st in (
                    (k_smem, kdst, pb["k_raw"], pb["k_strides"]),
                    (v_smem, vdst, pb["v_raw"], pb["v_strides"]),
                ):
                    src = base + (page * st[0] + off * st[1] + kvh * st[2]) * elt + u * 16
                    smem[dst : dst + 16] = data[src : src + 16]
            else:
                k_smem[kdst : kdst + 16] = 0
                v_smem[vdst : vdst + 16] = 0
        if not token_scales:
            return
        # Thread r < block_n copies key row r's K and V scale (zeros past n_keys).
        for r, offsets in enumerate(T["scale"]):
            if n0 + r >= n_keys:
                for dst in offsets:
                    v_smem[dst : dst + 4] = 0
                continue
            page = pb["block_table"][seq, (n0 >> block_shift) + hk.tile_page(r, block_shift)]
            off = hk.page_key(n0, r, pb["block_size"])
            for dst, (data, base), st in zip(offsets, pb["scale_raw"], pb["scale_strides"],
                                             strict=True):  # fmt: skip
                src = base + (page * st[0] + off * st[1] + kvh * st[2]) * 4
                v_smem[dst : dst + 4] = data[src : src + 4]

    def word(smem, addr):
        return int(smem[addr : addr + 4].view(np.uint32)[0])

    # A 1-byte tile is dequantised once per CTA into a 16-bit tile: K to the query dtype, V to
    # fp16 (the P V operand dtype), or with per-token-head scales V times its key's scale in
    # fp32, rounded once to the query dtype; a 16-bit cache's tile is read as copied.
    kv_dtype = pb["kv_dtype"]
    fp8 = elt == 1
    k_dtype = pb["q_dtype"] if fp8 else kv_dtype
    v_dtype = pb["q_dtype"] if token_scales else torch.float16 if fp8 else kv_dtype
    k16 = np.zeros(bn * C["k_row"], np.uint8) if fp8 else k_smem
    v16 = np.zeros(bn * C["v_row"], np.uint8) if fp8 else v_smem

    def widen(src, src_off, dst, dst_offs, dtype, order=range(16), scale=None):
        values = decode(src[src_off : src_off + 16], kv_dtype)[list(order)]
        if scale is not None:  # an fp32 product (the cache values are exact in fp32)
            values = values.astype(np.float32) * scale
        wide = torch.from_numpy(values).to(dtype).view(torch.uint8).numpy()
        for half, off in enumerate(dst_offs):
            dst[off : off + 16] = wide[16 * half : 16 * half + 16]

    def scale_of(r, which):
        """Key row r's per-token-head scale (0: K, 1: V) where the tile copy put it."""
        at = T["scale"][r][which]
        return v_smem[at : at + 4].view(np.float32)[0]

    def dequantize_tile():
        for slot, (k8, v8, k0, k1, v0, v1) in enumerate(T["dequant"]):
            widen(k_smem, k8, k16, (k0, k1), k_dtype, order)
            v_scale = scale_of(T["copy"][slot][0], 1) if token_scales else None
            widen(v_smem, v8, v16, (v0, v1), v_dtype, scale=v_scale)

    # Per-token-head K scales multiply the score columns instead (in fp32, below).
    head_k_scale = 1.0 if token_scales else pb["k_scale"][kvh]
    scale_log2 = pb["softmax_scale"] * head_k_scale * 1.4426950408889634
    o = np.zeros((warps, 32, C["ot"], 4))
    m_i = np.full((warps, 32, 2), -math.inf)
    l_i = np.zeros((warps, 32, 2))
    for tile in range(t_begin, t_end):
        load_tile(tile)
        if fp8:
            dequantize_tile()
        for warp in range(warps):
            if not active(warp):
                continue
            s = np.zeros((32, C["nt"], 4))
            for c in range(C["groups"]):
                for j in jr[warp]:
                    kw = []
                    for lane in range(32):
                        addr = C["k_frag"][j][c][lane]
                        kw.append([word(k16, addr + 4 * i) for i in range(4)])
                    for kk in range(C["steps_per_unit"]):
                        b0 = [pair(w[2 * kk], k_dtype) for w in kw]
                        b1 = [pair(w[2 * kk + 1], k_dtype) for w in kw]
                        acc = s[:, j]
                        mma(acc, qf[warp, c * C["steps_per_unit"] + kk], b0, b1)
            if token_scales:
                # Lane (g, t)'s columns of n-tile j: keys 8j + 2t, + 1 (accumulators e & 1).
                for lane in range(32):
                    for j in jr[warp]:
                        for e in range(4):
                            key = 8 * j + 2 * (lane & 3) + (e & 1)
                            s[lane, j, e] = np.float32(s[lane, j, e]) * scale_of(key, 0)
            n0 = tile * bn
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                if hk.tile_needs_mask(keys, n0):
                    for j in jr[warp]:
                        for e in range(4):
                            key = n0 + 8 * j + 2 * t + (e & 1)
                            if not hk.key_visible(row_keys[warp, g, e >> 1], key):
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
            # The kernel's ldmatrix addresses: the lane's row address, the key group's first
            # k-step and each (k-step, n-tile pair) offset, added (pv_tile).
            kk0 = jr[warp].start // 2
            lane_addr = [kk0 * C["v_ldsm"][1][0][0] + C["v_ldsm"][0][0][ln] for ln in range(32)]
            for kk in range(kk0, jr[warp].stop // 2):
                a = [
                    [s[ln, 2 * kk, 0:2], s[ln, 2 * kk, 2:4], s[ln, 2 * kk + 1, 0:2],
                     s[ln, 2 * kk + 1, 2:4]]
                    for ln in range(32)
                ]  # fmt: skip
                for jp in range(C["ot"] // 2):
                    step = C["v_ldsm"][kk - kk0][jp][0]
                    b = ldmatrix_x4_trans(v16, [x + step for x in lane_addr], v_dtype)
                    mma(o[warp, :, 2 * jp], a, b[0], b[1])
                    mma(o[warp, :, 2 * jp + 1], a, b[2], b[3])
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
    for warp in range(warps):
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
                scale = 1.0 if token_scales else pb["v_scale"][kvh]
                m = m_i[warp, lane, h] * scale_log2  # total's reference point, log2 units
                if num_splits == 1 and pb["sinks"] is not None:
                    # The sink joins the denominator at max(m, sink), log2 units (epilogue.cuh).
                    sink = pb["sinks"][head] * LOG2E
                    m_sink = max(m, sink)
                    a = 2.0 ** (m - m_sink)
                    total = total * a + 2.0 ** (sink - m_sink)
                    scale *= a
                    m = m_sink
                row_lse = m + math.log2(total) if total != 0 else -math.inf
                inv = scale / total if total > 0 else 0.0
                target = out if num_splits == 1 else ws_o[split]
                for j in range(C["ot"]):
                    dim = C["out_dim"][j][t]
                    target[tok, head, dim : dim + 2] = o[warp, lane, j, 2 * h : 2 * h + 2] * inv
                if num_splits > 1 and t == 0:
                    ws_lse[split, tok, head] = row_lse
                if num_splits == 1 and lse is not None and t == 0:
                    # The LSE twin's epilogue: natural log, the sink inside.
                    lse[tok, head] = row_lse * math.log(2.0)


def sequences(problem):
    """Per-sequence (q_start, q_len, kv_len, causal) and the first padded row, read from the
    problem's own index tensors (any strides, bool or int32 flags) by the kernels' readers, with
    the pointers and strides the launch passes (the launch record's values)."""
    values = launch_values(MMA_SYNC, LaunchInputs(problem, problem.query, 1))
    names = ("cu_seqlens_q", "cu_stride", "seq_lens", "sl_stride", "causal_per_seq",
             "causal_bytes", "causal_stride", "causal", "num_seqs")  # fmt: skip
    return host().sequences(*(values[name] for name in names))


def emulate(problem, num_splits, lse=None):
    """The whole launch (attention kernel grid, then merge.cu when split) on the CPU, on the C++
    plan's tile (64 or 128 query rows) and grid. Every output row starts as NaN, so a row no CTA
    writes shows up. ``lse`` (numpy [num_tokens, num_q_heads]) receives each row's natural-log
    LSE as return_lse gets it: from the LSE kernel's epilogue when unsplit, from merge.cu when
    split; -inf for padded rows."""
    plan = mma_sync.kernel_plan(problem.batch, resident=1, num_splits=num_splits)
    assert plan["num_splits"] == num_splits
    T = tables(problem.head_dim, problem.key_cache.element_size(), plan["block_m"])
    assert (plan["threads"], plan["smem_bytes"]) == (T["threads"], T["smem"])
    seqs, padding_start = sequences(problem)
    token_scales = problem.per_token_head_scales
    scales = (problem.k_scale, problem.v_scale)
    pb = {
        "group": problem.group_size,
        "seqs": seqs,
        "q": problem.query.double().numpy(),
        "k_raw": raw_bytes(problem.key_cache),
        "v_raw": raw_bytes(problem.value_cache),
        "k_strides": problem.key_cache.stride()[:3],
        "v_strides": problem.value_cache.stride()[:3],
        "block_table": problem.block_table.numpy(),
        "block_size": problem.block_size,
        "kv_dtype": problem.key_cache.dtype,
        "q_dtype": problem.query.dtype,
        "softmax_scale": problem.softmax_scale,
        "k_scale": problem.k_scale.double().numpy(),
        "v_scale": problem.v_scale.double().numpy(),
        "token_scales": token_scales,
        "scale_raw": [raw_bytes(t) for t in scales] if token_scales else None,
        "scale_strides": [t.stride() for t in scales] if token_scales else None,
        "window": extension.window_sides(problem),
        "sinks": None if problem.sinks is None else problem.sinks.double().numpy(),
    }
    shape = (problem.num_tokens, problem.num_q_heads, problem.head_dim)
    out = np.full(shape, np.nan)
    ws_o = np.full((num_splits, *shape), np.nan)
    ws_lse = np.full((num_splits, *shape[:2]), np.nan)
    m_tiles, kv_heads, _ = plan["grid"]
    for z in range(problem.num_seqs * num_splits):
        for kvh in range(kv_heads):
            for m_tile in range(m_tiles):
                seq, split = z // num_splits, z % num_splits
                run_cta(pb, T, m_tile, kvh, seq, split, num_splits, out, ws_o, ws_lse, lse)
    if num_splits > 1:
        # merge.cu, by its own arithmetic (merge_row.h): the sink (log2 units) is one more term
        # of the denominator, counted once.
        for tok in range(padding_start):
            for head in range(problem.num_q_heads):
                sink = -math.inf if pb["sinks"] is None else pb["sinks"][head] * LOG2E
                out[tok, head] = host().merge_row(
                    ws_o[:, tok, head].tolist(), ws_lse[:, tok, head].tolist(), sink
                )
                if lse is not None:
                    merged = host().merge_lse(ws_lse[:, tok, head].tolist(), sink)
                    lse[tok, head] = merged * math.log(2.0)
    # Padded rows: the zero slice of the grid (one split; the LSE kernel's writes their LSE) or
    # the merge kernel (several).
    out[padding_start:] = 0.0
    if lse is not None:
        lse[padding_start:] = -math.inf
    return torch.from_numpy(out)


CASES = {
    # head_dim 64, FP8, GQA 4, mixed mask, rows past q_len, pages of 128 keys (two key tiles
    # in one page), a partial last page
    "d64_e4m3_mixed": dict(
        q_lens=[3, 8], kv_lens=[70, 9], num_q_heads=8, num_kv_heads=2, head_dim=64,
        cache_dtype=torch.float8_e4m3fn, causal=[True, False], block_size=128, splits=1,
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


@pytest.mark.parametrize("block_m", [64, 128])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("elt", [1, 2])
def test_copy_slots_are_one_unit_of_rows_a_constant_step_apart(head_dim, elt, block_m):
    """The kernel forms a thread's copy row and unit once (slot tid) and steps the row by
    copy_row_step for slots tid + i * threads: the maps must agree with that."""
    T = tables(head_dim, elt, block_m)
    assert T["threads"] == 32 * T["warps"] == 2 * block_m
    threads, step = T["threads"], T["copy_row_step"]
    assert T["copy_slots"] * threads == len(T["copy"]) == T["block_n"] * T["units"]
    for tid in range(threads):
        r0, u0 = T["copy"][tid][:2]
        for i in range(T["copy_slots"]):
            assert T["copy"][tid + i * threads][:2] == [r0 + i * step, u0]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_ldmatrix_addresses_are_a_lane_part_plus_a_step_part(head_dim):
    """pv_tile adds a lane's row address and a (k-step, n-tile pair) offset (an immediate)."""
    vl = tables(head_dim, 2)["v_ldsm"]
    for kk, row in enumerate(vl):
        for jp, lanes in enumerate(row):
            for lane, addr in enumerate(lanes):
                assert (
                    addr
                    == vl[0][0][lane] + vl[kk][jp][0]
                    == vl[0][0][lane] + kk * vl[1][0][0] + vl[0][jp][0]
                )


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_bit_dequantisation_is_exact_for_every_byte(kv_dtype):
    """The kernel's FP8 -> bf16 bit moves (fp8_bits.h) times the format's power of two give
    every finite FP8 value exactly, in bf16_k_dim order; the special test flags exactly the
    Inf / NaN bytes."""
    hk = host()
    codes = extension.DTYPE_CODES
    kv = codes[kv_dtype]
    assert hk.bit_dequant_k(codes[torch.bfloat16], kv)
    assert not hk.bit_dequant_k(codes[torch.float16], kv)
    assert not hk.bit_dequant_k(codes[torch.bfloat16], codes[torch.bfloat16])
    assert [hk.bf16_k_dim(p) for p in range(8)] == [0, 2, 1, 3, 4, 6, 5, 7]
    finite = [b for b in range(256) if math.isfinite(decode(np.array([b], np.uint8), kv_dtype)[0])]
    rng = np.random.default_rng(5)
    for b in range(256):
        for pos in range(4):
            raw = rng.choice(finite, 4).astype(np.uint8)  # specials only where placed
            raw[pos] = b
            word = int(raw.view(np.uint32)[0])
            expect = decode(raw, kv_dtype)
            special = not np.isfinite(expect).all()
            assert (hk.fp8x4_special_bits(word, kv) != 0) == special, (b, pos)
            if special:
                continue
            even, odd, scale = hk.fp8x4_to_bf16x2_scaled(word, kv)
            (factor, _) = pair(scale, torch.bfloat16)
            got = [x * factor for x in (*pair(even, torch.bfloat16), *pair(odd, torch.bfloat16))]
            want = [expect[hk.bf16_k_dim(p)] for p in range(4)]
            assert got == want, (b, pos, got, want)
            for g, w in zip(got, want, strict=True):
                assert math.copysign(1.0, g) == math.copysign(1.0, w)


def words_with_every_byte(seed: int):
    """(byte, position, word): 4 random bytes with each of the 256 bytes at each position."""
    rng = np.random.default_rng(seed)
    for b in range(256):
        for pos in range(4):
            raw = rng.integers(0, 256, 4, dtype=np.uint8)
            raw[pos] = b
            yield b, pos, raw


def test_e5m2_to_fp16_byte_moves_are_exact_for_every_byte():
    """e5m2 -> fp16 (V, and K under an fp16 query) is a byte move: each pair equals the fp16
    conversion of the e5m2 values, Inf and NaN included."""
    hk = host()
    for b, pos, raw in words_with_every_byte(6):
        lo, hi = hk.e5m2x4_to_f16x2(int(raw.view(np.uint32)[0]))
        got = np.array([*pair(lo, torch.float16), *pair(hi, torch.float16)])
        want = decode(raw, torch.float8_e5m2)
        assert np.array_equal(got, want, equal_nan=True), (b, pos, got, want)
        finite = ~np.isnan(want)
        assert np.array_equal(np.signbit(got[finite]), np.signbit(want[finite]))


@pytest.mark.parametrize("block_size", [8, 16, 64, 128, 256])
def test_tile_page_and_page_key_find_every_key_of_a_tile(block_size):
    """Key n0 + r of a key tile (n0 a multiple of block_n): the kernel's page (first page of the
    tile plus tile_page) and offset in it (page_key) are the key's own."""
    hk = host()
    shift = block_size.bit_length() - 1
    for block_n in (32, 64):
        for n0 in range(0, 4 * max(block_size, block_n), block_n):
            for r in range(block_n):
                key = n0 + r
                assert (n0 >> shift) + hk.tile_page(r, shift) == key // block_size
                assert hk.page_key(n0, r, block_size) == key % block_size


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


# The 128-row tile (head_dim 128; R = q_len x group in 65..128 per CTA): sequences of 160 rows
# (two M tiles, the second of 32 rows) and 68 rows (GQA 4), two padded rows past the last
# sequence: (cache, query, causal, window, sinks, splits).
WIDE_CASES = [
    (torch.float8_e4m3fn, torch.bfloat16, [True, False], (-1, -1), False, 1),
    (torch.float8_e5m2, torch.float16, True, (40, 17), True, 3),
    (torch.float8_e5m2, torch.bfloat16, False, (3, 2), True, 2),
    (torch.float8_e4m3fn, torch.float16, [False, True], (-1, 5), False, 1),
]


@pytest.mark.parametrize("cache,query,causal,window,sinks,splits", WIDE_CASES, ids=str)
def test_emulated_128_row_tile_matches_reference(cache, query, causal, window, sinks, splits):
    """More than 64 rows per KV head on an FP8 cache: the plan launches the 128-row tile (8 warps,
    one CTA streams the KV once for its 128 rows), replayed with its own maps; causal per
    sequence, windows, sinks, split-KV and padded rows as for the 64-row tile."""
    case = make_case(
        [40, 17], [120, 75], num_q_heads=8, num_kv_heads=2, head_dim=128, cache_dtype=cache,
        query_dtype=query, causal=causal, block_size=16, seed=17, padded_rows=2,
    )  # fmt: skip
    kwargs = {"window": window, "sinks": torch.tensor(SINKS * 2) if sinks else None}
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, **kwargs
    )
    plan = mma_sync.kernel_plan(problem.batch, resident=1, num_splits=splits)
    assert (plan["block_m"], plan["threads"], plan["m_tiles"]) == (128, 256, 2)
    assert plan["kernel_name"] == "paged_attention_kernel_m128"
    out = emulate(problem, splits).to(query)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), **kwargs, backend="reference")
    tokens = sum(case.q_lens)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out[:tokens], ref[:tokens]) <= TOLERANCE[query]
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


# Per-token-head caches (paged_attention_kernel_pth): sequences [q 3 / kv 70, q 8 / kv 40]
# (GQA 4: 12 and 32 rows), pages of 16 keys in aligned inline pages (strided scales), two padded
# rows: (cache, query, causal, window, sinks, splits).
TOKEN_SCALE_CASES = [
    (torch.float8_e4m3fn, torch.bfloat16, [True, False], (-1, -1), False, 1),
    (torch.float8_e5m2, torch.float16, False, (-1, -1), True, 3),
    (torch.int8, torch.bfloat16, [False, True], (5, 3), False, 2),
    (torch.int8, torch.float16, True, (-1, -1), True, 1),
]


def token_scale_problem(cache, query, causal, window=(-1, -1), sinks=False, **sizes):
    return token_head_problem(
        cache, query, sizes.pop("q_lens", [3, 8]), sizes.pop("kv_lens", [70, 40]),
        causal=causal, window=window, padded_rows=2, seed=21,
        sinks=torch.tensor(SINKS * 2) if sinks else None, **sizes,
    )  # fmt: skip


@pytest.mark.parametrize("cache,query,causal,window,sinks,splits", TOKEN_SCALE_CASES, ids=str)
def test_emulated_token_scales_match_reference(cache, query, causal, window, sinks, splits):
    """k_scale / v_scale per token and KV head ([num_blocks, block_size, num_kv_heads], strided
    views of the page): each key's K scale on its score column, each value's V scale on the
    dequantised value tile (rounded once to the query dtype), int8 converted exactly; causal or
    bidirectional, windows, sinks, split or unsplit, the LSE; padded rows zero."""
    problem = token_scale_problem(cache, query, causal, window, sinks)
    assert problem.per_token_head_scales and problem.k_scale.stride()[1] != 1
    lse = np.full(problem.query.shape[:2], np.nan)
    out = emulate(problem, splits, lse).to(query)
    ref, ref_lse = run_backend("reference", problem)
    tokens = int(problem.cu_seqlens_q[-1])
    assert torch.isfinite(out.float()).all()
    assert relative_error(out[:tokens], ref[:tokens]) <= TOLERANCE[query]
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))
    lse = torch.from_numpy(lse)
    assert torch.all(lse[tokens:] == -math.inf)
    assert (lse[:tokens] - ref_lse[:tokens].double()).abs().max() < 1e-4


@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.int8], ids=str)
def test_emulated_token_scales_dropped_or_per_head_are_caught(cache):
    """The comparison above bites: the kernel replayed over one scale per KV head (each head's
    first key's, broadcast to every token) or with the V scales dropped (all ones) misses the
    reference by far more than the tolerance."""
    problem = token_scale_problem(cache, torch.bfloat16, [True, False])
    ref, _ = run_backend("reference", problem)
    first_page = int(problem.block_table[0, 0])
    per_head = {name: getattr(problem, name).clone() for name in ("k_scale", "v_scale")}
    for name, scale in per_head.items():
        scale[:] = getattr(problem, name)[first_page, 0]
    broadcast = replaced(problem, **per_head)
    dropped = replaced(problem, v_scale=torch.ones_like(problem.v_scale))
    for wrong in (broadcast, dropped):
        out = emulate(wrong, 1).to(torch.bfloat16)
        assert relative_error(out, ref) > 10 * TOLERANCE[torch.bfloat16]


def test_emulated_128_row_tile_reads_token_scales():
    """More than 64 rows per KV head on an int8 cache at head_dim 128: the 128-row per-token-head
    kernel (paged_attention_kernel_m128_pth), split."""
    problem = token_scale_problem(torch.int8, torch.bfloat16, [False, True], q_lens=[40, 17],
                                  kv_lens=[120, 75], head_dim=128)  # fmt: skip
    plan = mma_sync.kernel_plan(problem.batch, resident=1, num_splits=2)
    assert (plan["block_m"], plan["m_tiles"]) == (128, 2)
    out = emulate(problem, 2).to(torch.bfloat16)
    ref, _ = run_backend("reference", problem)
    tokens = int(problem.cu_seqlens_q[-1])
    assert relative_error(out[:tokens], ref[:tokens]) <= TOLERANCE[torch.bfloat16]


def test_int8_byte_moves_are_exact_for_every_byte():
    """int8 -> fp16 (K and V of int8 caches) is a byte move under fp16's 1024 and one fp16
    subtraction: exact for every byte, in order."""
    hk = host()
    for b, pos, raw in words_with_every_byte(7):
        lo, hi, bias = hk.int8x4_to_biased_f16x2(int(raw.view(np.uint32)[0]))
        biased = [*pair(lo, torch.float16), *pair(hi, torch.float16)]
        # The subtraction is exact in fp16 (an integer of at most 8 bits): modelled in fp64.
        assert [x - bias for x in biased] == raw.view(np.int8).tolist(), (b, pos)


def test_scale_slots_lie_in_the_value_rows_pad():
    """Each key row's two scales sit in its V row's 16-byte pad of a 1-byte stage: inside the
    row, past its data, distinct per row and scale, 4-byte aligned."""
    for head_dim in (64, 128, 256):
        for block_m in (64, 128):
            T = tables(head_dim, 1, block_m)
            data_end = T["units"] * 16
            assert T["v_row"] == data_end + 16
            for r, (k, v) in enumerate(T["scale"]):
                assert r * T["v_row"] + data_end <= k and v == k + 4 <= (r + 1) * T["v_row"] - 4
                assert k % 4 == 0


def test_plan_picks_the_128_row_tile_past_64_rows_of_an_fp8_cache():
    """block_m_for: 128 rows for R > 64 on 1-byte caches (e4m3, e5m2, int8) at head_dim 128,
    else 64 (16-bit caches, head_dims 64 and 256); the 128-row tile never splits keys and fits
    99 KB of shared memory (sm_89 / sm_120)."""
    _C = pytest.importorskip("fp8_noncausal_attn._C", reason="the CUDA extension is not built")

    codes = extension.DTYPE_CODES
    for head_dim in (64, 128, 256):
        for dtype, code in codes.items():
            fp8 = dtype.itemsize == 1
            for rows in (1, 32, 64, 65, 128, 129, 4096):
                wide = rows > 64 and fp8 and head_dim == 128
                assert _C.block_m_for(head_dim, code, rows) == (128 if wide else 64)
            if fp8 and head_dim == 128:
                T = tables(head_dim, 1, 128)
                assert T["max_key_groups"] == 1 and T["smem"] <= 99 * 1024
                assert all(host().key_groups(head_dim, 1, r, 128) == 1 for r in (1, 16, 33, 128))


def merge_formula(o: np.ndarray, lse: np.ndarray, sink: float) -> np.ndarray:
    """The split merge in float64, independently: sum_s 2^lse_s O_s / (sum_s 2^lse_s + 2^sink)
    over the splits that saw a key (lse > -inf), 0 when nothing was seen."""
    seen = lse > -np.inf
    top = max([*lse[seen], sink])
    if top == -np.inf:
        return np.zeros(o.shape[1])
    w = np.exp2(lse[seen] - top)
    return (w[:, None] * o[seen]).sum(0) / (w.sum() + np.exp2(sink - top))


def test_merge_row_matches_the_formula_on_random_partials():
    """merge.cu's arithmetic (merge_row.h, compiled for the CPU) on random partials of 1..6
    splits, some empty (lse -inf, partial NaN: never read), with and without a sink."""
    rng = np.random.default_rng(8)
    for trial in range(200):
        splits = int(rng.integers(1, 7))
        o = rng.standard_normal((splits, 16)).astype(np.float32)
        lse = (rng.standard_normal(splits) * 8).astype(np.float32)
        empty = rng.random(splits) < 0.3
        lse[empty], o[empty] = -np.inf, np.nan
        sink = float(rng.standard_normal() * 8) if trial % 2 else -math.inf
        got = np.array(host().merge_row(o.tolist(), lse.tolist(), sink))
        want = merge_formula(o.astype(np.float64), lse.astype(np.float64), sink)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-6), (trial, got, want)


def test_merge_lse_matches_the_formula_on_random_partials():
    """The merged state's LSE (merge_row.h, compiled for the CPU): log2 of the merged
    denominator, the sink inside it once; -inf when no split saw a key; NaN propagates."""
    rng = np.random.default_rng(9)
    for trial in range(200):
        splits = int(rng.integers(1, 7))
        lse = (rng.standard_normal(splits) * 40).astype(np.float32)
        lse[rng.random(splits) < 0.3] = -np.inf
        sink = float(rng.standard_normal() * 40) if trial % 2 else -math.inf
        terms = np.append(lse.astype(np.float64), sink)
        top = terms.max()
        want = -math.inf if top == -math.inf else top + np.log2(np.exp2(terms - top).sum())
        got = host().merge_lse(lse.tolist(), sink)
        assert got == want if want == -math.inf else abs(got - want) < 1e-4, (trial, got, want)
    assert host().merge_lse([-math.inf, -math.inf], -math.inf) == -math.inf
    assert host().merge_lse([-math.inf], 3.0) == pytest.approx(3.0)
    assert math.isnan(host().merge_lse([2.0, math.nan], -math.inf))


@pytest.mark.parametrize("unsplit", [True, False], ids=["epilogue", "split_merge"])
@pytest.mark.parametrize("name", ["d64_e4m3_mixed", "d128_e5m2_vllm_split", "d256_fp16_split"])
def test_emulated_lse_matches_reference(name, unsplit):
    """return_lse on mma_sync: unsplit, the LSE kernel's epilogue writes it (sink inside, -inf
    for padded rows); split, the split epilogue's partial LSEs merged by merge.cu's arithmetic
    give it. Both match the reference's LSE."""
    spec = dict(CASES[name])
    splits = 1 if unsplit else max(spec.pop("splits"), 2)
    spec.pop("splits", None)
    case = make_case(spec.pop("q_lens"), spec.pop("kv_lens"), seed=3, padded_rows=2, **spec)
    sinks = torch.tensor([SINKS[h % len(SINKS)] for h in range(case.query.shape[1])])
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, sinks=sinks
    )
    lse = np.full(problem.query.shape[:2], np.nan)
    emulate(problem, splits, lse)
    _, ref_lse = fna.paged_attention(
        *case.args(), **case.kwargs(), sinks=sinks, backend="reference", return_lse=True
    )
    lse = torch.from_numpy(lse)
    tokens = int(case.cu_seqlens_q[-1])
    assert torch.all(lse[tokens:] == -math.inf)
    assert (lse[:tokens] - ref_lse[:tokens].double()).abs().max() < 1e-4


@pytest.mark.parametrize("splits", [1, 2])
def test_emulated_key_shards_give_the_reference_states(splits):
    """Decode-context-parallel shards (test_lse_merge's dcp4_interleave8 layout): fewer keys than
    query rows, and a sequence with none, on a bidirectional launch; the kernel's rows match the
    reference's states (rows with no key: zeros, LSE -inf)."""
    case = lse_case(torch.float8_e4m3fn, torch.bfloat16, False, seed=11)
    for keys in LAYOUTS["dcp4_interleave8"]:
        problem = shard_problem(case, keys)
        lse = np.full(problem.query.shape[:2], np.nan)
        out = emulate(problem, splits, lse).to(torch.bfloat16)
        ref_out, ref_lse = run_backend("reference", problem)
        assert relative_error(out, ref_out) <= TOLERANCE[torch.bfloat16]
        empty = torch.isinf(ref_lse)
        assert torch.equal(out[empty], torch.zeros_like(out[empty]))
        lse = torch.from_numpy(lse)
        assert torch.equal(torch.isinf(lse), empty)
        assert (lse[~empty] - ref_lse[~empty].double()).abs().max() < 1e-4


def test_merge_row_adds_the_sink_once_without_overflow():
    """A sink of 500 (natural log) dwarfs a row's LSE of 200 without overflowing; a sink counts
    once however many splits there are; a row no split saw merges to zeros; NaN propagates."""
    hk = host()
    o = [[1.0, -2.0], [4.0, 0.5]]
    got = hk.merge_row(o, [1.0, 3.0], 0.7 * LOG2E)
    w, sink = np.array([2.0, 8.0]), math.exp(0.7)
    assert np.allclose(got, (w[:, None] * np.array(o)).sum(0) / (w.sum() + sink), rtol=1e-6)
    scale = 2.0 ** (200.0 - 500.0 * LOG2E)  # vs the sink's weight 1
    tiny = hk.merge_row([[3.0, 1.0], [math.nan, math.nan]], [200.0, -math.inf], 500.0 * LOG2E)
    assert np.all(np.isfinite(tiny)) and np.allclose(tiny, np.array([3.0, 1.0]) * scale)
    assert hk.merge_row([[math.nan], [math.inf]], [-math.inf, -math.inf], -math.inf) == [0.0]
    # A NaN partial (a NaN in the cache) is no empty split: it reaches the output.
    assert np.isnan(hk.merge_row([[1.0], [math.nan]], [2.0, math.nan], -math.inf)).all()
    assert np.isnan(hk.merge_row([[1.0], [math.nan]], [2.0, 1.0], -math.inf)).all()


# Large positive and negative sink logits per q head (as in tests/test_window_sinks.py): +25
# outweighs every key of its head (the output shrinks ~e^-25), -40 changes nothing.
SINKS = [25.0, -40.0, 0.5, 3.0]

# (causal, window, sinks, splits) on sequences [q 3 / kv 21, q 24 / kv 300] with 16-key pages
# and 64-key tiles: a window inside one page, one spanning pages and tiles (most tiles of the
# long sequence lie outside it), one past the context, one-sided ones, sinks alone.
WINDOW_CASES = [
    (False, (3, 2), False, 1),
    (True, (3, 2), True, 3),
    ([True, False], (40, 17), True, 1),
    ([False, True], (40, 17), False, 3),
    (False, (1000, 1000), True, 2),
    (True, (-1, -1), True, 2),
    ([False, True], (-1, 0), False, 1),
    (False, (70, -1), True, 3),
    (False, (-1, 5), True, 1),
]


def attention_kwargs(window, sinks):
    return {"window": window, "sinks": torch.tensor(SINKS) if sinks else None}


@pytest.mark.parametrize("causal,window,sinks,splits", WINDOW_CASES)
def test_emulated_window_and_sinks_match_reference(causal, window, sinks, splits):
    """The window bounds (index_maps.h row_keys / cta_keys), the tiles it skips, the split of the
    windowed tile range, the sink in the unsplit epilogue or once in the merge; two padded rows
    past the last sequence stay exact zeros."""
    case = make_case(
        [3, 24], [21, 300], num_q_heads=4, num_kv_heads=2, head_dim=64, causal=causal, seed=13,
        padded_rows=2,
    )  # fmt: skip
    kwargs = attention_kwargs(window, sinks)
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, **kwargs
    )
    out = emulate(problem, splits).to(case.query.dtype)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), **kwargs, backend="reference")
    # The window and the sinks each change the result (else this test could not fail).
    plain = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    if window not in ((-1, -1), (1000, 1000)):
        windowed = fna.paged_attention(
            *case.args(), **case.kwargs(), window=window, backend="reference"
        )
        assert relative_error(windowed, plain) > 0.05
    if sinks:  # q head 0's sink of +25 outweighs its keys
        assert ref[:, 0].abs().max() < 1e-4 * plain[:, 0].abs().max()
    assert torch.isfinite(out.float()).all()
    tokens = sum(case.q_lens)
    assert relative_error(out[:tokens], ref[:tokens]) <= TOLERANCE[case.query.dtype]
    assert torch.equal(out[tokens:], torch.zeros_like(out[tokens:]))


@pytest.mark.parametrize("splits", [1, 3])
def test_emulated_windowed_launch_loads_only_the_windows_tiles(splits):
    """The pages of every key tile that no query's window touches are poisoned with FP8 NaN bytes
    (K and V): a kernel that loads one, even masked out afterwards (0 * NaN = NaN in P V), gives
    NaN. The tile range comes from the window, so the output stays finite and correct."""
    q_len, kv_len, block_size, window = 4, 1000, 16, (40, 3)
    case = make_case(
        [q_len], [kv_len], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size,
        seed=5,
    )  # fmt: skip
    kwargs = attention_kwargs(window, sinks=True)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), **kwargs, backend="reference")
    block_n = tables(64, 1)["block_n"]
    start, end = visible_range(torch.arange(q_len), q_len, kv_len, False, window)
    first_tile, end_tile = int(start.min()) // block_n, -(-int(end.max()) // block_n)
    pages = case.block_table[0].tolist()
    poisoned = [
        pages[n]
        for n in range(-(-kv_len // block_size))
        if not first_tile <= n * block_size // block_n < end_tile
    ]
    assert len(poisoned) >= 50  # most of the context lies outside the window
    for cache in (case.key_cache, case.value_cache):
        cache.view(torch.uint8)[poisoned] = 0x7F  # e4m3 NaN
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False, **kwargs
    )
    out = emulate(problem, splits).to(case.query.dtype)
    assert torch.isfinite(out.float()).all()
    assert relative_error(out, ref) <= TOLERANCE[case.query.dtype]
    # Without the window the poisoned pages are read: the check bites.
    unwindowed = emulate(replaced(problem, window=(-1, -1)), splits)
    assert not torch.isfinite(unwindowed).all()


WINDOWS = [(-1, -1), (0, 0), (3, 2), (40, 17), (-1, 0), (70, -1), (-1, 5), (1000, 1000),
           (2**31 - 1, 2**31 - 1)]  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_window_maps_follow_the_masking_rule(window, causal):
    """index_maps.h on the CPU: row_keys is masking.visible_range (any int window, no overflow),
    key_visible its per-key test, cta_keys the union of its rows' ranges, and tile_needs_mask
    exact (false only for tiles every row of the CTA sees whole)."""
    hk = host()
    for kv_len, q_len, group, block_n in ((70, 3, 3, 64), (130, 130, 1, 64), (200, 17, 2, 32)):
        start, end = visible_range(torch.arange(q_len), q_len, kv_len, causal, window)
        ranges = [(int(start[r // group]), int(end[r // group]) - 1) for r in range(q_len * group)]
        got = [hk.row_keys(*window, causal, kv_len, q_len, r, group) for r in range(len(ranges))]
        assert got == ranges
        for r in range(0, len(ranges), 5):
            visible = [hk.key_visible(got[r], key) for key in range(-2, kv_len + 2)]
            assert visible == [ranges[r][0] <= key <= ranges[r][1] for key in range(-2, kv_len + 2)]
        for row0 in range(0, len(ranges), 7):
            rows = ranges[row0 : row0 + 11]
            keys = hk.cta_keys(*window, causal, kv_len, q_len, row0, row0 + len(rows) - 1,
                               group, block_n)  # fmt: skip
            assert keys[:2] == (min(lo for lo, _ in rows), max(hi for _, hi in rows) + 1)
            for n0 in range(0, kv_len + block_n, block_n):
                whole = all(lo <= n0 and n0 + block_n - 1 <= hi for lo, hi in rows)
                assert hk.tile_needs_mask(keys, n0) == (not whole), (row0, n0)


def test_splits_partition_the_windowed_tile_range():
    """Split-KV splits the tiles the window touches, [first, end), in order, each tile once."""
    hk = host()
    for tiles in ((0, 5), (3, 4), (7, 40), (2, 2), (1998, 2003)):
        for num_splits in range(1, 9):
            parts = [hk.split_tiles(tiles, num_splits, s) for s in range(num_splits)]
            assert [t for b, e in parts for t in range(b, e)] == list(range(*tiles))
    keys = hk.cta_keys(4095, 4095, False, 131072, 8, 0, 31, 4, 64)
    assert hk.cta_tiles(keys, 64) == (1983, 2048)  # 65 of 2048 tiles: the window's


def strided(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The values of 1-D ``t`` (as ``dtype``) in a view with stride 3 into a larger buffer whose
    other elements are garbage, like vLLM's slices of persistent buffers."""
    dtype = dtype or t.dtype
    buffer = torch.full((t.numel(), 3), 7, dtype=dtype)
    buffer[:, 0] = t.to(dtype)
    return buffer[:, 0]


@pytest.mark.parametrize("causal_dtype", [torch.int32, torch.bool])
@pytest.mark.parametrize("splits", [1, 2])
def test_emulated_kernel_reads_vllm_index_tensors_in_place(causal_dtype, splits):
    """Strided cu_seqlens_q / seq_lens / causal (int32 or bool) read where they lie, and padded
    rows past cu_seqlens_q[-1] (vLLM under CUDA graphs) written as zeros."""
    causal = [True, False, True]
    case = make_case(
        [4, 8, 2], [40, 70, 9], num_q_heads=8, num_kv_heads=2, head_dim=64, causal=causal,
        seed=5,
    )  # fmt: skip
    problem = validate_attention(
        *case.args(), **case.kwargs(), softmax_scale=None, out=None, validate=False
    )
    padding = torch.randn(5, *case.query.shape[1:]).to(case.query.dtype)
    flags = torch.tensor([7 if c else 0 for c in causal], dtype=torch.int32)  # nonzero = causal
    vllm_like = replaced(
        problem,
        query=torch.cat([problem.query, padding]),
        cu_seqlens_q=strided(problem.cu_seqlens_q),
        seq_lens=strided(problem.seq_lens),
        causal_per_seq=strided(flags, causal_dtype),
    )
    out = emulate(vllm_like, splits).to(case.query.dtype)
    ref = fna.paged_attention(*case.args(), **case.kwargs(), backend="reference")
    tokens = case.query.shape[0]
    assert relative_error(out[:tokens], ref) <= TOLERANCE[case.query.dtype]
    assert torch.equal(out[tokens:], torch.zeros_like(padding))


def test_index_tensor_readers_follow_strides_and_flag_width():
    """The kernels' readers on host tensors: int32 flags of any nonzero value are causal, bool
    flags are read as bytes, and a stride skips the garbage between elements."""
    cu = strided(torch.tensor([0, 3, 3, 9], dtype=torch.int32))
    lens = strided(torch.tensor([5, 4, 12], dtype=torch.int32))
    for flags in (strided(torch.tensor([-2, 0, 1], dtype=torch.int32)),
                  strided(torch.tensor([True, False, True]), torch.bool)):  # fmt: skip
        seqs, padding_start = host().sequences(
            cu.data_ptr(), cu.stride(0), lens.data_ptr(), lens.stride(0), flags.data_ptr(),
            flags.element_size(), flags.stride(0), False, 3,
        )  # fmt: skip
        assert seqs == [(0, 3, 5, True), (3, 0, 4, False), (3, 6, 12, True)]
        assert padding_start == 9
    seqs, _ = host().sequences(
        cu.data_ptr(), cu.stride(0), lens.data_ptr(), lens.stride(0), 0, 1, 0, True, 3
    )
    assert [s[3] for s in seqs] == [True, True, True]


CACHE_CODES = {torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.bfloat16: 0, torch.float16: 1}


def spec_quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """SPEC section 4's store-side conversion, independently: divide in fp32, saturate to the
    format's finite max (16-bit formats too), round to nearest even (torch's own casts)."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


@pytest.mark.parametrize("dtype", list(CACHE_CODES), ids=str)
def test_cache_write_quantisation_is_bit_exact(dtype):
    """csrc/cache/quantize.h (the cache-write kernel's conversion, compiled for the CPU) gives
    the bytes of fp8_noncausal_attn.scales.quantize and of the spec's rule, over the whole range:
    subnormals, ties, values past the format's max (saturated, never inf)."""
    from fp8_noncausal_attn.scales import quantize

    gen = torch.Generator().manual_seed(int(CACHE_CODES[dtype]))
    fmax = torch.finfo(dtype).max
    tiny = torch.finfo(dtype).smallest_normal
    magnitudes = torch.cat([
        torch.rand(2000, generator=gen) * 4,
        torch.exp2(torch.rand(2000, generator=gen) * 40 - 20),
        torch.rand(500, generator=gen) * tiny * 2,  # the subnormal range
        torch.tensor([fmax, fmax * 1.01, fmax * 4, 3e38, 0.0]),
    ])  # fmt: skip
    signs = torch.where(torch.rand(magnitudes.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (magnitudes * signs).to(torch.bfloat16).float()  # what a bf16 key row holds
    x = x[torch.isfinite(x)]
    storage = torch.uint8 if dtype.itemsize == 1 else torch.int16
    for scale in (1.0, 0.37, 3.5e-3):
        codes = host().quantize(x.tolist(), scale, CACHE_CODES[dtype])
        got = torch.tensor(codes, dtype=torch.int64)
        expected = spec_quantize(x, scale, dtype).view(storage).to(torch.int64)
        expected &= 0xFF if dtype.itemsize == 1 else 0xFFFF
        assert torch.equal(got, expected), (scale, (got != expected).sum())
        in_range = (x.abs() / scale) <= fmax
        library = quantize(x[in_range][:, None, None], torch.tensor([scale]), dtype)
        lib = library.flatten().view(storage).to(torch.int64)
        lib &= 0xFF if dtype.itemsize == 1 else 0xFFFF
        assert torch.equal(got[in_range], lib)
    decoded = torch.tensor(codes, dtype=torch.int64).to(storage).view(dtype).float()
    assert torch.isfinite(decoded).all()  # saturated, never inf


def test_cache_write_quantisation_keeps_nan():
    for code, dtype in ((2, torch.float8_e4m3fn), (3, torch.float8_e5m2), (0, torch.bfloat16),
                        (1, torch.float16)):  # fmt: skip
        (bits,) = host().quantize([math.nan], 1.0, code)
        storage = torch.uint8 if dtype.itemsize == 1 else torch.int16
        assert torch.tensor([bits]).to(storage).view(dtype).float().isnan().all()
