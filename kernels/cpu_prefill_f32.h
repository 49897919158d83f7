// Prefill attention in float32 tiles: one work item of cpu_paged_attention.cpp (a sequence, a
// KV head, up to 16 query tokens) for a bfloat16 query and cache on AVX-512 CPUs without
// AVX512-BF16 (and so without AMX), where the row path's pair products are emulated.
//
// Why: the row path computes each (query token, head) row against each 16-key group on its own:
// Q.K by emulated pair products and a reduction tree per 16 keys, then a max, an exp and a sum
// reduced across lanes per row. cpu_prefill_amx.h showed the cure on AMX CPUs; this is its
// shape with FMAs. Per group of 16 keys and per query head g, the 16 query tokens are the lanes:
//
//   S^T [16 keys][16 queries] = sum over d of K[key][d] (broadcast) x Q_g^T[d] (a vector)
//   O_g^T [D][16 queries] = O_g^T * c + sum over keys of V[key][d] (broadcast) x P[key]
//
// so the online softmax is lane-wise as there (max and sum over keys are vector ops, one exp
// serves 16 scores) and nothing is reduced across lanes. K and V rows are widened to float32
// once per group (exact) and shared by the G heads; Q_g^T once per item. P stays float32 (the
// AMX kernel rounds it to bfloat16 for its tiles). Rows past the context are never read.
#pragma once

#include "cpu_prefill_tiles.h"
#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS) && !defined(__AVX512BF16__)
#define CPU_PREFILL_F32 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace cpu_prefill_f32 {

constexpr int ROWS = cpu_prefill_tiles::ROWS;  // query tokens per item at most: the lanes
constexpr int KEYS = cpu_prefill_tiles::KEYS;  // keys per group

// Head dims served: whole 16-dim vectors, at most 256.
inline bool supports(int head_dim) { return head_dim % 16 == 0 && head_dim <= 256; }

using cpu_prefill_tiles::Item;
using cpu_prefill_tiles::Rows;

// Per-thread buffers, grown on first use (no allocation in the hot loop).
struct Scratch {
  std::vector<__m512> qt;   // [G][D] Q_g^T: dim d's 16 query lanes (scaled)
  std::vector<__m512> acc;  // [G][D] O_g^T, unnormalized
  std::vector<__m512> m, l;  // [G] the query lanes' running max and sum
  std::vector<float> k, v;  // [16 keys][D] the group's rows in float32, zeros past the context

  void size_for(int group, int head_dim) {
    const size_t vectors = size_t(group) * head_dim;
    if (qt.size() < vectors) {
      qt.resize(vectors);
      acc.resize(vectors);
    }
    if (m.size() < size_t(group)) {
      m.resize(size_t(group));
      l.resize(size_t(group));
    }
    if (k.size() < size_t(KEYS) * head_dim) {
      k.resize(size_t(KEYS) * head_dim);
      v.resize(size_t(KEYS) * head_dim);
    }
  }
};

// Rows j0 .. j0 + n - 1 widened into dst [16][D] (zeros past n: P is 0 there, 0 x NaN is not).
inline void widen_group(const Rows& rows, int j0, int n, int D, float* dst) {
  for (int t = 0; t < KEYS; ++t) {
    const c10::BFloat16* src = t < n ? rows.row(j0 + t) : nullptr;
    for (int d = 0; d < D; d += 16) {
      const __m512 x = src ? __m512(cpu_simd::load_bf16x16(src + d)) : _mm512_setzero_ps();
      _mm512_storeu_ps(dst + t * D + d, x);
    }
  }
}

// H query heads at a time (up to 3): each K or V element broadcast once serves the H heads'
// products, 8 keys or dims per pass so that 8 x H accumulators stay in registers (one head
// at a time, a broadcast per FMA made the loads the bound: 150 of ~350 GFLOP/s).
constexpr int MAX_HEADS = 3;
constexpr int SPAN = 8;

// S^T of H heads: st[h][key] (16 query lanes) = sum_d K[key][d] Q_h^T[d], d in order.
template <int H>
inline void scores(const float* k, const __m512* qt, int D, __m512 (&st)[MAX_HEADS][KEYS]) {
  for (int t0 = 0; t0 < KEYS; t0 += SPAN) {
    __m512 acc[H][SPAN];
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SPAN; ++i) acc[h][i] = _mm512_setzero_ps();
    }
    for (int d = 0; d < D; ++d) {
      __m512 q[H];
      for (int h = 0; h < H; ++h) q[h] = qt[size_t(h) * D + d];
      for (int i = 0; i < SPAN; ++i) {
        const __m512 kb = _mm512_set1_ps(k[(t0 + i) * D + d]);
        for (int h = 0; h < H; ++h) acc[h][i] = _mm512_fmadd_ps(kb, q[h], acc[h][i]);
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < SPAN; ++i) st[h][t0 + i] = acc[h][i];
    }
  }
}

