// pybind11 module fp8nca_host_hooks, for the tests only (never in the wheel): the kernels' own
// index maps, the cache quantisation and the split-KV merge row, compiled for the CPU by a host
// C++ compiler (the functions are FP8NCA_HD, see csrc/common/host_device.h), so that the CPU
// tests (tests/test_cuda_kernel_emulation.py) check the very maps the kernels use. Built and
// loaded by tests/helpers/host_hooks.py; needs no CUDA toolkit.
#include <array>
#include <cstdint>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cache/quantize.h"
#include "cascade/merge_row.h"
#include "common/index_tensors.h"
#include "common/params.h"
#include "mma_sync/fp8_bits.h"
#include "mma_sync/index_maps.h"
#include "simt/cuda_twin.h"

namespace py = pybind11;

namespace {

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

std::vector<uint32_t> quantize_host(const std::vector<float>& values, float scale, int dtype) {
  std::vector<uint32_t> codes;
  codes.reserve(values.size());
  for (const float x : values) codes.push_back(fp8nca::cache::quantize(x, scale, dtype));
  return codes;
}

// (q_start, q_len, kv_len, causal) of every sequence and the first padded row, read from host
// (CPU) copies of the index tensors by the functions the kernels read them with.
py::tuple sequences_host(std::uintptr_t cu_seqlens_q, int64_t cu_stride, std::uintptr_t seq_lens,
                         int64_t sl_stride, std::uintptr_t causal_per_seq, int causal_bytes,
                         int64_t causal_stride, bool causal, int num_seqs) {
  fp8nca::AttnParams p{};
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.cu_stride = cu_stride;
  p.seq_lens = ptr<const int32_t>(seq_lens);
  p.sl_stride = sl_stride;
  p.causal_per_seq = ptr<const void>(causal_per_seq);
  p.causal_bytes = causal_bytes;
  p.causal_stride = causal_stride;
  p.causal = causal ? 1 : 0;
  py::list seqs;
  for (int s = 0; s < num_seqs; ++s) {
    const int q_start = fp8nca::cu_seqlens_at(p, s);
    seqs.append(py::make_tuple(q_start, fp8nca::cu_seqlens_at(p, s + 1) - q_start,
                               fp8nca::seq_len_at(p, s), fp8nca::seq_is_causal(p, s)));
  }
  return py::make_tuple(seqs, fp8nca::cu_seqlens_at(p, num_seqs));
}

// One row of the split-KV merge by merge.cu's own arithmetic (merge_row.h): partials
// o[split][d], lse[split] (log2), the sink in log2 units (-inf: none).
std::vector<float> merge_row_host(const std::vector<std::vector<float>>& o,
                                  const std::vector<float>& lse, float sink) {
  const int splits = static_cast<int>(lse.size());
  if (splits < 1 || o.size() != lse.size()) {
    throw std::invalid_argument("merge_row: one partial row and one lse per split");
  }
  const size_t dims = o[0].size();
  std::vector<float> flat;
  for (const auto& row : o) {
    if (row.size() != dims) throw std::invalid_argument("merge_row: rows of unequal length");
    flat.insert(flat.end(), row.begin(), row.end());
  }
  const fp8nca::MergeScale scale = fp8nca::merge_scale(lse.data(), 1, splits, sink);
  std::vector<float> merged(dims);
  for (size_t d = 0; d < dims; ++d) {
    merged[d] = fp8nca::merge_element(flat.data() + d, static_cast<int64_t>(dims), lse.data(), 1,
                                      splits, scale);
  }
  return merged;
}

// The merged state's log2-sum-exp by merge.cu's own arithmetic (merge_row.h): lse[split]
// (log2), the sink in log2 units (-inf: none); -inf when no split saw a key.
float merge_lse_host(const std::vector<float>& lse, float sink) {
  if (lse.empty()) throw std::invalid_argument("merge_lse: at least one split");
  return fp8nca::merge_scale(lse.data(), 1, static_cast<int>(lse.size()), sink).lse;
}

// A map sampled at every index of [0, n) x [0, rest)...: nested Python lists, outermost index
// first (table(f, 2, 4)[i][j] == f(i, j)).
template <typename F>
py::list table(const F& f, int n) {
  py::list out;
  for (int i = 0; i < n; ++i) out.append(py::cast(f(i)));
  return out;
}

template <typename F, typename... Rest>
py::list table(const F& f, int n, Rest... rest) {
  py::list out;
  for (int i = 0; i < n; ++i) {
    out.append(table([&f, i](auto... inner) { return f(i, inner...); }, rest...));
  }
  return out;
}

py::dict mma_sync_tables(int head_dim, int elt, int block_m) {
  namespace m = fp8nca::mma_sync;
  const m::TileShape s = m::tile_shape(head_dim, elt, block_m);
  const m::TileShape c = m::compute_shape(head_dim, block_m);
  py::dict d;
  for (const auto& [name, value] :
       {std::pair<const char*, int>{"head_dim", s.head_dim}, {"elt", s.elt},
        {"block_m", s.block_m}, {"warps", s.warps}, {"threads", s.threads},
        {"block_n", s.block_n}, {"units", s.units}, {"e", s.e},
        {"steps_per_unit", s.steps_per_unit}, {"groups", s.groups},
        {"k_row", s.k_row}, {"v_row", s.v_row}, {"scale_bytes", s.scale_bytes},
        {"nt", s.nt}, {"ot", s.ot},
        {"max_key_groups", s.max_key_groups}, {"stage_bytes", s.stage_bytes},
        {"copy_slots", m::copy_slots(s)}, {"copy_row_step", m::copy_row_step(s)},
        {"stages", s.stages}, {"q_bytes", s.q_bytes}, {"wide_bytes", s.wide_bytes},
        {"smem", s.smem}}) {
    d[name] = value;
  }
  const int slots = s.block_n * s.units;
  // Tile copy: slot -> (key row, unit) and the unit's K / V stage offsets.
  d["copy"] = table([&](int slot) {
    const int r = m::copy_row(s, slot), u = m::copy_unit(s, slot);
    return std::vector<int>{r, u, m::k_smem_offset(s, r, u), m::v_smem_offset(s, r, u)};
  }, slots);
  // 1-byte tiles: key row -> the offsets of its per-token-head K and V scale in the V stage.
  d["scale"] = table([&](int r) {
    return std::vector<int>{m::scale_smem_offset(s, r, 0), m::scale_smem_offset(s, r, 1)};
  }, elt == 1 ? s.block_n : 0);
  // ldmatrix.x4.trans row addresses of the P V operand, [kk][jp][lane]
  d["v_ldsm"] = table([&](int kk, int jp, int lane) { return m::v_ldsm_offset(s, kk, jp, lane); },
                      s.block_n / 16, s.ot / 2, 32);
  return d;
}

// The key-range maps of index_maps.h (window, mask, tiles, splits) as tuples: KeyRange as
// (first, n_keys, free_first, free_count), RowKeys as (lo, hi), TileRange as (begin, end).
using KeyTuple = std::tuple<int, int, int, int>;
using PairTuple = std::pair<int, int>;

fp8nca::mma_sync::KeyRange key_range(const KeyTuple& k) {
  return {std::get<0>(k), std::get<1>(k), std::get<2>(k), std::get<3>(k)};
}

void def_key_range_hooks(py::module_& host) {
  namespace ms = fp8nca::mma_sync;
  host.def("row_keys", [](int left, int right, bool causal, int kv_len, int q_len, int row,
                          int group) {
    const ms::RowKeys r = ms::row_keys({left, right}, causal, kv_len, q_len, row, group);
    return PairTuple{r.lo, r.hi};
  }, py::arg("left"), py::arg("right"), py::arg("causal"), py::arg("kv_len"), py::arg("q_len"),
     py::arg("row"), py::arg("group"), "Keys [lo, hi] one row sees (mask and window).");
  host.def("key_visible", [](const PairTuple& r, int key) {
    return ms::key_visible({r.first, r.second}, key);
  }, py::arg("row_keys"), py::arg("key"), "The mask's per-element test.");
  host.def("cta_keys", [](int left, int right, bool causal, int kv_len, int q_len, int row0,
                          int last_row, int group, int block_n) {
    const ms::KeyRange k =
        ms::cta_keys({left, right}, causal, kv_len, q_len, row0, last_row, group, block_n);
    return KeyTuple{k.first, k.n_keys, k.free_first, k.free_count};
  }, py::arg("left"), py::arg("right"), py::arg("causal"), py::arg("kv_len"), py::arg("q_len"),
     py::arg("row0"), py::arg("last_row"), py::arg("group"), py::arg("block_n"),
     "A CTA's keys: (first, n_keys, free_first, free_count).");
  host.def("tile_needs_mask", [](const KeyTuple& k, int n0) {
    return ms::tile_needs_mask(key_range(k), n0);
  }, py::arg("keys"), py::arg("n0"));
  host.def("cta_tiles", [](const KeyTuple& k, int block_n) {
    const ms::TileRange r = ms::cta_tiles(key_range(k), block_n);
    return PairTuple{r.begin, r.end};
  }, py::arg("keys"), py::arg("block_n"));
  host.def("split_tiles", [](const PairTuple& tiles, int num_splits, int split) {
    const ms::TileRange r = ms::split_tiles({tiles.first, tiles.second}, num_splits, split);
    return PairTuple{r.begin, r.end};
  }, py::arg("tiles"), py::arg("num_splits"), py::arg("split"));
}

}  // namespace

