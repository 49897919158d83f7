// Portable SIMD helpers shared by the C++ CPU kernels: GCC/Clang vector extensions of 16
// floats, lowered to one zmm, two ymm or four xmm registers by -march=native (so one source
// serves AVX-512 and AVX2 machines), plus the scalar conversions of torch's 16-bit types.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cpu_simd {

constexpr int LANES = 16;
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int8_t i8x16 __attribute__((vector_size(16)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

template <typename V>
inline V load_vec(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof v);  // an unaligned vector load
  return v;
}
inline void store_vec(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

inline f32x16 bits_to_floats(u32x16 bits) {
  f32x16 x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// 16 bfloat16 -> float32: bfloat16 is the top half of a float32, so shift the bits up.
inline f32x16 load_bf16x16(const void* p) {
  return bits_to_floats(__builtin_convertvector(load_vec<u16x16>(p), u32x16) << 16);
}

// 16 small integers (int8 or uint8 lanes) -> float32. GCC 12 lowers a direct char-vector ->
// float-vector conversion to 16 scalar conversions, so widen explicitly: one vpmovsxbd /
// vpmovzxbd with AVX-512, else via 16-bit lanes (three vector steps, any x86-64).
typedef int16_t i16x16 __attribute__((vector_size(32)));
template <typename V>
inline f32x16 to_floats(V v) {
  static_assert(std::is_same_v<V, i8x16> || std::is_same_v<V, u8x16>, "int8 or uint8 lanes");
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<V, i8x16>) {
    return __builtin_convertvector(i32x16(_mm512_cvtepi8_epi32(__m128i(v))), f32x16);
  } else {
    return __builtin_convertvector(i32x16(_mm512_cvtepu8_epi32(__m128i(v))), f32x16);
  }
#else
  return __builtin_convertvector(
      __builtin_convertvector(__builtin_convertvector(v, i16x16), i32x16), f32x16);
#endif
}

inline float hsum(f32x16 x) {
  f32x8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
            __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0, 16 lanes at once (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6
// polynomial, 2^n through the exponent bits; ~1 ulp). std::exp is a scalar call: it was a
// third of a decode step of the attention kernel. Below -87 it returns ~1e-38, not 0: next to
// the row's max term (1) that changes nothing. n is rounded with the 1.5 * 2^23 trick (plain
// arithmetic, vectorizes).
inline f32x16 exp_nonpositive(f32x16 x) {
  const f32x16 lowest = f32x16{} - 87.0f;
  x = x < lowest ? lowest : x;
  const float round_magic = 12582912.0f;
  const f32x16 n = (x * 1.44269504088896341f + round_magic) - round_magic;
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = f32x16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  f32x16 two_n;
  std::memcpy(&two_n, &exponent, sizeof two_n);
  return p * two_n;
}

inline float exp_nonpositive(float x) {
  return exp_nonpositive(f32x16{} + x)[0];
}

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// bfloat16 widens by shifting (vectorizes, unlike a call).
inline float to_float(c10::BFloat16 x) { return bits_to_float(uint32_t(x.x) << 16); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// 16 model-dtype values (float32 / bfloat16 / float16) as float32 lanes.
inline f32x16 load16(const float* p) { return load_vec<f32x16>(p); }
inline f32x16 load16(const c10::BFloat16* p) { return load_bf16x16(p); }
inline f32x16 load16(const c10::Half* p) {
  f32x16 v;
  for (int i = 0; i < LANES; ++i) v[i] = to_float(p[i]);
  return v;
}

// v's lanes rounded to bfloat16 by the bits, nearest even (c10::BFloat16's rule), NaN made
// the quiet NaN 0x7FC0: the bfloat16 in each lane's top half, the low half zero.
inline u32x16 bf16_bits_on_top(f32x16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof bits);
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  const u32x16 is_nan = (u32x16)(v != v);  // all ones where NaN
  return (is_nan & 0x7FC00000u) | (~is_nan & rounded);
}

// 16 float32 lanes -> bfloat16, rounded to nearest even (c10::BFloat16's rule), NaN kept a
// quiet NaN. With AVX512-BF16 one vcvtneps2bf16 (as oneDNN's bf16 kernels round), which also
// flushes float32 subnormals (< 1.2e-38) to a signed zero; elsewhere the same rounding on the
// bits, ~8 vector steps (a fifth of an RMSNorm's instructions when it was the only way).
inline void store_bf16x16(void* p, f32x16 v) {
#if defined(__AVX512BF16__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
#else
  const u16x16 narrow = __builtin_convertvector(bf16_bits_on_top(v) >> 16, u16x16);
  std::memcpy(p, &narrow, sizeof narrow);
#endif
}

// v rounded to bfloat16 and widened back to float32 lanes, in registers (store_bf16x16's
// rounding).
inline f32x16 round_bf16x16(f32x16 v) {
#if defined(__AVX512BF16__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  const __m256i narrow = (__m256i)_mm512_cvtneps_pbh(x);
  const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16);
  return bits_to_floats(u32x16(wide));
#else
  return bits_to_floats(bf16_bits_on_top(v));  // in registers (it went through memory)
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// bfloat16 pair arithmetic on any AVX-512 CPU. The kernels multiply bfloat16 two inputs at a
// time into float32 lanes (vdpbf16ps) and round float32 pairs to bfloat16 (vcvtne2ps2bf16);
// both instructions need AVX512-BF16 (Zen 4, Sapphire Rapids and later), which Skylake-X to Ice
// Lake servers lack and which some hypervisors hide from a guest of a CPU that has it (a 2-core
// cloud Xeon of 2026 reported AVX512-VNNI and VBMI but neither AVX512-BF16 nor AMX). Without
// it the same arithmetic takes a few AVX-512F instructions: a bfloat16 widens to float32
// exactly by a shift (even half) or a mask (odd half), the product of two bfloat16 is exact in
// float32, and vdpbf16ps adds the odd product before the even one, each rounded, by Intel's
// description, as two FMAs do: the same results, unless a CPU's instruction rounds the pair's
// sum once (a last float32 bit). The instruction also flushes subnormals to zero (below
// 1.2e-38 the two may differ). tests/test_cpu_bf16_pairs.py compares the two builds.
#define CPU_BF16_PAIRS 1

// acc + a.odd * b.odd + a.even * b.even per 32-bit lane of bfloat16 pairs (vdpbf16ps).
__attribute__((always_inline)) inline __m512 dot_bf16_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i odd = _mm512_set1_epi32(int(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, odd)),
                        _mm512_castsi512_ps(_mm512_and_si512(b, odd)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), acc);
#endif
}

// 32 bfloat16 rounded to nearest even from float32: words 0-15 from lo, 16-31 from hi
// (vcvtne2ps2bf16 hi, lo). The fallback rounds as store_bf16x16 does.
__attribute__((always_inline)) inline __m512i bf16_pairs_from(__m512 hi, __m512 lo) {
#if defined(__AVX512BF16__)
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
#else
  auto round = [](__m512 v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC0)));
  };
  return _mm512_inserti64x4(_mm512_castsi256_si512(round(lo)), round(hi), 1);
