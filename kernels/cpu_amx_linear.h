// Weight-only products for many bfloat16 rows (a batch-64 decode step, a prefill chunk) on CPUs
// with AMX tiles (Sapphire Rapids and later). Included by cpu_fused_ops.cpp after the int8 and
// int4 few-row kernels, whose 16-bit pair builders it reuses.
//
// Why: with AMX, oneDNN multiplies a bfloat16 weight by 64 rows several times faster than the
// vdpbf16ps kernels can (a SmolLM2 layer at 64 rows on a 2-core Xeon: ~0.5 ms against ~2.3 ms
// for the int8/int4 kernels), so quantized layers dequantized into a scratch for it, paying a
// write of the whole 16-bit weight and oneDNN's reorder of that plain matrix into its own
// layout on every call (~0.8-0.9 ms a layer, batch-64 decode at ~0.65x bf16's rate). Here each
// thread takes whole blocks of 64 output rows; a block's weights become bfloat16 pairs once per
// call in a block-sized buffer that stays in L2, in the layout AMX's B operand reads:
//
//   pairs[(p * 4 + quarter) * 16 + lane] = (w(16 quarter + lane, 2p), w(.., 2p + 1)), bfloat16
//
// so a B tile (16 pairs of inputs x 16 output rows) is 16 rows of 64 bytes at a 256-byte
// stride, and every 16 x rows are multiplied with them by tdpbf16ps into four 16 x 16 float32
// accumulator tiles (products of bfloat16 are exact in float32, sums in float32). That is
// int4's scheme: its pairs are the dequantized weights, (q - 8) * s + zf in float32 rounded to
// bfloat16 (dequant_int4's weight up to the multiply-add's rounding), as dequantize + GEMM.
// int8 turns it around (weight rows as the A operand, below); its per-row scale multiplies the
// float32 sums.
#pragma once

#include "cpu_amx_tiles.h"
#include "cpu_int4_linear.h"  // before the check below: they define CPU_INT4_LINEAR / _INT8_ROWS
#include "cpu_int8_rows.h"

#if defined(CPU_AMX_TILES) && defined(CPU_INT8_ROWS) && defined(CPU_INT4_LINEAR)
#define CPU_AMX_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_amx_linear {

constexpr int BLOCK_ROWS = 64;  // output rows per block: four B tiles of 16
constexpr int QUARTERS = 4;
constexpr int TILE_ROWS = 16;   // x rows per A tile
constexpr int K_STEP = 32;      // inputs per tile product (16 pairs)
constexpr int PAIR_ROW_BYTES = BLOCK_ROWS * 4;  // one pair of inputs for the block's 64 rows

using cpu_amx_tiles::tiles_permitted;

// Tiles 0-3: the four 16 x 16 float32 accumulators; 4: 16 x rows x 32 inputs; 5, 6: B tiles
// (two, so a load overlaps the previous product). All 16 rows of 64 bytes. The configuration is
// per thread and other code (oneDNN) loads its own between our calls: set at each call's start.
inline void configure_tiles() {
  cpu_amx_tiles::TileConfig config;
  for (int t = 0; t < 7; ++t) config.set(t, TILE_ROWS, 64);
  _tile_loadconfig(&config);
}

// acc [16, 64] float32 = x [16, K] (contiguous rows) @ the block's pairs.
inline void block_product(const c10::BFloat16* x, const uint32_t* pairs, int64_t K, float* acc) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride_bytes = K * int64_t(sizeof(c10::BFloat16));
  for (int64_t k0 = 0; k0 < K; k0 += K_STEP) {
    const uint32_t* b = pairs + (k0 / 2) * QUARTERS * 16;
    _tile_loadd(4, x + k0, x_stride_bytes);
    _tile_loadd(5, b, PAIR_ROW_BYTES);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 16, PAIR_ROW_BYTES);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, b + 32, PAIR_ROW_BYTES);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, b + 48, PAIR_ROW_BYTES);
    _tile_dpbf16ps(3, 4, 6);
  }
  constexpr int ACC_STRIDE_BYTES = BLOCK_ROWS * sizeof(float);
  _tile_stored(0, acc, ACC_STRIDE_BYTES);
  _tile_stored(1, acc + 16, ACC_STRIDE_BYTES);
  _tile_stored(2, acc + 32, ACC_STRIDE_BYTES);
  _tile_stored(3, acc + 48, ACC_STRIDE_BYTES);
}

