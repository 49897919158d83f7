// Paged attention on CPU that reads K/V blocks in place through the block table (no gather
// copy). One entry point serves decode (one query token per sequence) and prefill / chunked
// prefill (several query tokens per sequence, causal over the cached context).
//
// Work item = (sequence, KV head, chunk of up to QUERY_CHUNK query tokens). Its rows are the
// chunk's tokens x the KV head's G query heads (GQA), so each K/V block is loaded and converted
// to float32 once per item and used by all G x chunk rows. Per block, an online softmax in
// float32 per row r (m = running max, l = running sum, acc = unnormalized output):
//     m' = max(m, max_t s_t),  c = exp(m - m'),  l' = c l + sum_t exp(s_t - m'),
//     acc' = c acc + sum_t exp(s_t - m') v_t,      out = acc / l.
// Query token i of a sequence with context L and q_len new tokens sits at position
// L - q_len + i and sees keys [0, L - q_len + i]; positions >= L are never read (an unowned
// slot may hold anything, NaN included).
//
// Cache views: logical [num_blocks, block_size, num_kv_heads, head_dim] with any strides but a
// contiguous last dim (the torch backend's head-major cache is passed as a permuted view).

#include <torch/extension.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <omp.h>

#include "cpu_attention_api.h"
#include "cpu_simd.h"
#include "cpu_decode_bf16.h"
#include "cpu_prefill_amx.h"
#include "cpu_prefill_f32.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using namespace cpu_simd;  // f32x16 & co., load_vec, hsum, to_float (cpu_simd.h)
// (Plain loops with 16 accumulators were left scalar by GCC 12: hence the vector types.)
constexpr int QUERY_CHUNK = 16;  // query tokens per work item (prefill); decode has 1
constexpr int CACHE_LINE = 64;   // bytes
// Keys per pass of the decode path (read_kv_rows reads in its order): a span's K rows, then
// its V rows.
#if defined(CPU_BF16_PAIRS)
constexpr int DECODE_SPAN_KEYS = cpu_decode_bf16::SPAN_KEYS;
#else
constexpr int DECODE_SPAN_KEYS = 1;  // the generic path: a block's K rows, then its V rows
#endif

// All 256 float8_e4m3fn values as float32: a table lookup beats the bit manipulation.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) {
      t[i] = static_cast<float>(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
    }
    return t;
  }();
  return table.data();
}

// One cache row (head_dim elements) -> float32, times `scale` (int8's per-token scale,
// fp8's per-head one, 1 otherwise: exact for float32).
template <typename C>
inline void load_row(const C* src, int n, float scale, float* dst) {
  for (int d = 0; d < n; ++d) dst[d] = to_float(src[d]) * scale;
}
template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, int n, float scale, float* dst) {
  for (int d = 0; d < n; d += LANES) store_vec(dst + d, load_bf16x16(src + d) * scale);
}
template <>
inline void load_row<float>(const float* src, int n, float scale, float* dst) {
  for (int d = 0; d < n; d += LANES) store_vec(dst + d, load_vec<f32x16>(src + d) * scale);
}
template <>
inline void load_row<int8_t>(const int8_t* src, int n, float scale, float* dst) {
  for (int d = 0; d < n; d += LANES) {
    store_vec(dst + d, to_floats(load_vec<i8x16>(src + d)) * scale);
  }
}
template <>
inline void load_row<c10::Float8_e4m3fn>(const c10::Float8_e4m3fn* src, int n, float scale,
                                         float* dst) {
  const float* table = fp8_table();
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
  for (int d = 0; d < n; ++d) dst[d] = table[bytes[d]] * scale;
}

inline float dot(const float* a, const float* b, int n) {
  f32x16 acc = load_vec<f32x16>(a) * load_vec<f32x16>(b);
  for (int d = LANES; d < n; d += LANES) acc += load_vec<f32x16>(a + d) * load_vec<f32x16>(b + d);
  return hsum(acc);
}

