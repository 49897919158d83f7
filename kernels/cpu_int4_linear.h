// W4A16 matrix-vector products for decode's few rows, bfloat16 activations, on AVX-512 CPUs
// with VBMI (Ice Lake and later, Zen 4; vdpbf16ps where the CPU has AVX512-BF16, else its
// two-FMA equivalent, cpu_simd::dot_bf16_pairs). Included by
// cpu_fused_ops.cpp; elsewhere (or for float32/float16 models) the int4 layers call aten's
// _weight_int4pack_mm_for_cpu instead.
//
// Why our own: at batch 1 aten's kernel moved the int4 weights at ~19 GB/s on a 2-core EPYC
// whose memory copies at ~70: it widens every nibble to float32 and multiplies with FMAs, ~25
// instructions per 64 weights, so it is bound by arithmetic, not by the bytes it was meant to
// save. Here a nibble becomes a bfloat16 with two bit operations and a byte permute:
//
//   bfloat16 bits 0x4300 | q  ==  128 + q   exactly (exponent 2^7, q in the mantissa's low bits)
//
// so vdpbf16ps multiplies (128 + q) by x two inputs at a time into float32 lanes (products of
// two bfloat16 are exact in float32), 32 weights per instruction. Per group g of G inputs and
// output row n, with a(k) = 128 + q(n, k) and the layer's w = (q - 8) * s + zf:
//
//   sum_k x(k) w(n, k) = s * sum_k x(k) a(k) + (zf - 136 s) * sum_k x(k)
//
// The group's x sums are computed once per call and shared by every row. The 128 offset costs
// ~4 bits of the float32 sum's 24 (sum_k x a is ~16x the part that matters): still ~1e-5
// relative, far below the bfloat16 output's rounding.
//
// Rows go in tiles of 4 (TILE_M), each tile over the nibbles as above. From 9 rows the product
// is bound by arithmetic, not bytes, and that per-group correction would be paid again by every
// tile (a pass of 30 SmolLM2 layers at 64 rows ran 43.0 ms against bf16's 37.4 on a 2-core
// EPYC): there each block is dequantized once into bfloat16 pairs, w = (q - 8) s + zf rounded
// to bfloat16 as dequantize + GEMM has it, and the rows run cpu_pair_tiles.h's loop over them,
// the bf16 kernel's (36.1 ms). At 5-8 rows the nibbles stay ahead: 4.5 / 6.3 ms at 5 / 8 rows
// against 6.9 / 7.7 dequantized (benchmarks.packed_linear --quantized); level at 9-12.
//
// Layout (kernels/int4_pack.py, aten's on AVX-512): a block of 64 output rows holds, for each
// input k, 32 bytes whose low nibbles are rows 0-31 and high nibbles rows 32-63; inputs k and
// k + 1 are adjacent, so one 64-byte load holds a pair of inputs for all 64 rows. A byte
// permute (vpermt2b) interleaves the pair per row and puts 0x43 above each nibble:
// 32-bit lane r = (0x4300 | q(r, k), 0x4300 | q(r, k + 1)), matching x's pair (x(k), x(k+1)).
// Each thread streams whole blocks (K * 32 contiguous bytes), prefetched STREAM_PREFETCH_BYTES
// ahead (cpu_simd.h).
#pragma once

#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS) && defined(__AVX512VBMI__)
#define CPU_INT4_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_f32_tiles.h"
#include "cpu_pair_tiles.h"
#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_int4_linear {

constexpr int BLOCK_ROWS = cpu_pair_tiles::BLOCK_ROWS;  // output rows per packed block
constexpr int QUARTERS = cpu_pair_tiles::QUARTERS;      // 16-row vectors per block
constexpr int TILE_M = cpu_pair_tiles::TILE_M;  // x rows per tile over the nibbles
#if defined(CPU_F32_TILES)
// Without AVX512-BF16, float32 blocks (below) from 13 rows: SmolLM2's 121 products, 2-core
// cloud Xeon, min of 7, ms, nibble tiles / float32 blocks: 4 rows 6.8 / 12.7, 8 rows 13.0 /
// 17.2, 9 rows 18.8 / 22.1, 12 rows 22.4 / 22.9, 16 rows 25.6 / 23.6.
constexpr int64_t DEQUANTIZED_PAIRS_MIN_M = 13;
#else
constexpr int64_t DEQUANTIZED_PAIRS_MIN_M = 9;
#endif

