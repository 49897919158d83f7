// W8A8 / W4A8 products: int8 or int4 weights times activations quantized to int8 on the fly,
// multiplied with AVX512-VNNI (vpdpbusd). Included by cpu_fused_ops.cpp, whose int8_linear and
// int4_linear call it when the engine asks for int8 activations (EngineConfig.int8_activations)
// and the rows are at least int8_activations_min_rows; fewer rows keep the weight-only kernels.
//
// Why: with many rows a weight-only product is bound by arithmetic, and the weight-only
// kernels multiply bfloat16 pairs: vdpbf16ps does 32 multiply-adds an instruction, vpdpbusd 64
// on bytes, at the same rate (one 512-bit instruction a cycle per core each, 3.6 G/s on a
// 2-core Zen 4 EPYC). At 64 rows our bf16 linears run at ~97% of the measured bf16 matmul peak,
// so a weight-only format can at best tie bf16 there (docs/measurements/quantization.md);
// integer products are the way past that tie, as llama.cpp's CPU kernels multiply their
// quantized weights by activations quantized to 8 bits.
//
// Activations: each row's inputs, in groups of G (the int4 weight's group size; 64 for int8),
// are scaled by a = max|x| / 127 and rounded to int8 (to nearest even), xq, and sq = sum xq is
// kept. Weights: each thread unpacks half a 64-row block at a time into bytes u in vpdpbusd's
// order (a 32-bit lane holds 4 consecutive inputs of one row, 16 rows a vector), with per
// (group, row) floats s and c such that the layer's weight is w = s u + c:
//   int4 (w = (q - 8) s + zf):  u = q (0-15),       c = zf - 8 s;
//   int8 (w = q s):             u = q + 128 (0-255), c = -128 s.
// Then per row m, output n:
//   out(m, n) = sum_g a(m, g) (s(g, n) dot_g(u(n), xq(m)) + c(g, n) sq(m, g))
// with dot_g exact in int32. The rounding beyond the weight-only path's is xq's: at most half a
// step of a group's max / 127 per input (relative error ~0.6% of a layer's output on random
// inputs, tests/test_int8_activations.py), the dynamic int8 activations that vLLM's W8A8 and
// llama.cpp's q8 dot products accept.
#pragma once

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#define CPU_INT8_ACT_LINEAR 1
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>

#include "cpu_simd.h"

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

namespace cpu_int8_act_linear {

// Work is split in half blocks: the rows 16 h .. 16 h + 15 and 32 + 16 h .. 32 + 16 h + 15 of
// a 64-row block (the low and high nibbles of the same packed bytes), so a layer of B blocks is
// 2 B items and two threads get equal shares (SmolLM2's 576-row layers are 9 blocks: whole
// blocks split 5 / 4, and perf showed the threads' wait as ~19% of a 576 x 1536 layer's time).
constexpr int BLOCK_ROWS = 64;  // output rows per packed block
constexpr int HALF_ROWS = 32;   // output rows per work item (two vectors of 16)
constexpr int TILE_M = 6;       // x rows per register tile: 6 x 2 int32 + 6 x 2 float32 sums

inline __m512 load_bf16(const c10::BFloat16* p) {  // 16 bfloat16 -> float32 (exact)
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// x quantized: xq int8 [M, K], scale a [M, G] and sum of xq [M, G] (as float).
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> scale, sum;
  int64_t K = 0, groups = 0;
};

// Row m of x [M, K] bfloat16 into q, in groups of `group` inputs.
inline void quantize_row(const c10::BFloat16* x, int64_t m, int64_t group, QuantizedRows& q) {
  const int64_t K = q.K;
  for (int64_t g = 0; g < q.groups; ++g) {
    const c10::BFloat16* row = x + m * K + g * group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < group; k += 16) {
      amax = _mm512_max_ps(amax, _mm512_abs_ps(load_bf16(row + k)));
    }
    const float a = _mm512_reduce_max_ps(amax) / 127.0f;
    const __m512 inv = _mm512_set1_ps(a > 0.0f ? 1.0f / a : 0.0f);  // an all-zero group: 0
    __m512i total = _mm512_setzero_si512();
    for (int64_t k = 0; k < group; k += 16) {
      // cvtps_epi32 rounds to nearest even (the default MXCSR); |x / a| <= 127 already.
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load_bf16(row + k), inv));
      total = _mm512_add_epi32(total, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.xq.data() + m * K + g * group + k),
                       _mm512_cvtepi32_epi8(v));
    }
    q.scale[size_t(m * q.groups + g)] = a;
    q.sum[size_t(m * q.groups + g)] = float(_mm512_reduce_add_epi32(total));
  }
}