// acc[0:D] = acc * correction + sum_t p[t] v[t][0:D], with v rows D floats apart. Four
// 16-lane accumulators at a time, each chained over t: with one, every FMA waited on the
// previous one's latency, and this loop was the kernel's hottest (perf: 15 % of a decode step).
inline void accumulate_pv(float* acc, float correction, const float* p, const float* v, int n,
                          int D) {
  int d = 0;
  for (; d + 4 * LANES <= D; d += 4 * LANES) {
    f32x16 a0 = load_vec<f32x16>(acc + d) * correction;
    f32x16 a1 = load_vec<f32x16>(acc + d + LANES) * correction;
    f32x16 a2 = load_vec<f32x16>(acc + d + 2 * LANES) * correction;
    f32x16 a3 = load_vec<f32x16>(acc + d + 3 * LANES) * correction;
    for (int t = 0; t < n; ++t) {
      const float* row = v + size_t(t) * D + d;
      const f32x16 pt = f32x16{} + p[t];
      a0 += pt * load_vec<f32x16>(row);
      a1 += pt * load_vec<f32x16>(row + LANES);
      a2 += pt * load_vec<f32x16>(row + 2 * LANES);
      a3 += pt * load_vec<f32x16>(row + 3 * LANES);
    }
    store_vec(acc + d, a0);
    store_vec(acc + d + LANES, a1);
    store_vec(acc + d + 2 * LANES, a2);
    store_vec(acc + d + 3 * LANES, a3);
  }
  for (; d < D; d += LANES) {  // head_dim not a multiple of 64: the last 16-32-48 dims
    f32x16 a = load_vec<f32x16>(acc + d) * correction;
    for (int t = 0; t < n; ++t) a += p[t] * load_vec<f32x16>(v + size_t(t) * D + d);
    store_vec(acc + d, a);
  }
}

struct CacheView {
  const void* data;
  int64_t block_stride, token_stride, head_stride;  // elements
};

struct ScaleView {  // int8: per (block, token, head); fp8: per head; none: nullptr
  const float* per_head = nullptr;
  const c10::Half* per_token = nullptr;
  int64_t block_stride = 0, token_stride = 0, head_stride = 0;

  float at(int64_t block, int64_t token, int64_t head) const {
    if (per_token) {
      return static_cast<float>(
          per_token[block * block_stride + token * token_stride + head * head_stride]);
    }
    return per_head ? per_head[head] : 1.0f;
  }
};

struct Problem {
  CacheView k, v;
  ScaleView k_scale, v_scale;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t q_token_stride, q_head_stride, o_token_stride, o_head_stride;
  int num_kv_heads, group, head_dim, block_size;
  float scale;
};

inline int padded(int n) { return (n + LANES - 1) / LANES * LANES; }

struct WorkItem {
  int seq, first_query, num_queries;
};

// Per-thread scratch, reused across items (no allocation in the hot loop).
struct Scratch {
  std::vector<float> q, acc, m, l, scores, k_block, v_block;
  void size_for(int rows, int block_size, int head_dim) {  // grows only
    auto at_least = [](std::vector<float>& v, size_t n) {
      if (v.size() < n) v.resize(n);
    };
    at_least(q, size_t(rows) * head_dim);
    at_least(acc, size_t(rows) * head_dim);
    at_least(m, size_t(rows));
    at_least(l, size_t(rows));
    at_least(scores, size_t(rows) * padded(block_size));
    at_least(k_block, size_t(block_size) * head_dim);
    at_least(v_block, size_t(block_size) * head_dim);
  }
};

