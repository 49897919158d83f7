// W8A16 products for many rows (a batch-64 decode step, a verify step, a prefill chunk),
// bfloat16 activations, on AVX-512 CPUs (vdpbf16ps with AVX512-BF16, else its equivalent:
// cpu_simd::dot_bf16_pairs). Included by cpu_fused_ops.cpp; the few-row FMA kernel there
// (int8_linear) keeps decode's 1-4 rows, and float32/float16 models keep dequantize + GEMM.
//
// Why: with many rows the product is bound by arithmetic, where vdpbf16ps does two multiply-adds
// per float32 lane to an FMA's one, and the int8 path dequantized each layer into a 16-bit
// scratch for oneDNN's GEMM on every call (which also reordered it for its own layout). Each
// thread takes groups of 16 weight rows and widens them to bfloat16 in place (exact: |q| <= 127
// has 7 significant bits; no transpose), the next group's widening interleaved with the current
// group's multiply-adds; the per-row scale multiplies the float32 sum once,
// out(m, n) = s(n) sum_k x(m, k) q(n, k). Then:
//
// - 5-31 rows, dot products (linear_dot): each (weight row, x row) pair is a dot product over
//   32-input chunks read straight from both rows, reduced once per tile;
// - from 32 rows, x lanes (linear_lanes): x is the per-lane operand (16 x rows a vector) and the
//   weight pair is broadcast, with no reduction;
// - without AVX512-BF16 instead, from 13 rows (MIN_M), each 64-row block widened to float32 and
//   cpu_f32_tiles.h's tiles (linear_block_f32).
//
// An earlier path built 64-row blocks of transposed bf16 pairs (16 x 16 transposes of the
// widened rows, a 16-row strided read): over SmolLM2's 30 decoder layers, 2-core EPYC, it took
// 11.8 / 16.5 / 45.5 ms at 4 / 16 / 64 rows (bf16's own kernel 7.6 / 12.9 / 36.4); now 7.1
// (FMA kernel) / 14.5 / 34.0 against 8.8 / 11.1 / 34.9 (benchmarks.packed_linear --quantized).
#pragma once

#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS)
#define CPU_INT8_ROWS 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_decode_bf16.h"
#include "cpu_f32_tiles.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_int8_rows {

constexpr int K_STEP = 32;  // inputs converted per row at a time (16 pairs)

// 32 int8 values -> 32 bfloat16 in order (int8 -> int32 -> float32 -> bfloat16, all exact).
inline __m512i widen32(const int8_t* src) {
  const __m512 lo = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
  const __m512 hi = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16))));
  return cpu_simd::bf16_pairs_from(hi, lo);
}

// x lanes, as in the AMX kernel (cpu_amx_linear.h): x becomes the per-lane operand, 16 x rows
// per vector, turned into pairs once per call, xp[(t * K/2 + p) * 16 + i] = (x(16 t + i, 2p),
// x(16 t + i, 2p + 1)), zero past row M; the weight is broadcast a pair at a time from its
// widened rows. At 64 rows: 38.4 ms with the widening done apart, 34.7 interleaved. The price:
// x rows are padded to a multiple of 16, so fewer rows take the dot products (at 32 rows 19.9
// against their 23.4, at 24 rows 20.9 against 18.9).
constexpr int X_ROWS = 16;   // x rows per pairs vector (one per lane)
constexpr int X_TILES = 4;   // x vectors per pass over a weight row group: 64 rows
constexpr int W_ROWS = 16;   // weight rows widened at a time
constexpr int64_t LANES_MIN_M = 32;

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

// One 64-byte step of widening 16 contiguous int8 weight rows [16, K] to bfloat16 [16, K]
// (exact): weights [i, i + 64). The rows are one stream, prefetched STREAM_PREFETCH_BYTES ahead
// (on demand: a pass over SmolLM2's layers at 16 rows took 11.1 ms, prefetched 9.1, bf16 9.8;
// 2-core Xeon, the AMX kernel).
__attribute__((always_inline)) inline void widen_step(const int8_t* q, int64_t i,
                                                      c10::BFloat16* w) {
  _mm_prefetch(reinterpret_cast<const char*>(q + i + cpu_simd::STREAM_PREFETCH_BYTES),
               _MM_HINT_T0);
  _mm512_storeu_si512(w + i, widen32(q + i));
  _mm512_storeu_si512(w + i + K_STEP, widen32(q + i + K_STEP));
}

