// Prefill attention with AMX tiles: one work item of cpu_paged_attention.cpp (a sequence, a KV
// head, up to 16 query tokens) for a bfloat16 query and cache, on CPUs with AMX-BF16.
//
// Why: the generic item path computes each (query token, head) row against each key on its own,
// vector by vector; a 512-token prompt chunk of SmolLM2 took 5.1 ms a layer there (60 GFLOP/s,
// 2-core Xeon), i.e. ~150 ms of a 512-token chunked-prefill step. Here, per group of 16 keys and
// per query head g of the KV head, the 16 query tokens are a matrix, and both products are tile
// products (tdpbf16ps: bfloat16 x bfloat16 -> float32 sums):
//
//   S [16 queries, 16 keys] = Q_g [16, D] @ K^T       (B operand: K rows turned into dim pairs)
//   O_g [16, D] = O_g * c + P [16, 16 keys] @ V        (B operand: V rows interleaved by key pair)
//
// with the same online softmax as the generic path (m, l, c = exp(m - m'); float32), masked to
// each query's causal horizon. P is rounded to bfloat16 for its product, as flash attention
// kernels do on GPUs; scores, softmax and sums stay float32. K and V rows are read in place
// through the block table (any block size), each 16-key group once per item and shared by the
// G query heads; rows past the context are never read (unowned slots may hold NaN).
#pragma once

#include "cpu_amx_tiles.h"

#if defined(CPU_AMX_TILES) && defined(__AVX512BF16__)
#define CPU_PREFILL_AMX 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace cpu_prefill_amx {

constexpr int ROWS = 16;       // query tokens per tile (and per work item at most)
constexpr int KEYS = 16;       // keys per group: one S tile's columns
constexpr int MAX_HEAD_DIM = 256;
// Tile registers (literals below: the tile intrinsics paste the number into the instruction):
// 0 the S accumulator, 1 Q_g (32 dims), 2 K^T pairs (32 dims), 3 P, 4 V pairs (16 dims), 5 one
// 16-dim slice of P @ V.

// Head dims the tile layout serves: whole 64-byte tile rows of Q (32 dims), at most 256.
inline bool supports(int head_dim) { return head_dim % 32 == 0 && head_dim <= MAX_HEAD_DIM; }

// AMX usable now (the build has it and Linux granted the tile state).
inline bool available() { return cpu_amx_tiles::tiles_permitted(); }

// Each thread that runs items loads this once per kernel call (oneDNN loads its own
// configurations between calls) and releases the tiles at the end.
inline void configure_tiles() {
  cpu_amx_tiles::TileConfig config;
  config.set(0, ROWS, KEYS * 4);  // S: float32
  config.set(1, ROWS, 64);        // Q_g: 32 dims in bfloat16
  config.set(2, 16, KEYS * 4);    // K^T: 16 dim pairs x 16 keys
  config.set(3, ROWS, KEYS * 2);  // P: 16 keys in bfloat16
  config.set(4, KEYS / 2, 64);    // V: 8 key pairs x 16 dims
  config.set(5, ROWS, 64);        // P @ V: 16 dims in float32
  _tile_loadconfig(&config);
}

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
  int group;           // query heads per KV head
  int head_dim;
  int num_queries;     // 1..16
  int first_pos;       // position of the first query token; token i sees keys <= first_pos + i
  int num_keys;        // keys any query of the item sees (<= context)
  float scale;
};

struct alignas(64) Line {  // one 64-byte vector's storage (a vector of __m512i drops alignment)
  uint32_t words[16];
};

// Per-thread buffers, sized on first use (no allocation in the hot loop).
struct Scratch {
  std::vector<c10::BFloat16> q;  // [G, 16, D], rows past num_queries zero
  std::vector<float> acc;        // [G, 16, D] unnormalized outputs
  std::vector<float> m, l;       // [G, 16] running max and sum
  std::vector<Line> kt, vp;  // K^T pairs [D/32][16 pairs][16 keys]; V pairs [8][D]
  alignas(64) float s[ROWS * KEYS];
  alignas(64) float pv[ROWS * 16];
  alignas(64) uint16_t p[ROWS * KEYS];