// pairs_for(b, buffer) gives each 64-row block's pairs (built into `buffer`, K/2 x 256 bytes,
// or read in place), then out [M, N] = x [M, K] @ W.T in 16-row tiles.
template <typename PairsFor>
inline void linear_blocks(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                          int64_t N, PairsFor pairs_for) {
  at::parallel_for(0, N / BLOCK_ROWS, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<__m512i> buffer(size_t(K / 2 * QUARTERS));  // K/2 x 256 bytes, in L2
    uint32_t* scratch = reinterpret_cast<uint32_t*>(buffer.data());
    // The last tile's rows when M is not a multiple of 16, zero-padded (A tiles read 16 rows).
    std::vector<c10::BFloat16> tail(M % TILE_ROWS ? size_t(TILE_ROWS * K) : 0);
    if (!tail.empty()) {
      const int64_t m0 = M / TILE_ROWS * TILE_ROWS;
      std::memcpy(tail.data(), x + m0 * K, size_t((M - m0) * K) * sizeof(c10::BFloat16));
    }
    alignas(64) float acc[TILE_ROWS * BLOCK_ROWS];
    for (int64_t b = begin; b < end; ++b) {
      const uint32_t* pairs = pairs_for(b, scratch);
      for (int64_t m0 = 0; m0 < M; m0 += TILE_ROWS) {
        const int64_t rows = std::min<int64_t>(TILE_ROWS, M - m0);
        block_product(rows == TILE_ROWS ? x + m0 * K : tail.data(), pairs, K, acc);
        for (int64_t r = 0; r < rows; ++r) {
          c10::BFloat16* dst = out + (m0 + r) * N + b * BLOCK_ROWS;
          for (int j = 0; j < QUARTERS; ++j) {
            const __m512 row = _mm512_load_ps(acc + r * BLOCK_ROWS + j * 16);
            cpu_simd::store_bf16x16(dst + j * 16, cpu_simd::f32x16(row));
          }
        }
      }
    }
    _tile_release();
  });
}

// int8 takes the weight as the A operand instead: a tile of A is 16 rows of 32 inputs as
// stored, so the int8 -> bfloat16 conversion is a widening per row with no transpose (building
// B-operand pairs, conversion and 16 x 16 transposes, cost ~60 % of a 64-row gate_up product on
// a 2-core Xeon: 111 us at 4 rows, nearly all conversion, against 187 at 64), and x goes in
// as B, turned into pairs once per call: xp[(t * K/2 + p) * 16 + i] = (x(16 t + i, 2p),
// x(16 t + i, 2p + 1)), zero past row M. The accumulators are then out.T
// tiles (16 weight rows x 16 x rows), transposed in registers when written out.
constexpr int M_TILES = 4;  // accumulator tiles: 64 x rows per pass over a weight row group

