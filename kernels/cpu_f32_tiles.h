// Many x rows over a 64-row weight block on AVX-512 CPUs without AVX512-BF16: the block widened
// once to float32 in a buffer that stays in L2, then every 6 x rows multiply it with plain FMAs.
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
// (tests/test_cpu_bf16_pairs.py). Included by cpu_fused_ops.cpp, cpu_int4_linear.h and
// cpu_int8_rows.h (whose rows are widened from int8, their scale applied to the sums).
#pragma once

#include "cpu_pair_tiles.h"
#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS) && !defined(__AVX512BF16__)
#define CPU_F32_TILES 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

namespace cpu_f32_tiles {

// The pairs loops' blocks.
constexpr int BLOCK_ROWS = cpu_pair_tiles::BLOCK_ROWS;
constexpr int QUARTERS = cpu_pair_tiles::QUARTERS;
// x rows per tile: 6 x 4 accumulators, 4 weight vectors and a broadcast of 32 registers (4 rows,
// the pairs loops' tile: 5-12 % slower over SmolLM2's layers at 40-512 rows, 2-core cloud Xeon).
constexpr int TILE_M = 6;

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
// SETS (1 or 2) accumulator sets take alternate input pairs, summed at the end. Never inlined:
// inlined into int8's block loop, GCC 12 kept a 6-row tile's 24 accumulators on the stack
// (a store and a load around every FMA, half the speed).
template <int MR, int SETS>
__attribute__((noinline)) void block_tile(const float* wf, int64_t K, const float* const* x,
                                          c10::BFloat16* const* out,
                                          const cpu_simd::NextBlockShare& next,
                                          const float* scale) {
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
      __m512 sum = SETS == 2 ? _mm512_add_ps(acc[0][m][j], acc[SETS - 1][m][j]) : acc[0][m][j];
      if (scale != nullptr) sum = _mm512_mul_ps(sum, _mm512_load_ps(scale + 16 * j));
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

// A tile of `rows` x rows (from row m0) over the widened block, `two` accumulator sets or one:
// out[m][0 .. 63] (row stride N).
inline void rows_tile(const float* wf, const float* xf, int64_t m0, int rows, bool two, int64_t K,
                      c10::BFloat16* out, int64_t N, const cpu_simd::NextBlockShare& share,
                      const float* scale) {
  const float* x[TILE_M];
  c10::BFloat16* o[TILE_M];
  for (int i = 0; i < rows; ++i) {
    x[i] = xf + (m0 + i) * K;
    o[i] = out + (m0 + i) * N;
  }
  switch (rows) {
    case 6: block_tile<6, 1>(wf, K, x, o, share, scale); break;
    case 5: block_tile<5, 1>(wf, K, x, o, share, scale); break;
    case 4: block_tile<4, 1>(wf, K, x, o, share, scale); break;
    case 3: block_tile<3, 1>(wf, K, x, o, share, scale); break;
    case 2:
      if (two) return block_tile<2, 2>(wf, K, x, o, share, scale);
      return block_tile<2, 1>(wf, K, x, o, share, scale);
    default:
      if (two) return block_tile<1, 2>(wf, K, x, o, share, scale);
      return block_tile<1, 1>(wf, K, x, o, share, scale);
  }
}

// A thread's widened-block buffer (K x 64 float32: 147 KB at K = 576, 393 KB at 1536, in L2).
inline float* block_buffer(int64_t K) {
  static thread_local std::vector<__m512> buffer;
  const size_t vectors = size_t(K * BLOCK_ROWS / 16);
  if (buffer.size() < vectors) buffer.resize(vectors);
  return reinterpret_cast<float*>(buffer.data());
}

// How M x rows split into tiles of 6: two_sets_below is the row count below which the pairs
// loop a caller replaces (tiles of 4 rows) takes its last tile with two accumulator sets
// (packed_bf16_linear: 1-2 rows, 3; cpu_pair_tiles.h never, 0); those rows form a last tile
// of their own here, with two sets, so every row sums as it did there.
struct RowTiles {
  int64_t rows, one_set_rows, two_set_rows, one_set_tiles, count;
  RowTiles(int64_t M, int two_sets_below) : rows(M) {
    const int64_t pairs_last = M % cpu_pair_tiles::TILE_M;  // the pairs loop's last tile's rows
    two_set_rows = pairs_last > 0 && pairs_last < two_sets_below ? pairs_last : 0;
    one_set_rows = M - two_set_rows;
    one_set_tiles = (one_set_rows + TILE_M - 1) / TILE_M;
    count = one_set_tiles + (two_set_rows > 0);
  }
  // Tile t's first row (t == count: the end).
  int64_t first_row(int64_t t) const {
    return t == count ? rows : t < one_set_tiles ? t * TILE_M : one_set_rows;
  }
};

// Tiles [t0, t1) of `tiles` over a widened block: out[m][0 .. 63] from `out` (row stride N).
// `ahead` (next_bytes, or nullptr) is requested into L2 over these tiles.
inline void some_tiles(const float* wf, const float* xf, const RowTiles& tiles, int64_t t0,
                       int64_t t1, int64_t K, c10::BFloat16* out, int64_t N, const char* ahead,
                       int64_t next_bytes, const float* scale) {
  for (int64_t t = t0; t < t1; ++t) {
    const cpu_simd::NextBlockShare share =
        cpu_simd::next_block_share(ahead, next_bytes, t - t0, t1 - t0);
    const int64_t m0 = tiles.first_row(t);
    const int rows = int(tiles.first_row(t + 1) - m0);
    rows_tile(wf, xf, m0, rows, t >= tiles.one_set_tiles, K, out, N, share, scale);
  }
}

// out [M, N] = x [M, K] (float32 xf) times a weight of `blocks` 64-row blocks, the last one
// possibly short (N % 64 rows; their outputs pass through a buffer). widen(b, wf, scale)
// widens block b into wf and returns its 64 per-row scales (written to `scale`, 64-byte
// aligned) or nullptr; block_bytes(b) -> {address, bytes} of block b, requested into L2 while
// the thread's previous block is multiplied. The blocks are split over the threads; where
// their count does not divide among the threads, each block's rows are split too (tile-wise,
// the block widened once per thread that takes rows of it): SmolLM2's 9-block o and down
// projections left one of 2 threads idle a ninth of their time.
template <typename Widen, typename BlockBytes>
void for_blocks(int64_t blocks, const float* xf, int64_t M, int64_t K, c10::BFloat16* out,
                int64_t N, int two_sets_below, const Widen& widen,
                const BlockBytes& block_bytes) {
  const RowTiles tiles(M, two_sets_below);
  const int64_t threads = at::get_num_threads();
  int64_t chunks = blocks % threads == 0 ? 1 : threads / std::gcd(blocks, threads);
  chunks = std::max<int64_t>(1, std::min(chunks, tiles.count / 2));  // >= 2 tiles a chunk
  at::parallel_for(0, blocks * chunks, 1, [&](int64_t begin, int64_t end) {
    float* wf = block_buffer(K);
    alignas(64) float scale_buffer[BLOCK_ROWS];
    const float* scale = nullptr;
    std::vector<c10::BFloat16> short_out;  // a short last block's outputs [M, 64]
    int64_t widened = -1;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / chunks, c = i % chunks, n0 = b * BLOCK_ROWS;
      if (b != widened) {
        scale = widen(b, wf, scale_buffer);
        widened = b;
      }
      const int64_t next_b = (i + 1) / chunks;
      const bool prefetch = i + 1 < end && next_b != b;
      const auto [next, next_bytes] =
          prefetch ? block_bytes(next_b) : std::pair<const void*, int64_t>{nullptr, 0};
      const int64_t t0 = tiles.count * c / chunks, t1 = tiles.count * (c + 1) / chunks;
      const int64_t columns = std::min<int64_t>(BLOCK_ROWS, N - n0);
      c10::BFloat16* o = out + n0;
      int64_t stride = N;
      if (columns < BLOCK_ROWS) {
        short_out.resize(size_t(M * BLOCK_ROWS));
        o = short_out.data();
        stride = BLOCK_ROWS;
      }
      some_tiles(wf, xf, tiles, t0, t1, K, o, stride, static_cast<const char*>(next), next_bytes,
                 scale);
      if (columns < BLOCK_ROWS) {
        for (int64_t m = tiles.first_row(t0); m < tiles.first_row(t1); ++m) {
          std::memcpy(out + m * N + n0, o + m * BLOCK_ROWS, size_t(columns) * sizeof(*o));
        }
      }
    }
  });
}

}  // namespace cpu_f32_tiles
#endif  // CPU_BF16_PAIRS without AVX512-BF16
