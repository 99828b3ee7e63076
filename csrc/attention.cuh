// Paged attention over an FP8 / BF16 / FP16 KV cache with a BF16 / FP16 query (SPEC section 3).
//
// One CTA = (M tile of query rows, KV head, sequence x KV split). The M tile packs the query
// tokens x the query heads of one KV head (row r: token r / group, head r % group), so every KV
// page is read once per KV head. Four warps each own 16 rows; the CTA streams the KV range of
// its split through shared memory with cp.async (16-byte copies, kStages deep) and every warp
// runs mma.sync m16n8k16 (fp32 accumulation) with an online fp32 softmax (FlashAttention-2).
// When the rows fill only one or two warps (decode and drafter shapes), the other warps take a
// share of every key tile instead and the shares are merged at the end.
//
// FP8 tiles stay FP8 in shared memory and are dequantised in registers, exactly, to the query
// dtype. To read them with wide shared loads the kernel permutes reduction and output indices,
// which leaves the result unchanged:
//  * S = Q K^T: thread t of a quad loads 16 bytes of one key row (kE elements) and feeds them
//    to kE / 4 consecutive mma k-steps; in each step its four B values (logical k = 2t, 2t+1,
//    2t+8, 2t+9) are four adjacent head dims. The Q fragment is loaded with the same map.
//  * O = P V: thread (g, t) loads one 32-bit word (kEpw adjacent dims) from each of its four
//    key rows; word byte/half i feeds output n-tile (kEpw * J + i), whose column g is head dim
//    8 * kEpw * J + kEpw * g + i. Each thread thus ends up owning 2 * kEpw adjacent output dims.
// K rows are XOR-swizzled in 16-byte units and V rows padded by 16 bytes so both read patterns
// are free of bank conflicts.
#pragma once

#include <atomic>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "params.h"

namespace fp8nca {

template <int D, typename QT, int KV>
struct AttnConfig {
  static constexpr int kWarps = kBlockM / 16;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockN = block_n_for(D);
  static constexpr bool kFp8 = KV == kE4M3 || KV == kE5M2;
  static constexpr int kElt = kFp8 ? 1 : 2;           // bytes per cache element
  static constexpr int kRow = D * kElt;               // bytes per key / value row
  static constexpr int kUnits = kRow / 16;            // 16-byte units per row
  static constexpr int kE = 16 / kElt;                // elements per unit
  static constexpr int kStepsPerUnit = kE / 4;        // mma k-steps fed by one unit
  static constexpr int kGroups = D / (4 * kE);        // groups of 4 units (one per quad lane)
  static constexpr int kEpw = 4 / kElt;               // elements per 32-bit word
  static constexpr int kKRow = kRow;                  // swizzled, unpadded
  static constexpr int kVRow = kRow + 16;             // padded
  static constexpr int kNT = kBlockN / 8;             // S n-tiles
  static constexpr int kMaxKeyGroups = kBlockN / 16 < kWarps ? kBlockN / 16 : kWarps;
  static constexpr int kOT = D / 8;                   // O n-tiles
  static constexpr int kStageBytes = kBlockN * (kKRow + kVRow);
  static constexpr int kStages = 3 * kStageBytes <= 100 * 1024 ? 3 : 2;
  static constexpr int kQBytes = kBlockM * D * 2;     // Q fragments, in fragment order
  static constexpr int kSmem = kQBytes + kStages * kStageBytes;
  // CTAs per SM the register allocation must allow (several in flight hide HBM latency):
  // 3 where ptxas fits that in 168 registers without spilling (sm_100a's ptxas spills the
  // d128 FP8 kernels at 168 where sm_90a's does not), else 2.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  static constexpr bool kTightD128 = false;
#else
  static constexpr bool kTightD128 = kFp8 && std::is_same_v<QT, __nv_bfloat16>;
#endif
  static constexpr int kMinBlocks = D == 64 || (D == 128 && kTightD128) ? 3 : 2;
  static_assert(D % (4 * kE) == 0, "head_dim must be a multiple of 4 units");
  static_assert(kBlockN % 16 == 0, "key tile must hold whole mma k-steps");