// vpermt2b indices building quarter `quarter % 2` of a nibble vector's rows (quarters 0-1
// from the low nibbles, 2-3 from the high ones): lane r's four bytes are (row's k byte, 0x43,
// row's k+1 byte, 0x43); index 64 picks byte 0 of the second source, a vector of 0x43.
struct PairIndex {
  alignas(64) uint8_t bytes[2][64];
  constexpr PairIndex() : bytes{} {
    for (int half = 0; half < 2; ++half) {
      for (int r = 0; r < 16; ++r) {
        bytes[half][4 * r] = uint8_t(16 * half + r);
        bytes[half][4 * r + 1] = 64;
        bytes[half][4 * r + 2] = uint8_t(32 + 16 * half + r);
        bytes[half][4 * r + 3] = 64;
      }
    }
  }
};
inline constexpr PairIndex PAIR_INDEX{};
constexpr float ONE_TWENTY_EIGHT_PLUS_EIGHT = 136.0f;  // the a(k) offset plus the layout's 8

// 16 rows' s and zf - 136 s (the offset of the (128 + q) form) of group g, from their (s, zf)
// bfloat16 pairs at scale_zero + g * N + 16 j (s in the low half of each 32-bit lane).
struct ScaleOffset {
  __m512 scale, offset;
};
__attribute__((always_inline)) inline ScaleOffset scale_offset(const uint32_t* scale_zero,
                                                               int64_t g, int64_t N, int j) {
  const __m512i sz = _mm512_loadu_si512(scale_zero + g * N + j * 16);
  const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
  const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512 zf = _mm512_castsi512_ps(_mm512_and_si512(sz, high_half));
  return {s, _mm512_fnmadd_ps(s, _mm512_set1_ps(ONE_TWENTY_EIGHT_PLUS_EIGHT), zf)};
}