inline void widen_rows(const int8_t* q, int64_t K, c10::BFloat16* w) {
  for (int64_t i = 0; i < W_ROWS * K; i += 2 * K_STEP) widen_step(q, i, w);
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
      __m512i xv[TILES];
      for (int t = 0; t < TILES; ++t) {
        xv[t] = _mm512_loadu_si512(xp_tiles + t * tile_stride + p * 16);
      }
      for (int n = 0; n < W_TILE; ++n) {
        const __m512i wb = _mm512_set1_epi32(int(rows[n * K / 2 + p]));
        for (int t = 0; t < TILES; ++t) a[n][t] = cpu_simd::dot_bf16_pairs(a[n][t], xv[t], wb);
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

#if defined(CPU_F32_TILES)
// A 64-row block of int8 weights [rows, K] (row-major; rows <= 64, zero past them) -> float32
// [K][64] (cpu_f32_tiles.h's layout; exact). Per 16 rows and 64 inputs: 16 row loads, one
// 16 x 16 transpose of their 32-bit words (4 inputs each), then each word's 4 bytes
// sign-extended by shifts and converted.
inline void widen_int8_block(const int8_t* q, int64_t K, int64_t rows, float* wf) {
  for (int j = 0; j < 4; ++j) {
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      const int64_t inputs = std::min<int64_t>(64, K - k0);  // K % 32 == 0: 64 or 32
      const __mmask64 valid = inputs == 64 ? ~__mmask64(0) : (__mmask64(1) << inputs) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t n = 16 * j + i;
        r[i] = n < rows ? _mm512_maskz_loadu_epi8(valid, q + n * K + k0) : _mm512_setzero_si512();
      }
      cpu_simd::transpose16(r);  // r[c] lane i: inputs k0 + 4c .. + 3 of row 16 j + i
      for (int c = 0; c < inputs / 4; ++c) {
        for (int d = 0; d < 4; ++d) {  // byte d of each word: input k0 + 4c + d
          const __m512i q32 = _mm512_srai_epi32(_mm512_slli_epi32(r[c], 24 - 8 * d), 24);
          _mm512_store_ps(wf + (k0 + 4 * c + d) * 64 + 16 * j, _mm512_cvtepi32_ps(q32));
        }
      }
    }
  }
}

// From MIN_M rows without AVX512-BF16: each 64-row block widened to float32 once and
// multiplied by cpu_f32_tiles.h's tiles, the rows' scales applied to the sums (as write_rows
// does: the same bits as linear_lanes). It replaced x lanes in float32 (x re-read per 16 weight
// rows, 32-byte row pieces written per group): SmolLM2's 121 products, 2-core cloud Xeon, min
// of 7, ms, lanes / blocks: 33 rows 54.7 / 41.8, 64 rows 69.1 / 65.1 (bf16 61.9), 512 rows
// 712.8 / 507.4 (bf16 489.3).
inline void linear_block_f32(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                             const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  constexpr int64_t B = cpu_f32_tiles::BLOCK_ROWS;
  const std::vector<float> xf = cpu_f32_tiles::widen_rows(x, M, K);
  auto widen = [&](int64_t b, float* wf, float* s) -> const float* {
    const int64_t n0 = b * B, rows = std::min(B, N - n0);
    widen_int8_block(q + n0 * K, K, rows, wf);
    for (int64_t n = 0; n < B; ++n) s[n] = n < rows ? float(scales[n0 + n]) : 0.0f;
    return s;
  };
  auto block_bytes = [&](int64_t b) {
    return std::pair<const void*, int64_t>{q + b * B * K, std::min(B, N - b * B) * K};
  };
  cpu_f32_tiles::for_blocks((N + B - 1) / B, xf.data(), M, K, out, N, 0, widen, block_bytes);
}
#endif  // CPU_F32_TILES

// 5-31 rows, dot products: the weight rows widened as above (the next 16 interleaved), and
// each (weight row, x row) a dot product over 32-input chunks read straight from both rows
// (vdpbf16ps: the chunk's 16 pairs in one instruction); a tile is 4 weight rows x up to 4 x
// rows, 16 accumulators, and their 16-lane partial sums are reduced together once per tile
// (cpu_decode_bf16.h's transpose-and-add tree, ~3 instructions a sum). No padding of x and no
// transpose of the weight.
constexpr int DOT_N = 4;  // weight rows per tile
constexpr int DOT_M = 4;  // x rows per tile
constexpr int64_t DOT_MIN_M = 5;  // at 4 rows cpu_fused_ops.cpp's FMA kernel is ahead

// Lane order [m][n] from [n][m]: lane m * 4 + n takes lane n * 4 + m.
struct DotByRow {
  alignas(64) int32_t lanes[16];
  constexpr DotByRow() : lanes{} {
    for (int m = 0; m < DOT_M; ++m) {
      for (int n = 0; n < DOT_N; ++n) lanes[m * DOT_N + n] = n * DOT_M + m;
    }
  }
};
inline constexpr DotByRow DOT_BY_ROW{};

// Spreads widen_step over the steps of a group's tiles: `per_step` 64-byte steps at each.
struct Widening {
  const int8_t* q = nullptr;  // the next 16 rows, or nullptr
  c10::BFloat16* w = nullptr;
  int64_t at = 0, end = 0, per_step = 0;
  __attribute__((always_inline)) void step() {
    for (int64_t i = 0; i < per_step && at < end; ++i, at += 2 * K_STEP) widen_step(q, at, w);
  }
  void finish() {
    for (; at < end; at += 2 * K_STEP) widen_step(q, at, w);
  }
};