  __device__ static int swizzle(int row) { return kUnits >= 8 ? (row & 1) << 2 : 0; }
};

// Operand type of O += P V. fp16 wherever V is exact in it (FP8 and fp16 caches): P in [0, 1]
// keeps 3 more mantissa bits than in bf16, and FP8 -> fp16 is one instruction where FP8 -> bf16
// takes four. A bf16 cache stays bf16 under a bf16 query (no conversion at all).
template <typename QT, int KV>
using PVType = std::conditional_t<KV == kBF16 && std::is_same_v<QT, __nv_bfloat16>,
                                  __nv_bfloat16, __half>;

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __nv_bfloat16) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                            b1, c[0], c[1], c[2], c[3]);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1, __half) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(c[0], c[1], c[2], c[3], a[0], a[1], a[2], a[3], b0,
                                          b1, c[0], c[1], c[2], c[3]);
}

// Two FP8 values (low byte first) -> two values of the query dtype, exactly: the hardware
// conversion to f16x2 is exact for e4m3 and e5m2, and every such value is a bf16 too.
template <int KV, typename QT>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t x16) {
  uint32_t h2;
  const uint16_t x = static_cast<uint16_t>(x16);
  if constexpr (KV == kE4M3) {
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(x));
  } else {
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h2) : "h"(x));
  }
  if constexpr (std::is_same_v<QT, __half>) {
    return h2;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h2));
    const __nv_bfloat162 b = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

// Two 16-bit cache values -> the query dtype: a no-op when the dtypes match; bf16 -> fp16 is
// exact within fp16's range, fp16 -> bf16 rounds to bf16's 8-bit mantissa.
template <int KV, typename QT>
__device__ __forceinline__ uint32_t half2_to(uint32_t x) {
  constexpr bool kSame = (KV == kBF16) == std::is_same_v<QT, __nv_bfloat16>;
  if constexpr (kSame) {
    return x;
  } else if constexpr (KV == kBF16) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x));
    const __half2 h = __float22half2_rn(f);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&x));
    const __nv_bfloat162 b = __float22bfloat162_rn(f);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

