// Prefill attention with AMX tiles: one work item of cpu_paged_attention.cpp (a sequence, a KV
// head, up to 16 query tokens) for a bfloat16 query and cache, on CPUs with AMX-BF16.
//
// Why: the generic item path computes each (query token, head) row against each key on its own,
// vector by vector; a 512-token prompt chunk of SmolLM2 took 5.1 ms a layer there (60 GFLOP/s,
// 2-core Xeon), i.e. ~150 ms of a 512-token chunked-prefill step. Here, per group of 16 keys and
// per query head g of the KV head, both products are tile products (tdpbf16ps: bfloat16 x
// bfloat16 -> float32 sums):
//
//   S^T [16 keys, 16 queries] = K [16, D] @ Q_g^T     (A operand: the K rows as cached)
//   O_g [16, D] = O_g * c + P [16, 16 keys] @ V        (B operand: V rows interleaved by key pair)
//
// with the same online softmax as the generic path (m, l, c = exp(m - m'); float32), masked to
// each query's causal horizon. Scores come transposed (a key per row, the 16 queries in the
// lanes) so the softmax is lane-wise: max and sum over keys are vector ops and each exp serves
// 16 scores. Row by row, with two horizontal reductions and a scalar exp per query, it was over
// half of the item's time (512-token chunk: 1.32 -> 0.76 ms a layer); and K, read as the A
// operand, needs no transpose (Q_g^T is built once per item). P is rounded to bfloat16 for its
// product, as flash attention kernels do on GPUs; scores, softmax and sums stay float32. K and V
// rows are read in place through the block table (any block size), each 16-key group once per
// item and shared by the G query heads; rows past the context are never read (unowned slots
// may hold NaN).
#pragma once

#include "cpu_amx_tiles.h"
#include "cpu_prefill_tiles.h"

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

constexpr int ROWS = cpu_prefill_tiles::ROWS;  // query tokens per tile (and per item at most)
constexpr int KEYS = cpu_prefill_tiles::KEYS;  // keys per group: one S tile's columns
constexpr int MAX_HEAD_DIM = 256;
// Tile registers (literals below: the tile intrinsics paste the number into the instruction):
// 0 the S^T accumulator, 1 K rows (32 dims), 2 Q_g^T pairs (32 dims), 3 P, 4 V pairs (16 dims),
// 5 one 16-dim slice of P @ V.

// Head dims the tile layout serves: whole 64-byte tile rows of Q (32 dims), at most 256.
inline bool supports(int head_dim) { return head_dim % 32 == 0 && head_dim <= MAX_HEAD_DIM; }

// AMX usable now (the build has it and Linux granted the tile state).
inline bool available() { return cpu_amx_tiles::tiles_permitted(); }

// Each thread that runs items loads this once per kernel call (oneDNN loads its own
// configurations between calls) and releases the tiles at the end.
inline void configure_tiles() {
  cpu_amx_tiles::TileConfig config;
  config.set(0, KEYS, ROWS * 4);  // S^T: 16 keys x 16 queries in float32
  config.set(1, KEYS, 64);        // K: 16 keys x 32 dims in bfloat16
  config.set(2, 16, ROWS * 4);    // Q_g^T: 16 dim pairs x 16 queries
  config.set(3, ROWS, KEYS * 2);  // P: 16 keys in bfloat16
  config.set(4, KEYS / 2, 64);    // V: 8 key pairs x 16 dims
  config.set(5, ROWS, 64);        // P @ V: 16 dims in float32
  _tile_loadconfig(&config);
}

using cpu_prefill_tiles::Item;
using cpu_prefill_tiles::Rows;

struct alignas(64) Line {  // one 64-byte vector's storage (a vector of __m512i drops alignment)
  uint32_t words[16];
};

// Per-thread buffers, sized on first use (no allocation in the hot loop).
struct Scratch {
  std::vector<c10::BFloat16> q;     // [16, D]: one head's query rows, rows past num_queries zero
  std::vector<c10::BFloat16> keys;  // [16, D]: a key group that is not 16 rows of one block
  std::vector<float> acc;           // [G, 16, D] unnormalized outputs
  std::vector<float> m, l;          // [G, 16] running max and sum
  std::vector<Line> qt, vp;  // Q_g^T pairs [G][D/32][16 pairs][16 queries]; V pairs [8][D]
  alignas(64) float s[KEYS * ROWS];  // S^T [16 keys][16 queries]
  alignas(64) float pv[ROWS * 16];
  alignas(64) uint16_t p[ROWS * KEYS];

  void size_for(int group, int head_dim) {
    const size_t rows = size_t(group) * ROWS;
    if (acc.size() < rows * head_dim) {
      acc.resize(rows * head_dim);
      m.resize(rows);
      l.resize(rows);
      qt.resize(size_t(group) * head_dim / 2);  // D/2 pairs x 16 lanes x 4 B = D/2 vectors
    }
    if (q.size() < size_t(ROWS) * head_dim) {
      q.resize(size_t(ROWS) * head_dim);
      keys.resize(size_t(KEYS) * head_dim);
      vp.resize(size_t(head_dim) / 2);
    }
  }
};