template <typename Q, typename C>
void attend_item(const Problem& p, const WorkItem& item, int kv_head, const Q* query, Q* out,
                 Scratch& s) {
  const int D = p.head_dim, G = p.group, bs = p.block_size;
  const int rows = item.num_queries * G;  // row = query token i * G + head g
  const int ctx = p.seq_lens[item.seq];
  const int q_len = p.query_start_loc[item.seq + 1] - p.query_start_loc[item.seq];
  const int first_pos = ctx - q_len + item.first_query;  // position of the item's first query
  const int last_pos = first_pos + item.num_queries - 1;
  const int64_t token0 = p.query_start_loc[item.seq] + item.first_query;
  const int32_t* table = p.block_tables + int64_t(item.seq) * p.table_stride;
  // bfloat16 query and cache on AVX-512: Q.K straight from the cache rows (bfloat16 pair
  // products and a reduction tree per 16 keys, cpu_decode_bf16.h) instead of widened rows and
  // a dot each.
#if defined(CPU_BF16_PAIRS)
  constexpr bool kBf16Types = std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, Q>;
#else
  constexpr bool kBf16Types = false;
#endif
  const bool bf16_dot = kBf16Types && D % 32 == 0;

  // Queries pre-multiplied by the softmax scale.
  for (int i = 0; i < item.num_queries; ++i) {
    for (int g = 0; g < G; ++g) {
      const Q* src = query + (token0 + i) * p.q_token_stride +
                     int64_t(kv_head * G + g) * p.q_head_stride;
      load_row(src, D, p.scale, &s.q[size_t(i * G + g) * D]);
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + size_t(rows) * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);

  const int num_keys = std::min(ctx, last_pos + 1);  // keys any row of the item sees
  const int64_t row_bytes = int64_t(D) * sizeof(C);
  const int64_t k_token_bytes = p.k.token_stride * sizeof(C);
  const int64_t v_token_bytes = p.v.token_stride * sizeof(C);
  // This item's KV head in a block of the cache.
  auto head_rows = [kv_head](const CacheView& c, int64_t block) {
    return static_cast<const C*>(c.data) + block * c.block_stride + kv_head * c.head_stride;
  };
  for (int start = 0; start < num_keys; start += bs) {
    const int64_t block = table[start / bs];
    const int n = std::min(bs, num_keys - start);
    const C* k_base = head_rows(p.k, block);
    const C* v_base = head_rows(p.v, block);
    // The next block's rows are requested while this one's are converted: blocks sit anywhere
    // in the pool, and the hardware prefetcher does not follow a jump to the next one.
    const int64_t next = start + bs < num_keys ? table[start / bs + 1] : block;
    const char* k_next = reinterpret_cast<const char*>(head_rows(p.k, next));
    const char* v_next = reinterpret_cast<const char*>(head_rows(p.v, next));
    for (int t = 0; t < n; ++t) {
      for (int64_t line = 0; line < row_bytes; line += CACHE_LINE) {
        __builtin_prefetch(k_next + t * k_token_bytes + line);
        __builtin_prefetch(v_next + t * v_token_bytes + line);
      }
      if (!bf16_dot) {
        load_row(k_base + t * p.k.token_stride, D, p.k_scale.at(block, t, kv_head),
                 &s.k_block[size_t(t) * D]);
      }
      load_row(v_base + t * p.v.token_stride, D, p.v_scale.at(block, t, kv_head),
               &s.v_block[size_t(t) * D]);
    }
    for (int r = 0; r < rows; ++r) {
      // Keys of this block row r may see: positions <= its own.
      const int visible = std::min(n, first_pos + r / G - start + 1);
      if (visible <= 0) continue;
      float* sc = &s.scores[size_t(r) * padded(bs)];
      const float* qr = &s.q[size_t(r) * D];
      float block_max = -std::numeric_limits<float>::infinity();
      if (bf16_dot) {
#if defined(CPU_BF16_PAIRS)
        if constexpr (kBf16Types) {
          const Q* q_row = query + (token0 + r / G) * p.q_token_stride +
                           int64_t(kv_head * G + r % G) * p.q_head_stride;
          for (int t0 = 0; t0 < visible; t0 += LANES) {
            block_max = std::max(block_max, cpu_decode_bf16::key_group_scores(
                                                q_row, k_base + t0 * p.k.token_stride,
                                                p.k.token_stride, std::min(LANES, visible - t0),
                                                D, p.scale, sc + t0));
          }
        }
#endif
      } else {
        for (int t = 0; t < visible; ++t) {
          sc[t] = dot(qr, &s.k_block[size_t(t) * D], D);
          block_max = std::max(block_max, sc[t]);
        }
      }
      const float m_new = std::max(s.m[r], block_max);
      const float correction = exp_nonpositive(s.m[r] - m_new);  // m = -inf: 0
      for (int t = 0; t < visible; t += LANES) {
        store_vec(sc + t, exp_nonpositive(load_vec<f32x16>(sc + t) - m_new));
      }
      for (int t = visible; t < padded(visible); ++t) sc[t] = 0.f;  // lanes past the keys
      f32x16 sums{};
      for (int t = 0; t < visible; t += LANES) sums += load_vec<f32x16>(sc + t);
      const float sum = hsum(sums);
      s.l[r] = s.l[r] * correction + sum;
      s.m[r] = m_new;
      accumulate_pv(&s.acc[size_t(r) * D], correction, sc, s.v_block.data(), visible, D);
    }
  }
  for (int r = 0; r < rows; ++r) {
    // l = 0 only for an empty context (a padding row): write zeros, not NaN.
    const float inv = s.l[r] > 0.f ? 1.f / s.l[r] : 0.f;
    Q* dst = out + (token0 + r / G) * p.o_token_stride +
             int64_t(kv_head * G + r % G) * p.o_head_stride;
    for (int d = 0; d < D; ++d) from_float(s.acc[size_t(r) * D + d] * inv, dst + d);
  }
}

// Decode rows (a sequence's only new token) of a bfloat16 query and cache go through
// cpu_decode_bf16 where the CPU has AVX-512 and the shape has an instantiation.
#if defined(CPU_BF16_PAIRS)
using FastDecode = cpu_decode_bf16::AttendFn;
#else
using FastDecode = void (*)();
#endif

template <typename Q, typename C>
FastDecode fast_decode(const Problem& p) {
#if defined(CPU_BF16_PAIRS)
  if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
    return cpu_decode_bf16::select(p.head_dim, p.group);
  }
#endif
  return nullptr;
}