template <typename QT>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<QT, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
  } else {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

template <int D, typename QT, int KV>
__global__ void __launch_bounds__(AttnConfig<D, QT, KV>::kThreads, AttnConfig<D, QT, KV>::kMinBlocks)
    paged_attention_kernel(const AttnParams p) {
  using C = AttnConfig<D, QT, KV>;
  using VT = PVType<QT, KV>;
  extern __shared__ __align__(128) uint8_t smem[];

  const int m_tile = blockIdx.x;
  const int kvh = blockIdx.y;
  const int seq = blockIdx.z / p.num_splits;
  const int split = blockIdx.z % p.num_splits;
  const int group = p.group;

  const int q_start = p.cu_seqlens_q[seq];
  const int q_len = p.cu_seqlens_q[seq + 1] - q_start;
  const int rows = q_len * group;
  const int row0 = m_tile * kBlockM;
  if (row0 >= rows) return;

  const int kv_len = p.seq_lens[seq];
  const bool causal = p.causal_per_seq != nullptr ? p.causal_per_seq[seq] != 0 : p.causal != 0;
  const int pos0 = kv_len - q_len;  // absolute position of the sequence's first query token
  const int last_row = min(row0 + kBlockM, rows) - 1;
  // Keys any row of this CTA can see, and the smallest causal limit among its rows.
  const int n_keys = causal ? pos0 + last_row / group + 1 : kv_len;
  const int min_limit = causal ? pos0 + row0 / group : kv_len - 1;

  const int n_tiles = (n_keys + C::kBlockN - 1) / C::kBlockN;
  const int tiles_per_split = (n_tiles + p.num_splits - 1) / p.num_splits;
  const int t_begin = split * tiles_per_split;
  const int t_end = min(n_tiles, t_begin + tiles_per_split);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  // Warps the rows leave idle (a drafter's 8 tokens x group 4 fill two of the four) share the
  // keys instead: the warps form n_groups key groups of m_span row warps; group ng takes
  // n-tiles [j_lo, j_hi) of every key tile (at least 16 keys, one P V k-step) with its own
  // softmax state, and the groups are merged through shared memory at the end.
  const int row_warps = (min(kBlockM, rows - row0) + 15) / 16;
  const int n_groups = row_warps == 1 ? C::kMaxKeyGroups : row_warps == 2 ? 2 : 1;
  const int m_span = C::kWarps / n_groups;
  const int wm = warp % m_span;
  const int ng = warp / m_span;
  const int j_lo = ng * (C::kNT / n_groups);
  const int j_hi = j_lo + C::kNT / n_groups;
  const bool warp_active = row0 + 16 * wm < rows;

  // This thread's two rows are g and g + 8 of its warp's 16 (rows past `rows` are clamped for
  // addressing and never stored). Recomputed where needed rather than kept live in registers.
  auto row_of = [&](int h) { return min(row0 + 16 * wm + g + 8 * h, rows - 1); };
  auto row_ok = [&](int h) { return row0 + 16 * wm + g + 8 * h < rows; };
  auto row_tok = [&](int h) { return q_start + row_of(h) / group; };
  auto row_head = [&](int h) { return kvh * group + row_of(h) % group; };
  const int row_limit[2] = {causal ? pos0 + row_of(0) / group : kv_len - 1,
                            causal ? pos0 + row_of(1) / group : kv_len - 1};

  // Q fragments for all D / 16 k-steps, permuted as the K fragments are (see top comment).
  // They live in shared memory in fragment order (one 16-byte slot per lane and k-step, so
  // reads are conflict-free); each thread reads back only what it wrote, so no barrier.
  uint4* q_frag = reinterpret_cast<uint4*>(smem) + warp * (D / 16) * 32 + lane;
  uint8_t* kv_smem = smem + C::kQBytes;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) q_frag[ks * 32] = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const QT* qrow = static_cast<const QT*>(p.q) + row_tok(h) * p.q_stride_t +
                     row_head(h) * p.q_stride_h;
#pragma unroll
    for (int c = 0; c < C::kGroups; ++c) {
#pragma unroll
      for (int kk = 0; kk < C::kStepsPerUnit; ++kk) {
        const int dim = c * 4 * C::kE + C::kE * t + 4 * kk;
        const uint2 v = row_ok(h) ? *reinterpret_cast<const uint2*>(qrow + dim) : make_uint2(0, 0);
        uint32_t* slot = reinterpret_cast<uint32_t*>(q_frag + (c * C::kStepsPerUnit + kk) * 32);
        slot[h] = v.x;
        slot[2 + h] = v.y;
      }
    }
  }

  const uint8_t* k_base = static_cast<const uint8_t*>(p.k);
  const uint8_t* v_base = static_cast<const uint8_t*>(p.v);
  const int32_t* bt_row = p.block_table + seq * p.bt_stride_s;

  // Keys past n_keys are zero-filled: they are masked, and zeros keep 0 * V finite.
  auto load_tile = [&](int tile, int stage) {
    uint8_t* ks = kv_smem + stage * C::kStageBytes;
    uint8_t* vs = ks + C::kBlockN * C::kKRow;
    const int n0 = tile * C::kBlockN;
#pragma unroll
    for (int i = 0; i < C::kBlockN * C::kUnits / C::kThreads; ++i) {
      const int idx = tid + i * C::kThreads;
      const int r = idx / C::kUnits;
      const int u = idx % C::kUnits;
      const int key = n0 + r;
      const bool ok = key < n_keys;
      const uint8_t* ksrc = k_base;
      const uint8_t* vsrc = v_base;
      if (ok) {
        const int64_t page = bt_row[(key / p.block_size) * p.bt_stride_b];
        const int64_t off = key % p.block_size;
        ksrc += (page * p.k_stride_b + off * p.k_stride_s + kvh * p.k_stride_h) * C::kElt + u * 16;
        vsrc += (page * p.v_stride_b + off * p.v_stride_s + kvh * p.v_stride_h) * C::kElt + u * 16;
      }
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
          *reinterpret_cast<const uint4*>(ksrc),
          *reinterpret_cast<uint4*>(ks + r * C::kKRow + ((u ^ C::swizzle(r)) * 16)), ok);
      cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint4>::copy(
          *reinterpret_cast<const uint4*>(vsrc),
          *reinterpret_cast<uint4*>(vs + r * C::kVRow + u * 16), ok);
    }
  };
  static_assert(C::kBlockN * C::kUnits % C::kThreads == 0, "tile copy must split evenly");

  float o[C::kOT][4];