// One half block's weights unpacked: u [K/4][2][16 lanes of 4 bytes]; s, c [groups][32].
struct HalfBlock {
  std::vector<__m512i> u;
  std::vector<float> s, c;
  void size_for(int64_t K, int64_t groups) {
    u.resize(size_t(K / 4 * 2));
    s.resize(size_t(groups * HALF_ROWS));
    c.resize(size_t(groups * HALF_ROWS));
  }
};

// vpermt2b indices: from A = inputs (k, k+1) and B = (k+2, k+3) of a 64-row int4 block
// (kernels/int4_pack.py: per input 32 bytes, low nibbles rows 0-31, high nibbles rows 32-63),
// lane r gets the bytes of row (16 h + r) for k .. k+3: their low nibbles are rows 16 h + r,
// their high nibbles rows 32 + 16 h + r.
struct QuadIndex {
  alignas(64) uint8_t bytes[2][64];
  constexpr QuadIndex() : bytes{} {
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < 16; ++r) {
        for (int i = 0; i < 4; ++i) bytes[h][4 * r + i] = uint8_t(32 * i + 16 * h + r);
      }
    }
  }
};
inline constexpr QuadIndex QUAD_INDEX{};

// Half h of an int4 block (K/2 * 64 bytes, two inputs a 64-byte line) -> u = q; scale_zero:
// the (s, zf) bfloat16 pairs of the block's row 0 in group 0 ([K/G, N] 32-bit units), the
// layer's w = (q - 8) s + zf = s q + c with c = zf - 8 s.
inline void unpack_half(const uint8_t* block, const uint32_t* scale_zero, int64_t N, int64_t K,
                        int64_t groups, int h, HalfBlock& b) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i index = _mm512_load_si512(QUAD_INDEX.bytes[h]);
  // Plain pointers: b is a thread_local, and through b.u GCC looked its address up
  // (__tls_get_addr) again after every store.
  __m512i* u = b.u.data();
  float *s_out = b.s.data(), *c_out = b.c.data();
  for (int64_t k4 = 0; k4 < K / 4; ++k4) {
    const __m512i bytes = _mm512_permutex2var_epi8(_mm512_loadu_si512(block + 2 * k4 * 64), index,
                                                   _mm512_loadu_si512(block + (2 * k4 + 1) * 64));
    _mm512_store_si512(u + 2 * k4, _mm512_and_si512(bytes, nibble));
    _mm512_store_si512(u + 2 * k4 + 1, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
  }
  for (int64_t g = 0; g < groups; ++g) {
    for (int r = 0; r < HALF_ROWS; ++r) {
      const int row = (r / 16) * 32 + 16 * h + r % 16;
      const uint32_t sz = scale_zero[g * N + row];
      const uint32_t s_bits = sz << 16, zf_bits = sz & 0xFFFF0000u;
      float s, zf;
      std::memcpy(&s, &s_bits, sizeof s);
      std::memcpy(&zf, &zf_bits, sizeof zf);
      s_out[g * HALF_ROWS + r] = s;
      c_out[g * HALF_ROWS + r] = zf - 8.0f * s;
    }
  }
}

// acc += u . x per 32-bit lane (4 unsigned x signed byte products), x one 32-bit word
// broadcast from memory. In inline assembly (INT8_ACT_INTRINSIC: the intrinsic) because GCC 12
// copies accumulators between registers around the intrinsic: 1-4% slower per layer
// (gate_up and down shapes at 64 rows, 2-core EPYC, 2026-12-06, at two versions of the tile).
__attribute__((always_inline)) inline void dot_bytes(__m512i& acc, __m512i u, const int8_t* x) {
#if defined(INT8_ACT_INTRINSIC)
  int32_t word;
  std::memcpy(&word, x, sizeof word);
  acc = _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(word));
#else
  const int32_t& word = *reinterpret_cast<const int32_t*>(x);
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(word));
#endif
}