#endif
}
#endif

#if defined(__AVX512F__)
// 16 vectors of 16 32-bit lanes transposed in registers: r[i][c] -> r[c][i]. Two interleaving
// stages within 128-bit lanes, then two 128-bit lane shuffles (64 shuffles for 256 lanes).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int m = 0; m < 8; ++m) {
    t[2 * m] = _mm512_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
    t[2 * m + 1] = _mm512_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
  }
  // u[4n + d], 128-bit lane L: column 4L + d of rows 4n .. 4n + 3.
  for (int n = 0; n < 4; ++n) {
    u[4 * n] = _mm512_unpacklo_epi64(t[4 * n], t[4 * n + 2]);
    u[4 * n + 1] = _mm512_unpackhi_epi64(t[4 * n], t[4 * n + 2]);
    u[4 * n + 2] = _mm512_unpacklo_epi64(t[4 * n + 1], t[4 * n + 3]);
    u[4 * n + 3] = _mm512_unpackhi_epi64(t[4 * n + 1], t[4 * n + 3]);
  }
  // Column 4L + d gathers lane L of u[d], u[4 + d], u[8 + d], u[12 + d].
  for (int d = 0; d < 4; ++d) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[d], u[4 + d], 0x88);  // lanes 0, 2
    const __m512i v1 = _mm512_shuffle_i32x4(u[d], u[4 + d], 0xDD);  // lanes 1, 3
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + d], u[12 + d], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + d], u[12 + d], 0xDD);
    r[d] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + d] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[4 + d] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + d] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}
