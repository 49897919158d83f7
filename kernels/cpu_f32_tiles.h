// Many x rows over a 64-row weight block on AVX-512 CPUs without AVX512-BF16: the block widened
// once to float32 in a buffer that stays in L2, then every 4 x rows multiply it with plain FMAs.
//
// Why: there vdpbf16ps is emulated (cpu_simd::dot_bf16_pairs), and in the pairs loops
// (cpu_pair_tiles.h, packed_bf16_linear) each pair vector costs a shift and a mask for the
// weights and two more for each x row's broadcast pair on top of its two FMAs: ~1.5 vector
// operations per FMA, where many rows are bound by arithmetic. Widened once per block, the
// weights are float32 lanes (w(16 j + lane, k) at wf[k * 64 + 16 j + lane]) and x float32
// scalars, so a tile is one broadcast and four FMAs per input and row, nothing else; the
// widening (a shift and a mask per 32 weights, or the int4 nibbles' conversion) is paid once
// per block for all its tiles. Products are exact in float32 as before and summed in the pairs
// loops' order (per pair of inputs the odd one first, as vdpbf16ps; SETS accumulator sets
// taking alternate pairs, as the loop each caller replaces), so the outputs are the same bits
// (tests/test_cpu_bf16_pairs.py). Included by cpu_fused_ops.cpp and cpu_int4_linear.h.
#pragma once

#include "cpu_pair_tiles.h"
#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS) && !defined(__AVX512BF16__)
#define CPU_F32_TILES 1
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <vector>

namespace cpu_f32_tiles {

// The pairs loops' blocks and tiles (a tile: 16 accumulators, 4 weight vectors, a broadcast).
constexpr int BLOCK_ROWS = cpu_pair_tiles::BLOCK_ROWS;
constexpr int QUARTERS = cpu_pair_tiles::QUARTERS;
constexpr int TILE_M = cpu_pair_tiles::TILE_M;

// A block in the pairs layout (per input pair p, 4 vectors of 16 rows' (w(n, 2p), w(n, 2p + 1))
// bfloat16 pairs) -> float32 [K][64]: the even inputs by a shift, the odd ones by a mask.
inline void widen_pairs_block(const uint32_t* pairs, int64_t K, float* wf) {
  const __m512i odd = _mm512_set1_epi32(int(0xFFFF0000u));
  for (int64_t p = 0; p < K / 2; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(pairs + p * 64) + cpu_simd::STREAM_PREFETCH_BYTES,
                 _MM_HINT_T0);
    for (int j = 0; j < QUARTERS; ++j) {
      const __m512i v = _mm512_loadu_si512(pairs + (p * QUARTERS + j) * 16);
      _mm512_store_ps(wf + (2 * p) * 64 + 16 * j, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
      _mm512_store_ps(wf + (2 * p + 1) * 64 + 16 * j,
                      _mm512_castsi512_ps(_mm512_and_si512(v, odd)));
    }
  }
}

// out[m][0..63] for MR x rows (float32, K inputs each) over the widened block; meanwhile this
// tile's share of the thread's next block is requested into L2 (cpu_simd::next_block_share).
// SETS (1 or 2) accumulator sets take alternate input pairs, summed at the end.
template <int MR, int SETS>
inline void block_tile(const float* wf, int64_t K, const float* const* x,
                       c10::BFloat16* const* out, const cpu_simd::NextBlockShare& next) {
  __m512 acc[SETS][MR][QUARTERS];
  for (int s = 0; s < SETS; ++s) {
    for (int m = 0; m < MR; ++m) {
      for (int j = 0; j < QUARTERS; ++j) acc[s][m][j] = _mm512_setzero_ps();
    }
  }
  const int64_t pairs = K / 2, per = next.lines_per(pairs);
  auto input = [&](int64_t k, int s) __attribute__((always_inline)) {
    __m512 w[QUARTERS];
    for (int j = 0; j < QUARTERS; ++j) w[j] = _mm512_load_ps(wf + k * 64 + 16 * j);
    for (int m = 0; m < MR; ++m) {
      const __m512 xb = _mm512_set1_ps(x[m][k]);
      for (int j = 0; j < QUARTERS; ++j) acc[s][m][j] = _mm512_fmadd_ps(w[j], xb, acc[s][m][j]);
    }
  };
  int64_t p = 0;
  for (; p + SETS <= pairs; p += SETS) {
    for (int s = 0; s < SETS; ++s) {
      next.at_step(p + s, per);
      input(2 * (p + s) + 1, s);  // the odd input first, as vdpbf16ps adds it
      input(2 * (p + s), s);
    }
  }
  for (; p < pairs; ++p) {
    next.at_step(p, per);
    input(2 * p + 1, 0);
    input(2 * p, 0);
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) {
      const __m512 sum = SETS == 2 ? _mm512_add_ps(acc[0][m][j], acc[SETS - 1][m][j])
                                   : acc[0][m][j];
      cpu_simd::store_bf16x16(out[m] + j * 16, cpu_simd::f32x16(sum));
    }
  }
}

// x bfloat16 [M, K] -> float32 [M, K] (exact), once per call.
inline std::vector<float> widen_rows(const c10::BFloat16* x, int64_t M, int64_t K) {
  std::vector<float> xf(size_t(M * K));
  for (int64_t i = 0; i < M * K; ++i) xf[size_t(i)] = cpu_simd::to_float(x[i]);
  return xf;
}

// All M x rows (float32 [M, K]) over a widened block: out[m][n0 .. n0 + 63] of [M, N]. The
// thread's next block (next_bytes at `next`, or nullptr) is requested into L2 tile by tile.
// two_sets_below: tiles of fewer rows than this use two accumulator sets (the pairs loop
// replaced does: packed_bf16_linear for 1-2 rows; cpu_pair_tiles.h never, 0).
inline void all_rows(const float* wf, const float* xf, int64_t M, int64_t K, c10::BFloat16* out,
                     int64_t N, int64_t n0, const void* next, int64_t next_bytes,
                     int two_sets_below) {
  const int64_t tiles = (M + TILE_M - 1) / TILE_M;
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
    const cpu_simd::NextBlockShare share =
        cpu_simd::next_block_share(static_cast<const char*>(next), next_bytes, m0 / TILE_M, tiles);
    const int rows = int(M - m0 < TILE_M ? M - m0 : TILE_M);
    const float* x[TILE_M];
    c10::BFloat16* o[TILE_M];
    for (int i = 0; i < rows; ++i) {
      x[i] = xf + (m0 + i) * K;
      o[i] = out + (m0 + i) * N + n0;
    }
    const bool two = rows < two_sets_below;
    switch (rows) {
      case 4: block_tile<4, 1>(wf, K, x, o, share); break;
      case 3: block_tile<3, 1>(wf, K, x, o, share); break;
      case 2:
        two ? block_tile<2, 2>(wf, K, x, o, share) : block_tile<2, 1>(wf, K, x, o, share);
        break;
      default:
        two ? block_tile<1, 2>(wf, K, x, o, share) : block_tile<1, 1>(wf, K, x, o, share);
    }
  }
}

// A thread's widened-block buffer (K x 64 float32: 147 KB at K = 576, 393 KB at 1536, in L2).
inline float* block_buffer(int64_t K) {
  static thread_local std::vector<__m512> buffer;
  const size_t vectors = size_t(K * BLOCK_ROWS / 16);
  if (buffer.size() < vectors) buffer.resize(vectors);
  return reinterpret_cast<float*>(buffer.data());
}

}  // namespace cpu_f32_tiles
#endif  // CPU_BF16_PAIRS without AVX512-BF16
