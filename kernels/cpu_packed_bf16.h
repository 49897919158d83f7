// Products with a bf16 linear weight in oneDNN's packed layout, read in place, for any number
// of rows: cpu_fused_ops.cpp's packed_bf16_linear calls packed_bf16_linear_impl (the last
// function here), which picks AMX tiles (cpu_amx_linear.h) from AMX_BF16_MIN_ROWS rows where
// the CPU has them, blocks widened to float32 (cpu_f32_tiles.h) from F32_TILES_MIN_ROWS rows on
// CPUs without AVX512-BF16, and else the vdpbf16ps pairs kernel or the portable one below.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_amx_linear.h"
#include "cpu_f32_tiles.h"
#include "cpu_simd.h"  // and <immintrin.h> where the CPU has AVX-512

namespace cpu_packed_bf16 {

using namespace cpu_simd;

// packed_bf16_linear takes AMX tiles from this many bfloat16 rows (see the AMX_*_MIN_ROWS of
// the quantized products in cpu_fused_ops.cpp, and PACKED_GEMV_MAX_ROWS_AMX in Python).
constexpr int64_t AMX_BF16_MIN_ROWS = 5;

// --- few-row products with a oneDNN-prepacked bf16 weight, read in place ---
// The layout oneDNN packs a bf16 linear weight into on AVX512-BF16 CPUs (engine/runner/models/
// prepack.py checks it bit for bit at load, else this kernel is not used): blocks of 64 output
// rows, one after the other; inside a block, for each pair of inputs (2p, 2p+1), the 64 rows'
// two values side by side: element (n, k) at ((n / 64) * K/2 + k / 2) * 128 + (n % 64) * 2 + k % 2.
// One 32-bit lane then holds row n's pair, so per pair the block is 4 vectors of 16 rows:
// acc += low half * x[2p] + high half * x[2p + 1]. No horizontal sums, and each thread reads
// its blocks as one contiguous stream (oneDNN's own GEMV on this layout reached ~16 GB/s in a
// decode step; this ~25).
constexpr int64_t PACK_ROWS = 64;
constexpr int PACK_TILE_M = 4;  // x rows per pass: their accumulators fill the registers

// tile(b, m0, rows) for every 64-row block b (blocks split over the threads) and every tile
// of up to PACK_TILE_M x rows from m0; a block's later tiles read it again from L2. `rows` is
// a std::integral_constant, so the kernels are instantiated per tile height.
template <typename Tile>
void for_block_tiles(int64_t N, int64_t M, const Tile& tile) {
  at::parallel_for(0, N / PACK_ROWS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t m0 = 0; m0 < M; m0 += PACK_TILE_M) {
        const bool next = b + 1 < end;
        switch (std::min<int64_t>(PACK_TILE_M, M - m0)) {
          case 1: tile(b, m0, next, std::integral_constant<int, 1>{}); break;
          case 2: tile(b, m0, next, std::integral_constant<int, 2>{}); break;
          case 3: tile(b, m0, next, std::integral_constant<int, 3>{}); break;
          default: tile(b, m0, next, std::integral_constant<int, 4>{}); break;
        }
      }
    }
  });
}

template <int MR>
void packed_bf16_block(const uint32_t* block, int64_t pairs, const float* x_even,
                       const float* x_odd, c10::BFloat16* out, int64_t N) {
  constexpr int J = PACK_ROWS / LANES;
  // Even and odd inputs in their own accumulators: twice the independent FMA chains.
  f32x16 acc[MR][J], acc_odd[MR][J];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < J; ++j) acc[m][j] = acc_odd[m][j] = f32x16{};
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const uint32_t* row_pairs = block + p * PACK_ROWS;
    for (int j = 0; j < J; ++j) {
      const u32x16 bits = load_vec<u32x16>(row_pairs + j * LANES);
      const f32x16 even = bits_to_floats(bits << 16);
      const f32x16 odd = bits_to_floats(bits & 0xFFFF0000u);
      for (int m = 0; m < MR; ++m) {
        acc[m][j] += even * x_even[m * pairs + p];
        acc_odd[m][j] += odd * x_odd[m * pairs + p];
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < J; ++j) store16(out + m * N + j * LANES, acc[m][j] + acc_odd[m][j]);
  }
}