// The SIMT executor's CPU twin of the hardware's conversions (csrc/simt/cuda_twin.h), element
// by element over lists.
template <typename F>
std::vector<uint32_t> each(const std::vector<uint32_t>& words, F f) {
  std::vector<uint32_t> out;
  out.reserve(words.size());
  for (const uint32_t w : words) out.push_back(f(w));
  return out;
}

// One warp of the executor running mma.sync m16n8k16 on A (16 x 16), B (16 x 8, k x n) and
// C (16 x 8), the fragments placed as the PTX ISA's figures draw them: register i of A holds
// row g + 8 (i % 2), columns 2t + 8 (i / 2) and + 1; register i of B rows (k) 2t + 8i and + 1 of
// column g; accumulator i row g + 8 (i / 2), column 2t + i % 2 (lane = 4g + t).
void mma_probe(const uint16_t* a, const uint16_t* b, const float* c, float* d, bool bf16) {
  const int lane = static_cast<int>(threadIdx.x), g = lane / 4, t = lane % 4;
  const auto pair = [](const uint16_t* m, int i0, int i1) { return m[i0] | uint32_t{m[i1]} << 16; };
  uint32_t ra[4];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i % 2), col = 2 * t + 8 * (i / 2);
    ra[i] = pair(a, row * 16 + col, row * 16 + col + 1);
  }
  uint32_t rb[2];
  for (int i = 0; i < 2; ++i) rb[i] = pair(b, (2 * t + 8 * i) * 8 + g, (2 * t + 8 * i + 1) * 8 + g);
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = c[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2];
  if (bf16) {
    fp8nca::hw::mma_m16n8k16(acc, ra, rb[0], rb[1], __nv_bfloat16());
  } else {
    fp8nca::hw::mma_m16n8k16(acc, ra, rb[0], rb[1], __half());
  }
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i / 2)) * 8 + 2 * t + i % 2] = acc[i];
}