// True if `fast` served the item (a decode row); false leaves it to attend_item.
template <typename Q>
bool attend_decode_fast(FastDecode fast, const Problem& p, const WorkItem& item, int kv_head,
                        const Q* query, Q* out) {
#if defined(CPU_BF16_PAIRS)
  if constexpr (std::is_same_v<Q, c10::BFloat16>) {
    const int token = p.query_start_loc[item.seq];
    if (fast == nullptr || p.query_start_loc[item.seq + 1] - token != 1) return false;
    const int first_head = kv_head * p.group;
    fast(query + token * p.q_token_stride + first_head * p.q_head_stride, p.q_head_stride,
         out + token * p.o_token_stride + first_head * p.o_head_stride, p.o_head_stride,
         static_cast<const Q*>(p.k.data) + kv_head * p.k.head_stride,
         static_cast<const Q*>(p.v.data) + kv_head * p.v.head_stride, p.k.block_stride,
         p.k.token_stride, p.v.token_stride, p.block_tables + int64_t(item.seq) * p.table_stride,
         p.block_size, p.seq_lens[item.seq], p.scale);
    return true;
  }
#endif
  return false;
}

// Items of at least this many query tokens go to the prefill tiles (cpu_prefill_amx.h where
// the CPU has AMX, cpu_prefill_f32.h on AVX-512 CPUs without AVX512-BF16): a group of 16 keys
// costs a K/V conversion whatever the rows, which only pays with several query tokens sharing
// it (prefill chunks; speculative verification's few tokens stay on the row path).
constexpr int TILE_MIN_QUERIES = 8;

// Off: multi-token items take the row path even where tiles would serve them
// (set_prefill_tiles, for benchmarks.cpu_prefill_attention's "before" in the same run).
// Process-wide.
std::atomic<bool> prefill_tiles_enabled{true};

// Which tile kernel takes this call's multi-token items: AMX, float32, or none.
enum class PrefillTiles { kNone, kAmx, kF32 };

template <typename Q, typename C>
PrefillTiles prefill_tiles(const Problem& p) {
  if (!prefill_tiles_enabled.load()) return PrefillTiles::kNone;
  if constexpr (std::is_same_v<Q, c10::BFloat16> && std::is_same_v<C, Q>) {
#if defined(CPU_PREFILL_AMX)
    if (cpu_prefill_amx::supports(p.head_dim) && cpu_prefill_amx::available()) {
      return PrefillTiles::kAmx;
    }
#endif
#if defined(CPU_PREFILL_F32)
    if (cpu_prefill_f32::supports(p.head_dim)) return PrefillTiles::kF32;
#endif
  }
  return PrefillTiles::kNone;
}

#if defined(CPU_PREFILL_AMX) || defined(CPU_PREFILL_F32)
// The item as the tile kernels take it (bfloat16 query and cache).
cpu_prefill_tiles::Item tile_item(const Problem& p, const WorkItem& item, int kv_head,
                                  const c10::BFloat16* query, c10::BFloat16* out) {
  const int ctx = p.seq_lens[item.seq];
  const int q_len = p.query_start_loc[item.seq + 1] - p.query_start_loc[item.seq];
  const int first_pos = ctx - q_len + item.first_query;
  const int64_t token0 = p.query_start_loc[item.seq] + item.first_query;
  const int64_t head0 = int64_t(kv_head) * p.group;
  const int32_t* table = p.block_tables + int64_t(item.seq) * p.table_stride;
  auto rows = [&](const CacheView& c) {
    return cpu_prefill_tiles::Rows{
        static_cast<const c10::BFloat16*>(c.data) + kv_head * c.head_stride, c.block_stride,
        c.token_stride, table, p.block_size};
  };
  return {query + token0 * p.q_token_stride + head0 * p.q_head_stride,
          p.q_token_stride, p.q_head_stride,
          out + token0 * p.o_token_stride + head0 * p.o_head_stride,
          p.o_token_stride, p.o_head_stride,
          rows(p.k), rows(p.v), p.group, p.head_dim, item.num_queries, first_pos,
          std::min(ctx, first_pos + item.num_queries), p.scale};
}
#endif

