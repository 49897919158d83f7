// W8A16 products for many rows (a batch-64 decode step, a verify step), bfloat16 activations,
// on CPUs with AVX512-BF16. Included by cpu_fused_ops.cpp; the few-row kernel there (int8_linear)
// keeps decode's 1-3 rows, and float32/float16 models keep dequantize + GEMM.
//
// Why: with many rows the product is bound by arithmetic, where vdpbf16ps does two multiply-adds
// per float32 lane to an FMA's one, and the int8 path dequantized each layer into a 16-bit
// scratch for oneDNN's GEMM on every call (which also reordered it for its own layout). Two
// paths, both exact in the weight (|q| <= 127 has 7 significant bits, so int8 -> bfloat16 is
// exact) with the per-row scale multiplying the float32 sum once, out(m, n) = s(n) sum_k x q:
//
// - 4-31 rows, block pairs: each thread takes whole blocks of 64 output rows; a block's weights
//   become bfloat16 pairs once, pairs[p][quarter] lane i = (q(16 quarter + i, 2p),
//   q(.., 2p + 1)), in a block-sized buffer that stays in L2, and every 4 x rows are multiplied
//   with them (cpu_pair_tiles.h). The pairs need a 16 x 16 transpose per 512 weights.
// - From 32 rows, x lanes: x is the per-lane operand (16 x rows a vector) and the weight pair
//   is broadcast from rows widened in place, so there is no transpose; the widening of the next
//   16 rows is interleaved with the multiply-adds of the current ones (lanes_product).
#pragma once

#if defined(__AVX512BF16__)
#define CPU_INT8_ROWS 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_pair_tiles.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_int8_rows {

constexpr int BLOCK_ROWS = cpu_pair_tiles::BLOCK_ROWS;
constexpr int QUARTERS = cpu_pair_tiles::QUARTERS;
constexpr int K_STEP = 32;  // inputs converted per row at a time (16 pairs)

// 32 int8 values -> 32 bfloat16 in order (int8 -> int32 -> float32 -> bfloat16, all exact).
inline __m512i widen32(const int8_t* src) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

// A 64-row block of row-major int8 weights [64, K] -> pairs[(p * QUARTERS + quarter) * 16 +
// lane], K % 32 == 0. Per 16 rows and 32 inputs: each row's 16 pairs become one vector
// (int8 -> int32 -> float32 -> bfloat16, all exact), and a transpose turns the 16 row vectors
// into the 16 pair vectors.
inline void build_pairs(const int8_t* block, int64_t K, uint32_t* pairs) {
  for (int quarter = 0; quarter < QUARTERS; ++quarter) {
    const int8_t* rows = block + int64_t(quarter) * 16 * K;
    for (int64_t k0 = 0; k0 < K; k0 += K_STEP) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = widen32(rows + i * K + k0);
      cpu_simd::transpose16(r);
      for (int c = 0; c < 16; ++c) {
        _mm512_store_si512(pairs + ((k0 / 2 + c) * QUARTERS + quarter) * 16, r[c]);
      }
    }
  }
}

// With many x rows (from LANES_MIN_M) the roles turn around, as in the AMX kernel
// (cpu_amx_linear.h): x becomes the per-lane operand, 16 x rows per vector, turned into pairs
// once per call, xp[(t * K/2 + p) * 16 + i] = (x(16 t + i, 2p), x(16 t + i, 2p + 1)), zero past
// row M; the weight is broadcast a pair at a time from its rows widened to bfloat16 (16 rows
// at a time, no transpose). A pass over SmolLM2's layers at 64 rows, 2-core EPYC, one run: block
// pairs 45.5 ms (~10 of it building the pairs, mostly the transposes), x lanes 38.4, x lanes
// with the widening interleaved 34.7; bf16's own kernel 34.1. At 32 rows 20.4 against 18.0. The
// price: x rows are padded to a multiple of 16, so fewer rows keep the block pairs.
constexpr int X_ROWS = 16;   // x rows per pairs vector (one per lane)
constexpr int X_TILES = 4;   // x vectors per pass over a weight row group: 64 rows
constexpr int W_ROWS = 16;   // weight rows widened at a time
constexpr int64_t LANES_MIN_M = 32;  // at 24 rows level with the block pairs, at 32 ahead