// A 64-byte load of nibbles split: [0] the low nibbles (rows 0-31), [1] the high (rows 32-63);
// the stream is requested STREAM_PREFETCH_BYTES ahead (cpu_simd.h).
__attribute__((always_inline)) inline void split_nibbles(const uint8_t* bytes, __m512i (&out)[2]) {
  _mm_prefetch(reinterpret_cast<const char*>(bytes + cpu_simd::STREAM_PREFETCH_BYTES), _MM_HINT_T0);
  const __m512i v = _mm512_loadu_si512(bytes), nibble = _mm512_set1_epi8(0x0F);
  out[0] = _mm512_and_si512(v, nibble);
  out[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
}

// acc[m][quarter] += sum over the group's input pairs of (128 + q) * x, for MR x rows.
// Two accumulator sets (even and odd pairs) when they fit the registers: a vdpbf16ps waits on
// the previous one into the same accumulator, and 4 chains do not cover its latency.
template <int MR>
__attribute__((always_inline)) inline void group_dots(const uint8_t* bytes, int64_t pairs,
                                                      const uint32_t* const* x_pairs,
                                                      __m512 (&acc)[MR][QUARTERS]) {
  constexpr int SETS = MR <= 2 ? 2 : 1;
  const __m512i high_byte = _mm512_set1_epi8(0x43);
  const __m512i index_lo = _mm512_load_si512(PAIR_INDEX.bytes[0]);
  const __m512i index_hi = _mm512_load_si512(PAIR_INDEX.bytes[1]);
  __m512 part[SETS][MR][QUARTERS];
  for (int s = 0; s < SETS; ++s) {
    for (int m = 0; m < MR; ++m) {
      for (int j = 0; j < QUARTERS; ++j) part[s][m][j] = _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < pairs; p += SETS) {
    for (int s = 0; s < SETS; ++s) {
      __m512i n[2];  // low, high nibbles
      split_nibbles(bytes + (p + s) * 64, n);
      const __m512i w[QUARTERS] = {_mm512_permutex2var_epi8(n[0], index_lo, high_byte),
                                   _mm512_permutex2var_epi8(n[0], index_hi, high_byte),
                                   _mm512_permutex2var_epi8(n[1], index_lo, high_byte),
                                   _mm512_permutex2var_epi8(n[1], index_hi, high_byte)};
      for (int m = 0; m < MR; ++m) {
        const __m512i xb = _mm512_set1_epi32(int(x_pairs[m][p + s]));
        for (int j = 0; j < QUARTERS; ++j) {
          part[s][m][j] = cpu_simd::dot_bf16_pairs(part[s][m][j], w[j], xb);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) {
      acc[m][j] = SETS == 2 ? _mm512_add_ps(part[0][m][j], part[SETS - 1][m][j]) : part[0][m][j];
    }
  }
}


// One 64-row block for MR x rows: out[m][n0 .. n0 + 63].
template <int MR>
void block_rows(const uint8_t* block, const uint32_t* scale_zero, int64_t N, int64_t group_size,
                const uint32_t* const* x_pairs, const float* x_group_sums, int64_t groups,
                c10::BFloat16* const* out) {
  __m512 total[MR][QUARTERS];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) total[m][j] = _mm512_setzero_ps();
  }
  const int64_t pairs = group_size / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* group_pairs[MR];
    for (int m = 0; m < MR; ++m) group_pairs[m] = x_pairs[m] + g * pairs;
    __m512 acc[MR][QUARTERS];
    group_dots<MR>(block + g * group_size * 32, pairs, group_pairs, acc);
    for (int j = 0; j < QUARTERS; ++j) {
      const auto [s, offset] = scale_offset(scale_zero, g, N, j);
      for (int m = 0; m < MR; ++m) {
        total[m][j] = _mm512_fmadd_ps(s, acc[m][j], total[m][j]);
        const __m512 x_sum = _mm512_set1_ps(x_group_sums[m * groups + g]);
        total[m][j] = _mm512_fmadd_ps(offset, x_sum, total[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) {
      cpu_simd::store_bf16x16(out[m] + j * 16, cpu_simd::f32x16(total[m][j]));
    }
  }
}

// vpermb indices turning a nibble vector (bytes r < 32: row r's nibble of input k; bytes
// 32 + r: of input k + 1) into 16 float32 lanes for 8 rows, lane l = 128 + q(8e + l/2, k + l%2):
// the permute writes byte 2 of each lane (NIBBLE_BYTES) and keeps bytes (0, 0, -, 0x43) of
// 128.0f, so the lane's bits are those of 128 + q (exponent 2^7, q in the mantissa). A masked
// single-source vpermb costs half a two-source vpermt2b here (1.2 vs 2.2 cycles, 2-core Xeon).
struct EighthIndex {
  alignas(64) uint8_t bytes[4][64];
  constexpr EighthIndex() : bytes{} {
    for (int e = 0; e < 4; ++e) {
      for (int l = 0; l < 16; ++l) {
        bytes[e][4 * l + 2] = uint8_t((l % 2) * 32 + 8 * e + l / 2);  // the others are unused
      }
    }
  }
};
inline constexpr EighthIndex EIGHTH_INDEX{};
constexpr __mmask64 NIBBLE_BYTES = 0x4444444444444444ull;  // byte 2 of each 32-bit lane
// Lane order of the doubled per-row parameters: lane l holds row l / 2 (of 8, low or high).
struct DoubledIndex {
  alignas(64) int32_t lanes[2][16];
  constexpr DoubledIndex() : lanes{} {
    for (int h = 0; h < 2; ++h) {
      for (int l = 0; l < 16; ++l) lanes[h][l] = 8 * h + l / 2;
    }
  }
};
inline constexpr DoubledIndex DOUBLED_INDEX{};

// A block of int4 weights (the layout above: per input k, 32 bytes whose low
// nibbles are rows 0-31 and high nibbles rows 32-63) -> its dequantized bfloat16 pairs,
// w = (q - 8) * s + zf computed as (128 + q) * s + (zf - 136 s) in one float32 multiply-add and
// rounded once to bfloat16. scale_zero: the (s, zf) bfloat16 pairs of row n0 of group 0
// ([K/G, N, 2] as 32-bit units). Per pair of inputs (128 weights): 8 byte permutes build the
// float32 lanes straight from the nibbles, ordered (row, k), (row, k + 1) so that one
// vcvtne2ps2bf16 of two of them is a B row of pairs with no further shuffle (~28 vector
// instructions, where widening the nibbles to integers, converting, multiplying and adding
// apart, then interleaving took ~52); the weight bytes are prefetched STREAM_PREFETCH_BYTES
// ahead (they were read on demand, not overlapped with the conversion).
inline void build_dequantized_pairs(const uint8_t* block, const uint32_t* scale_zero, int64_t N,
                                    int64_t K, int64_t group_size, uint32_t* pairs) {
  const __m512i float_bytes = _mm512_set1_epi32(0x43000000);  // 128.0f
  __m512i index[4];
  for (int e = 0; e < 4; ++e) index[e] = _mm512_load_si512(EIGHTH_INDEX.bytes[e]);
  const __m512i doubled_lo = _mm512_load_si512(DOUBLED_INDEX.lanes[0]);
  const __m512i doubled_hi = _mm512_load_si512(DOUBLED_INDEX.lanes[1]);
  for (int64_t g = 0; g < K / group_size; ++g) {
    // Per eighth of the block's rows (8 rows), s and zf - 136 s doubled: lane l for row l / 2.
    __m512 scale[8], offset[8];
    for (int j = 0; j < QUARTERS; ++j) {
      const auto [s, off] = scale_offset(scale_zero, g, N, j);
      scale[2 * j] = _mm512_permutexvar_ps(doubled_lo, s);
      scale[2 * j + 1] = _mm512_permutexvar_ps(doubled_hi, s);
      offset[2 * j] = _mm512_permutexvar_ps(doubled_lo, off);
      offset[2 * j + 1] = _mm512_permutexvar_ps(doubled_hi, off);
    }
    for (int64_t p = g * group_size / 2; p < (g + 1) * group_size / 2; ++p) {
      __m512i nibbles[2];
      split_nibbles(block + p * 64, nibbles);
      for (int j = 0; j < QUARTERS; ++j) {
        __m512 w[2];
        for (int h = 0; h < 2; ++h) {
          const int eighth = 2 * j + h;  // rows 8 eighth .. + 7 of the block
          const __m512i f = _mm512_mask_permutexvar_epi8(float_bytes, NIBBLE_BYTES,
                                                         index[eighth % 4], nibbles[eighth / 4]);
          w[h] = _mm512_fmadd_ps(_mm512_castsi512_ps(f), scale[eighth], offset[eighth]);
        }
        // 16-bit lanes 0-15 from w[0] (rows 16j .. +7), 16-31 from w[1]: 16 rows' pairs.
        const __m512i row = cpu_simd::bf16_pairs_from(w[1], w[0]);
        _mm512_store_si512(pairs + (p * QUARTERS + j) * 16, row);
      }
    }
  }
}

#if !defined(__AVX512BF16__)
// One or two x rows on a CPU without AVX512-BF16, where a vdpbf16ps is two FMAs on a split pair
// (cpu_simd::dot_bf16_pairs): the pairs path then spends ~23 vector operations per 64 bytes of
// nibbles, four of them two-source byte permutes, and is bound by them (~18 GB/s on 2 cores of
// a cloud Xeon against ~25 for the bf16 stream). Here the nibbles become float32 lanes directly,
// as build_dequantized_pairs makes them, one masked vpermb per 16 weights: lane l of eighth e
// (rows 8e .. 8e + 7) is 128 + q(8e + l/2, k + l%2), multiplied by x's (x(k), x(k + 1)) repeated
// (one 64-bit broadcast), ~19 operations per 64 bytes. A row's two lanes (even and odd inputs)
// are summed once per block, the group's correction applied per lane with x's sums of the
// group's even and odd inputs. Float32 sums in another order than the pairs path: within its
// bfloat16 rounding, not bit-identical to it.
constexpr int LANES_MAX_M = 2;  // 2 x 8 accumulators; more rows take the pairs path

// Word-pair lanes of two eighths' totals back in row order: even lanes of a then of b (rows
// 16j + i and 16j + 8 + i), and the odd ones.
struct RowLanes {
  alignas(64) int32_t even[16], odd[16];
  constexpr RowLanes() : even{}, odd{} {
    for (int i = 0; i < 16; ++i) {
      even[i] = (i / 8) * 16 + 2 * (i % 8);
      odd[i] = even[i] + 1;
    }
  }
};
inline constexpr RowLanes ROW_LANES{};

template <int MR>
void block_rows_lanes(const uint8_t* block, const uint32_t* scale_zero, int64_t N,
                      int64_t group_size, const float* const* x, const double* parity_sums,
                      int64_t groups, c10::BFloat16* const* out) {
  const __m512i float_bytes = _mm512_set1_epi32(0x43000000);  // 128.0f
  __m512i index[4];
  for (int e = 0; e < 4; ++e) index[e] = _mm512_load_si512(EIGHTH_INDEX.bytes[e]);
  __m512 total[MR][8];
  for (int m = 0; m < MR; ++m) {
    for (int e = 0; e < 8; ++e) total[m][e] = _mm512_setzero_ps();
  }
  const int64_t pairs = group_size / 2;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MR][8];
    for (int m = 0; m < MR; ++m) {
      for (int e = 0; e < 8; ++e) acc[m][e] = _mm512_setzero_ps();
    }
    for (int64_t p = g * pairs; p < (g + 1) * pairs; ++p) {
      __m512i nibbles[2];
      split_nibbles(block + p * 64, nibbles);
      __m512 xb[MR];
      for (int m = 0; m < MR; ++m) {
        double pair;
        std::memcpy(&pair, x[m] + 2 * p, sizeof pair);  // (x(k), x(k + 1)) as one 64-bit unit
        xb[m] = _mm512_castpd_ps(_mm512_set1_pd(pair));
      }
      for (int e = 0; e < 8; ++e) {
        const __m512 w = _mm512_castsi512_ps(
            _mm512_mask_permutexvar_epi8(float_bytes, NIBBLE_BYTES, index[e % 4], nibbles[e / 4]));
        for (int m = 0; m < MR; ++m) acc[m][e] = _mm512_fmadd_ps(w, xb[m], acc[m][e]);
      }
    }
    const __m512i doubled[2] = {_mm512_load_si512(DOUBLED_INDEX.lanes[0]),
                                _mm512_load_si512(DOUBLED_INDEX.lanes[1])};
    for (int j = 0; j < QUARTERS; ++j) {
      const auto [s, offset] = scale_offset(scale_zero, g, N, j);
      for (int h = 0; h < 2; ++h) {
        const int e = 2 * j + h;
        const __m512 s_lanes = _mm512_permutexvar_ps(doubled[h], s);
        const __m512 offset_lanes = _mm512_permutexvar_ps(doubled[h], offset);
        for (int m = 0; m < MR; ++m) {
          const __m512 sums = _mm512_castpd_ps(_mm512_set1_pd(parity_sums[m * groups + g]));
          total[m][e] = _mm512_fmadd_ps(s_lanes, acc[m][e], total[m][e]);
          total[m][e] = _mm512_fmadd_ps(offset_lanes, sums, total[m][e]);
        }
      }
    }
  }
  const __m512i even = _mm512_load_si512(ROW_LANES.even), odd = _mm512_load_si512(ROW_LANES.odd);
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) {
      const __m512 a = total[m][2 * j], b = total[m][2 * j + 1];
      const __m512 rows = _mm512_add_ps(_mm512_permutex2var_ps(a, even, b),
                                        _mm512_permutex2var_ps(a, odd, b));
      cpu_simd::store_bf16x16(out[m] + j * 16, cpu_simd::f32x16(rows));
    }
  }
}

