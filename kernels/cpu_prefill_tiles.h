// What the two prefill tile kernels share (cpu_prefill_amx.h on AMX CPUs, cpu_prefill_f32.h on
// AVX-512 CPUs without AVX512-BF16): the work item as cpu_paged_attention.cpp hands it over, the
// rows of one KV head read through the block table, the next key group's prefetch, and the
// lane-wise online softmax over a group's scores (16 keys, the 16 query tokens in the lanes).
#pragma once

#if defined(__AVX512F__)
#define CPU_PREFILL_TILES 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace cpu_prefill_tiles {

constexpr int ROWS = 16;  // query tokens per item at most: the lanes
constexpr int KEYS = 16;  // keys per group

// One K or V head's rows of the cache: row of key position t.
struct Rows {
  const c10::BFloat16* base;  // the KV head's rows in block 0
  int64_t block_stride, token_stride;  // elements
  const int32_t* table;
  int block_size;

  const c10::BFloat16* row(int t) const {
    return base + int64_t(table[t / block_size]) * block_stride +
           int64_t(t % block_size) * token_stride;
  }
};

struct Item {
  const c10::BFloat16* query;  // the item's first token, query head kv_head * G
  int64_t q_token_stride, q_head_stride;
  c10::BFloat16* out;  // likewise
  int64_t o_token_stride, o_head_stride;
  Rows k, v;
  int group;        // query heads per KV head
  int head_dim;
  int num_queries;  // 1..16
  int first_pos;    // position of the first query token; token i sees keys <= first_pos + i
  int num_keys;     // keys any query of the item sees (<= context)
  float scale;
};

// Query lane i (padding lanes repeat the last query) sees keys <= horizon[i].
inline __m512i horizon(const Item& it) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  return _mm512_add_epi32(_mm512_set1_epi32(it.first_pos),
                          _mm512_min_epi32(lane, _mm512_set1_epi32(it.num_queries - 1)));
}

// Requests the next group's K and V rows while this group is computed: blocks sit anywhere in
// the pool, and the hardware prefetcher does not follow a jump to the next one.
inline void prefetch_group(const Item& it, int j0) {
  const int end = std::min(j0 + KEYS, it.num_keys);
  for (int t = j0; t < end; ++t) {
    const char* kr = reinterpret_cast<const char*>(it.k.row(t));
    const char* vr = reinterpret_cast<const char*>(it.v.row(t));
    for (int line = 0; line < it.head_dim * 2; line += 64) {
      _mm_prefetch(kr + line, _MM_HINT_T0);
      _mm_prefetch(vr + line, _MM_HINT_T0);
    }
  }
}

// Online softmax of one head's group, vectorized over the 16 queries: s[key] holds the key's
// scaled scores, one per query lane, so the max and the sum over keys are lane-wise (no
// horizontal reductions, one exp per 16 scores). Updates the lanes' m and l, writes e[key] =
// P's row of the key (0 where masked) and returns each lane's correction c = exp(m - m').
// Query lane i sees keys <= horizon[i] (and < j0 + n).
inline __m512 softmax_lanes(const __m512 (&s)[KEYS], int j0, int n, __m512i horizon,
                            bool all_visible, __m512& m, __m512& l, __m512 (&e)[KEYS]) {
  using cpu_simd::f32x16;
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 keep[KEYS];
  __m512 max = neg_inf;
  for (int k = 0; k < KEYS; ++k) {
    keep[k] = k >= n ? __mmask16(0)
              : all_visible ? __mmask16(0xFFFF)
                            : _mm512_cmple_epi32_mask(_mm512_set1_epi32(j0 + k), horizon);
    max = _mm512_max_ps(max, _mm512_mask_mov_ps(neg_inf, keep[k], s[k]));
  }
  // Key 0 is visible to every query, so m is finite from the first group on; a query that sees
  // none of this group's keys keeps its m (max = -inf) and gets c = 1.
  const __m512 m_new = _mm512_max_ps(m, max);
  const __m512 c = __m512(cpu_simd::exp_nonpositive(f32x16(_mm512_sub_ps(m, m_new))));
  __m512 sum = _mm512_setzero_ps();
  for (int k = 0; k < KEYS; ++k) {
    // Masked keys: 0, not exp(-inf) (~1e-38).
    e[k] = _mm512_maskz_mov_ps(
        keep[k], __m512(cpu_simd::exp_nonpositive(f32x16(_mm512_sub_ps(s[k], m_new)))));
    sum = _mm512_add_ps(sum, e[k]);
  }
  l = _mm512_fmadd_ps(l, c, sum);
  m = m_new;
  return c;
}

}  // namespace cpu_prefill_tiles

#endif  // __AVX512F__
