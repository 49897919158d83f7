// Decode attention for a bfloat16 query and cache on AVX-512 CPUs (vdpbf16ps where the CPU has
// AVX512-BF16, Zen 4 and Sapphire Rapids on; elsewhere its equivalent in AVX-512F, cpu_simd.h):
// one query token per sequence, one (sequence, KV head) per call, the G query heads of the KV
// head (GQA) sharing every K/V row loaded. Included by cpu_paged_attention.cpp, which falls
// back to its generic path elsewhere.
//
// Why a second path: at batch 64 x ~400 tokens the generic one spent ~4x the floor (K/V bytes
// over bandwidth) mostly on instructions, not on memory: it widened every K and V row to
// float32 in a scratch block, then reduced each (head, token) dot product across 16 lanes
// (~8 shuffle/add steps per score). Here:
// - Q.K: vdpbf16ps multiplies bfloat16 pairs straight from the cache row into float32 lanes
//   (products of two bfloat16 are exact in float32, so only the summation order changes);
//   each token's 16 partial sums go to a small scratch, and the block's 16 tokens are reduced
//   together by a transpose-and-add tree (45 steps per 16 scores instead of ~128), leaving the
//   scores one per lane, ready for the vector softmax.
// - Softmax: online per span of 128 keys (8 blocks of 16), not per block: the span's scores
//   are kept, so the max is reduced and the accumulators rescaled once per span, and the sum
//   stays a vector until the end (those per-block reductions were a third of the work).
// - P.V: each V row is widened once into registers (a 32-element load splits into its even and
//   odd dims with a shift and a mask, no shuffle) and accumulated into all G heads' float32
//   accumulators, which stay in registers for the whole sequence (G x D/16 vectors, in that
//   even/odd order until the output is written).
// - K's rows 48 keys ahead (in whole blocks: 3 of 16) are requested into L2 while K's rows
//   are scored (pass 1 below), V's while V's are accumulated (pass 2), a row per row
//   (cpu_simd::rows_ahead says why L2 and why spread). Both requested in pass 1, memory sat
//   idle through pass 2: over the engine's and contiguous block placements that was 10-14 %
//   slower, over shuffled blocks the same (in-process A/B, 12 alternating rounds each, 2-core
//   cloud Xeon, 2026-12-07).
// The softmax scale multiplies the float32 scores (the generic path pre-scales q instead).
#pragma once

#include "cpu_simd.h"