// out [M <= LANES_MAX_M, N]: x widened to float32 once, the groups' even and odd input sums
// as (even, odd) float pairs, then block_rows_lanes per 64-row block.
inline void linear_lanes(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                         const uint8_t* packed, const uint32_t* sz, int64_t N,
                         int64_t group_size) {
  const int64_t blocks = N / BLOCK_ROWS, groups = K / group_size;
  std::vector<float> xf(size_t(M * K));
  std::vector<double> parity_sums(size_t(M * groups));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum[2] = {0.0f, 0.0f};
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        xf[size_t(m * K + k)] = float(x[m * K + k]);
        sum[k % 2] += xf[size_t(m * K + k)];
      }
      std::memcpy(&parity_sums[size_t(m * groups + g)], sum, sizeof sum);
    }
  }
  const float* rows[LANES_MAX_M] = {xf.data(), xf.data() + (M > 1 ? K : 0)};
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      c10::BFloat16* outs[LANES_MAX_M] = {out + b * BLOCK_ROWS, out + N + b * BLOCK_ROWS};
      const uint8_t* block = packed + b * BLOCK_ROWS * K / 2;
      if (M == 2) {
        block_rows_lanes<2>(block, sz + b * BLOCK_ROWS, N, group_size, rows,
                            parity_sums.data(), groups, outs);
      } else {
        block_rows_lanes<1>(block, sz + b * BLOCK_ROWS, N, group_size, rows,
                            parity_sums.data(), groups, outs);
      }
    }
  });
}
#endif  // !__AVX512BF16__