// One warp running ldmatrix.x4.trans on four 8 x 8 matrices of 16-bit words laid out row after
// row in shared memory: lane l gives the address of row l % 8 of matrix l / 8 and returns its
// four registers in out[4 l ..].
void ldmatrix_probe(const uint16_t* matrices, uint32_t* out) {
  const int lane = static_cast<int>(threadIdx.x);
  uint16_t* smem = fp8nca::hw::dynamic_smem<uint16_t>();
  for (int i = lane; i < 4 * 64; i += 32) smem[i] = matrices[i];
  __syncthreads();
  uint32_t regs[4];
  fp8nca::hw::ldmatrix_x4_trans(regs, fp8nca::hw::shared_address(smem + lane * 8));
  for (int i = 0; i < 4; ++i) out[4 * lane + i] = regs[i];
}

void def_twin_hooks(py::module_& host) {
  host.def("twin_mma_m16n8k16", [](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b,
                                   const std::vector<float>& c, bool bf16) {
    if (a.size() != 256 || b.size() != 128 || c.size() != 128) {
      throw std::invalid_argument("twin_mma_m16n8k16: A 16 x 16, B 16 x 8, C 16 x 8");
    }
    std::vector<float> d(128);
    if (fp8nca::simt::launch<mma_probe>(dim3(1), dim3(32), 0, a.data(), b.data(), c.data(),
                                        d.data(), bf16) != cudaSuccess) {
      throw std::runtime_error(fp8nca::simt::last_report());
    }
    return d;
  }, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("bf16"),
     "D = A B + C by the executor's mma.sync (bit patterns of A and B, row-major).");
  host.def("twin_ldmatrix_x4_trans", [](const std::vector<uint16_t>& matrices) {
    if (matrices.size() != 256) throw std::invalid_argument("four 8 x 8 matrices");
    std::vector<uint32_t> out(128);
    if (fp8nca::simt::launch<ldmatrix_probe>(dim3(1), dim3(32), 512, matrices.data(),
                                             out.data()) != cudaSuccess) {
      throw std::runtime_error(fp8nca::simt::last_report());
    }
    return out;
  }, py::arg("matrices"), "Each lane's four registers, [lane][register].");
  namespace hw = fp8nca::hw;
  host.def("twin_cvt_e4m3x2", [](const std::vector<uint32_t>& x) {
    return each(x, [](uint32_t w) { return hw::cvt_f16x2_e4m3x2(static_cast<uint16_t>(w)); });
  }, py::arg("pairs"), "cvt.rn.f16x2.e4m3x2 of 16-bit words (low byte -> low half).");
  host.def("twin_cvt_e5m2x2", [](const std::vector<uint32_t>& x) {
    return each(x, [](uint32_t w) { return hw::cvt_f16x2_e5m2x2(static_cast<uint16_t>(w)); });
  }, py::arg("pairs"));
  host.def("twin_fma_rn_bf16x2", [](const std::vector<std::array<uint32_t, 3>>& abc) {
    std::vector<uint32_t> out;
    for (const auto& [a, b, c] : abc) out.push_back(hw::fma_rn_bf16x2(a, b, c));
    return out;
  }, py::arg("abc"), "fma.rn.bf16x2 of (a, b, c) words.");
  host.def("twin_ex2_approx_ftz", [](const std::vector<float>& x) {
    std::vector<float> out;
    for (const float v : x) out.push_back(hw::ex2_approx_ftz(v));
    return out;
  }, py::arg("x"));
  host.def("twin_byte_perm", [](uint32_t a, uint32_t b, uint32_t selector) {
    return __byte_perm(a, b, selector);
  }, py::arg("a"), py::arg("b"), py::arg("selector"), "prmt.b32 (default mode).");
}