// O_h^T = O_h^T * c[h] + sum over the group's n keys (in order) of V[key][d] x P_h[key], for H
// heads, 8 dims at a time.
template <int H>
inline void accumulate(const float* v, const __m512 (&p)[MAX_HEADS][KEYS], int n, int D,
                       const __m512 (&c)[MAX_HEADS], __m512* acc) {
  for (int d0 = 0; d0 < D; d0 += SPAN) {
    __m512 a[H][SPAN];
    for (int h = 0; h < H; ++h) {
      for (int j = 0; j < SPAN; ++j) a[h][j] = _mm512_mul_ps(acc[size_t(h) * D + d0 + j], c[h]);
    }
    for (int t = 0; t < n; ++t) {
      __m512 pt[H];
      for (int h = 0; h < H; ++h) pt[h] = p[h][t];
      const float* vt = v + t * D + d0;
      for (int j = 0; j < SPAN; ++j) {
        const __m512 vb = _mm512_set1_ps(vt[j]);
        for (int h = 0; h < H; ++h) a[h][j] = _mm512_fmadd_ps(vb, pt[h], a[h][j]);
      }
    }
    for (int h = 0; h < H; ++h) {
      for (int j = 0; j < SPAN; ++j) acc[size_t(h) * D + d0 + j] = a[h][j];
    }
  }
}

// One group for query heads g0 .. g0 + H - 1: their scores, softmax and P V.
template <int H>
inline void heads(Scratch& sc, int g0, int D, int j0, int n, __m512i horizon, bool all_visible) {
  __m512 st[MAX_HEADS][KEYS], p[MAX_HEADS][KEYS], c[MAX_HEADS];
  scores<H>(sc.k.data(), sc.qt.data() + size_t(g0) * D, D, st);
  for (int h = 0; h < H; ++h) {
    c[h] = cpu_prefill_tiles::softmax_lanes(st[h], j0, n, horizon, all_visible, sc.m[g0 + h],
                                            sc.l[g0 + h], p[h]);
  }
  accumulate<H>(sc.v.data(), p, n, D, c, sc.acc.data() + size_t(g0) * D);
}

inline void attend(const Item& it, Scratch& sc) {
  const int D = it.head_dim, G = it.group;
  sc.size_for(G, D);
  // Q_g^T, scaled: per 16 dims one 16 x 16 transpose of the query rows (zeros past the item).
  for (int g = 0; g < G; ++g) {
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512i r[16];
      for (int i = 0; i < ROWS; ++i) {
        const c10::BFloat16* q = it.query + i * it.q_token_stride + g * it.q_head_stride + d0;
        const __m512 x = i < it.num_queries
                             ? _mm512_mul_ps(__m512(cpu_simd::load_bf16x16(q)),
                                             _mm512_set1_ps(it.scale))
                             : _mm512_setzero_ps();
        r[i] = _mm512_castps_si512(x);
      }
      cpu_simd::transpose16(r);
      for (int j = 0; j < 16; ++j) sc.qt[size_t(g) * D + d0 + j] = _mm512_castsi512_ps(r[j]);
    }
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + size_t(G) * D, _mm512_setzero_ps());
  std::fill(sc.m.begin(), sc.m.begin() + G,
            _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
  std::fill(sc.l.begin(), sc.l.begin() + G, _mm512_setzero_ps());
  const __m512i horizon = cpu_prefill_tiles::horizon(it);

  for (int j0 = 0; j0 < it.num_keys; j0 += KEYS) {
    const int n = std::min(KEYS, it.num_keys - j0);
    if (j0 + KEYS < it.num_keys) cpu_prefill_tiles::prefetch_group(it, j0 + KEYS);
    widen_group(it.k, j0, n, D, sc.k.data());
    widen_group(it.v, j0, n, D, sc.v.data());
    const bool all_visible = j0 + n - 1 <= it.first_pos;  // the first query sees them all
    for (int g0 = 0; g0 < G; g0 += MAX_HEADS) {
      switch (std::min(MAX_HEADS, G - g0)) {
        case 3: heads<3>(sc, g0, D, j0, n, horizon, all_visible); break;
        case 2: heads<2>(sc, g0, D, j0, n, horizon, all_visible); break;
        default: heads<1>(sc, g0, D, j0, n, horizon, all_visible); break;
      }
    }
  }
  // out[i][d] = O_g^T[d][i] / l[i]: per 16 dims one transpose back to query rows.
  for (int g = 0; g < G; ++g) {
    alignas(64) float inv[ROWS];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), sc.l[g]));
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_castps_si512(sc.acc[size_t(g) * D + d0 + j]);
      cpu_simd::transpose16(r);
      for (int i = 0; i < it.num_queries; ++i) {
        // l = 0 only for an empty context (a padding row): zeros, not NaN.
        const float s = std::isfinite(inv[i]) ? inv[i] : 0.0f;
        const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(s));
        c10::BFloat16* dst = it.out + i * it.o_token_stride + g * it.o_head_stride + d0;
        cpu_simd::store_bf16x16(dst, cpu_simd::f32x16(y));
      }
    }
  }
}

}  // namespace cpu_prefill_f32

#endif
