// The inner product of the many-row int4 kernel on AVX-512 CPUs (cpu_int4_linear.h):
// a 64-row block of the weight, already dequantized into bfloat16 pairs in a block-sized
// buffer that stays in L2,
//
//   pairs[(p * 4 + quarter) * 16 + lane] = (w(16 quarter + lane, 2p), w(.., 2p + 1)), bfloat16
//
// times every 4 x rows by vdpbf16ps (products of two bfloat16 are exact in float32, sums in
// float32). It is packed_bf16_linear's loop on the same layout (cpu_fused_ops.cpp), so with
// many rows a quantized layer costs its bf16 twin plus one conversion per block, not per tile.
#pragma once

#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <cstdint>

namespace cpu_pair_tiles {

constexpr int BLOCK_ROWS = 64;
constexpr int QUARTERS = 4;  // 16-row vectors per block
constexpr int TILE_M = 4;    // x rows per pass: their 16 accumulators, 4 pairs and a broadcast

// out[m][0..63] for MR x rows over one block's pairs (K inputs).
template <int MR>
inline void block_tile(const uint32_t* pairs, int64_t K, const uint32_t* const* x_pairs,
                       c10::BFloat16* const* out, const cpu_simd::NextBlockShare& next) {
  __m512 acc[MR][QUARTERS];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < K / 2; ++p) {
    next.at_step(p);
    __m512i w[QUARTERS];
    for (int j = 0; j < QUARTERS; ++j) {
      w[j] = _mm512_load_si512(pairs + (p * QUARTERS + j) * 16);
    }
    for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(int(x_pairs[m][p]));
      for (int j = 0; j < QUARTERS; ++j) {
        acc[m][j] = cpu_simd::dot_bf16_pairs(acc[m][j], w[j], xb);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) {
      cpu_simd::store_bf16x16(out[m] + j * 16, cpu_simd::f32x16(acc[m][j]));
    }
  }
}

// All M x rows (bfloat16 [M, K]) over block n0 / 64's pairs: out[m][n0 .. n0 + 63] of [M, N].
// Meanwhile the thread's next block (next_bytes at `next`, or nullptr) is requested into L2.
inline void all_rows(const uint32_t* pairs, const c10::BFloat16* x, int64_t M, int64_t K,
                     c10::BFloat16* out, int64_t N, int64_t n0, const void* next,
                     int64_t next_bytes) {
  const int64_t tiles = (M + TILE_M - 1) / TILE_M;
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
    const cpu_simd::NextBlockShare share =
        cpu_simd::next_block_share(static_cast<const char*>(next), next_bytes, m0 / TILE_M, tiles);
    const cpu_simd::PairTile<TILE_M> t(x, K, M, m0, out, N, n0);
    switch (t.rows) {
      case 4: block_tile<4>(pairs, K, t.x_pairs, t.out, share); break;
      case 3: block_tile<3>(pairs, K, t.x_pairs, t.out, share); break;
      case 2: block_tile<2>(pairs, K, t.x_pairs, t.out, share); break;
      default: block_tile<1>(pairs, K, t.x_pairs, t.out, share); break;
    }
  }
}

}  // namespace cpu_pair_tiles
#endif  // CPU_BF16_PAIRS