#if defined(CPU_F32_TILES)
// vpermb indices for quarter-row float32 lanes (cpu_f32_tiles.h's [K][64] layout): lane l of
// QUARTER_INDEX[h][par] takes row 16 h + l's nibble (of the low or high nibble vector) of input
// k + par into byte 2 of 128.0f, as EIGHTH_INDEX does for (row, input) interleaved lanes.
struct QuarterIndex {
  alignas(64) uint8_t bytes[2][2][64];
  constexpr QuarterIndex() : bytes{} {
    for (int h = 0; h < 2; ++h) {
      for (int par = 0; par < 2; ++par) {
        for (int l = 0; l < 16; ++l) bytes[h][par][4 * l + 2] = uint8_t(32 * par + 16 * h + l);
      }
    }
  }
};
inline constexpr QuarterIndex QUARTER_INDEX{};

// A block of int4 weights -> float32 [K][64] (cpu_f32_tiles.h) of w = (q - 8) s + zf computed
// as build_dequantized_pairs does ((128 + q) s + (zf - 136 s), one multiply-add) and rounded to
// bfloat16 as it does, so the tiles multiply the same weights; per pair of inputs 8 vpermb, 8
// FMAs and 8 roundings of 16 lanes, and no pair packing.
inline void build_dequantized_f32(const uint8_t* block, const uint32_t* scale_zero, int64_t N,
                                  int64_t K, int64_t group_size, float* wf) {
  const __m512i float_bytes = _mm512_set1_epi32(0x43000000);  // 128.0f
  __m512i index[2][2];
  for (int h = 0; h < 2; ++h) {
    for (int par = 0; par < 2; ++par) {
      index[h][par] = _mm512_load_si512(QUARTER_INDEX.bytes[h][par]);
    }
  }
  for (int64_t g = 0; g < K / group_size; ++g) {
    __m512 scale[QUARTERS], offset[QUARTERS];
    for (int j = 0; j < QUARTERS; ++j) {
      const ScaleOffset so = scale_offset(scale_zero, g, N, j);
      scale[j] = so.scale;
      offset[j] = so.offset;
    }
    for (int64_t p = g * group_size / 2; p < (g + 1) * group_size / 2; ++p) {
      __m512i nibbles[2];
      split_nibbles(block + p * 64, nibbles);
      for (int j = 0; j < QUARTERS; ++j) {
        for (int par = 0; par < 2; ++par) {
          const __m512i f = _mm512_mask_permutexvar_epi8(float_bytes, NIBBLE_BYTES,
                                                         index[j % 2][par], nibbles[j / 2]);
          const __m512 w = _mm512_fmadd_ps(_mm512_castsi512_ps(f), scale[j], offset[j]);
          const cpu_simd::f32x16 rounded = cpu_simd::round_bf16x16(cpu_simd::f32x16(w));
          _mm512_store_ps(wf + (2 * p + par) * 64 + 16 * j, __m512(rounded));
        }
      }
    }
  }
}
#endif  // CPU_F32_TILES