// acc[t] (16 weight rows x 16 x rows, float32) for the `tiles` (1-4) x tiles from xp_tiles.
template <int TILES>
inline void rows_product(const c10::BFloat16* w, int64_t K, const uint32_t* xp_tiles,
                         float (*acc)[256]) {
  _tile_zero(0);
  if constexpr (TILES > 1) _tile_zero(1);
  if constexpr (TILES > 2) _tile_zero(2);
  if constexpr (TILES > 3) _tile_zero(3);
  const int64_t tile_stride = K / 2 * 16;  // uint32 units between x tiles' pairs
  for (int64_t k0 = 0; k0 < K; k0 += K_STEP) {
    const uint32_t* b = xp_tiles + k0 / 2 * 16;
    _tile_loadd(4, w + k0, K * int64_t(sizeof(c10::BFloat16)));
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (TILES > 1) {
      _tile_loadd(6, b + tile_stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if constexpr (TILES > 2) {
      _tile_loadd(5, b + 2 * tile_stride, 64);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (TILES > 3) {
      _tile_loadd(6, b + 3 * tile_stride, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  _tile_stored(0, acc[0], 64);
  if constexpr (TILES > 1) _tile_stored(1, acc[1], 64);
  if constexpr (TILES > 2) _tile_stored(2, acc[2], 64);
  if constexpr (TILES > 3) _tile_stored(3, acc[3], 64);
}

// out [M, N] = x [M, K] @ (q [N, K] * s [N, None]).T; N % 16 == 0, K % 32 == 0, bfloat16 x,
// scales and out.
inline void linear_int8(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                        const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  const int64_t x_tiles = (M + TILE_ROWS - 1) / TILE_ROWS;
  std::vector<__m512i> xp_buffer(size_t(x_tiles * K / 2));
  uint32_t* xp = reinterpret_cast<uint32_t*>(xp_buffer.data());
  cpu_int8_rows::build_x_pairs(x, M, K, xp);
  at::parallel_for(0, N / 16, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<c10::BFloat16> w(size_t(16 * K));  // 16 widened rows, in L1/L2
    alignas(64) float acc[M_TILES][256];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * 16;
      cpu_int8_rows::widen_rows(q + n0 * K, K, w.data());
      const __m512 s = (__m512)cpu_simd::load_bf16x16(scales + n0);
      for (int64_t t0 = 0; t0 < x_tiles; t0 += M_TILES) {
        const int64_t tiles = std::min<int64_t>(M_TILES, x_tiles - t0);
        const uint32_t* xp_tiles = xp + t0 * K / 2 * 16;
        switch (tiles) {
          case 4: rows_product<4>(w.data(), K, xp_tiles, acc); break;
          case 3: rows_product<3>(w.data(), K, xp_tiles, acc); break;
          case 2: rows_product<2>(w.data(), K, xp_tiles, acc); break;
          default: rows_product<1>(w.data(), K, xp_tiles, acc); break;
        }
        cpu_int8_rows::write_rows(acc, tiles, t0 * TILE_ROWS, M, N, n0, s, out);
      }
    }
    _tile_release();
  });
}

// out [M, N] = x [M, K] @ W.T, W int4 in kernels/int4_pack.py's 64-row blocks with
// scale_and_zero [K/G, N, 2] (s, zf); N % 64 == 0, K % 32 == 0, G even, all bfloat16.
inline void linear_int4(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                        const uint8_t* packed, const c10::BFloat16* scale_and_zero, int64_t N,
                        int64_t group_size) {
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_and_zero);
  linear_blocks(out, x, M, K, N, [&](int64_t b, uint32_t* buffer) {
    cpu_int4_linear::build_dequantized_pairs(packed + b * BLOCK_ROWS * K / 2, sz + b * BLOCK_ROWS,
                                             N, K, group_size, buffer);
    return static_cast<const uint32_t*>(buffer);
  });
}

// out [M, N] = x [M, K] @ W.T, W bfloat16 as oneDNN packs it for AVX512-BF16 and, for these
// shapes, with AMX too (engine/runner/models/prepack.py, packed_layout_matches): 64-row blocks
// of (w(n, 2p), w(n, 2p + 1)) pairs, which is the B operand's layout above, so the tiles load
// the packed weight in place. N % 64 == 0, K % 32 == 0.
inline void linear_bf16_packed(c10::BFloat16* out, const c10::BFloat16* x, int64_t M,
                               int64_t K, const c10::BFloat16* packed, int64_t N) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(packed);
  linear_blocks(out, x, M, K, N, [&](int64_t b, uint32_t*) { return w + b * K / 2 * BLOCK_ROWS; });
}

}  // namespace cpu_amx_linear
#endif  // AMX-TILE and AMX-BF16