// MR x rows (from m0) times the unpacked half block -> out[m][cols[0] + i], out[m][cols[1] + i]
// (i < 16): MR x 2 int32 sums for the group and MR x 2 float32 totals stay in registers.
// `ahead`: this tile's share of the thread's next item, requested into L2 a few lines per k
// step (cpu_simd.h's NextBlockShare says why: without it each block's unpacking waited on DRAM,
// a fifth of the time at 64 rows).
template <int MR>
void tile(const HalfBlock& b, const QuantizedRows& x, int64_t group, int64_t m0,
          c10::BFloat16* out, int64_t N, const int64_t (&cols)[2],
          const cpu_simd::NextBlockShare& ahead) {
  const int64_t K = x.K, per_step = ahead.lines_per(K / 4);
  const int8_t* rows[MR];
  for (int m = 0; m < MR; ++m) rows[m] = x.xq.data() + (m0 + m) * K;
  __m512 total[MR][2];
  for (int m = 0; m < MR; ++m) total[m][0] = total[m][1] = _mm512_setzero_ps();
  const __m512i* u = b.u.data();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i dot[MR][2];
    for (int m = 0; m < MR; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
    const int64_t k_end = (g + 1) * group;
    for (int64_t k = g * group; k < k_end; k += 4, u += 2) {
      ahead.at_step(k / 4, per_step);
      const __m512i w0 = u[0], w1 = u[1];
      for (int m = 0; m < MR; ++m) {
        dot_bytes(dot[m][0], w0, rows[m] + k);
        dot_bytes(dot[m][1], w1, rows[m] + k);
      }
    }
    const float* s = &b.s[size_t(g * HALF_ROWS)];
    const float* c = &b.c[size_t(g * HALF_ROWS)];
    for (int m = 0; m < MR; ++m) {
      const size_t mg = size_t((m0 + m) * x.groups + g);
      const __m512 a = _mm512_set1_ps(x.scale[mg]), sq = _mm512_set1_ps(x.sum[mg]);
      for (int j = 0; j < 2; ++j) {
        const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(c + 16 * j), sq,
                                         _mm512_mul_ps(_mm512_loadu_ps(s + 16 * j),
                                                       _mm512_cvtepi32_ps(dot[m][j])));
        total[m][j] = _mm512_fmadd_ps(a, t, total[m][j]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < 2; ++j) {
      cpu_simd::store_bf16x16(out + (m0 + m) * N + cols[j], cpu_simd::f32x16(total[m][j]));
    }
  }
}

// All x rows times the unpacked half block h of the block at row n0; `next`/`next_bytes`: the
// thread's next item's block (nullptr for none), split between the tiles for prefetching.
inline void all_rows(const HalfBlock& b, const QuantizedRows& x, int64_t group, int64_t M,
                     c10::BFloat16* out, int64_t N, int64_t n0, int h, const void* next,
                     int64_t next_bytes) {
  const int64_t cols[2] = {n0 + 16 * h, n0 + 32 + 16 * h};
  const int64_t tiles = (M + TILE_M - 1) / TILE_M;
  for (int64_t m0 = 0; m0 < M; m0 += TILE_M) {
    const cpu_simd::NextBlockShare ahead = cpu_simd::next_block_share(
        static_cast<const char*>(next), next_bytes, m0 / TILE_M, tiles);
    const auto run = [&](auto rows) {
      tile<decltype(rows)::value>(b, x, group, m0, out, N, cols, ahead);
    };
    switch (M - m0 < TILE_M ? M - m0 : TILE_M) {
      case 6: run(std::integral_constant<int, 6>{}); break;
      case 5: run(std::integral_constant<int, 5>{}); break;
      case 4: run(std::integral_constant<int, 4>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      default: run(std::integral_constant<int, 1>{}); break;
    }
  }
}

// Half h of rows n0 .. n0 + 63 of an int8 weight q [N, K] (row-major) -> u = q + 128 (a sign
// flip), by 16 x 16 transposes of 32-bit words (4 inputs of a row), with s = scale and
// c = -128 scale, so that w = q scale = s u + c. Rows 16 h .. and 32 + 16 h .. as for int4.
inline void unpack_int8_half(const int8_t* q, const c10::BFloat16* scales, int64_t K,
                             int64_t groups, int h, HalfBlock& b) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512i* u = b.u.data();  // plain pointers: see unpack_half
  float *s_out = b.s.data(), *c_out = b.c.data();
  for (int j = 0; j < 2; ++j) {
    const int8_t* rows = q + (32 * j + 16 * h) * K;
    for (int64_t k0 = 0; k0 < K; k0 += 64) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(rows + i * K + k0);
      cpu_simd::transpose16(r);  // r[i]: input word k0 / 4 + i of the 16 rows
      for (int i = 0; i < 16; ++i) {
        _mm512_store_si512(u + 2 * (k0 / 4 + i) + j, _mm512_xor_si512(r[i], flip));
      }
    }
  }
  for (int r = 0; r < HALF_ROWS; ++r) {
    const float scale = float(scales[(r / 16) * 32 + 16 * h + r % 16]);
    for (int64_t g = 0; g < groups; ++g) {
      s_out[g * HALF_ROWS + r] = scale;
      c_out[g * HALF_ROWS + r] = -128.0f * scale;
    }
  }
}