#if defined(CPU_BF16_PAIRS)
// The same product with vdpbf16ps: a lane's (low, high) pair times x's (x[2p], x[2p + 1]) in
// one instruction, straight from the packed bytes (products of two bfloat16 are exact in
// float32, so only the summation order changes). The shift-and-mask-and-two-FMAs above made
// the kernel compute-bound at ~38 GB/s on SmolLM2's layers; this one is bound by the stream.
// Two accumulator sets for one or two rows: 4 chains do not cover vdpbf16ps's latency.
constexpr int DP_TWO_SETS_BELOW = 3;  // tiles of fewer rows take two sets

template <int MR>
void packed_bf16_block_dp(const uint32_t* block, int64_t pairs, const uint32_t* x_pairs,
                          c10::BFloat16* out, int64_t N, const NextBlockShare& next) {
  constexpr int J = PACK_ROWS / LANES;
  constexpr int SETS = MR < DP_TWO_SETS_BELOW ? 2 : 1;
  __m512 acc[SETS][MR][J];
  for (int s = 0; s < SETS; ++s) {
    for (int m = 0; m < MR; ++m) {
      for (int j = 0; j < J; ++j) acc[s][m][j] = _mm512_setzero_ps();
    }
  }
  auto pair = [&](int64_t p, int s) __attribute__((always_inline)) {
    const uint32_t* row_pairs = block + p * PACK_ROWS;
    next.at_step(p);
    // This pair's 4 cache lines, STREAM_PREFETCH_BYTES ahead (cpu_simd.h; none: -8%).
    for (int line = 0; line < J; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(row_pairs + line * LANES) + STREAM_PREFETCH_BYTES,
                   _MM_HINT_T0);
    }
    __m512i w[J];
    for (int j = 0; j < J; ++j) w[j] = _mm512_loadu_si512(row_pairs + j * LANES);
    for (int m = 0; m < MR; ++m) {
      const __m512i xb = _mm512_set1_epi32(int(x_pairs[m * pairs + p]));
      for (int j = 0; j < J; ++j) acc[s][m][j] = dot_bf16_pairs(acc[s][m][j], w[j], xb);
    }
  };
  int64_t p = 0;
  for (; p + SETS <= pairs; p += SETS) {
    for (int s = 0; s < SETS; ++s) pair(p + s, s);
  }
  for (; p < pairs; ++p) pair(p, 0);
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < J; ++j) {
      const f32x16 sum = SETS == 2 ? f32x16(_mm512_add_ps(acc[0][m][j], acc[SETS - 1][m][j]))
                                   : f32x16(acc[0][m][j]);
      store16(out + m * N + j * LANES, sum);
    }
  }
}

void packed_bf16_linear_dp(torch::Tensor out, torch::Tensor x, const c10::BFloat16* weight,
                           int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2;
  // x's rows are contiguous bfloat16: read as (x[2p], x[2p + 1]) pairs in place.
  const uint32_t* x_pairs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
  const uint32_t* w = reinterpret_cast<const uint32_t*>(weight);
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  // With more than one tile, each tile requests its share of the thread's next block into L2
  // (cpu_simd.h, next_block_share); one tile streams its block with its own prefetch.
  const int64_t tiles = (M + PACK_TILE_M - 1) / PACK_TILE_M, block_bytes = pairs * PACK_ROWS * 4;
  for_block_tiles(N, M, [&](int64_t b, int64_t m0, bool next, auto rows) {
    const char* next_block = reinterpret_cast<const char*>(w + (b + 1) * pairs * PACK_ROWS);
    const NextBlockShare share = next_block_share(tiles > 1 && next ? next_block : nullptr,
                                                  block_bytes, m0 / PACK_TILE_M, tiles);
    packed_bf16_block_dp<decltype(rows)::value>(w + b * pairs * PACK_ROWS, pairs,
                                                x_pairs + m0 * pairs, op + m0 * N + b * PACK_ROWS,
                                                N, share);
  });
}
#endif

