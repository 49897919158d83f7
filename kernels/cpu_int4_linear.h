// W4A16 matrix-vector products for decode's few rows, bfloat16 activations, on CPUs with
// AVX512-BF16 and AVX512-VBMI (Zen 4, Sapphire Rapids and later). Included by
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
// Layout (kernels/int4_pack.py, aten's on AVX-512): a block of 64 output rows holds, for each
// input k, 32 bytes whose low nibbles are rows 0-31 and high nibbles rows 32-63; inputs k and
// k + 1 are adjacent, so one 64-byte load holds a pair of inputs for all 64 rows. A byte
// permute (vpermt2b) interleaves the pair per row and puts 0x43 above each nibble:
// 32-bit lane r = (0x4300 | q(r, k), 0x4300 | q(r, k + 1)), matching x's pair (x(k), x(k+1)).
// Each thread streams whole blocks (K * 32 contiguous bytes), prefetched STREAM_PREFETCH_BYTES
// ahead (cpu_simd.h).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define CPU_INT4_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_int4_linear {

constexpr int BLOCK_ROWS = 64;  // output rows per packed block
constexpr int QUARTERS = 4;     // 16-row vectors per block
constexpr int TILE_M = 4;       // x rows per pass over a block (its bytes stay in L1/L2)

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

// Where a tile of x rows gets the block's bfloat16 pairs: built from the nibbles (one tile),
// built and kept in a scratch (the first of several tiles), or read back from it (the others:
// with more than 4 rows the conversion is done once per block, not once per tile, and the
// block's 16-bit pairs, K/2 x 256 bytes, stay in L2).
enum class Pairs { BUILD, BUILD_AND_KEEP, REUSE };

// acc[m][quarter] += sum over the group's input pairs of (128 + q) * x, for MR x rows.
// Two accumulator sets (even and odd pairs) when they fit the registers: a vdpbf16ps waits on
// the previous one into the same accumulator, and 4 chains do not cover its latency.
template <int MR, Pairs SOURCE>
__attribute__((always_inline)) inline void group_dots(const uint8_t* bytes, int64_t pairs,
                                                      const uint32_t* const* x_pairs,
                                                      __m512i* kept,
                                                      __m512 (&acc)[MR][QUARTERS]) {
  constexpr int SETS = MR <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
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
      __m512i w[QUARTERS];
      __m512i* keep = kept + (p + s) * QUARTERS;
      if constexpr (SOURCE == Pairs::REUSE) {
        for (int j = 0; j < QUARTERS; ++j) w[j] = _mm512_loadu_si512(keep + j);
      } else {
        const uint8_t* ahead = bytes + (p + s) * 64 + cpu_simd::STREAM_PREFETCH_BYTES;
        _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(bytes + (p + s) * 64);
        const __m512i lo = _mm512_and_si512(v, nibble);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
        w[0] = _mm512_permutex2var_epi8(lo, index_lo, high_byte);
        w[1] = _mm512_permutex2var_epi8(lo, index_hi, high_byte);
        w[2] = _mm512_permutex2var_epi8(hi, index_lo, high_byte);
        w[3] = _mm512_permutex2var_epi8(hi, index_hi, high_byte);
        if constexpr (SOURCE == Pairs::BUILD_AND_KEEP) {
          for (int j = 0; j < QUARTERS; ++j) _mm512_storeu_si512(keep + j, w[j]);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(x_pairs[m][p + s]));
        for (int j = 0; j < QUARTERS; ++j) {
          part[s][m][j] = _mm512_dpbf16_ps(part[s][m][j], (__m512bh)w[j], xb);
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
template <int MR, Pairs SOURCE>
void block_rows(const uint8_t* block, const uint32_t* scale_zero, int64_t N, int64_t group_size,
                const uint32_t* const* x_pairs, const float* x_group_sums, int64_t groups,
                __m512i* kept, c10::BFloat16* const* out) {
  __m512 total[MR][QUARTERS];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < QUARTERS; ++j) total[m][j] = _mm512_setzero_ps();
  }
  const int64_t pairs = group_size / 2;
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* group_pairs[MR];
    for (int m = 0; m < MR; ++m) group_pairs[m] = x_pairs[m] + g * pairs;
    __m512 acc[MR][QUARTERS];
    group_dots<MR, SOURCE>(block + g * group_size * 32, pairs, group_pairs,
                           kept + g * pairs * QUARTERS, acc);
    for (int j = 0; j < QUARTERS; ++j) {
      // 16 rows' (s, zf) bfloat16 pairs: s in the low half of each 32-bit lane.
      const __m512i sz = _mm512_loadu_si512(scale_zero + g * N + j * 16);
      const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(sz, 16));
      const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000u));
      const __m512 zf = _mm512_castsi512_ps(_mm512_and_si512(sz, high_half));
      const __m512 offset = _mm512_fnmadd_ps(s, _mm512_set1_ps(ONE_TWENTY_EIGHT_PLUS_EIGHT), zf);
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