#endif

// A weight stream's lines requested this far ahead into L1 by the few-row products
// (cpu_int4_linear.h, packed_bf16_linear): each thread reads its blocks as one contiguous
// stream, but a layer is short (a 576 x 576 int4 one is 83 KB a thread), and the hardware
// prefetcher's ramp costs ~5-8% of it from DRAM (1 KB ahead: no gain, 16 KB: a little less).
constexpr int64_t STREAM_PREFETCH_BYTES = 4096;

// With many x rows a weight block is read from memory once and then multiplied from L2 tile
// after tile (cpu_pair_tiles.h, packed_bf16_linear): the hardware prefetcher does not run ahead
// across those tiles, so each block's first pass waited on DRAM (~5 ms of a 37 ms pass over
// SmolLM2's layers at 64 rows, 2-core EPYC). So every tile of a block requests its share of
// the thread's next block into L2 (prefetcht1), a line per step of its loop (a burst of them
// at the tile's start gained nothing): next_block_share(next, bytes, tile, tiles).at_step(p).
struct NextBlockShare {
  const char* ahead = nullptr;  // the share's first line
  int64_t lines = 0;            // requested one per step, the first `lines` steps
  // Always inlined: see RowsAhead below.
  __attribute__((always_inline)) void at_step(int64_t step) const {
    if (step < lines) __builtin_prefetch(ahead + step * 64, 0, 2);  // locality 2: prefetcht1
  }
  // Lines per step for a loop of `steps` steps to request the whole share (one, where the
  // share has no more lines than the loop has steps).
  int64_t lines_per(int64_t steps) const { return lines > steps ? (lines + steps - 1) / steps : 1; }
  // Step `step` of such a loop: lines step * per .. step * per + per - 1.
  __attribute__((always_inline)) void at_step(int64_t step, int64_t per) const {
    for (int64_t i = step * per; i < step * per + per; ++i) at_step(i);
  }
};

// Tile `tile` of `tiles`' share of the next block's `next_bytes` at `next` (none if nullptr).
inline NextBlockShare next_block_share(const char* next, int64_t next_bytes, int64_t tile,
                                       int64_t tiles) {
  if (next == nullptr) return {};
  const int64_t lines = (next_bytes + 63) / 64, first = lines * tile / tiles;
  return {next + first * 64, lines * (tile + 1) / tiles - first};
}

// A tile of up to TILE bfloat16 x rows (starting at row m0 of M) over one output block starting
// at column n0: each x row seen as (x(k), x(k + 1)) pairs in 32-bit units, the operand
// vdpbf16ps broadcasts, and where the row's outputs go. For the bf16-pair kernels
// (cpu_int4_linear.h, cpu_pair_tiles.h).
template <int TILE>
struct PairTile {
  int rows = 0;
  const uint32_t* x_pairs[TILE];
  c10::BFloat16* out[TILE];
  PairTile(const c10::BFloat16* x, int64_t K, int64_t M, int64_t m0, c10::BFloat16* y, int64_t N,
           int64_t n0) {
    rows = int(M - m0 < TILE ? M - m0 : TILE);
    for (int i = 0; i < rows; ++i) {
      x_pairs[i] = reinterpret_cast<const uint32_t*>(x + (m0 + i) * K);
      out[i] = y + (m0 + i) * N + n0;
    }
  }
};

inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, c10::BFloat16* dst) { *dst = c10::BFloat16(x); }  // RNE
inline void from_float(float x, c10::Half* dst) { *dst = c10::Half(x); }

// float32 lanes -> 16 values of T (load16 the other way).
inline void store16(float* p, f32x16 v) { store_vec(p, v); }
inline void store16(c10::BFloat16* p, f32x16 v) { store_bf16x16(p, v); }
inline void store16(c10::Half* p, f32x16 v) {
  for (int i = 0; i < LANES; ++i) from_float(v[i], &p[i]);
}