  void size_for(int group, int head_dim) {
    const size_t rows = size_t(group) * ROWS;
    if (q.size() < rows * head_dim) {
      q.resize(rows * head_dim);
      acc.resize(rows * head_dim);
      m.resize(rows);
      l.resize(rows);
    }
    const size_t vectors = size_t(head_dim) / 2;  // D/2 pairs x 16 keys x 4 B = D/2 vectors
    if (kt.size() < vectors) {
      kt.resize(vectors);
      vp.resize(vectors);
    }
  }
};

// K rows j0 .. j0 + n - 1 -> kt[c * 16 + p] = (K[j0 + key][32c + 2p], K[..][32c + 2p + 1]) for
// the 16 keys (zeros past n): the B operand of Q_g @ K^T, one 16 x 16 transpose of 32-bit pairs
// per 32 dims.
inline void build_kt(const Rows& k, int j0, int n, int D, __m512i* kt) {
  const c10::BFloat16* rows[KEYS];
  for (int t = 0; t < n; ++t) rows[t] = k.row(j0 + t);
  for (int c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int t = 0; t < KEYS; ++t) {
      r[t] = t < n ? _mm512_loadu_si512(rows[t] + 32 * c) : _mm512_setzero_si512();
    }
    cpu_simd::transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(kt + c * 16 + p, r[p]);
  }
}

// V rows j0 .. j0 + n - 1 -> vp as [8 key pairs][D dims] of (V[2i][d], V[2i + 1][d]) (zeros past
// n: P is 0 there, but 0 x NaN is not): the B operand of P @ V, a row of 16 dims per tile row.
inline void build_vp(const Rows& v, int j0, int n, int D, __m512i* vp) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38,
                                                7, 39, 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13,
                                                45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const __m512i zero = _mm512_setzero_si512();
  for (int i = 0; i < KEYS / 2; ++i) {
    const c10::BFloat16* a = 2 * i < n ? v.row(j0 + 2 * i) : nullptr;
    const c10::BFloat16* b = 2 * i + 1 < n ? v.row(j0 + 2 * i + 1) : nullptr;
    for (int c = 0; c < D / 32; ++c) {
      const __m512i x = a ? _mm512_loadu_si512(a + 32 * c) : zero;
      const __m512i y = b ? _mm512_loadu_si512(b + 32 * c) : zero;
      __m512i* dst = vp + (int64_t(i) * D + 32 * c) / 16;  // 16 pairs (64 B) per vector
      _mm512_store_si512(dst, _mm512_permutex2var_epi16(x, low, y));
      _mm512_store_si512(dst + 1, _mm512_permutex2var_epi16(x, high, y));
    }
  }
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

// Online softmax of one head's S tile (already in s): updates m and l, writes P in bfloat16 and
// each row's correction c. Row i sees keys j0 .. first_pos + i (and < num_keys).
inline void softmax_rows(const Item& it, int j0, int n, const float* s, float* m, float* l,
                         uint16_t* p, float* correction) {
  using cpu_simd::f32x16;
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < ROWS; ++i) {
    // Padding rows (past num_queries) repeat the last query's horizon: finite, never written.
    const int pos = it.first_pos + std::min(i, it.num_queries - 1);
    const int visible = std::min(n, pos - j0 + 1);
    if (visible <= 0) {  // every key of the group is after this query
      correction[i] = 1.0f;
      std::memset(p + i * KEYS, 0, KEYS * sizeof(uint16_t));
      continue;
    }
    const __mmask16 keep = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(visible));
    const __m512 scores = _mm512_mask_mov_ps(
        _mm512_set1_ps(neg_inf), keep, _mm512_mul_ps(_mm512_load_ps(s + i * KEYS),
                                                     _mm512_set1_ps(it.scale)));
    const float m_new = std::max(m[i], _mm512_reduce_max_ps(scores));
    correction[i] = cpu_simd::exp_nonpositive(m[i] - m_new);  // m = -inf: 0
    const f32x16 e = cpu_simd::exp_nonpositive(f32x16(_mm512_sub_ps(scores, _mm512_set1_ps(m_new))));
    const __m512 probs = _mm512_maskz_mov_ps(keep, __m512(e));  // exp(-inf) is ~1e-38, not 0
    l[i] = l[i] * correction[i] + _mm512_reduce_add_ps(probs);
    m[i] = m_new;
    _mm256_store_si256(reinterpret_cast<__m256i*>(p + i * KEYS),
                       (__m256i)_mm512_cvtneps_pbh(probs));
  }
}