template <typename Q, typename C>
void run(const Problem& p, const std::vector<WorkItem>& items, const Q* query, Q* out) {
  const int64_t total = int64_t(items.size()) * p.num_kv_heads;
  const int max_rows = QUERY_CHUNK * p.group;
  const FastDecode fast = fast_decode<Q, C>(p);
  [[maybe_unused]] const PrefillTiles tiles = prefill_tiles<Q, C>(p);  // none in AVX2 builds
  // torch's intra-op thread count; dynamic schedule: items differ in context length.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    // Kept per thread across calls (torch's OpenMP threads persist): sizing it afresh each call
    // allocated and zeroed ~30 KB per thread, a decode step's 30 calls a token included.
    static thread_local Scratch scratch;
    scratch.size_for(max_rows, p.block_size, p.head_dim);
#if defined(CPU_PREFILL_AMX)
    cpu_prefill_amx::Scratch amx_scratch;
    bool tiles_configured = false;
#endif
#if defined(CPU_PREFILL_F32)
    static thread_local cpu_prefill_f32::Scratch f32_scratch;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total; ++w) {
      const WorkItem& item = items[w / p.num_kv_heads];
      const int kv_head = int(w % p.num_kv_heads);
      if (attend_decode_fast(fast, p, item, kv_head, query, out)) continue;
      if constexpr (std::is_same_v<Q, c10::BFloat16>) {
        const bool tile_item_here = item.num_queries >= TILE_MIN_QUERIES;
#if defined(CPU_PREFILL_AMX)
        if (tiles == PrefillTiles::kAmx && tile_item_here) {
          if (!tiles_configured) cpu_prefill_amx::configure_tiles();
          tiles_configured = true;
          cpu_prefill_amx::attend(tile_item(p, item, kv_head, query, out), amx_scratch);
          continue;
        }
#endif
#if defined(CPU_PREFILL_F32)
        if (tiles == PrefillTiles::kF32 && tile_item_here) {
          cpu_prefill_f32::attend(tile_item(p, item, kv_head, query, out), f32_scratch);
          continue;
        }
#endif
        (void)tile_item_here;
      }
      attend_item<Q, C>(p, item, kv_head, query, out, scratch);
    }
#if defined(CPU_PREFILL_AMX)
    if (tiles_configured) _tile_release();
#endif
  }
}

CacheView cache_view(const torch::Tensor& cache) {
  return {cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2)};
}

ScaleView scale_view(const c10::optional<torch::Tensor>& scale) {
  ScaleView view;
  if (!scale.has_value()) return view;
  const torch::Tensor& t = *scale;
  if (t.dim() == 1) {
    view.per_head = t.data_ptr<float>();
  } else {
    view.per_token = reinterpret_cast<const c10::Half*>(t.data_ptr<at::Half>());
    view.block_stride = t.stride(0);
    view.token_stride = t.stride(1);
    view.head_stride = t.stride(2);
  }
  return view;
}

template <typename Q>
void dispatch_cache(const Problem& p, const std::vector<WorkItem>& items,
                    const torch::Tensor& query, torch::Tensor& out, at::ScalarType cache_type) {
  const Q* q = static_cast<const Q*>(query.data_ptr());
  Q* o = static_cast<Q*>(out.data_ptr());
  switch (cache_type) {
    case at::kChar: return run<Q, int8_t>(p, items, q, o);
    case at::kFloat8_e4m3fn: return run<Q, c10::Float8_e4m3fn>(p, items, q, o);
    default: return run<Q, Q>(p, items, q, o);  // the wrapper checked: cache dtype = query's
  }
}

}  // namespace