template <int MR>
inline void dot_tile(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, int64_t m0,
                     const float* s, c10::BFloat16* out, int64_t N, Widening& widening) {
  __m512 acc[DOT_N * DOT_M];  // [n][m]; the unused ones stay zero for the reduction
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += K_STEP) {
    widening.step();
    __m512i wv[DOT_N];
    for (int n = 0; n < DOT_N; ++n) wv[n] = _mm512_loadu_si512(w + n * K + k0);
    for (int m = 0; m < MR; ++m) {
      const __m512i xv = _mm512_loadu_si512(x + (m0 + m) * K + k0);
      for (int n = 0; n < DOT_N; ++n) {
        acc[n * DOT_M + m] = cpu_simd::dot_bf16_pairs(acc[n * DOT_M + m], wv[n], xv);
      }
    }
  }
  // Lane n * 4 + m holds (weight row n, x row m); turned to m * 4 + n, scaled, rounded to
  // bfloat16, each x row's 4 outputs are 8 contiguous bytes.
  const __m512i by_row = _mm512_load_si512(DOT_BY_ROW.lanes);
  const __m512 sums = _mm512_permutexvar_ps(by_row, cpu_decode_bf16::transpose_sum(acc));
  const __m512 scaled = _mm512_mul_ps(sums, _mm512_broadcast_f32x4(_mm_loadu_ps(s)));  // s[n]
  alignas(32) uint64_t rows[DOT_M];  // 4 bfloat16 per x row
  cpu_simd::store_bf16x16(reinterpret_cast<c10::BFloat16*>(rows), cpu_simd::f32x16(scaled));
  for (int m = 0; m < MR; ++m) std::memcpy(out + (m0 + m) * N, &rows[m], sizeof(uint64_t));
}

inline void linear_dot(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                       const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  at::parallel_for(0, N / W_ROWS, 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::BFloat16> buffer(size_t(2 * W_ROWS * K));  // this group's rows, the next's
    c10::BFloat16* w[2] = {buffer.data(), buffer.data() + W_ROWS * K};
    widen_rows(q + begin * W_ROWS * K, K, w[0]);
    const int64_t m_tiles = (M + DOT_M - 1) / DOT_M;
    const int64_t steps = W_ROWS / DOT_N * m_tiles * (K / K_STEP);
    const int64_t widen_steps = W_ROWS * K / (2 * K_STEP);  // widen_step's 64 weights each
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * W_ROWS, which = (g - begin) % 2;
      Widening widening;
      if (g + 1 < end) {
        widening = {q + (n0 + W_ROWS) * K, w[1 - which], 0, W_ROWS * K,
                    (widen_steps + steps - 1) / steps};
      }
      alignas(64) float s[W_ROWS];
      for (int n = 0; n < W_ROWS; ++n) s[n] = float(scales[n0 + n]);
      for (int nt = 0; nt < W_ROWS; nt += DOT_N) {
        const c10::BFloat16* rows = w[which] + nt * K;
        c10::BFloat16* o = out + n0 + nt;
        for (int64_t m0 = 0; m0 < M; m0 += DOT_M) {
          switch (std::min<int64_t>(DOT_M, M - m0)) {
            case 4: dot_tile<4>(rows, K, x, m0, s + nt, o, N, widening); break;
            case 3: dot_tile<3>(rows, K, x, m0, s + nt, o, N, widening); break;
            case 2: dot_tile<2>(rows, K, x, m0, s + nt, o, N, widening); break;
            default: dot_tile<1>(rows, K, x, m0, s + nt, o, N, widening); break;
          }
        }
      }
      widening.finish();
    }
  });
}

#if defined(CPU_F32_TILES)
// The rows from which int8_linear calls linear below. Without AVX512-BF16 the FMA kernel
// (cpu_fused_ops.cpp) keeps up to 12 rows, then float32 blocks for every row count: SmolLM2's
// 121 products, 2-core cloud Xeon, min of 7, ms, FMA kernel / emulated dot products / float32
// blocks: 5 rows 9.8 / 17.8 / 15.6, 8 rows 13.0 / - / 18.4, 12 rows 19.0 / - / 19.7, 16 rows
// 25.2 / - / 23.0, 31 rows - / 49.8 / 36.1.
constexpr int64_t MIN_M = 13;
#else
constexpr int64_t MIN_M = DOT_MIN_M;
#endif

// out [M, N] = x [M, K] @ (q [N, K] * s [N, None]).T; N % 16 == 0, K % 32 == 0, bfloat16 x,
// scales and out; from MIN_M rows.
inline void linear(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                   const int8_t* q, const c10::BFloat16* scales, int64_t N) {
#if defined(CPU_F32_TILES)
  linear_block_f32(out, x, M, K, q, scales, N);
#else
  if (M >= LANES_MIN_M) return linear_lanes(out, x, M, K, q, scales, N);
  linear_dot(out, x, M, K, q, scales, N);
#endif
}

}  // namespace cpu_int8_rows
#endif  // CPU_BF16_PAIRS