PYBIND11_MODULE(fp8nca_host_hooks, host) {
  host.doc() = "The CUDA kernels' own maps compiled for the CPU, for tests without a GPU.";
  host.def("quantize", &quantize_host, py::arg("values"), py::arg("scale"), py::arg("dtype"),
           "Cache-write codes (bit patterns) of fp32 values divided by scale.");
  host.def("sequences", &sequences_host, py::arg("cu_seqlens_q"), py::arg("cu_stride"),
           py::arg("seq_lens"), py::arg("sl_stride"), py::arg("causal_per_seq"),
           py::arg("causal_bytes"), py::arg("causal_stride"), py::arg("causal"),
           py::arg("num_seqs"),
           "Per-sequence (q_start, q_len, kv_len, causal) and the first padded row, from CPU "
           "index tensors read as the kernels read them.");
  host.def("merge_row", &merge_row_host, py::arg("o"), py::arg("lse"), py::arg("sink"),
           "One row of the split-KV merge by the merge kernel's arithmetic (merge_row.h): "
           "partials o[split][dim], log2 lse[split], the log2 sink (-inf: none).");
  host.def("merge_lse", &merge_lse_host, py::arg("lse"), py::arg("sink"),
           "The merged state's log2-sum-exp by the merge kernel's arithmetic (merge_row.h).");
  host.def("mma_sync_tables", &mma_sync_tables, py::arg("head_dim"), py::arg("elt"),
           py::arg("block_m") = fp8nca::mma_sync::kBlockM,
           "Tile shape and shared-memory / fragment index maps of the mma.sync family (tile of "
           "block_m query rows).");
  namespace ms = fp8nca::mma_sync;
  host.def("tile_page", &ms::tile_page, py::arg("r"), py::arg("block_shift"));
  host.def("bit_dequant_k", &ms::bit_dequant_k, py::arg("q_dtype"), py::arg("cache_dtype"));
  host.def("fp8x4_to_bf16x2_scaled", [](uint32_t w, int cache_dtype) {
    return py::make_tuple(ms::fp8x4_even_to_bf16x2_scaled(w, cache_dtype),
                          ms::fp8x4_odd_to_bf16x2_scaled(w, cache_dtype),
                          ms::fp8_to_bf16_scale(cache_dtype));
  }, py::arg("word"), py::arg("cache_dtype"));
  host.def("fp8x4_special_bits", &ms::fp8x4_special_bits, py::arg("word"), py::arg("cache_dtype"));
  host.def("e5m2x4_to_f16x2", [](uint32_t w) {
    return py::make_tuple(ms::e5m2x4_low_to_f16x2(w), ms::e5m2x4_high_to_f16x2(w));
  }, py::arg("word"));
  host.def("int8x4_to_biased_f16x2", [](uint32_t w) {
    return py::make_tuple(ms::int8x4_low_to_biased_f16x2(w), ms::int8x4_high_to_biased_f16x2(w),
                          ms::kInt8F16Bias);
  }, py::arg("word"), "int8 bytes as biased fp16 pairs (low, high) and the bias to subtract.");
  host.def("bf16_k_dim", &ms::bf16_k_dim, py::arg("position"));
  host.def("page_key", &ms::page_key, py::arg("n0"), py::arg("r"), py::arg("block_size"));
  host.def("key_groups", [](int head_dim, int elt, int rows_in_tile, int block_m) {
    return ms::key_groups(ms::tile_shape(head_dim, elt, block_m), rows_in_tile);
  }, py::arg("head_dim"), py::arg("elt"), py::arg("rows_in_tile"),
     py::arg("block_m") = ms::kBlockM);
  def_key_range_hooks(host);
  def_twin_hooks(host);
}