inline void build_x_pairs(const c10::BFloat16* x, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t tiles = (M + X_ROWS - 1) / X_ROWS;
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t p0 = 0; p0 < K / 2; p0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t m = t * X_ROWS + i;
        r[i] = m < M ? _mm512_loadu_si512(x + m * K + 2 * p0) : _mm512_setzero_si512();
      }
      cpu_simd::transpose16(r);
      for (int c = 0; c < 16; ++c) _mm512_storeu_si512(xp + (t * K / 2 + p0 + c) * 16, r[c]);
    }
  }
}

// 16 int8 weight rows [16, K] -> bfloat16 [16, K] (exact). The rows are contiguous, so they are
// one stream, prefetched STREAM_PREFETCH_BYTES ahead (on demand: a pass over SmolLM2's layers at
// 16 rows took 11.1 ms, prefetched 9.1, bf16 9.8; 2-core Xeon, the AMX kernel).
inline void widen_rows(const int8_t* q, int64_t K, c10::BFloat16* w) {
  for (int64_t i = 0; i < W_ROWS * K; i += 2 * K_STEP) {  // contiguous: 64 bytes a step
    _mm_prefetch(reinterpret_cast<const char*>(q + i + cpu_simd::STREAM_PREFETCH_BYTES),
                 _MM_HINT_T0);
    _mm512_storeu_si512(w + i, widen32(q + i));
    _mm512_storeu_si512(w + i + K_STEP, widen32(q + i + K_STEP));
  }
}

// One 64-byte step of widen_rows: weights [i, i + 64) of the 16 contiguous rows.
__attribute__((always_inline)) inline void widen_step(const int8_t* q, int64_t i,
                                                      c10::BFloat16* w) {
  _mm_prefetch(reinterpret_cast<const char*>(q + i + cpu_simd::STREAM_PREFETCH_BYTES),
               _MM_HINT_T0);
  _mm512_storeu_si512(w + i, widen32(q + i));
  _mm512_storeu_si512(w + i + K_STEP, widen32(q + i + K_STEP));
}

// acc[t] + 16 n, lane i: the float32 sum for x row 16 t + i and weight row n of 16, for the
// TILES (1-4) x vectors of xp_tiles, by vdpbf16ps with the weight pair broadcast. Meanwhile the
// next 16 weight rows (next_q, or nullptr) are widened into next_w, a step every 2 steps of the
// loop: the multiply-adds leave issue slots and the other vector pipes free, and the widening
// done apart cost ~4 ms of a 38 ms pass at 64 rows (2-core EPYC).
template <int TILES>
inline void lanes_product(const c10::BFloat16* w, int64_t K, const uint32_t* xp_tiles,
                          float (*acc)[256], const int8_t* next_q, c10::BFloat16* next_w) {
  const int64_t tile_stride = K / 2 * 16;  // uint32 units between x vectors' pairs
  const int64_t widen_end = next_q ? W_ROWS * K : 0;
  int64_t widen_at = 0;
  // Weight rows per register tile: 4 x 4 or 3 x 4 accumulators, or 2 x 8 (4 chains of
  // dependent vdpbf16ps would not cover its latency).
  constexpr int W_TILE = TILES <= 2 ? 8 : 4;
  for (int n0 = 0; n0 < W_ROWS; n0 += W_TILE) {
    const uint32_t* rows = reinterpret_cast<const uint32_t*>(w + n0 * K);  // as pairs
    __m512 a[W_TILE][TILES];
    for (int n = 0; n < W_TILE; ++n) {
      for (int t = 0; t < TILES; ++t) a[n][t] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < K / 2; ++p) {
      if ((p & 1) == 0 && widen_at < widen_end) {
        widen_step(next_q, widen_at, next_w);
        widen_at += 2 * K_STEP;
      }
      __m512bh xv[TILES];
      for (int t = 0; t < TILES; ++t) {
        xv[t] = (__m512bh)_mm512_loadu_si512(xp_tiles + t * tile_stride + p * 16);
      }
      for (int n = 0; n < W_TILE; ++n) {
        const __m512bh wb = (__m512bh)_mm512_set1_epi32(int(rows[n * K / 2 + p]));
        for (int t = 0; t < TILES; ++t) a[n][t] = _mm512_dpbf16_ps(a[n][t], xv[t], wb);
      }
    }
    for (int n = 0; n < W_TILE; ++n) {
      for (int t = 0; t < TILES; ++t) _mm512_store_ps(acc[t] + (n0 + n) * 16, a[n][t]);
    }
  }
  for (; widen_at < widen_end; widen_at += 2 * K_STEP) widen_step(next_q, widen_at, next_w);
}