// Q_g^T as the B operand of S^T = K @ Q_g^T: qt[c * 16 + p] holds, for each query lane i,
// (Q[i][32c + 2p], Q[i][32c + 2p + 1]); one 16 x 16 transpose of 32-bit pairs per 32 dims, once
// per item and head (q: [16, D], rows past num_queries zero).
inline void build_qt(const c10::BFloat16* q, int D, __m512i* qt) {
  for (int c = 0; c < D / 32; ++c) {
    __m512i r[16];
    for (int i = 0; i < ROWS; ++i) r[i] = _mm512_loadu_si512(q + i * D + 32 * c);
    cpu_simd::transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(qt + c * 16 + p, r[p]);
  }
}

// The A operand of S^T: keys j0 .. j0 + 15 as 16 rows. In place when the group is 16 whole rows
// of one block (returns their first row and stride); else copied into `rows` with zeros past n
// (rows past the context are never read: unowned slots may hold NaN).
inline const c10::BFloat16* key_rows(const Rows& k, int j0, int n, int D, c10::BFloat16* rows,
                                     int64_t* stride_bytes) {
  if (n == KEYS && j0 % k.block_size + KEYS <= k.block_size) {
    *stride_bytes = k.token_stride * int64_t(sizeof(c10::BFloat16));
    return k.row(j0);
  }
  for (int t = 0; t < KEYS; ++t) {
    if (t < n) {
      std::memcpy(rows + t * D, k.row(j0 + t), size_t(D) * sizeof(c10::BFloat16));
    } else {
      std::memset(rows + t * D, 0, size_t(D) * sizeof(c10::BFloat16));
    }
  }
  *stride_bytes = D * int64_t(sizeof(c10::BFloat16));
  return rows;
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

// Online softmax of one head's S^T tile (st: [16 keys][16 query lanes], unscaled), lane-wise
// (cpu_prefill_tiles::softmax_lanes); writes P [16 queries][16 keys] in bfloat16 (the A operand
// of P @ V) and each query's correction c = exp(m - m').
inline void softmax_lanes(const float* st, int j0, int n, float scale, __m512i horizon,
                          bool all_visible, __m512& m, __m512& l, uint16_t* p,
                          float* correction) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 s[KEYS], e[KEYS];
  for (int k = 0; k < KEYS; ++k) s[k] = _mm512_mul_ps(_mm512_load_ps(st + k * ROWS), scale_v);
  _mm512_store_ps(correction,
                  cpu_prefill_tiles::softmax_lanes(s, j0, n, horizon, all_visible, m, l, e));
  // [key][query] -> [query][key], then two queries' 16 keys per bfloat16 conversion.
  __m512i rows[KEYS];
  for (int k = 0; k < KEYS; ++k) rows[k] = _mm512_castps_si512(e[k]);
  cpu_simd::transpose16(rows);
  for (int i = 0; i < ROWS; i += 2) {
    _mm512_store_si512(p + i * KEYS, (__m512i)_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(rows[i + 1]),
                                                                   _mm512_castsi512_ps(rows[i])));
  }
}

inline void attend(const Item& it, Scratch& sc) {
  const int D = it.head_dim, G = it.group;
  sc.size_for(G, D);
  __m512i* qt = reinterpret_cast<__m512i*>(sc.qt.data());
  __m512i* vp = reinterpret_cast<__m512i*>(sc.vp.data());
  for (int g = 0; g < G; ++g) {
    c10::BFloat16* q = sc.q.data();
    for (int i = 0; i < ROWS; ++i) {
      if (i < it.num_queries) {
        std::memcpy(q + i * D, it.query + i * it.q_token_stride + g * it.q_head_stride,
                    size_t(D) * sizeof(c10::BFloat16));
      } else {
        std::memset(q + i * D, 0, size_t(D) * sizeof(c10::BFloat16));
      }
    }
    build_qt(q, D, qt + size_t(g) * D / 2);
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + size_t(G) * ROWS * D, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + G * ROWS, -std::numeric_limits<float>::infinity());
  std::fill(sc.l.begin(), sc.l.begin() + G * ROWS, 0.f);
  const __m512i horizon = cpu_prefill_tiles::horizon(it);
  alignas(64) float correction[ROWS];

  for (int j0 = 0; j0 < it.num_keys; j0 += KEYS) {
    const int n = std::min(KEYS, it.num_keys - j0);
    if (j0 + KEYS < it.num_keys) cpu_prefill_tiles::prefetch_group(it, j0 + KEYS);
    int64_t k_stride_bytes = 0;
    const c10::BFloat16* keys = key_rows(it.k, j0, n, D, sc.keys.data(), &k_stride_bytes);
    build_vp(it.v, j0, n, D, vp);
    const bool all_visible = j0 + n - 1 <= it.first_pos;  // the first query sees them all
    for (int g = 0; g < G; ++g) {
      _tile_zero(0);
      for (int c = 0; c < D / 32; ++c) {
        _tile_loadd(1, keys + 32 * c, k_stride_bytes);
        _tile_loadd(2, qt + size_t(g) * D / 2 + c * 16, 64);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, sc.s, ROWS * 4);
      __m512 m = _mm512_loadu_ps(sc.m.data() + g * ROWS);
      __m512 l = _mm512_loadu_ps(sc.l.data() + g * ROWS);
      softmax_lanes(sc.s, j0, n, it.scale, horizon, all_visible, m, l, sc.p, correction);
      _mm512_storeu_ps(sc.m.data() + g * ROWS, m);
      _mm512_storeu_ps(sc.l.data() + g * ROWS, l);
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