#pragma unroll
  for (int n = 0; n < C::kOT; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_i[2] = {-INFINITY, -INFINITY};
  float l_i[2] = {0.f, 0.f};
  const float scale_log2 = p.softmax_scale * p.k_scale[kvh] * 1.4426950408889634f;

#pragma unroll
  for (int st = 0; st < C::kStages - 1; ++st) {
    if (t_begin + st < t_end) load_tile(t_begin + st, st);
    cute::cp_async_fence();
  }

  for (int tile = t_begin; tile < t_end; ++tile) {
    const int it = tile - t_begin;
    cute::cp_async_wait<C::kStages - 2>();
    __syncthreads();
    if (tile + C::kStages - 1 < t_end) load_tile(tile + C::kStages - 1, (it + C::kStages - 1) % C::kStages);
    cute::cp_async_fence();
    if (!warp_active) continue;

    const uint8_t* ks = kv_smem + (it % C::kStages) * C::kStageBytes;
    const uint8_t* vs = ks + C::kBlockN * C::kKRow;

    // S = Q K^T for this warp's 16 rows and the tile's kBlockN keys.
    float s[C::kNT][4];
#pragma unroll
    for (int j = 0; j < C::kNT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int c = 0; c < C::kGroups; ++c) {
      uint32_t qf[C::kStepsPerUnit][4];
#pragma unroll
      for (int kk = 0; kk < C::kStepsPerUnit; ++kk) {
        const uint4 q = q_frag[(c * C::kStepsPerUnit + kk) * 32];
        qf[kk][0] = q.x;
        qf[kk][1] = q.y;
        qf[kk][2] = q.z;
        qf[kk][3] = q.w;
      }
#pragma unroll
      for (int j = 0; j < C::kNT; ++j) {
        if (j < j_lo || j >= j_hi) continue;
        const int r = 8 * j + g;
        const uint4 kr =
            *reinterpret_cast<const uint4*>(ks + r * C::kKRow + (((4 * c + t) ^ C::swizzle(r)) * 16));
        const uint32_t kw[4] = {kr.x, kr.y, kr.z, kr.w};
#pragma unroll
        for (int kk = 0; kk < C::kStepsPerUnit; ++kk) {
          uint32_t b0, b1;
          if constexpr (C::kFp8) {
            b0 = fp8x2_to<KV, QT>(kw[kk] & 0xffffu);
            b1 = fp8x2_to<KV, QT>(kw[kk] >> 16);
          } else {
            b0 = half2_to<KV, QT>(kw[2 * kk]);
            b1 = half2_to<KV, QT>(kw[2 * kk + 1]);
          }
          mma16816(s[j], qf[kk], b0, b1, QT());
        }
      }
    }

    const int n0 = tile * C::kBlockN;
    if (n0 + C::kBlockN - 1 > min_limit) {
#pragma unroll
      for (int j = 0; j < C::kNT; ++j) {
        if (j < j_lo || j >= j_hi) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n0 + 8 * j + 2 * t + (e & 1);
          if (key > row_limit[e >> 1]) s[j][e] = -INFINITY;
        }
      }
    }

    // Online softmax in fp32 (log2 domain); rows are reduced over the 4 lanes of a quad.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < C::kNT; ++j) {
        if (j >= j_lo && j < j_hi) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_i[h], mx);
      // A row with every key masked so far keeps m = -inf; subtracting 0 keeps exp2 at 0.
      const float m_scaled = m_new == -INFINITY ? 0.f : m_new * scale_log2;
      const float alpha = exp2f(m_i[h] * scale_log2 - m_scaled);
      m_i[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < C::kNT; ++j) {
        if (j < j_lo || j >= j_hi) continue;
        s[j][2 * h] = exp2f(fmaf(s[j][2 * h], scale_log2, -m_scaled));
        s[j][2 * h + 1] = exp2f(fmaf(s[j][2 * h + 1], scale_log2, -m_scaled));
        sum += s[j][2 * h] + s[j][2 * h + 1];
      }
      l_i[h] = l_i[h] * alpha + sum;