// The calling thread's quantized rows, sized for x [M, K] in groups of `group` (grown, never
// shrunk).
inline QuantizedRows& caller_rows(int64_t M, int64_t K, int64_t group) {
  static thread_local QuantizedRows rows;
  rows.K = K;
  rows.groups = K / group;
  if (rows.xq.size() < size_t(M * K)) rows.xq.resize(size_t(M * K));
  if (rows.scale.size() < size_t(M * rows.groups)) {
    rows.scale.resize(size_t(M * rows.groups));
    rows.sum.resize(size_t(M * rows.groups));
  }
  return rows;
}

// The shared driver: one parallel region in which the threads quantize x's rows, then (after
// the barrier) take equal runs of the 2 N / 64 half blocks. unpack(n0, h, b) fills b;
// ahead(item, end) gives the bytes worth requesting while the item is multiplied (pointer,
// bytes; nullptr for none).
template <typename Unpack, typename Ahead>
void run_items(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K, int64_t N,
               int64_t group, const Unpack& unpack, const Ahead& ahead) {
  // Bound by reference here: inside the parallel region the name of a thread_local would be
  // each worker's own.
  QuantizedRows& xq = caller_rows(M, K, group);
  const int64_t items = 2 * (N / BLOCK_ROWS);
#pragma omp parallel num_threads(at::get_num_threads())
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) quantize_row(x, m, group, xq);
    static thread_local HalfBlock b;  // kept per thread across calls (the threads persist)
    b.size_for(K, xq.groups);
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t begin = items * t / threads, end = items * (t + 1) / threads;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t n0 = item / 2 * BLOCK_ROWS;
      const int h = int(item % 2);
      unpack(n0, h, b);
      const auto [next, next_bytes] = ahead(item, end);
      all_rows(b, xq, group, M, out, N, n0, h, next, next_bytes);
    }
  }
}

// out [M, N] = x [M, K] @ W.T, W int4 in kernels/int4_pack.py's 64-row blocks (N % 64 == 0),
// scale_and_zero [K/G, N, 2] (s, zf) bfloat16; G a multiple of 16.
inline void linear_int4(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                        const uint8_t* packed, const c10::BFloat16* scale_and_zero, int64_t N,
                        int64_t group) {
  const uint32_t* sz = reinterpret_cast<const uint32_t*>(scale_and_zero);
  const int64_t block_bytes = BLOCK_ROWS * K / 2, groups = K / group;
  run_items(
      out, x, M, K, N, group,
      [&](int64_t n0, int h, HalfBlock& b) {
        unpack_half(packed + n0 * K / 2, sz + n0, N, K, groups, h, b);
        // The next item's (s, zf) pairs: a group's are N pairs apart, so each of its two
        // 64-byte runs is a line of its own; without this, perf put ~7% of a 64-row pass's
        // samples on the unpacking's scale loop, stalled on those loads.
        const int64_t next0 = h == 0 ? n0 : n0 + BLOCK_ROWS;
        if (next0 < N) {
          const int next_h = 1 - h;
          for (int64_t g = 0; g < groups; ++g) {
            for (int j = 0; j < 2; ++j) {
              __builtin_prefetch(sz + g * N + next0 + 32 * j + 16 * next_h, 0, 3);
            }
          }
        }
      },
      [&](int64_t item, int64_t end) {
        // Both halves read the same bytes: during the second, request the next block's.
        const bool next = item % 2 == 1 && item + 1 < end;
        return std::pair<const void*, int64_t>(
            next ? packed + (item + 1) / 2 * block_bytes : nullptr, block_bytes);
      });
}

// Inputs per activation scale for int8 weights (their scale is per row: any group fits).
constexpr int64_t INT8_WEIGHT_ACT_GROUP = 64;

// out [M, N] = x [M, K] @ (q * scales).T; q int8 [N, K] row-major, N % 64 == 0 and
// K % 64 == 0, scales bfloat16 [N].
inline void linear_int8(c10::BFloat16* out, const c10::BFloat16* x, int64_t M, int64_t K,
                        const int8_t* q, const c10::BFloat16* scales, int64_t N) {
  const int64_t block_bytes = BLOCK_ROWS * K, groups = K / INT8_WEIGHT_ACT_GROUP;
  run_items(
      out, x, M, K, N, INT8_WEIGHT_ACT_GROUP,
      [&](int64_t n0, int h, HalfBlock& b) {
        unpack_int8_half(q + n0 * K, scales + n0, K, groups, h, b);
      },
      [&](int64_t item, int64_t end) {
        // The halves read different rows of the block: during the first, request the whole
        // block (the second half's rows); during the second, the next block.
        const int64_t block = item / 2 + item % 2;
        const bool any = item % 2 == 0 || item + 1 < end;
        return std::pair<const void*, int64_t>(any ? q + block * block_bytes : nullptr,
                                               block_bytes);
      });
}

}  // namespace cpu_int8_act_linear
#endif  // AVX512-VNNI, BW and VBMI