// out[m][n0 .. n0 + 15] = s * the sums of acc's `tiles` x tiles (from x row m0; rows < M).
inline void write_rows(float (*acc)[256], int64_t tiles, int64_t m0, int64_t M, int64_t N,
                       int64_t n0, __m512 s, c10::BFloat16* out) {
  for (int64_t t = 0; t < tiles; ++t) {
    __m512i r[16];  // r[n] lane i: output (x row m0 + 16 t + i, weight row n0 + n)
    for (int n = 0; n < 16; ++n) r[n] = _mm512_load_si512(acc[t] + n * 16);
    cpu_simd::transpose16(r);
    const int64_t first = m0 + t * X_ROWS;
    for (int64_t i = 0; i < std::min<int64_t>(X_ROWS, M - first); ++i) {
      const __m512 y = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), s);
      cpu_simd::store_bf16x16(out + (first + i) * N + n0, cpu_simd::f32x16(y));
    }
  }
}

inline void linear_lanes(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                         const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  const int64_t x_tiles = (M + X_ROWS - 1) / X_ROWS;
  std::vector<__m512i> xp_buffer(size_t(x_tiles * K / 2));
  uint32_t* xp = reinterpret_cast<uint32_t*>(xp_buffer.data());
  build_x_pairs(x, M, K, xp);
  at::parallel_for(0, N / W_ROWS, 1, [&](int64_t begin, int64_t end) {
    // Two groups of 16 widened rows (in L1/L2): this group's, and the next one's being widened.
    std::vector<c10::BFloat16> buffer(size_t(2 * W_ROWS * K));
    c10::BFloat16* w[2] = {buffer.data(), buffer.data() + W_ROWS * K};
    alignas(64) float acc[X_TILES][256];
    widen_rows(q + begin * W_ROWS * K, K, w[0]);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * W_ROWS, which = (g - begin) % 2;
      const __m512 s = (__m512)cpu_simd::load_bf16x16(scales + n0);
      for (int64_t t0 = 0; t0 < x_tiles; t0 += X_TILES) {
        const int64_t tiles = std::min<int64_t>(X_TILES, x_tiles - t0);
        const uint32_t* xp_tiles = xp + t0 * K / 2 * 16;
        // The next group is widened during the last pass over this one.
        const bool last = t0 + X_TILES >= x_tiles && g + 1 < end;
        const int8_t* next_q = last ? q + (n0 + W_ROWS) * K : nullptr;
        c10::BFloat16* next_w = w[1 - which];
        switch (tiles) {
          case 4: lanes_product<4>(w[which], K, xp_tiles, acc, next_q, next_w); break;
          case 3: lanes_product<3>(w[which], K, xp_tiles, acc, next_q, next_w); break;
          case 2: lanes_product<2>(w[which], K, xp_tiles, acc, next_q, next_w); break;
          default: lanes_product<1>(w[which], K, xp_tiles, acc, next_q, next_w); break;
        }
        write_rows(acc, tiles, t0 * X_ROWS, M, N, n0, s, out);
      }
    }
  });
}

inline void linear(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                   const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  if (M >= LANES_MIN_M) return linear_lanes(out, x, M, K, q, scales, N);
  at::parallel_for(0, N / BLOCK_ROWS, 1, [&](int64_t begin, int64_t end) {
    // One block's pairs: K/2 x 64 lanes x 4 bytes (196 KB at K = 1536), reused for all rows.
    std::vector<__m512i> buffer(size_t(K / 2 * QUARTERS));
    uint32_t* pairs = reinterpret_cast<uint32_t*>(buffer.data());
    alignas(64) float block_scales[BLOCK_ROWS];
    for (int64_t b = begin; b < end; ++b) {
      build_pairs(q + b * BLOCK_ROWS * K, K, pairs);
      for (int r = 0; r < BLOCK_ROWS; ++r) block_scales[r] = float(scales[b * BLOCK_ROWS + r]);
      const int8_t* next = b + 1 < end ? q + (b + 1) * BLOCK_ROWS * K : nullptr;
      cpu_pair_tiles::all_rows(pairs, x, M, K, block_scales, out, N, b * BLOCK_ROWS, next,
                               BLOCK_ROWS * K);
    }
  });
}

}  // namespace cpu_int8_rows
#endif  // __AVX512BF16__