#pragma unroll
      for (int n = 0; n < C::kOT; ++n) {
        o[n][2 * h] *= alpha;
        o[n][2 * h + 1] *= alpha;
      }
    }

    // O += P V. The S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < C::kBlockN / 16; ++kk) {
      if (2 * kk < j_lo || 2 * kk >= j_hi) continue;
      const uint32_t a[4] = {pack2<VT>(s[2 * kk][0], s[2 * kk][1]),
                             pack2<VT>(s[2 * kk][2], s[2 * kk][3]),
                             pack2<VT>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                             pack2<VT>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
      const uint8_t* vrow = vs + (16 * kk + 2 * t) * C::kVRow;
#pragma unroll
      for (int J = 0; J < D / (8 * C::kEpw); ++J) {
        const int wo = (8 * J + g) * 4;
        const uint32_t w0 = *reinterpret_cast<const uint32_t*>(vrow + wo);
        const uint32_t w1 = *reinterpret_cast<const uint32_t*>(vrow + C::kVRow + wo);
        const uint32_t w2 = *reinterpret_cast<const uint32_t*>(vrow + 8 * C::kVRow + wo);
        const uint32_t w3 = *reinterpret_cast<const uint32_t*>(vrow + 9 * C::kVRow + wo);
        if constexpr (C::kFp8) {
#pragma unroll
          for (int i = 0; i < 4; i += 2) {
            // Bytes i of (w0, w1) and of (w2, w3) for n-tile i, bytes i+1 for n-tile i+1.
            const uint32_t sel = i | ((4 + i) << 4) | ((i + 1) << 8) | ((5 + i) << 12);
            const uint32_t x01 = prmt(w0, w1, sel);
            const uint32_t x23 = prmt(w2, w3, sel);
            mma16816(o[4 * J + i], a, fp8x2_to<KV, VT>(x01 & 0xffffu),
                     fp8x2_to<KV, VT>(x23 & 0xffffu), VT());
            mma16816(o[4 * J + i + 1], a, fp8x2_to<KV, VT>(x01 >> 16),
                     fp8x2_to<KV, VT>(x23 >> 16), VT());
          }
        } else {
          mma16816(o[2 * J], a, half2_to<KV, VT>(prmt(w0, w1, 0x5410)),
                   half2_to<KV, VT>(prmt(w2, w3, 0x5410)), VT());
          mma16816(o[2 * J + 1], a, half2_to<KV, VT>(prmt(w0, w1, 0x7632)),
                   half2_to<KV, VT>(prmt(w2, w3, 0x7632)), VT());
        }
      }
    }
  }
  cute::cp_async_wait<0>();

  float l_row[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_row[h] = l_i[h];
    l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 1);
    l_row[h] += __shfl_xor_sync(0xffffffffu, l_row[h], 2);
  }
  if (n_groups > 1) {
    // Merge the key groups of each row warp into group 0, reusing the KV stages as scratch:
    // (m, l) of every warp's rows, then the O fragments of groups 1.. rescaled to the joint max.
    static_assert((C::kWarps - 1) * 32 * C::kOT * 4 * 4 + C::kWarps * 16 * 2 * 4 <=
                      C::kStages * C::kStageBytes,
                  "key-group merge must fit in the KV stages");
    float* o_buf = reinterpret_cast<float*>(kv_smem);
    float* ml_buf = o_buf + (C::kWarps - 1) * 32 * C::kOT * 4;
    __syncthreads();  // every warp is done reading the KV stages
    if (t == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ml_buf[(warp * 16 + g + 8 * h) * 2] = m_i[h];
        ml_buf[(warp * 16 + g + 8 * h) * 2 + 1] = l_row[h];
      }
    }
    __syncthreads();
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m_tot = -INFINITY;
      for (int gg = 0; gg < n_groups; ++gg) {
        m_tot = fmaxf(m_tot, ml_buf[((wm + gg * m_span) * 16 + g + 8 * h) * 2]);
      }
      const float m_scaled = m_tot == -INFINITY ? 0.f : m_tot * scale_log2;
      float l_tot = 0.f;
      for (int gg = 0; gg < n_groups; ++gg) {
        const float* ml = ml_buf + ((wm + gg * m_span) * 16 + g + 8 * h) * 2;
        l_tot += ml[1] * exp2f(ml[0] * scale_log2 - m_scaled);
      }
      f[h] = exp2f(m_i[h] * scale_log2 - m_scaled);
      m_i[h] = m_tot;
      l_row[h] = l_tot;
    }
    if (ng > 0 && warp_active) {
      float* dst = o_buf + ((ng - 1) * m_span + wm) * 32 * C::kOT * 4 + lane;
#pragma unroll
      for (int n = 0; n < C::kOT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[(n * 4 + e) * 32] = o[n][e] * f[e >> 1];
      }
    }
    __syncthreads();
    if (ng > 0) return;