#if defined(CPU_BF16_PAIRS)
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace cpu_decode_bf16 {

constexpr int TOKENS = 16;           // keys per reduction tree (one per float32 lane)
constexpr int SPAN_KEYS = 128;       // keys per online-softmax step (whole blocks, >= 1)

// r[t] = sum of the 16 lanes of v[t], for 16 vectors. Two levels inside each 128-bit lane
// (unpack and add: pairs of vectors, then pairs of pairs), after which vector j holds, in every
// 128-bit quarter, that quarter's partial sums of v[4j .. 4j + 3]; then two levels across
// quarters (vshuff32x4 and add) sum the quarters. 45 operations as the earlier tree of
// cross-lane permutes (vpermt2ps) had, but 36 of them in-lane: the decode kernel's arithmetic
// (benchmarks.cpu_attention's cpu_kernel_in_cache) went 0.47-0.51 -> 0.40-0.44 ms a layer on a
// 2-core EPYC (three alternating pairs, 2026-12-06); from DRAM the change was inside the noise.
__attribute__((always_inline)) inline __m512 transpose_sum(const __m512* v) {
  __m512 a[TOKENS / 2];
#pragma GCC unroll 8
  for (int i = 0; i < TOKENS / 2; ++i) {  // per quarter: v(2i)[0+2], v(2i+1)[0+2], .[1+3], .[1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m512 b[TOKENS / 4];
#pragma GCC unroll 4
  for (int j = 0; j < TOKENS / 4; ++j) {  // per quarter: v(4j) .. v(4j + 3), partial
    const __m512d lo = _mm512_castps_pd(a[2 * j]), hi = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Quarters (q0 + q1, q2 + q3) of b0 and b1, then of b2 and b3; then those pairs summed.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88),
                                  _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88),
                                  _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

inline __m512 exp_nonpositive(__m512 x) {
  cpu_simd::f32x16 v;
  std::memcpy(&v, &x, sizeof v);
  v = cpu_simd::exp_nonpositive(v);
  std::memcpy(&x, &v, sizeof x);
  return x;
}

// scores[t] = scale * q.k_t for the n <= 16 keys at `keys` (token_stride elements apart), with
// the vdpbf16ps + tree of `attend`: for the prefill rows of cpu_paged_attention.cpp's generic
// loop (head_dim D a multiple of 32). Keys past n are not read. Returns their max.
inline float key_group_scores(const c10::BFloat16* q, const c10::BFloat16* keys,
                              int64_t token_stride, int n, int D, float scale, float* scores) {
  __m512 part[TOKENS];
  for (int t = 0; t < n; ++t) {
    const c10::BFloat16* row = keys + t * token_stride;
    __m512 s = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 32) {
      s = cpu_simd::dot_bf16_pairs(s, _mm512_loadu_si512(q + d), _mm512_loadu_si512(row + d));
    }
    part[t] = s;
  }
  for (int t = n; t < TOKENS; ++t) part[t] = _mm512_setzero_ps();
  const __m512 s = _mm512_mul_ps(transpose_sum(part), _mm512_set1_ps(scale));
  _mm512_storeu_ps(scores, s);
  return _mm512_mask_reduce_max_ps(__mmask16((1u << n) - 1u), s);
}

// Word indices for the output: cvtne2ps2bf16(odd, even) gives even dims in words 0-15 and odd
// dims in words 16-31; word 2i takes word i, word 2i + 1 takes word 16 + i.
struct InterleaveWords {
  alignas(64) uint16_t words[32];
  constexpr InterleaveWords() : words{} {
    for (int i = 0; i < 16; ++i) {
      words[2 * i] = uint16_t(i);
      words[2 * i + 1] = uint16_t(16 + i);
    }
  }
};
inline constexpr InterleaveWords INTERLEAVE_WORDS{};

// Per-thread score scratch (grown on demand; a span's worth).
inline float* score_scratch(size_t floats) {
  static thread_local std::vector<float> scratch;
  if (scratch.size() < floats) scratch.resize(floats);
  return scratch.data();
}

// One sequence's newest token, the G heads of KV head `kv_head`, over `ctx` keys whose blocks
// are `table[0 .. ceil(ctx / block_size))`. k_head / v_head: the KV head's rows of block 0
// (block b's rows start block_stride elements further). D: head_dim.
// The softmax is online per span of up to SPAN_KEYS keys, not per block: a span's scores are
// kept (G x SPAN_KEYS floats), so the max is reduced, and the accumulators rescaled, once per
// span instead of once per 16 keys (those reductions were a third of the instructions). A
// span's K rows are read in pass 1 and its V rows in pass 2, each pass requesting its own rows
// ahead, so memory is kept busy through both.
template <int D, int G>
void attend(const c10::BFloat16* query, int64_t q_head_stride, c10::BFloat16* out,
            int64_t o_head_stride, const c10::BFloat16* k_head, const c10::BFloat16* v_head,
            int64_t block_stride, int64_t k_token_stride, int64_t v_token_stride,
            const int32_t* table, int block_size, int ctx, float scale) {
  static_assert(D % 32 == 0, "head_dim: whole 32-element bfloat16 pairs vectors");
  constexpr int QV = D / 32;  // bfloat16 vectors per row
  constexpr int AV = D / 16;  // float32 vectors per row
  __m512i q[G][QV];
  __m512 acc[G][AV], sum_lanes[G];
  float m[G];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < QV; ++j) {
      q[g][j] = _mm512_loadu_si512(query + g * q_head_stride + 32 * j);
    }
    for (int j = 0; j < AV; ++j) acc[g][j] = _mm512_setzero_ps();
    sum_lanes[g] = _mm512_setzero_ps();
    m[g] = -__builtin_inff();
  }
  // A span is whole blocks (at least one); each head's row of scores has 16 floats of slack,
  // as a 16-key group starting anywhere in a block is stored whole.
  const int span_blocks = block_size >= SPAN_KEYS ? 1 : SPAN_KEYS / block_size;
  const int span_keys = span_blocks * block_size;
  const int row_floats = span_keys + TOKENS;
  float* scores = score_scratch(size_t(G) * row_floats);  // [G][row_floats]
  __m512 part[G * TOKENS];  // Q.K partial sums [head][token], 16 lanes each
  alignas(64) float p[G][TOKENS];
  const __m512 scale_v = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-__builtin_inff());
  // P.V widens a V load of 32 bfloat16 into two float32 vectors without a shuffle: the even
  // dims shifted into place, the odd ones masked (they already are the top halves).
  const __m512i odd_mask = _mm512_set1_epi32(int(0xFFFF0000u));
  const __m512i interleave = _mm512_load_si512(INTERLEAVE_WORDS.words);
  constexpr int64_t E = sizeof(c10::BFloat16);
  const char* k_bytes = reinterpret_cast<const char*>(k_head);
  const char* v_bytes = reinterpret_cast<const char*>(v_head);
  cpu_simd::prefetch_first_blocks(k_bytes, block_stride * E, k_token_stride * E, D * E, table,
                                  block_size, ctx);
  cpu_simd::prefetch_first_blocks(v_bytes, block_stride * E, v_token_stride * E, D * E, table,
                                  block_size, ctx);
  for (int span = 0; span < ctx; span += span_keys) {
    const int span_end = ctx - span < span_keys ? ctx : span + span_keys;
    // Pass 1: scores = scale * q.k per 16-key group; keys past ctx are never read (an unowned
    // slot may hold anything) and score -inf.
    __m512 max_lanes[G];
    for (int g = 0; g < G; ++g) max_lanes[g] = minus_inf;
    for (int start = span; start < span_end; start += block_size) {
      const c10::BFloat16* k_block = k_head + table[start / block_size] * block_stride;
      const int in_block = span_end - start < block_size ? span_end - start : block_size;
      const cpu_simd::RowsAhead k_ahead = cpu_simd::rows_ahead(
          k_bytes, block_stride * E, k_token_stride * E, D * E, table, block_size, ctx, start);
      for (int t0 = 0; t0 < in_block; t0 += TOKENS) {
        const int n = in_block - t0 < TOKENS ? in_block - t0 : TOKENS;
        for (int t = 0; t < n; ++t) {
          k_ahead.at(t0 + t);
          const c10::BFloat16* row = k_block + (t0 + t) * k_token_stride;
          __m512i k[QV];
          for (int j = 0; j < QV; ++j) k[j] = _mm512_loadu_si512(row + 32 * j);
          for (int g = 0; g < G; ++g) {
            __m512 s = cpu_simd::dot_bf16_pairs(_mm512_setzero_ps(), q[g][0], k[0]);
            for (int j = 1; j < QV; ++j) s = cpu_simd::dot_bf16_pairs(s, q[g][j], k[j]);
            part[g * TOKENS + t] = s;
          }
        }
        for (int t = n; t < TOKENS; ++t) {
          for (int g = 0; g < G; ++g) part[g * TOKENS + t] = _mm512_setzero_ps();
        }
        const __mmask16 valid = __mmask16((1u << n) - 1u);
        for (int g = 0; g < G; ++g) {
          const __m512 s =
              _mm512_mask_mul_ps(minus_inf, valid, transpose_sum(part + g * TOKENS), scale_v);
          _mm512_storeu_ps(scores + size_t(g) * row_floats + (start - span) + t0, s);
          max_lanes[g] = _mm512_max_ps(max_lanes[g], s);
        }
      }
    }
    // The running max moves once per span: rescale what was accumulated before it.
    __m512 max_v[G];
    for (int g = 0; g < G; ++g) {
      const float span_max = _mm512_reduce_max_ps(max_lanes[g]);
      const float m_new = m[g] > span_max ? m[g] : span_max;
      const __m512 correction = exp_nonpositive(_mm512_set1_ps(m[g] - m_new));  // m = -inf: 0
      for (int j = 0; j < AV; ++j) acc[g][j] = _mm512_mul_ps(acc[g][j], correction);
      sum_lanes[g] = _mm512_mul_ps(sum_lanes[g], correction);
      m[g] = m_new;
      max_v[g] = _mm512_set1_ps(m_new);
    }
    // Pass 2: p = exp(s - max), summed per lane, and P.V with each V row widened once for
    // all G heads.
    for (int start = span; start < span_end; start += block_size) {
      const c10::BFloat16* v_block = v_head + table[start / block_size] * block_stride;
      const int in_block = span_end - start < block_size ? span_end - start : block_size;
      const cpu_simd::RowsAhead v_ahead = cpu_simd::rows_ahead(
          v_bytes, block_stride * E, v_token_stride * E, D * E, table, block_size, ctx, start);
      for (int t0 = 0; t0 < in_block; t0 += TOKENS) {
        const int n = in_block - t0 < TOKENS ? in_block - t0 : TOKENS;
        const __mmask16 valid = __mmask16((1u << n) - 1u);
        for (int g = 0; g < G; ++g) {
          const __m512 s = _mm512_loadu_ps(scores + size_t(g) * row_floats + (start - span) + t0);
          // Masked lanes: 0, not exp(-87).
          const __m512 e =
              _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, max_v[g])));
          sum_lanes[g] = _mm512_add_ps(sum_lanes[g], e);
          _mm512_store_ps(p[g], e);
        }
        for (int t = 0; t < n; ++t) {
          v_ahead.at(t0 + t);
          const c10::BFloat16* row = v_block + (t0 + t) * v_token_stride;
          __m512 v[AV];
          for (int j = 0; j < QV; ++j) {  // 32 dims a load: even ones, then odd ones
            const __m512i bits = _mm512_loadu_si512(row + 32 * j);
            v[2 * j] = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
            v[2 * j + 1] = _mm512_castsi512_ps(_mm512_and_si512(bits, odd_mask));
          }
          for (int g = 0; g < G; ++g) {
            const __m512 pt = _mm512_set1_ps(p[g][t]);
            for (int j = 0; j < AV; ++j) acc[g][j] = _mm512_fmadd_ps(pt, v[j], acc[g][j]);
          }
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    // sum = 0 only for an empty context (a padding row): write zeros, not NaN.
    const float sum = _mm512_reduce_add_ps(sum_lanes[g]);
    const __m512 inv = _mm512_set1_ps(sum > 0.f ? 1.f / sum : 0.f);
    for (int j = 0; j < QV; ++j) {
      // acc[2j] holds dims 32j + 0, 2, .., 30 and acc[2j + 1] the odd ones (P.V's order):
      // vcvtne2ps2bf16 packs the pair, then one word permute puts dims back in order.
      const __m512i packed = cpu_simd::bf16_pairs_from(_mm512_mul_ps(acc[g][2 * j + 1], inv),
                                                       _mm512_mul_ps(acc[g][2 * j], inv));
      _mm512_storeu_si512(out + g * o_head_stride + 32 * j,
                          _mm512_permutexvar_epi16(interleave, packed));
    }
  }
}

using AttendFn = decltype(&attend<64, 1>);

// The instantiation for (head_dim, group), or nullptr: the generic path serves the others.
template <int D>
AttendFn for_group(int group) {
  switch (group) {
    case 1: return &attend<D, 1>;
    case 2: return &attend<D, 2>;
    case 3: return &attend<D, 3>;
    case 4: return &attend<D, 4>;
    case 5: return &attend<D, 5>;
    case 6: return &attend<D, 6>;
    case 7: return &attend<D, 7>;
    case 8: return &attend<D, 8>;
    default: return nullptr;
  }
}

inline AttendFn select(int head_dim, int group) {
  switch (head_dim) {
    case 64: return for_group<64>(group);
    case 128: return for_group<128>(group);
    default: return nullptr;
  }
}

}  // namespace cpu_decode_bf16
#endif  // CPU_BF16_PAIRS