inline void attend(const Item& it, Scratch& sc) {
  const int D = it.head_dim, G = it.group;
  sc.size_for(G, D);
  for (int g = 0; g < G; ++g) {
    c10::BFloat16* q = sc.q.data() + size_t(g) * ROWS * D;
    for (int i = 0; i < ROWS; ++i) {
      if (i < it.num_queries) {
        std::memcpy(q + i * D, it.query + i * it.q_token_stride + g * it.q_head_stride,
                    size_t(D) * sizeof(c10::BFloat16));
      } else {
        std::memset(q + i * D, 0, size_t(D) * sizeof(c10::BFloat16));
      }
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + size_t(G) * ROWS * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + G * ROWS, -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.begin() + G * ROWS, 0.f);
  __m512i* kt = reinterpret_cast<__m512i*>(sc.kt.data());
  __m512i* vp = reinterpret_cast<__m512i*>(sc.vp.data());
  alignas(64) float correction[ROWS];

  for (int j0 = 0; j0 < it.num_keys; j0 += KEYS) {
    const int n = std::min(KEYS, it.num_keys - j0);
    if (j0 + KEYS < it.num_keys) prefetch_group(it, j0 + KEYS);
    build_kt(it.k, j0, n, D, kt);
    build_vp(it.v, j0, n, D, vp);
    for (int g = 0; g < G; ++g) {
      const c10::BFloat16* q = sc.q.data() + size_t(g) * ROWS * D;
      _tile_zero(0);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(1, q + 32 * c, D * 2);
        _tile_loadd(2, kt + c * 16, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sc.s, KEYS * 4);
      float* m = sc.m.data() + g * ROWS;
      float* l = sc.l.data() + g * ROWS;
      softmax_rows(it, j0, n, sc.s, m, l, sc.p, correction);
      _tile_loadd(3, sc.p, KEYS * 2);
      float* acc = sc.acc.data() + size_t(g) * ROWS * D;
      for (int d0 = 0; d0 < D; d0 += 16) {
        _tile_zero(5);
        _tile_loadd(4, vp + d0 / 16, D * 4);  // 8 key-pair rows of D pairs each
        _tile_dpbf16ps(5, 3, 4);
        _tile_stored(5, sc.pv, 64);
        for (int i = 0; i < ROWS; ++i) {
          float* a = acc + i * D + d0;
          _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), _mm512_set1_ps(correction[i]),
                                              _mm512_load_ps(sc.pv + i * 16)));
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float* acc = sc.acc.data() + size_t(g) * ROWS * D;
    const float* l = sc.l.data() + g * ROWS;
    for (int i = 0; i < it.num_queries; ++i) {
      const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;  // l = 0 only for an empty context
      c10::BFloat16* dst = it.out + i * it.o_token_stride + g * it.o_head_stride;
      for (int d = 0; d < D; d += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + d), _mm512_set1_ps(inv));
        cpu_simd::store_bf16x16(dst + d, cpu_simd::f32x16(y));
      }
    }
  }
}

}  // namespace cpu_prefill_amx

#endif