#pragma unroll
    for (int n = 0; n < C::kOT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= f[e >> 1];
    }
    for (int gg = 1; gg < n_groups; ++gg) {
      const float* src = o_buf + ((gg - 1) * m_span + wm) * 32 * C::kOT * 4 + lane;
#pragma unroll
      for (int n = 0; n < C::kOT; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] += src[(n * 4 + e) * 32];
      }
    }
  }
  if (!warp_active) return;

  const float v_scale = p.v_scale[kvh];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = l_row[h];
    if (!row_ok(h)) continue;
    const float inv = l > 0.f ? v_scale / l : 0.f;
    if (p.num_splits == 1) {
      QT* orow = static_cast<QT*>(p.out) + row_tok(h) * p.o_stride_t + row_head(h) * p.o_stride_h;
#pragma unroll
      for (int J = 0; J < D / (8 * C::kEpw); ++J) {
        // This thread's 2 * kEpw adjacent output dims (see top comment).
        uint32_t packed[C::kEpw];
        float vals[2 * C::kEpw];
#pragma unroll
        for (int i = 0; i < C::kEpw; ++i) {
          vals[i] = o[C::kEpw * J + i][2 * h] * inv;
          vals[C::kEpw + i] = o[C::kEpw * J + i][2 * h + 1] * inv;
        }
#pragma unroll
        for (int e = 0; e < C::kEpw; ++e) packed[e] = pack2<QT>(vals[2 * e], vals[2 * e + 1]);
        QT* dst = orow + 8 * C::kEpw * J + 2 * C::kEpw * t;
        if constexpr (C::kEpw == 4) {
          *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        } else {
          *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
        }
      }
    } else {
      const int64_t ws_row =
          (static_cast<int64_t>(split) * p.num_tokens + row_tok(h)) * p.num_q_heads + row_head(h);
      float* wrow = p.ws_o + ws_row * D;
#pragma unroll
      for (int J = 0; J < D / (8 * C::kEpw); ++J) {
        float* dst = wrow + 8 * C::kEpw * J + 2 * C::kEpw * t;
#pragma unroll
        for (int i = 0; i < C::kEpw; ++i) {
          dst[i] = o[C::kEpw * J + i][2 * h] * inv;
          dst[C::kEpw + i] = o[C::kEpw * J + i][2 * h + 1] * inv;
        }
      }
      if (t == 0) p.ws_lse[ws_row] = l > 0.f ? m_i[h] * scale_log2 + __log2f(l) : -INFINITY;
    }
  }
}