namespace {

bool is_model_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// Everything the kernel would misread, as a ValueError naming the argument. In C++ because
// the same checks in Python cost ~8 us per call: a third of a batch-1 layer's attention.
void check_inputs(const torch::Tensor& out, const torch::Tensor& query,
                  const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                  const torch::Tensor& query_start_loc, const c10::optional<torch::Tensor>& k_scale,
                  const c10::optional<torch::Tensor>& v_scale) {
  const std::pair<const char*, const torch::Tensor*> views[] = {
      {"query", &query}, {"k_cache", &k_cache}, {"v_cache", &v_cache}, {"out", &out}};
  for (const auto& [name, t] : views) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, ": CPU tensor expected, got ", t->device());
    TORCH_CHECK_VALUE(t->dim() > 0 && t->stride(-1) == 1, name,
                      ": last dim must be contiguous, strides ", t->strides());
  }
  TORCH_CHECK_VALUE(query.dim() == 3 && is_model_dtype(query.scalar_type()),
                    "query: [tokens, heads, head_dim] float32/16, got ", query.sizes(), " ",
                    query.scalar_type());
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.scalar_type() == v_cache.scalar_type(),
                    "k_cache: 4-d like v_cache, got ", k_cache.sizes(), " / ", v_cache.sizes());
  TORCH_CHECK_VALUE(query.size(2) % LANES == 0, "query: head_dim must be a multiple of 16, got ",
                    query.size(2));
  TORCH_CHECK_VALUE(k_cache.size(3) == query.size(2) && query.size(1) % k_cache.size(2) == 0,
                    "query: heads/head_dim ", query.sizes().slice(1), " do not fit cache ",
                    k_cache.sizes());
  TORCH_CHECK_VALUE(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type(),
                    "out: ", query.sizes(), " ", query.scalar_type(), " expected, got ",
                    out.sizes(), " ", out.scalar_type());
  const at::ScalarType cache_type = k_cache.scalar_type();
  const bool quantized = cache_type == at::kChar || cache_type == at::kFloat8_e4m3fn;
  TORCH_CHECK_VALUE(quantized || cache_type == query.scalar_type(), "k_cache: dtype ",
                    cache_type, " must be the query's, int8 or float8_e4m3fn");
  const std::pair<const char*, const c10::optional<torch::Tensor>*> scales[] = {
      {"k_scale", &k_scale}, {"v_scale", &v_scale}};
  for (const auto& [name, scale] : scales) {
    TORCH_CHECK_VALUE(quantized == scale->has_value(), name,
                      ": needed exactly when the cache is int8 or float8_e4m3fn");
    if (!scale->has_value()) continue;
    const torch::Tensor& t = **scale;
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, ": CPU tensor expected");
    if (cache_type == at::kChar) {
      TORCH_CHECK_VALUE(t.sizes() == k_cache.sizes().slice(0, 3) && t.scalar_type() == at::kHalf,
                        name, ": float16 ", k_cache.sizes().slice(0, 3),
                        " expected for int8, got ", t.scalar_type(), " ", t.sizes());
    } else {
      TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == k_cache.size(2) &&
                            t.scalar_type() == at::kFloat && t.is_contiguous(),
                        name, ": contiguous float32 [num_kv_heads] expected for fp8, got ",
                        t.scalar_type(), " ", t.sizes());
    }
  }
  TORCH_CHECK_VALUE(block_tables.dim() == 2, "block_tables: [batch, max_blocks] expected, got ",
                    block_tables.sizes());
  const int64_t batch = block_tables.size(0);
  const std::tuple<const char*, const torch::Tensor*, int64_t> ints[] = {
      {"block_tables", &block_tables, -1},
      {"seq_lens", &seq_lens, batch},
      {"query_start_loc", &query_start_loc, batch + 1}};
  for (const auto& [name, t, length] : ints) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kInt && t->device().is_cpu() && t->dim() > 0 &&
                          t->stride(-1) == 1,
                      name, ": int32 CPU tensor with a contiguous last dim expected");
    TORCH_CHECK_VALUE(length < 0 || (t->dim() == 1 && t->size(0) == length), name, ": shape (",
                      length, ",) expected, got ", t->sizes());
  }
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                     torch::Tensor query_start_loc, double scale,
                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  check_inputs(out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, k_scale,
               v_scale);
  Problem p;
  p.k = cache_view(k_cache);
  p.v = cache_view(v_cache);
  p.k_scale = scale_view(k_scale);
  p.v_scale = scale_view(v_scale);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.q_token_stride = query.stride(0);
  p.q_head_stride = query.stride(1);
  p.o_token_stride = out.stride(0);
  p.o_head_stride = out.stride(1);
  p.num_kv_heads = int(k_cache.size(2));
  p.group = int(query.size(1) / p.num_kv_heads);
  p.head_dim = int(query.size(2));
  p.block_size = int(k_cache.size(1));
  p.scale = float(scale);

  std::vector<WorkItem> items;
  const int64_t batch = seq_lens.size(0);
  for (int b = 0; b < batch; ++b) {
    const int q_len = p.query_start_loc[b + 1] - p.query_start_loc[b];
    for (int i = 0; i < q_len; i += QUERY_CHUNK) {
      items.push_back({b, i, std::min(QUERY_CHUNK, q_len - i)});
    }
  }
  switch (query.scalar_type()) {
    case at::kFloat: return dispatch_cache<float>(p, items, query, out, k_cache.scalar_type());
    case at::kBFloat16:
      return dispatch_cache<c10::BFloat16>(p, items, query, out, k_cache.scalar_type());
    case at::kHalf: return dispatch_cache<c10::Half>(p, items, query, out, k_cache.scalar_type());
    default: TORCH_CHECK(false, "query: float32, float16 or bfloat16 expected");
  }
}