// out [M, N] = x [M, K] @ W.T, W int4 in whole 64-row blocks (N % 64 == 0), bfloat16 x, scales
// and output. scale_and_zero [K/G, N, 2] (s, zf) as kernels/int4_pack.py describes.
inline void linear(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                   const uint8_t* packed, const c10::BFloat16* scale_and_zero, int64_t N,
                   int64_t group_size) {
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_and_zero);
  const int64_t blocks = N / BLOCK_ROWS, groups = K / group_size;
  if (M >= DEQUANTIZED_PAIRS_MIN_M) {  // dequantize each block once, then the bf16 pairs loop
#if defined(CPU_F32_TILES)
    // Without AVX512-BF16: into float32 lanes, then plain FMAs (cpu_f32_tiles.h): SmolLM2's 30
    // layers, 2-core cloud Xeon, min of 5, ms, bf16 pairs vs float32 lanes (4-row tiles): 16 rows
    // 22.6 vs 17.6, 64 rows 65.3 vs 50.3, 512 rows 457 vs 361 (same bits).
    const std::vector<float> xf = cpu_f32_tiles::widen_rows(x, M, K);
    auto widen = [&](int64_t b, float* wf, float*) -> const float* {
      build_dequantized_f32(packed + b * BLOCK_ROWS * K / 2, sz + b * BLOCK_ROWS, N, K,
                            group_size, wf);
      return nullptr;
    };
    auto block_bytes = [&](int64_t b) {
      return std::pair<const void*, int64_t>{packed + b * BLOCK_ROWS * K / 2, BLOCK_ROWS * K / 2};
    };
    cpu_f32_tiles::for_blocks(blocks, xf.data(), M, K, out, N, 0, widen, block_bytes);
#else
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<__m512i> buffer(size_t(K / 2 * QUARTERS));  // K/2 x 256 bytes, in L2
      uint32_t* pairs = reinterpret_cast<uint32_t*>(buffer.data());
      for (int64_t b = begin; b < end; ++b) {
        build_dequantized_pairs(packed + b * BLOCK_ROWS * K / 2, sz + b * BLOCK_ROWS, N, K,
                                group_size, pairs);
        const uint8_t* next = b + 1 < end ? packed + (b + 1) * BLOCK_ROWS * K / 2 : nullptr;
        cpu_pair_tiles::all_rows(pairs, x, M, K, out, N, b * BLOCK_ROWS, next, BLOCK_ROWS * K / 2);
      }
    });