#if defined(CPU_F32_TILES)
// From 25 rows on a CPU without AVX512-BF16: each block widened to float32 once, then plain FMAs
// for every tile (cpu_f32_tiles.h; the same bits as packed_bf16_linear_dp). Below, writing and
// re-reading twice the block's bytes costs more than the emulated pairs' extra operations save:
// SmolLM2's 121 products (the LM head too), 2-core cloud Xeon, min of 7, ms, pairs vs widened
// (6-row tiles): 5 rows 14.8 vs 22.6, 16 rows 20.4 vs 26.2, 24 rows 29.7 vs 29.1, 32 rows 38.8
// vs 37.6; 64 / 512 rows 0.91x the 4-row tiles, themselves 0.91x / 0.82x the pairs.
constexpr int64_t F32_TILES_MIN_ROWS = 25;
void packed_bf16_linear_f32(torch::Tensor out, torch::Tensor x, const c10::BFloat16* weight,
                            int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), block_units = K / 2 * PACK_ROWS;
  const std::vector<float> xf = cpu_f32_tiles::widen_rows(x.data_ptr<c10::BFloat16>(), M, K);
  const uint32_t* w = reinterpret_cast<const uint32_t*>(weight);
  auto widen = [&](int64_t b, float* wf, float*) -> const float* {
    cpu_f32_tiles::widen_pairs_block(w + b * block_units, K, wf);
    return nullptr;
  };
  auto block_bytes = [&](int64_t b) {
    return std::pair<const void*, int64_t>{w + b * block_units, block_units * 4};
  };
  // The pairs loop's last tile of 1-2 rows with two accumulator sets, as packed_bf16_block_dp.
  cpu_f32_tiles::for_blocks(N / PACK_ROWS, xf.data(), M, K, out.data_ptr<c10::BFloat16>(), N,
                            DP_TWO_SETS_BELOW, widen, block_bytes);
}
#endif

void packed_bf16_linear_impl(torch::Tensor out, torch::Tensor x, const c10::BFloat16* weight,
                             int64_t N) {
#if defined(CPU_F32_TILES)
  if (x.size(0) >= F32_TILES_MIN_ROWS) return packed_bf16_linear_f32(out, x, weight, N);
#endif
#if defined(CPU_AMX_LINEAR)
  if (x.size(0) >= AMX_BF16_MIN_ROWS && x.size(1) % cpu_amx_linear::K_STEP == 0 &&
      cpu_amx_linear::tiles_permitted()) {
    return cpu_amx_linear::linear_bf16_packed(out.data_ptr<c10::BFloat16>(),
                                              x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1),
                                              weight, N);
  }
#endif
#if defined(CPU_BF16_PAIRS)
  return packed_bf16_linear_dp(out, x, weight, N);
#endif
  const int64_t M = x.size(0), K = x.size(1), pairs = K / 2;
  std::vector<float> xs(size_t(2 * M * pairs));  // x's even inputs, then its odd ones
  float* x_even = xs.data();
  float* x_odd = xs.data() + M * pairs;
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t p = 0; p < pairs; ++p) {
      x_even[m * pairs + p] = to_float(xp[m * K + 2 * p]);
      x_odd[m * pairs + p] = to_float(xp[m * K + 2 * p + 1]);
    }
  }
  const uint32_t* w = reinterpret_cast<const uint32_t*>(weight);
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  for_block_tiles(N, M, [&](int64_t b, int64_t m0, bool, auto rows) {
    packed_bf16_block<decltype(rows)::value>(w + b * pairs * PACK_ROWS, pairs,
                                             x_even + m0 * pairs, x_odd + m0 * pairs,
                                             op + m0 * N + b * PACK_ROWS, N);
  });
}

}  // namespace cpu_packed_bf16