// The step's new K and V [T, Hkv, D] (any strides, contiguous last dim: views of the qkv
// projection) into a head-major cache [Hkv, blocks, block_size, D] of the same dtype at
// slot_mapping[t] (slot = block * block_size + offset). One call for K and V: the torch
// path's transposes, flattens and two index_copy_ were ~10 ops per layer. Quantized caches
// keep the torch path (the values are quantized first).
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
              torch::Tensor slot_mapping) {
  TORCH_CHECK_VALUE(k_cache.device().is_cpu() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
                        v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "k_cache: contiguous [Hkv, blocks, block_size, D] like v_cache expected, got ",
                    k_cache.sizes(), " / ", v_cache.sizes());
  const int64_t heads = k_cache.size(0), head_dim = k_cache.size(3);
  const int64_t num_slots = k_cache.size(1) * k_cache.size(2);
  for (const auto* t : {&k, &v}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 3 && t->size(1) == heads &&
                          t->size(2) == head_dim && t->stride(2) == 1 &&
                          t->scalar_type() == k_cache.scalar_type() && t->sizes() == k.sizes(),
                      "k/v: [tokens, ", heads, ", ", head_dim, "] of the cache's dtype with a "
                      "contiguous last dim expected, got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK_VALUE(slot_mapping.device().is_cpu() && slot_mapping.scalar_type() == at::kLong &&
                        slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                        slot_mapping.is_contiguous(),
                    "slot_mapping: contiguous int64 [", k.size(0), "] expected, got ",
                    slot_mapping.scalar_type(), " ", slot_mapping.sizes());
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < k.size(0); ++t) {
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping: slot ", slots[t],
                      " is outside the cache's [0, ", num_slots, ")");
  }
  const size_t row_bytes = size_t(head_dim) * k_cache.element_size();
  const std::pair<const torch::Tensor*, torch::Tensor*> pairs[] = {{&k, &k_cache},
                                                                   {&v, &v_cache}};
  for (const auto& [src, dst] : pairs) {
    const char* from = static_cast<const char*>(src->data_ptr());
    char* to = static_cast<char*>(dst->data_ptr());
    const int64_t token_stride = src->stride(0) * src->element_size();
    const int64_t head_stride = src->stride(1) * src->element_size();
    for (int64_t t = 0; t < src->size(0); ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(to + (h * num_slots + slots[t]) * row_bytes,
                    from + t * token_stride + h * head_stride, row_bytes);
      }
    }
  }
}

