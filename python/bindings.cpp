// pybind11 module fp8_noncausal_attn._C: the CUDA kernels from raw device pointers, the plan
// function, version queries, and host hooks that run the kernels' own index maps and cache
// quantisation on the CPU (tests/test_cuda_kernel_emulation.py). Taking integers (pointers,
// strides, the stream handle) rather than torch tensors keeps the extension independent of the
// torch build it runs next to.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cache/quantize.h"
#include "cache/reshape_and_cache.h"
#include "cascade/merge.h"
#include "cascade/merge_row.h"
#include "common/index_tensors.h"
#include "common/launch.h"
#include "common/params.h"
#include "common/plan.h"
#include "mma_sync/fp8_bits.h"
#include "mma_sync/index_maps.h"

namespace py = pybind11;

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("fp8_noncausal_attn._C: ") + what + ": " +
                             cudaGetErrorString(err));
  }
}

template <typename T>
T* ptr(std::uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// Makes `device` current for the scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Largest power of two (<= 16 bytes) dividing a 16-bit tensor's address and its strides: the
// kernels pick their store width from it, so any `out` the API admits is written in place.
int alignment_of(std::uintptr_t address, int64_t stride_t, int64_t stride_h) {
  int align = 16;
  for (const uint64_t bytes : {static_cast<uint64_t>(address), static_cast<uint64_t>(stride_t) * 2,
                               static_cast<uint64_t>(stride_h) * 2}) {
    while (align > 1 && bytes % align != 0) align /= 2;
  }
  return align;
}

int log2_exact(int x) {
  int shift = 0;
  while ((1 << shift) < x) ++shift;
  if ((1 << shift) != x) {
    throw std::invalid_argument("fp8_noncausal_attn._C: block_size must be a power of two");
  }
  return shift;
}

fp8nca::PlanInput plan_input(int num_seqs, int num_tokens, int num_q_heads, int num_kv_heads,
                             int head_dim, int kv_dtype, int max_seqlen_q, int max_seqlen_k,
                             int64_t resident_ctas, int num_splits, int window_left,
                             int window_right, bool all_causal) {
  fp8nca::PlanInput in;
  in.num_seqs = num_seqs;
  in.num_tokens = num_tokens;
  in.num_q_heads = num_q_heads;
  in.num_kv_heads = num_kv_heads;
  in.head_dim = head_dim;
  in.kv_dtype = kv_dtype;
  in.max_seqlen_q = max_seqlen_q;
  in.max_seqlen_k = max_seqlen_k;
  in.resident_ctas = resident_ctas;
  in.num_splits = num_splits;
  in.window_left = window_left;
  in.window_right = window_right;
  in.all_causal = all_causal;
  return in;
}

py::dict plan(int num_seqs, int num_tokens, int num_q_heads, int num_kv_heads, int head_dim,
              int kv_dtype, int max_seqlen_q, int max_seqlen_k, int64_t resident_ctas,
              int num_splits, int window_left, int window_right, bool causal) {
  const fp8nca::Plan p = fp8nca::make_plan(plan_input(
      num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, kv_dtype, max_seqlen_q,
      max_seqlen_k, resident_ctas, num_splits, window_left, window_right, causal));
  py::dict d;
  d["family"] = "mma_sync";
  // The kernel the launch runs: its demangled name is kernel_name<head_dim, QT, KV>.
  d["kernel_name"] = p.block_m == fp8nca::mma_sync::kBlockM ? "paged_attention_kernel"
                                                            : "paged_attention_kernel_m128";
  d["block_m"] = p.block_m;
  d["block_n"] = p.block_n;
  d["threads"] = p.threads;
  d["smem_bytes"] = p.smem_bytes;
  d["m_tiles"] = p.m_tiles;
  d["num_splits"] = p.num_splits;
  d["grid"] = py::make_tuple(p.grid_x, p.grid_y, p.grid_z);
  d["ws_o_elems"] = p.ws_o_elems;
  d["ws_lse_elems"] = p.ws_lse_elems;
  return d;
}

// CTAs of the attention kernel for (head_dim, tile of block_m rows, dtypes) that fit on one SM
// of `device`.
int ctas_per_sm(int device, int head_dim, int q_dtype, int kv_dtype, int block_m) {
  const DeviceGuard guard(device);
  int ctas = 0;
  check(fp8nca::ctas_per_sm(fp8nca::Family::kMmaSync, head_dim, block_m, q_dtype, kv_dtype,
                            &ctas),
        "occupancy query");
  return ctas;
}

// Launches attention (and the split-KV merge when num_splits > 1) on `stream`. Asynchronous.
void paged_attention(int device, std::uintptr_t stream, std::uintptr_t q, std::uintptr_t k,
                     std::uintptr_t v, std::uintptr_t out, std::uintptr_t block_table,
                     std::uintptr_t cu_seqlens_q, std::uintptr_t seq_lens, std::uintptr_t k_scale,
                     std::uintptr_t v_scale, std::uintptr_t causal_per_seq, int causal_bytes,
                     int64_t causal_stride, bool causal, std::uintptr_t sinks, int window_left,
                     int window_right, std::uintptr_t ws_o,
                     std::uintptr_t ws_lse, int q_dtype, int kv_dtype, py::tuple q_strides,
                     py::tuple o_strides, py::tuple k_strides, py::tuple v_strides,
                     py::tuple bt_strides, int64_t cu_stride, int64_t sl_stride,
                     int num_tokens, int num_seqs, int num_q_heads, int num_kv_heads,
                     int head_dim, int block_size, int max_seqlen_q, int num_splits,
                     float softmax_scale) {
  fp8nca::AttnParams p{};
  p.q = ptr<const void>(q);
  p.k = ptr<const void>(k);
  p.v = ptr<const void>(v);
  p.out = ptr<void>(out);
  p.block_table = ptr<const int32_t>(block_table);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.seq_lens = ptr<const int32_t>(seq_lens);
  p.k_scale = ptr<const float>(k_scale);
  p.v_scale = ptr<const float>(v_scale);
  p.causal_per_seq = ptr<const void>(causal_per_seq);
  p.causal_bytes = causal_bytes;
  p.causal_stride = causal_stride;
  p.sinks = ptr<const float>(sinks);
  p.window_left = window_left;
  p.window_right = window_right;
  p.ws_o = ptr<float>(ws_o);
  p.ws_lse = ptr<float>(ws_lse);
  p.q_stride_t = q_strides[0].cast<int64_t>();
  p.q_stride_h = q_strides[1].cast<int64_t>();
  p.o_stride_t = o_strides[0].cast<int64_t>();
  p.o_stride_h = o_strides[1].cast<int64_t>();
  p.k_stride_b = k_strides[0].cast<int64_t>();
  p.k_stride_s = k_strides[1].cast<int64_t>();
  p.k_stride_h = k_strides[2].cast<int64_t>();
  p.v_stride_b = v_strides[0].cast<int64_t>();
  p.v_stride_s = v_strides[1].cast<int64_t>();
  p.v_stride_h = v_strides[2].cast<int64_t>();
  p.bt_stride_s = bt_strides[0].cast<int64_t>();
  p.bt_stride_b = bt_strides[1].cast<int64_t>();
  p.cu_stride = cu_stride;
  p.sl_stride = sl_stride;
  p.out_align = alignment_of(out, p.o_stride_t, p.o_stride_h);
  p.num_tokens = num_tokens;
  p.num_seqs = num_seqs;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.block_shift = log2_exact(block_size);
  p.max_seqlen_q = max_seqlen_q;
  p.causal = causal ? 1 : 0;
  p.softmax_scale = softmax_scale;
  if (causal_per_seq != 0 && causal_bytes != 1 && causal_bytes != 4) {
    throw std::invalid_argument(
        "fp8_noncausal_attn._C: causal_bytes must be 1 (bool) or 4 (int32)");
  }
  if (window_left < -1 || window_right < -1) {
    throw std::invalid_argument("fp8_noncausal_attn._C: window sides must be -1 or >= 0");
  }
  // With no sequence every row is padding: the launch still zeroes them.
  if (num_tokens == 0) return;
  // max_seqlen_q == 0: no sequence has query rows, only padded rows (if any) to zero.
  const fp8nca::Plan plan = fp8nca::make_plan(plan_input(
      num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim, kv_dtype,
      max_seqlen_q, 1, 0, num_splits, window_left, window_right, causal));
  p.num_splits = plan.num_splits;
  if (plan.num_splits > 1 && (ws_o == 0 || ws_lse == 0)) {
    throw std::invalid_argument("fp8_noncausal_attn._C: num_splits > 1 needs ws_o and ws_lse");
  }
  const DeviceGuard guard(device);
  check(fp8nca::launch_attention(plan, p, q_dtype, kv_dtype,
                                 reinterpret_cast<cudaStream_t>(stream)),
        "attention launch");
}

// The split-KV merge kernel (csrc/cascade/merge.cu) on partials another kernel family wrote
// (the CUTLASS-DSL families): ws_o fp32 [num_splits, num_tokens, num_q_heads, head_dim] and
// ws_lse fp32 [num_splits, num_tokens, num_q_heads] (log2 units), both contiguous, into `out`
// [num_tokens, num_q_heads, head_dim] of the query dtype through its strides; sinks: fp32
// [num_q_heads] natural-log logits or 0; rows past cu_seqlens_q[num_seqs] written as zeros.
// Asynchronous on `stream`.
void merge_splits(int device, std::uintptr_t stream, std::uintptr_t ws_o, std::uintptr_t ws_lse,
                  std::uintptr_t out, py::tuple o_strides, std::uintptr_t sinks,
                  std::uintptr_t cu_seqlens_q, int64_t cu_stride, int num_seqs, int num_splits,
                  int num_tokens, int num_q_heads, int head_dim, int q_dtype) {
  if (num_splits < 1 || num_seqs < 0 || num_tokens < 0 || num_q_heads < 1 || head_dim < 1) {
    throw std::invalid_argument("fp8_noncausal_attn._C: merge_splits got an empty or negative "
                                "size");
  }
  if (q_dtype != fp8nca::kBF16 && q_dtype != fp8nca::kFP16) {
    throw std::invalid_argument("fp8_noncausal_attn._C: merge_splits writes bf16 or fp16");
  }
  if (ws_o == 0 || ws_lse == 0 || out == 0 || cu_seqlens_q == 0) {
    throw std::invalid_argument("fp8_noncausal_attn._C: merge_splits needs every pointer");
  }
  fp8nca::AttnParams p{};
  p.out = ptr<void>(out);
  p.o_stride_t = o_strides[0].cast<int64_t>();
  p.o_stride_h = o_strides[1].cast<int64_t>();
  p.ws_o = ptr<float>(ws_o);
  p.ws_lse = ptr<float>(ws_lse);
  p.sinks = ptr<const float>(sinks);
  p.cu_seqlens_q = ptr<const int32_t>(cu_seqlens_q);
  p.cu_stride = cu_stride;
  p.num_seqs = num_seqs;
  p.num_splits = num_splits;
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.head_dim = head_dim;
  const DeviceGuard guard(device);
  check(fp8nca::launch_merge(p, q_dtype, reinterpret_cast<cudaStream_t>(stream)),
        "merge launch");
}

void reshape_and_cache(int device, std::uintptr_t stream, std::uintptr_t key,
                       std::uintptr_t value, std::uintptr_t key_cache,
                       std::uintptr_t value_cache, std::uintptr_t slot_mapping,
                       std::uintptr_t k_scale, std::uintptr_t v_scale, py::tuple key_strides,
                       py::tuple value_strides, py::tuple kc_strides, py::tuple vc_strides,
                       int64_t slot_stride, int num_tokens, int num_kv_heads, int head_dim,
                       int block_size, int in_dtype, int cache_dtype) {
  fp8nca::CacheWriteParams p{};
  p.key = ptr<const void>(key);
  p.value = ptr<const void>(value);
  p.key_cache = ptr<void>(key_cache);
  p.value_cache = ptr<void>(value_cache);
  p.slot_mapping = ptr<const int64_t>(slot_mapping);
  p.k_scale = ptr<const float>(k_scale);
  p.v_scale = ptr<const float>(v_scale);
  p.key_stride_t = key_strides[0].cast<int64_t>();
  p.key_stride_h = key_strides[1].cast<int64_t>();
  p.value_stride_t = value_strides[0].cast<int64_t>();
  p.value_stride_h = value_strides[1].cast<int64_t>();
  p.kc_stride_b = kc_strides[0].cast<int64_t>();
  p.kc_stride_s = kc_strides[1].cast<int64_t>();
  p.kc_stride_h = kc_strides[2].cast<int64_t>();
  p.vc_stride_b = vc_strides[0].cast<int64_t>();
  p.vc_stride_s = vc_strides[1].cast<int64_t>();
  p.vc_stride_h = vc_strides[2].cast<int64_t>();
  p.slot_stride = slot_stride;
  p.num_tokens = num_tokens;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.block_size = block_size;
  p.in_dtype = in_dtype;
  p.cache_dtype = cache_dtype;
  if (in_dtype != fp8nca::kBF16 && in_dtype != fp8nca::kFP16) {
    throw std::invalid_argument("fp8_noncausal_attn._C: key/value must be bf16 or fp16");
  }
  const DeviceGuard guard(device);
  check(fp8nca::launch_reshape_and_cache(p, reinterpret_cast<cudaStream_t>(stream)),
        "reshape_and_cache launch");
}

int driver_version() {
  int version = 0;
  // 0 when no driver is installed (the call itself needs none).
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

// --- host hooks: the kernels' own maps, compiled for the CPU ----------------------------------

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
        {"k_row", s.k_row}, {"v_row", s.v_row}, {"nt", s.nt}, {"ot", s.ot},
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
  // FP8 tiles: slot -> (K, V unit offsets in the FP8 stage, then the two 16-bit units of the
  // dequantised tile each lands in: K unit 0, K unit 1, V unit 0, V unit 1).
  d["dequant"] = table([&](int slot) {
    const int r = m::copy_row(s, slot), u = m::copy_unit(s, slot);
    return std::vector<int>{m::k_smem_offset(s, r, u), m::v_smem_offset(s, r, u),
                            m::k_smem_offset(c, r, m::wide_unit(u, 0)),
                            m::k_smem_offset(c, r, m::wide_unit(u, 1)),
                            m::v_smem_offset(c, r, m::wide_unit(u, 0)),
                            m::v_smem_offset(c, r, m::wide_unit(u, 1))};
  }, elt == 1 ? slots : 0);
  d["qk_dim"] = table([&](int g, int kk, int t) { return m::qk_dim(s, g, kk, t); }, s.groups,
                      s.steps_per_unit, 4);
  d["k_frag"] = table([&](int j, int g, int lane) { return m::k_frag_offset(s, j, g, lane); },
                      s.nt, s.groups, 32);
  // ldmatrix.x4.trans row addresses of the P V operand, [kk][jp][lane]
  d["v_ldsm"] = table([&](int kk, int jp, int lane) { return m::v_ldsm_offset(s, kk, jp, lane); },
                      s.block_n / 16, s.ot / 2, 32);
  d["out_dim"] = table([](int j, int t) { return m::out_dim(j, t); }, s.ot, 4);
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "CUDA paged attention kernels of fp8_noncausal_attn (mma.sync family, cp.async).";
  m.def("paged_attention", &paged_attention, py::arg("device"), py::arg("stream"), py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("out"), py::arg("block_table"),
        py::arg("cu_seqlens_q"), py::arg("seq_lens"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("causal_per_seq"), py::arg("causal_bytes"), py::arg("causal_stride"),
        py::arg("causal"), py::arg("sinks"), py::arg("window_left"), py::arg("window_right"),
        py::arg("ws_o"), py::arg("ws_lse"), py::arg("q_dtype"),
        py::arg("kv_dtype"), py::arg("q_strides"), py::arg("o_strides"), py::arg("k_strides"),
        py::arg("v_strides"), py::arg("bt_strides"), py::arg("cu_stride"),
        py::arg("sl_stride"), py::arg("num_tokens"), py::arg("num_seqs"),
        py::arg("num_q_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("block_size"), py::arg("max_seqlen_q"), py::arg("num_splits"),
        py::arg("softmax_scale"));
  m.def("reshape_and_cache", &reshape_and_cache, py::arg("device"), py::arg("stream"),
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::arg("k_scale"), py::arg("v_scale"),
        py::arg("key_strides"), py::arg("value_strides"), py::arg("kc_strides"),
        py::arg("vc_strides"), py::arg("slot_stride"), py::arg("num_tokens"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("block_size"),
        py::arg("in_dtype"), py::arg("cache_dtype"));
  m.def("merge_splits", &merge_splits, py::arg("device"), py::arg("stream"), py::arg("ws_o"),
        py::arg("ws_lse"), py::arg("out"), py::arg("o_strides"), py::arg("sinks"),
        py::arg("cu_seqlens_q"), py::arg("cu_stride"), py::arg("num_seqs"), py::arg("num_splits"),
        py::arg("num_tokens"), py::arg("num_q_heads"), py::arg("head_dim"), py::arg("q_dtype"),
        "The split-KV merge kernel on fp32 partials [splits, tokens, q_heads(, head_dim)] "
        "(log2 LSE) into out; padded rows past cu_seqlens_q[num_seqs] zeroed. Asynchronous.");
  m.def("plan", &plan, py::arg("num_seqs"), py::arg("num_tokens"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("kv_dtype"),
        py::arg("max_seqlen_q"), py::arg("max_seqlen_k"), py::arg("resident_ctas"),
        py::arg("num_splits") = 0, py::arg("window_left") = -1, py::arg("window_right") = -1,
        py::arg("causal") = false,
        "Tiles, split-KV count, grid and workspace sizes of one batch (host only, no GPU); "
        "causal: every sequence is causal (sizes splits from a windowed key span).");
  m.def("ctas_per_sm", &ctas_per_sm, py::arg("device"), py::arg("head_dim"), py::arg("q_dtype"),
        py::arg("kv_dtype"), py::arg("block_m") = fp8nca::mma_sync::kBlockM,
        "CTAs of the attention kernel (tile of block_m query rows) resident per SM (occupancy).");
  m.def("block_m_for", &fp8nca::block_m_for, py::arg("head_dim"), py::arg("kv_dtype"),
        py::arg("rows_per_kv_head"),
        "Query rows per CTA the plan picks for R = max_seqlen_q x group rows per KV head.");
  m.def("driver_version", &driver_version,
        "The installed CUDA driver's version (cudaDriverGetVersion; 0 when none).");
  m.attr("CUDA_RUNTIME_VERSION") = CUDART_VERSION;
  m.attr("CUDA_ARCHS") = FP8NCA_CUDA_ARCHS;
  m.attr("PTX_ARCH") = FP8NCA_PTX_ARCH;  // PTX of the newest arch, JIT-compiled for newer GPUs
  m.attr("MAX_SEQS") = fp8nca::kMaxSeqs;
  m.attr("MAX_SPLITS") = fp8nca::kMaxSplits;
  m.attr("WAVE_FILL") = fp8nca::kWaveFill;

  py::module_ host = m.def_submodule(
      "host", "The kernels' own maps compiled for the CPU, for tests without a GPU.");
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
  host.def("mma_sync_tables", &mma_sync_tables, py::arg("head_dim"), py::arg("elt"),
           py::arg("block_m") = fp8nca::mma_sync::kBlockM,
           "Tile shape and shared-memory / fragment index maps of the mma.sync family (tile of "
           "block_m query rows).");
  namespace ms = fp8nca::mma_sync;
  host.def("tile_page", &ms::tile_page, py::arg("r"), py::arg("block_shift"));
  host.def("bit_dequant_k", &ms::bit_dequant_k, py::arg("q_dtype"), py::arg("kv_dtype"));
  host.def("fp8x4_to_bf16x2_scaled", [](uint32_t w, int kv_dtype) {
    return py::make_tuple(ms::fp8x4_even_to_bf16x2_scaled(w, kv_dtype),
                          ms::fp8x4_odd_to_bf16x2_scaled(w, kv_dtype),
                          ms::fp8_to_bf16_scale(kv_dtype));
  }, py::arg("word"), py::arg("kv_dtype"));
  host.def("fp8x4_special_bits", &ms::fp8x4_special_bits, py::arg("word"), py::arg("kv_dtype"));
  host.def("e5m2x4_to_f16x2", [](uint32_t w) {
    return py::make_tuple(ms::e5m2x4_low_to_f16x2(w), ms::e5m2x4_high_to_f16x2(w));
  }, py::arg("word"));
  host.def("bf16_k_dim", &ms::bf16_k_dim, py::arg("position"));
  host.def("page_key", &ms::page_key, py::arg("n0"), py::arg("r"), py::arg("block_size"));
  host.def("key_groups", [](int head_dim, int elt, int rows_in_tile, int block_m) {
    return ms::key_groups(ms::tile_shape(head_dim, elt, block_m), rows_in_tile);
  }, py::arg("head_dim"), py::arg("elt"), py::arg("rows_in_tile"),
     py::arg("block_m") = ms::kBlockM);
  def_key_range_hooks(host);
}