// Paged K/V rows requested ahead of use, into L2 (prefetcht1): a request's blocks sit anywhere
// in the pool and the hardware prefetcher does not follow the jump to the next one; into L1,
// a scattered 2 KB read stalled at ~9 GB/s per core, into L2 it reaches ~15 (2-6 blocks ahead
// measured alike). While the block at key position `start` is computed, the block
// prefetch_blocks(block_size) further is requested one row per row computed
// (rows_ahead(...).at(t)), not in a burst at the block's first row: the burst's 64 prefetches
// (K and V, 16 rows of two lines) queued behind each other and stalled the arithmetic after
// them; spread, the decode kernel ran ~8-10 % faster from DRAM (benchmarks.cpu_attention, 2-core
// EPYC, 2026-12-06; a distance of 2 or 5 blocks of 16 was slower). The blocks between a
// sequence's first and that distance are requested at its start (prefetch_first_blocks).
// `head`: one KV head's rows of block 0; strides and row size in bytes. Always inlined: GCC 12
// treats a function whose only effect is a prefetch as side-effect free and deletes the calls
// it has not inlined (objdump showed a kernel with none left, 1.6x slower on scattered blocks).
//
// The distance is PREFETCH_KEYS keys, rounded up to whole blocks: 3 blocks of 16, 2 of 32, 1 of
// 64 or 128. Three blocks whatever their size had a sequence of ~400 keys in 128-key blocks
// requested whole at its start (768 lines for K and V), and made 64- and 128-key blocks slower
// than 16-key ones: 0.99-1.06 and 1.18-1.22 ms a layer against 0.84-0.90; with the distance in
// keys, 0.80-0.85 and 0.87-0.93 (benchmarks.cpu_attention --block-size, 2-core EPYC,
// 2026-12-07, medians, separate runs).
constexpr int PREFETCH_KEYS = 48;
__attribute__((always_inline)) inline int prefetch_blocks(int block_size) {
  return (PREFETCH_KEYS + block_size - 1) / block_size;
}

struct RowsAhead {
  const char* block = nullptr;  // the block's rows (nullptr: past the context)
  int rows = 0;                 // its rows inside the context
  int64_t token_bytes = 0, row_bytes = 0;
  __attribute__((always_inline)) void at(int t) const {
    if (t >= rows) return;
    for (int64_t line = 0; line < row_bytes; line += 64) {
      __builtin_prefetch(block + t * token_bytes + line, 0, 2);  // locality 2: prefetcht1
    }
  }
};

// Block `index` of a sequence's table, as RowsAhead (no rows if it starts past ctx).
__attribute__((always_inline)) inline RowsAhead block_rows(const char* head, int64_t block_bytes,
                                                           int64_t token_bytes, int64_t row_bytes,
                                                           const int32_t* table, int block_size,
                                                           int ctx, int index) {
  const int first = index * block_size;
  if (first >= ctx) return {};
  const int rows = ctx - first < block_size ? ctx - first : block_size;
  return {head + table[index] * block_bytes, rows, token_bytes, row_bytes};
}

// The block prefetch_blocks(block_size) past the one starting at key position `start`.
__attribute__((always_inline)) inline RowsAhead rows_ahead(const char* head, int64_t block_bytes,
                                                           int64_t token_bytes, int64_t row_bytes,
                                                           const int32_t* table, int block_size,
                                                           int ctx, int start) {
  return block_rows(head, block_bytes, token_bytes, row_bytes, table, block_size, ctx,
                    start / block_size + prefetch_blocks(block_size));
}

// Blocks 0 .. prefetch_blocks - 1 of a sequence, at its start (rows_ahead covers the rest).
// Block 0 too: the decode kernel reads V's first rows only after a span of keys, too late for
// a demand load to start then.
__attribute__((always_inline)) inline void prefetch_first_blocks(
    const char* head, int64_t block_bytes, int64_t token_bytes, int64_t row_bytes,
    const int32_t* table, int block_size, int ctx) {
  const int blocks = prefetch_blocks(block_size);
  for (int index = 0; index < blocks; ++index) {
    const RowsAhead block =
        block_rows(head, block_bytes, token_bytes, row_bytes, table, block_size, ctx, index);
    for (int t = 0; t < block.rows; ++t) block.at(t);
  }
}

}  // namespace cpu_simd