// The memory-only share of decode attention, for benchmarks.cpu_attention: the K/V rows the
// decode kernel reads for each (sequence, KV head), in its order, with its prefetch
// (prefetch_first_blocks, rows_ahead), threads and schedule, summed as raw 32-bit words
// instead of attended. The sum is returned so that nothing is optimized away. How fast this
// pattern of scattered blocks can be read at all, with no arithmetic in the way.
int64_t read_kv_rows(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                     torch::Tensor seq_lens) {
  TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                        k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                        k_cache.size(3) * k_cache.element_size() % 64 == 0,
                    "k_cache/v_cache: [blocks, block_size, heads, head_dim] with rows of whole "
                    "64-byte lines expected");
  TORCH_CHECK_VALUE(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 &&
                        block_tables.stride(1) == 1 && seq_lens.scalar_type() == at::kInt &&
                        seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
                    "block_tables / seq_lens: int32 [batch, width] / [batch] expected");
  const CacheView k = cache_view(k_cache), v = cache_view(v_cache);
  const int64_t row_bytes = k_cache.size(3) * k_cache.element_size();
  const int64_t element = k_cache.element_size(), heads = k_cache.size(2);
  const int bs = int(k_cache.size(1));
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int64_t total = seq_lens.size(0) * heads;
  int64_t sum = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads()) reduction(+ : sum)
  for (int64_t w = 0; w < total; ++w) {
    const int64_t seq = w / heads, head = w % heads;
    const int32_t* table = tables + seq * table_stride;
    const int ctx = lens[seq];
    u32x16 acc{};
    const CacheView* views[2] = {&k, &v};
    const char* heads_rows[2];  // K's and V's rows of this head in block 0
    for (int i = 0; i < 2; ++i) {
      const char* data = static_cast<const char*>(views[i]->data);
      heads_rows[i] = data + head * views[i]->head_stride * element;
      prefetch_first_blocks(heads_rows[i], views[i]->block_stride * element,
                            views[i]->token_stride * element, row_bytes, table, bs, ctx);
    }
    // Per span of keys (whole blocks), K's rows and then V's, each requesting its own rows
    // ahead, as the decode kernel's two passes do.
    const int span = std::max(1, DECODE_SPAN_KEYS / bs) * bs;
    for (int span_start = 0; span_start < ctx; span_start += span) {
      const int span_end = std::min(ctx, span_start + span);
      for (int i = 0; i < 2; ++i) {
        const CacheView* c = views[i];
        for (int start = span_start; start < span_end; start += bs) {
          const int n = std::min(bs, span_end - start);
          const RowsAhead ahead =
              rows_ahead(heads_rows[i], c->block_stride * element, c->token_stride * element,
                         row_bytes, table, bs, ctx, start);
          const char* base = heads_rows[i] + table[start / bs] * c->block_stride * element;
          for (int t = 0; t < n; ++t) {
            ahead.at(t);
            const char* row = base + t * c->token_stride * element;
            for (int64_t line = 0; line < row_bytes; line += CACHE_LINE) {
              acc += load_vec<u32x16>(row + line);
            }
          }
        }
      }
    }
    for (int lane = 0; lane < LANES; ++lane) sum += acc[lane];
  }
  return sum;
}

// Which tiles multi-token items of a bfloat16 query and cache take here: "amx"
// (cpu_prefill_amx.h: the build has AMX and Linux granted the tiles), "float32"
// (cpu_prefill_f32.h: AVX-512 without AVX512-BF16) or "" (the row path), for tests and the
// benchmark's report.
std::string prefill_tiles_kind() {
#if defined(CPU_PREFILL_AMX)
  if (cpu_prefill_amx::available()) return "amx";
#endif
#if defined(CPU_PREFILL_F32)
  return "float32";
#endif
  return "";
}

void set_prefill_tiles(bool enabled) { prefill_tiles_enabled.store(enabled); }

// The entry points above for other extensions (cpu_attention_api.h): cpu_fused_ops.cpp's
// decode step calls them per layer without a trip through Python.
pybind11::capsule api() {
  static const cpu_attention_api::Api table{&store_kv, &paged_attention};
  return pybind11::capsule(&table, cpu_attention_api::CAPSULE_NAME);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("api", &api, "store_kv and paged_attention as a C function table (cpu_attention_api.h)");
  m.def("paged_attention", &paged_attention,
        "Paged attention over a block-table KV cache, in place (decode and prefill)");
  m.def("store_kv", &store_kv, "New K/V rows into a head-major paged cache at their slots");
  m.def("prefill_tiles", &prefill_tiles_kind,
        "Which tiles bfloat16 prefill items of >= TILE_MIN_QUERIES tokens take here: amx, "
        "float32 or '' (the row path)");
  m.def("set_prefill_tiles", &set_prefill_tiles,
        "Let bfloat16 prefill items use the tiles (default) or the row path (benchmarks)");
  m.attr("TILE_MIN_QUERIES") = TILE_MIN_QUERIES;
  m.attr("QUERY_CHUNK") = QUERY_CHUNK;
  m.def("read_kv_rows", &read_kv_rows,
        "The K/V rows decode attention reads, summed: its memory-only share (benchmarks)");
}