#endif
    return;
  }
#if !defined(__AVX512BF16__)
  if (M <= LANES_MAX_M) return linear_lanes(out, x, M, K, packed, sz, N, group_size);
#endif
  std::vector<float> sums(size_t(M * groups));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        s += float(x[m * K + k]);
      }
      sums[size_t(m * groups + g)] = s;
    }
  }
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * BLOCK_ROWS * K / 2;
      const uint32_t* block_sz = sz + b * BLOCK_ROWS;
      for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {  // a second tile reads the block from L2
        const cpu_simd::PairTile<TILE_M> t(x, K, M, m0, out, N, b * BLOCK_ROWS);
        const float* s = sums.data() + m0 * groups;
        switch (t.rows) {
          case 4: block_rows<4>(block, block_sz, N, group_size, t.x_pairs, s, groups, t.out); break;
          case 3: block_rows<3>(block, block_sz, N, group_size, t.x_pairs, s, groups, t.out); break;
          case 2: block_rows<2>(block, block_sz, N, group_size, t.x_pairs, s, groups, t.out); break;
          default: block_rows<1>(block, block_sz, N, group_size, t.x_pairs, s, groups, t.out);
        }
      }
    }
  });
}

}  // namespace cpu_int4_linear
#endif  // CPU_BF16_PAIRS and AVX512-VBMI