// Raises the kernel's dynamic shared-memory limit, once per device (on the first, eager call,
// so that graph capture sees only launches).
template <int D, typename QT, int KV>
cudaError_t prepare_kernel() {
  using C = AttnConfig<D, QT, KV>;
  if (C::kSmem <= 48 * 1024) return cudaSuccess;
  static std::atomic<uint64_t> raised{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = uint64_t{1} << (device & 63);
  if (raised.load(std::memory_order_acquire) & bit) return cudaSuccess;
  err = cudaFuncSetAttribute(paged_attention_kernel<D, QT, KV>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, C::kSmem);
  if (err == cudaSuccess) raised.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

// Launches the kernel, or with `ctas_per_sm` set only reports how many of its CTAs fit on one
// SM of the current device (the host sizes split-KV with it).
template <int D, typename QT, int KV>
cudaError_t launch_attention_t(const AttnParams& p, cudaStream_t stream, int* ctas_per_sm) {
  using C = AttnConfig<D, QT, KV>;
  const cudaError_t err = prepare_kernel<D, QT, KV>();
  if (err != cudaSuccess) return err;
  if (ctas_per_sm != nullptr) {
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        ctas_per_sm, paged_attention_kernel<D, QT, KV>, C::kThreads, C::kSmem);
  }
  const dim3 grid((p.max_seqlen_q * p.group + kBlockM - 1) / kBlockM, p.num_kv_heads,
                  p.num_seqs * p.num_splits);
  paged_attention_kernel<D, QT, KV><<<grid, C::kThreads, C::kSmem, stream>>>(p);
  return cudaGetLastError();
}

// A 16-bit cache runs only under a query of its own dtype: converting bf16 keys to fp16 could
// overflow, so cuda_backend sends the mixed 16-bit pairs to Triton (fp32 dots) instead.
template <int D, typename QT>
cudaError_t launch_attention_for_cache(const AttnParams& p, int kv_dtype, cudaStream_t s,
                                       int* ctas_per_sm) {
  constexpr int kOwnDtype = std::is_same_v<QT, __half> ? kFP16 : kBF16;
  switch (kv_dtype) {
    case kE4M3: return launch_attention_t<D, QT, kE4M3>(p, s, ctas_per_sm);
    case kE5M2: return launch_attention_t<D, QT, kE5M2>(p, s, ctas_per_sm);
    case kOwnDtype: return launch_attention_t<D, QT, kOwnDtype>(p, s, ctas_per_sm);
    default: return cudaErrorInvalidValue;
  }
}

// Instantiates the six (query dtype x cache dtype) kernels of one head dim.
template <int D>
cudaError_t launch_attention_for_dim(const AttnParams& p, int q_dtype, int kv_dtype,
                                     cudaStream_t s, int* ctas_per_sm) {
  if (q_dtype == kBF16) {
    return launch_attention_for_cache<D, __nv_bfloat16>(p, kv_dtype, s, ctas_per_sm);
  }
  if (q_dtype == kFP16) return launch_attention_for_cache<D, __half>(p, kv_dtype, s, ctas_per_sm);
  return cudaErrorInvalidValue;
}

}  // namespace fp8nca