template <Pairs SOURCE>
void tile_rows(int mr, const uint8_t* block, const uint32_t* sz, int64_t N, int64_t group_size,
               const uint32_t* const* x_pairs, const float* sums, int64_t groups, __m512i* kept,
               c10::BFloat16* const* o) {
  switch (mr) {
    case 4: return block_rows<4, SOURCE>(block, sz, N, group_size, x_pairs, sums, groups, kept, o);
    case 3: return block_rows<3, SOURCE>(block, sz, N, group_size, x_pairs, sums, groups, kept, o);
    case 2: return block_rows<2, SOURCE>(block, sz, N, group_size, x_pairs, sums, groups, kept, o);
    default: return block_rows<1, SOURCE>(block, sz, N, group_size, x_pairs, sums, groups, kept, o);
  }
}

inline void tile(Pairs source, int mr, const uint8_t* block, const uint32_t* sz, int64_t N,
                 int64_t group_size, const uint32_t* const* x_pairs, const float* sums,
                 int64_t groups, __m512i* kept, c10::BFloat16* const* o) {
  switch (source) {
    case Pairs::BUILD:
      return tile_rows<Pairs::BUILD>(mr, block, sz, N, group_size, x_pairs, sums, groups, kept, o);
    case Pairs::BUILD_AND_KEEP:
      return tile_rows<Pairs::BUILD_AND_KEEP>(mr, block, sz, N, group_size, x_pairs, sums, groups,
                                              kept, o);
    default:
      return tile_rows<Pairs::REUSE>(mr, block, sz, N, group_size, x_pairs, sums, groups, kept, o);
  }
}

// out [M, N] = x [M, K] @ W.T, W int4 in whole 64-row blocks (N % 64 == 0), bfloat16 x, scales
// and output. scale_and_zero [K/G, N, 2] (s, zf) as kernels/int4_pack.py describes.
inline void linear(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                   const uint8_t* packed, const c10::BFloat16* scale_and_zero, int64_t N,
                   int64_t group_size) {
  const int64_t groups = K / group_size;
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
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_and_zero);
  const int64_t blocks = N / BLOCK_ROWS;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    // A block's 16-bit pairs, kept for its later tiles when x has more than TILE_M rows.
    std::vector<__m512i> kept(M > TILE_M ? size_t(K / 2 * QUARTERS) : 0);
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block = packed + b * BLOCK_ROWS * K / 2;
      const uint32_t* block_sz = sz + b * BLOCK_ROWS;
      for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
        const cpu_simd::PairTile<TILE_M> t(x, K, M, m0, out, N, b * BLOCK_ROWS);
        const float* tile_sums = sums.data() + m0 * groups;
        const Pairs source = M <= TILE_M ? Pairs::BUILD
                             : m0 == 0   ? Pairs::BUILD_AND_KEEP
                                         : Pairs::REUSE;
        tile(source, t.rows, block, block_sz, N, group_size, t.x_pairs, tile_sums, groups,
             kept.data(), t.out);
      }
    }
  });
}

}  // namespace cpu_int4_linear
#endif  // AVX512-BF16 and AVX512-VBMI
