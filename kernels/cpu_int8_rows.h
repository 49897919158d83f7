// W8A16 products for many rows (a batch-64 decode step, a verify step), bfloat16 activations,
// on CPUs with AVX512-BF16. Included by cpu_fused_ops.cpp; the few-row kernel there (int8_linear)
// keeps decode's 1-4 rows, and float32/float16 models keep dequantize + GEMM.
//
// Why: with many rows the product is bound by arithmetic, where vdpbf16ps does two multiply-adds
// per float32 lane to an FMA's one, and the int8 path dequantized each layer into a 16-bit
// scratch for oneDNN's GEMM on every call (which also reordered it for its own layout). Here
// each thread takes whole blocks of 64 output rows: a block's weights become bfloat16 pairs
// once, in a block-sized buffer that stays in L2, and every 4 x rows are multiplied with them:
//
//   pairs[p][quarter] lane i = (q(16 quarter + i, 2p), q(16 quarter + i, 2p + 1)) as bfloat16
//
// exactly (|q| <= 127 has 7 significant bits); the per-row scale multiplies the float32 sum once:
// out(m, n) = s(n) * sum_k x(m, k) q(n, k).
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

// out [M, N] = x [M, K] @ (q [N, K] * s [N, None]).T; N % 64 == 0, K % 32 == 0, bfloat16 x,
// scales and out.
inline void linear(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                   const int8_t* q, const c10::BFloat16* scales, int64_t N) {
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
