// The small per-layer ops of a Llama decoder, fused for CPU: each replaces 3-12 torch ops (and
// as many trips through Python and the dispatcher, ~5 us each). A batch-1 decode step of
// SmolLM2-135M ran ~1,800 torch ops: most of its time outside the matmuls was per-op overhead,
// not arithmetic (README, "Fused ops").
//
//   rms_norm:      out = w * dtype(x * rsqrt(mean(x^2) + eps))       (x widened to float32)
//   add_rms_norm:  residual = dtype(residual + x) in place; out = rms_norm(residual)
//   rope_:         rotate-half RoPE in place on the first `num_heads` heads of each row
//   silu_mul:      out = dtype(silu(gate)) * up, gate_up = [gate | up] per row
//
// The roundings to the model dtype sit where Hugging Face's torch code has them (the residual
// sum, the normalized activations before the weight, silu's output), so bfloat16 runs differ
// from the torch ops only by float32 summation order, RoPE's cos/sin kept in float32 (the
// torch path rounds them to the model dtype first), silu's reciprocal (~1 ulp of float32) and,
// with AVX512-BF16, float32 subnormals rounding to zero (cpu_simd.h, store_bf16x16). Rows are
// independent: parallel over rows, single-threaded for a decode step's few rows (a parallel
// region costs more than the work).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_int4_linear.h"
#include "cpu_int8_act_linear.h"
#include "cpu_int8_rows.h"
#include "cpu_amx_linear.h"  // after the two above: it reuses their pair builders
#include "cpu_f32_tiles.h"
#include "cpu_sample_rows.h"
#include "cpu_simd.h"

namespace {

using namespace cpu_simd;

constexpr int64_t GRAIN_ELEMENTS = 32768;  // per thread: below this a row range runs serially

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_elements));
}

// float32 lanes -> 16 values of T (cpu_simd::load16 the other way).
inline void store16(float* p, f32x16 v) { store_vec(p, v); }
inline void store16(c10::BFloat16* p, f32x16 v) { store_bf16x16(p, v); }
inline void store16(c10::Half* p, f32x16 v) {
  for (int i = 0; i < LANES; ++i) from_float(v[i], &p[i]);
}
// The model dtype's rounding of float32 lanes (identity for float32).
template <typename T>
inline f32x16 round_to(f32x16 v) {
  T tmp[LANES];
  store16(tmp, v);
  return load16(tmp);
}
template <>
inline f32x16 round_to<float>(f32x16 v) {
  return v;
}
template <>
inline f32x16 round_to<c10::BFloat16>(f32x16 v) {
  return round_bf16x16(v);
}

// One row: out = w * dtype(x * rsqrt(mean(x^2) + eps)); x already in float32 lanes (`xf`).
template <typename T>
inline void norm_row(const float* xf, const T* w, T* out, int64_t H, float eps) {
  f32x16 squares{};
  for (int64_t i = 0; i < H; i += LANES) {
    const f32x16 v = load_vec<f32x16>(xf + i);
    squares += v * v;
  }
  const float inv = 1.0f / std::sqrt(hsum(squares) / float(H) + eps);
  for (int64_t i = 0; i < H; i += LANES) {
    const f32x16 normed = round_to<T>(load_vec<f32x16>(xf + i) * inv);
    store16(out + i, load16(w + i) * normed);
  }
}

template <typename T>
void rms_norm_impl(torch::Tensor out, torch::Tensor x, torch::Tensor w, double eps,
                   c10::optional<torch::Tensor> residual) {
  const int64_t rows = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* rp = residual.has_value() ? residual->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, grain_rows(H), [&](int64_t begin, int64_t end) {
    std::vector<float> xf(static_cast<size_t>(H));
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * H;
      for (int64_t i = 0; i < H; i += LANES) {
        f32x16 v = load16(xr + i);
        if (rp) {  // the residual stream: dtype(residual + x), stored back, then normalized
          v = round_to<T>(load16(rp + r * H + i) + v);
          store16(rp + r * H + i, v);
        }
        store_vec(xf.data() + i, v);
      }
      norm_row(xf.data(), wp, op + r * H, H, float(eps));
    }
  });
}

template <typename T>
void rope_impl(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
               int64_t num_heads, int64_t head_dim) {
  const int64_t rows = x.size(0), row_stride = x.stride(0), half = head_dim / 2;
  T* xp = x.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t vec_end = half / LANES * LANES;
  at::parallel_for(0, rows, grain_rows(num_heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + pos[r] * half;
      const float* s = sp + pos[r] * half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x1 = xp + r * row_stride + h * head_dim;
        T* x2 = x1 + half;
        for (int64_t d = 0; d < vec_end; d += LANES) {
          const f32x16 a = load16(x1 + d), b = load16(x2 + d);
          const f32x16 cv = load_vec<f32x16>(c + d), sv = load_vec<f32x16>(s + d);
          store16(x1 + d, a * cv - b * sv);
          store16(x2 + d, b * cv + a * sv);
        }
        for (int64_t d = vec_end; d < half; ++d) {  // head_dim not a multiple of 32
          const float a = to_float(x1[d]), b = to_float(x2[d]);
          from_float(a * c[d] - b * s[d], &x1[d]);
          from_float(b * c[d] + a * s[d], &x2[d]);
        }
      }
    }
  });
}

// 1 / d for d in [1, 2] (silu's denominator): with AVX-512 a 14-bit reciprocal estimate and
// one Newton step (~1 ulp of float32, far inside the bfloat16 rounding that follows), 3 cheap
// instructions instead of a 16-lane division (~16 cycles a vector: silu_mul was bound by it).
inline f32x16 reciprocal_1_to_2(f32x16 d) {
#if defined(__AVX512F__)
  __m512 x;
  std::memcpy(&x, &d, sizeof x);
  const __m512 r = _mm512_rcp14_ps(x);
  // r (2 - d r)
  const __m512 refined = _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
  f32x16 out;
  std::memcpy(&out, &refined, sizeof out);
  return out;
#else
  return 1.0f / d;
#endif
}

// silu(g) = g * sigmoid(g); sigmoid through exp(-|g|) <= 1, which cannot overflow, so the
// denominator 1 + e is in [1, 2].
inline f32x16 silu(f32x16 g) {
  const f32x16 e = exp_nonpositive(g < 0 ? g : -g);
  const f32x16 sigmoid = (g < 0 ? e : 1.0f + f32x16{}) * reciprocal_1_to_2(1.0f + e);
  return g * sigmoid;
}

template <typename T>
void silu_mul_impl(torch::Tensor out, torch::Tensor gate_up) {
  const int64_t rows = gate_up.size(0), I = out.size(1);
  const T* gp = gate_up.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gp + r * 2 * I;
      for (int64_t i = 0; i < I; i += LANES) {
        store16(op + r * I + i, round_to<T>(silu(load16(g + i))) * load16(g + I + i));
      }
    }
  });
}

// Each row's argmax, torch.argmax's rule: the first index of the largest value, a NaN counting
// as larger than anything (the first NaN wins). For greedy sampling straight from the LM head's
// 16-bit logits: torch widened [64, 49152] bfloat16 logits to float32 and ran max(dim) on them,
// ~3 ms of a batch-64 decode step on 2 Xeon cores. Per lane the first strict maximum and its
// index, then the lanes reduced (largest value, smallest index among equals).
template <typename T>
void rows_argmax_impl(torch::Tensor out, torch::Tensor x) {
  const int64_t rows = x.size(0), V = x.size(1), row_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t vec_end = V / LANES * LANES;
  at::parallel_for(0, rows, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * row_stride;
      f32x16 best = f32x16{} - __builtin_inff();
      i32x16 best_at = i32x16{} - 1;
      i32x16 at{};
      for (int i = 0; i < LANES; ++i) at[i] = i;
      i32x16 unordered{};  // all ones in a lane that saw a NaN
      for (int64_t i = 0; i < vec_end; i += LANES) {
        const f32x16 v = load16(row + i);
        const i32x16 greater = v > best;  // all ones where v is a new strict maximum
        best = greater ? v : best;
        best_at = greater ? at : best_at;
        at += LANES;
        unordered |= v != v;
      }
      bool nan = false;
      for (int i = 0; i < LANES; ++i) nan |= unordered[i] != 0;
      float top = -__builtin_inff();
      int64_t index = -1;
      for (int i = 0; i < LANES; ++i) {
        if (best_at[i] >= 0 && (best[i] > top || (best[i] == top && best_at[i] < index))) {
          top = best[i];
          index = best_at[i];
        }
      }
      for (int64_t i = vec_end; i < V; ++i) {
        const float v = to_float(row[i]);
        nan |= v != v;
        if (v > top) {
          top = v;
          index = i;
        }
      }
      if (nan) {  // rare (a broken model): the first NaN, as torch.argmax
        for (int64_t i = 0; i < V; ++i) {
          const float v = to_float(row[i]);
          if (v != v) {
            index = i;
            break;
          }
        }
      }
      op[r] = index < 0 ? 0 : index;  // a row of -inf only: index 0, as torch
    }
  });
}

// --- dequantization for the many-rows path of quantized linears (engine/runner/quant) ---
// At many rows a quantized layer multiplies by its weight dequantized into a 16-bit scratch
// (the weight-only kernels are compute-bound there). The torch path took ~8 passes over the
// 16-bit size (unpack, two strided copies, a cast, a scale, an offset); these take one.

// int4 (kernels/int4_pack.py's layout, whole 64-row blocks) -> the TRANSPOSED weight
// wt [K, N] (y = x @ wt): one packed k of a block holds its 64 rows' values, which are 64
// consecutive elements of wt's row k, so every store is a whole vector. w = q * s + o with
// o = zf - 8 s per (group, row), converted once per group and block.
template <typename T>
void dequant_int4_impl(torch::Tensor wt, torch::Tensor packed, torch::Tensor scale_and_zero,
                       int64_t group_size, int64_t row_start, int64_t rows) {
  const int64_t K = wt.size(0), N = scale_and_zero.size(1), ld = wt.stride(0);
  const int64_t blocks = rows / 64, groups = K / group_size;
  const uint8_t* pk = packed.data_ptr<uint8_t>() + row_start * K / 2;
  const T* sz = scale_and_zero.data_ptr<T>();
  T* out = wt.data_ptr<T>();
  at::parallel_for(0, groups * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float scale[64], offset[64];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, b = item % blocks;
      const int64_t n0 = row_start + b * 64;
      for (int j = 0; j < 64; ++j) {
        scale[j] = to_float(sz[(g * N + n0 + j) * 2]);
        offset[j] = to_float(sz[(g * N + n0 + j) * 2 + 1]) - 8.0f * scale[j];
      }
      const uint8_t* block = pk + b * 64 * K / 2;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        const u8x16 lo = load_vec<u8x16>(block + k * 32), hi = load_vec<u8x16>(block + k * 32 + 16);
        const f32x16 q[4] = {to_floats(u8x16(lo & 15)), to_floats(u8x16(hi & 15)),
                             to_floats(u8x16(lo >> 4)), to_floats(u8x16(hi >> 4))};
        T* dst = out + k * ld + b * 64;
        for (int j = 0; j < 4; ++j) {
          store16(dst + j * LANES, q[j] * load_vec<f32x16>(scale + j * LANES) +
                                       load_vec<f32x16>(offset + j * LANES));
        }
      }
    }
  });
}

// int8 [rows, K] with per-row scales -> w [rows, K] = q * s (one pass, row-major).
template <typename T>
void dequant_int8_impl(torch::Tensor w, torch::Tensor qweight, torch::Tensor scales) {
  const int64_t rows = w.size(0), K = w.size(1);
  const int8_t* q = qweight.data_ptr<int8_t>();
  const T* sp = scales.data_ptr<T>();
  T* out = w.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(K), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float sc = to_float(sp[r]);
      for (int64_t k = 0; k < K; k += LANES) {
        store16(out + r * K + k, to_floats(load_vec<i8x16>(q + r * K + k)) * sc);
      }
    }
  });
}

// --- int8 matrix-vector products for decode's few rows (W8A16) ---
// out [M, N] = x [M, K] @ (q [N, K] * s [N, None]).T, q row-major. A thread takes INT8_ROWS
// weight rows at a time and runs the x rows over them in tiles of up to INT8_TILE_M: each
// weight vector is widened once per tile, and the tile's INT8_TILE_M x INT8_ROWS accumulators
// are independent FMA chains (one chain waits on each FMA's latency). x is widened to float32
// once per call.
constexpr int64_t INT8_ROWS = 4;
constexpr int INT8_TILE_M = 4;
// bfloat16 x rows from which int8_linear and int4_linear multiply with AMX tiles where the CPU
// has them (cpu_amx_linear.h). Measured per SmolLM2 layer shape on a 2-core Xeon (AMX), us,
// few-row kernel vs AMX: int8 at 4 rows qkv 87 vs 41, gate_up 140 vs 111, LM head 2352 vs
// 2083 (the vdpbf16ps rows kernel loses to AMX from its first row count); int4 at 4 rows
// gate_up 89 vs 112, down 53 vs 66, LM head 1462 vs 2107, level at 5, AMX ahead from 6.
constexpr int64_t AMX_INT8_MIN_ROWS = 4;
constexpr int64_t AMX_BF16_MIN_ROWS = 5;  // packed_bf16_linear: see PACKED_GEMV_MAX_ROWS_AMX
constexpr int64_t AMX_INT4_MIN_ROWS = 6;
// Weight rows are requested two blocks ahead, one cache line (INT8_ROWS x 16 bytes) per step:
// four interleaved rows of K bytes are streams too short for the hardware prefetcher (measured
// 6 GB/s per core from DRAM without, 18 with, on a 2-core EPYC).
constexpr int64_t INT8_PREFETCH_BLOCKS = 2;

template <int MR>
inline void int8_tile(const float* x, int64_t K, const int8_t* w, bool prefetch,
                      f32x16 (&acc)[INT8_TILE_M][INT8_ROWS]) {
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < INT8_ROWS; ++j) acc[i][j] = f32x16{};
  }
  const int8_t* ahead = w + INT8_PREFETCH_BLOCKS * INT8_ROWS * K;
  for (int64_t k = 0; k < K; k += LANES) {
    if (prefetch) __builtin_prefetch(ahead + INT8_ROWS * k);
    f32x16 wv[INT8_ROWS];
    for (int j = 0; j < INT8_ROWS; ++j) wv[j] = to_floats(load_vec<i8x16>(w + j * K + k));
    for (int i = 0; i < MR; ++i) {
      const f32x16 xv = load_vec<f32x16>(x + i * K + k);
      for (int j = 0; j < INT8_ROWS; ++j) acc[i][j] += xv * wv[j];
    }
  }
}

template <typename T>
void int8_linear_impl(torch::Tensor out, torch::Tensor x, torch::Tensor qweight,
                      torch::Tensor scales) {
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  std::vector<float> xf(size_t(M * K));
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < M * K; i += LANES) store_vec(&xf[size_t(i)], load16(xp + i));
  const int8_t* q = qweight.data_ptr<int8_t>();
  const T* sp = scales.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t full_blocks = N / INT8_ROWS;
  at::parallel_for(0, full_blocks, 1, [&](int64_t begin, int64_t end) {
    f32x16 acc[INT8_TILE_M][INT8_ROWS];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * INT8_ROWS;
      const int8_t* w = q + n0 * K;
      for (int64_t m0 = 0; m0 < M; m0 += INT8_TILE_M) {
        const int mr = int(std::min<int64_t>(INT8_TILE_M, M - m0));
        const float* xm = &xf[size_t(m0 * K)];
        switch (mr) {
          case 4: int8_tile<4>(xm, K, w, m0 == 0, acc); break;
          case 3: int8_tile<3>(xm, K, w, m0 == 0, acc); break;
          case 2: int8_tile<2>(xm, K, w, m0 == 0, acc); break;
          default: int8_tile<1>(xm, K, w, m0 == 0, acc); break;
        }
        for (int i = 0; i < mr; ++i) {
          for (int j = 0; j < INT8_ROWS; ++j) {
            from_float(hsum(acc[i][j]) * to_float(sp[n0 + j]), op + (m0 + i) * N + n0 + j);
          }
        }
      }
    }
  });
  for (int64_t n = full_blocks * INT8_ROWS; n < N; ++n) {  // N % 4 rows: one chain each
    for (int64_t m = 0; m < M; ++m) {
      f32x16 acc{};
      for (int64_t k = 0; k < K; k += LANES) {
        acc += load_vec<f32x16>(&xf[size_t(m * K + k)]) * to_floats(load_vec<i8x16>(q + n * K + k));
      }
      from_float(hsum(acc) * to_float(sp[n]), op + m * N + n);
    }
  }
}

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

#define DISPATCH_MODEL_DTYPE(dtype, NAME, ...)                                   \
  switch (dtype) {                                                               \
    case at::kFloat: NAME<float>(__VA_ARGS__); break;                            \
    case at::kBFloat16: NAME<c10::BFloat16>(__VA_ARGS__); break;                 \
    case at::kHalf: NAME<c10::Half>(__VA_ARGS__); break;                         \
    default: TORCH_CHECK(false, "float32, float16 or bfloat16 expected");       \
  }

// Checks in C++, not in the Python wrappers: a Python check costs ~3 us per call, more than
// the op itself at decode's few rows. TORCH_CHECK_VALUE raises ValueError in Python.
void check_rows(const char* name, const torch::Tensor& t, bool contiguous) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
                    ": CPU [rows, cols] with a contiguous last dim expected, got ", t.sizes(),
                    " strides ", t.strides(), " on ", t.device());
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                        t.scalar_type() == at::kHalf,
                    name, ": float32, float16 or bfloat16 expected, got ", t.scalar_type());
  TORCH_CHECK_VALUE(!contiguous || t.is_contiguous(), name, ": must be contiguous");
}
void check_like(const char* name, const torch::Tensor& t, const torch::Tensor& like) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.sizes() == like.sizes() &&
                        t.scalar_type() == like.scalar_type() && t.is_contiguous(),
                    name, ": contiguous CPU ", like.scalar_type(), " ", like.sizes(),
                    " expected, got ", t.scalar_type(), " ", t.sizes());
}
void check_norm(const torch::Tensor& x, const torch::Tensor& w) {
  check_rows("x", x, true);
  TORCH_CHECK_VALUE(x.size(1) % LANES == 0, "x: width must be a multiple of ", LANES, ", got ",
                    x.size(1));
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.dim() == 1 && w.size(0) == x.size(1) &&
                        w.scalar_type() == x.scalar_type() && w.is_contiguous(),
                    "weight: contiguous ", x.scalar_type(), " [", x.size(1), "] expected, got ",
                    w.scalar_type(), " ", w.sizes());
}

// The ops allocate their outputs here: at batch 1 a Python-side torch.empty_like cost ~1.5 us,
// several times this allocation, on each of a token's ~90 calls (2-core EPYC).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_norm(x, w);
  torch::Tensor out = at::empty_like(x);
  DISPATCH_MODEL_DTYPE(x.scalar_type(), rms_norm_impl, out, x, w, eps, c10::nullopt)
  return out;
}
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_norm(x, w);
  check_like("residual", residual, x);
  torch::Tensor out = at::empty_like(x);
  DISPATCH_MODEL_DTYPE(x.scalar_type(), rms_norm_impl, out, x, w, eps, residual)
  return out;
}
void rope_(torch::Tensor x, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
           int64_t num_heads, int64_t head_dim) {
  check_rows("x", x, false);
  TORCH_CHECK_VALUE(head_dim > 0 && head_dim % 2 == 0 && num_heads >= 0 &&
                        x.size(1) >= num_heads * head_dim,
                    "x: ", num_heads, " heads of an even head_dim ", head_dim, " expected in ",
                    x.size(1), " columns");
  TORCH_CHECK_VALUE(positions.device().is_cpu() && positions.scalar_type() == at::kLong &&
                        positions.dim() == 1 && positions.size(0) == x.size(0) &&
                        positions.is_contiguous(),
                    "positions: contiguous int64 [", x.size(0), "] expected, got ",
                    positions.scalar_type(), " ", positions.sizes());
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                          t->size(1) == head_dim / 2 && t->is_contiguous() &&
                          t->sizes() == cos.sizes(),
                      "cos/sin: contiguous float32 [positions, ", head_dim / 2, "] expected, got ",
                      t->scalar_type(), " ", t->sizes());
  }
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < positions.size(0); ++r) {
    TORCH_CHECK_VALUE(pos[r] >= 0 && pos[r] < cos.size(0), "positions: ", pos[r],
                      " is outside the table's [0, ", cos.size(0), ")");
  }
  DISPATCH_MODEL_DTYPE(x.scalar_type(), rope_impl, x, positions, cos, sin, num_heads, head_dim)
}
torch::Tensor rows_argmax(torch::Tensor x) {
  check_rows("x", x, false);
  TORCH_CHECK_VALUE(x.size(1) > 0, "x: rows of at least one value expected, got ", x.sizes());
  torch::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  DISPATCH_MODEL_DTYPE(x.scalar_type(), rows_argmax_impl, out, x)
  return out;
}
// One sampled token per row (cpu_sample_rows.h): temperature [R] > 0, top_k [R] (<= 0 off),
// top_p [R] in (0, 1], min_p [R] in [0, 1], uniforms [R] in [0, 1) (float64, one per row).
torch::Tensor rows_sample(torch::Tensor logits, torch::Tensor temperature, torch::Tensor top_k,
                          torch::Tensor top_p, torch::Tensor min_p, torch::Tensor uniforms) {
  check_rows("logits", logits, false);
  const int64_t R = logits.size(0);
  TORCH_CHECK_VALUE(logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31),
                    "logits: rows of 1 to 2^31 - 1 values expected, got ", logits.sizes());
  const std::tuple<const char*, const torch::Tensor*, at::ScalarType> params[] = {
      {"temperature", &temperature, at::kFloat}, {"top_k", &top_k, at::kLong},
      {"top_p", &top_p, at::kFloat}, {"min_p", &min_p, at::kFloat},
      {"uniforms", &uniforms, at::kDouble}};
  for (const auto& [name, t, dtype] : params) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->dim() == 1 && t->size(0) == R &&
                          t->scalar_type() == dtype && t->is_contiguous(),
                      name, ": contiguous CPU ", dtype, " [", R, "] expected, got ",
                      t->scalar_type(), " ", t->sizes());
  }
  std::vector<cpu_sample_rows::Row> rows(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    cpu_sample_rows::Row& row = rows[size_t(r)];
    row = {temperature.data_ptr<float>()[r], top_k.data_ptr<int64_t>()[r],
           top_p.data_ptr<float>()[r], min_p.data_ptr<float>()[r],
           uniforms.data_ptr<double>()[r]};
    TORCH_CHECK_VALUE(row.temperature > 0 && std::isfinite(row.temperature), "temperature: row ",
                      r, " is ", row.temperature, "; sampling needs > 0 (0 is greedy: argmax)");
    TORCH_CHECK_VALUE(row.top_p > 0 && row.top_p <= 1, "top_p: row ", r, " is ", row.top_p,
                      ", outside (0, 1]");
    TORCH_CHECK_VALUE(row.min_p >= 0 && row.min_p <= 1, "min_p: row ", r, " is ", row.min_p,
                      ", outside [0, 1]");
    TORCH_CHECK_VALUE(row.uniform >= 0 && row.uniform < 1, "uniforms: row ", r, " is ",
                      row.uniform, ", outside [0, 1)");
  }
  torch::Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  DISPATCH_MODEL_DTYPE(logits.scalar_type(), cpu_sample_rows::sample_rows_impl, out, logits, rows)
  return out;
}
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows("gate_up", gate_up, true);
  TORCH_CHECK_VALUE(gate_up.size(1) % (2 * LANES) == 0, "gate_up: width must be a multiple of ",
                    2 * LANES, ", got ", gate_up.size(1));
  torch::Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  DISPATCH_MODEL_DTYPE(out.scalar_type(), silu_mul_impl, out, gate_up)
  return out;
}

// An int4 weight as kernels/int4_pack.py lays it out: packed uint8 [N, K/2] with its
// scale_and_zero [K/G, N, 2] and a group size the 16-lane kernels take. Returns (N, K).
std::pair<int64_t, int64_t> check_int4_weight(const torch::Tensor& packed,
                                              const torch::Tensor& scale_and_zero,
                                              int64_t group_size) {
  TORCH_CHECK_VALUE(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                        packed.dim() == 2 && packed.is_contiguous(),
                    "packed: contiguous uint8 [N, K/2] expected, got ", packed.scalar_type(), " ",
                    packed.sizes());
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK_VALUE(group_size > 0 && group_size % LANES == 0 && K % group_size == 0,
                    "group_size: a multiple of 16 dividing K = ", K, " expected, got ",
                    group_size);
  TORCH_CHECK_VALUE(scale_and_zero.device().is_cpu() && scale_and_zero.dim() == 3 &&
                        scale_and_zero.size(0) == K / group_size && scale_and_zero.size(1) == N &&
                        scale_and_zero.size(2) == 2 && scale_and_zero.is_contiguous(),
                    "scale_and_zero: contiguous [K/G, N, 2] expected, got ",
                    scale_and_zero.scalar_type(), " ", scale_and_zero.sizes());
  return {N, K};
}

void dequant_int4(torch::Tensor wt, torch::Tensor packed, torch::Tensor scale_and_zero,
                  int64_t group_size, int64_t row_start, int64_t rows) {
  const auto [N, K] = check_int4_weight(packed, scale_and_zero, group_size);
  TORCH_CHECK_VALUE(row_start >= 0 && rows > 0 && row_start % 64 == 0 && rows % 64 == 0 &&
                        row_start + rows <= N / 64 * 64,
                    "rows: whole 64-row blocks inside N = ", N, " expected, got [", row_start,
                    ", ", row_start + rows, ")");
  TORCH_CHECK_VALUE(wt.device().is_cpu() && wt.dim() == 2 && wt.size(0) == K &&
                        wt.size(1) == rows && wt.stride(1) == 1 &&
                        wt.scalar_type() == scale_and_zero.scalar_type(),
                    "wt: [K, rows] of scale_and_zero's dtype with contiguous rows expected, got ",
                    wt.scalar_type(), " ", wt.sizes());
  DISPATCH_MODEL_DTYPE(wt.scalar_type(), dequant_int4_impl, wt, packed, scale_and_zero,
                       group_size, row_start, rows)
}

void dequant_int8(torch::Tensor w, torch::Tensor qweight, torch::Tensor scales) {
  TORCH_CHECK_VALUE(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar &&
                        qweight.dim() == 2 && qweight.is_contiguous() &&
                        qweight.size(1) % LANES == 0,
                    "qweight: contiguous int8 [rows, K], K a multiple of 16, expected");
  TORCH_CHECK_VALUE(scales.device().is_cpu() && scales.dim() == 1 &&
                        scales.size(0) == qweight.size(0) && scales.is_contiguous(),
                    "scales: contiguous [rows] expected");
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.sizes() == qweight.sizes() && w.is_contiguous() &&
                        w.scalar_type() == scales.scalar_type(),
                    "w: contiguous [rows, K] of the scales' dtype expected");
  DISPATCH_MODEL_DTYPE(w.scalar_type(), dequant_int8_impl, w, qweight, scales)
}

// The few-row products allocate their output here: a torch.empty in Python costs ~1 us, a
// tenth of a small layer's call at batch 1.
// int8_activations_min_rows: as int4_linear's (cpu_int8_act_linear.h, W8A8), for bfloat16 x
// with N and K multiples of 64.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                          int64_t int8_activations_min_rows) {
  check_rows("x", x, true);
  TORCH_CHECK_VALUE(qweight.device().is_cpu() && qweight.scalar_type() == at::kChar &&
                        qweight.dim() == 2 && qweight.is_contiguous() &&
                        qweight.size(1) == x.size(1) && x.size(1) % LANES == 0,
                    "qweight: contiguous int8 [N, K] with x's K (a multiple of 16) expected, got ",
                    qweight.scalar_type(), " ", qweight.sizes(), " for x ", x.sizes());
  TORCH_CHECK_VALUE(scales.device().is_cpu() && scales.dim() == 1 &&
                        scales.size(0) == qweight.size(0) && scales.is_contiguous() &&
                        scales.scalar_type() == x.scalar_type(),
                    "scales: contiguous [N] of x's dtype expected, got ", scales.scalar_type(),
                    " ", scales.sizes());
  torch::Tensor out = at::empty({x.size(0), qweight.size(0)}, x.options());
#if defined(CPU_INT8_ACT_LINEAR)
  if (int8_activations_min_rows > 0 && x.size(0) >= int8_activations_min_rows &&
      x.scalar_type() == at::kBFloat16 && qweight.size(0) % cpu_int8_act_linear::BLOCK_ROWS == 0 &&
      x.size(1) % cpu_int8_act_linear::INT8_WEIGHT_ACT_GROUP == 0) {
    cpu_int8_act_linear::linear_int8(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                     x.size(0), x.size(1), qweight.data_ptr<int8_t>(),
                                     scales.data_ptr<c10::BFloat16>(), qweight.size(0));
    return out;
  }
#endif
#if defined(CPU_AMX_LINEAR)
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= AMX_INT8_MIN_ROWS &&
      qweight.size(0) % cpu_amx_linear::TILE_ROWS == 0 &&
      x.size(1) % cpu_amx_linear::K_STEP == 0 && cpu_amx_linear::tiles_permitted()) {
    cpu_amx_linear::linear_int8(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                x.size(0), x.size(1), qweight.data_ptr<int8_t>(),
                                scales.data_ptr<c10::BFloat16>(), qweight.size(0));
    return out;
  }
#endif
#if defined(CPU_INT8_ROWS)
  // From 5 bfloat16 rows (DOT_MIN_M) the weight rows widened to bf16 once and vdpbf16ps dot
  // products, from 32 x as the per-lane operand (cpu_int8_rows.h); at 4 rows the FMA kernel
  // below is ahead (6.9 against 8.3 ms over SmolLM2's decoder layers, 2-core EPYC). Without
  // AVX512-BF16 the FMA kernel keeps up to 12 rows, then float32 blocks (MIN_M).
  if (x.scalar_type() == at::kBFloat16 && x.size(0) >= cpu_int8_rows::MIN_M &&
      qweight.size(0) % cpu_int8_rows::W_ROWS == 0 && x.size(1) % cpu_int8_rows::K_STEP == 0) {
    cpu_int8_rows::linear(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.size(0),
                          x.size(1), qweight.data_ptr<int8_t>(), scales.data_ptr<c10::BFloat16>(),
                          qweight.size(0));
    return out;
  }
#endif
  DISPATCH_MODEL_DTYPE(x.scalar_type(), int8_linear_impl, out, x, qweight, scales)
  return out;
}

// True where this build has cpu_int8_rows.h (AVX-512 F and BW): int8_linear then takes many
// bfloat16 rows there (Int8Linear moves its dequantize switch up to match).
bool has_int8_rows_linear() {
#if defined(CPU_INT8_ROWS)
  return true;
#else
  return false;
#endif
}

// True where this build has cpu_amx_linear.h (AMX tiles) and Linux lets this process use them:
// int8_linear, int4_linear and packed_bf16_linear then multiply many bfloat16 rows with AMX
// (AMX_*_MIN_ROWS).
bool has_amx_linear() {
#if defined(CPU_AMX_LINEAR)
  return cpu_amx_linear::tiles_permitted();
#else
  return false;
#endif
}

// True where this build has the bfloat16 int4 kernel (cpu_int4_linear.h: AVX-512 with VBMI).
bool has_int4_linear() {
#if defined(CPU_INT4_LINEAR)
  return true;
#else
  return false;
#endif
}

// True where this build has the W8A8 / W4A8 kernels (cpu_int8_act_linear.h: AVX512-VNNI, BW,
// VBMI).
bool has_int8_act_linear() {
#if defined(CPU_INT8_ACT_LINEAR)
  return true;
#else
  return false;
#endif
}

// int8_activations_min_rows: from this many rows (0: never) x is quantized to int8 per group
// and multiplied with vpdpbusd (cpu_int8_act_linear.h) where this CPU has it.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_and_zero,
                          int64_t group_size, int64_t int8_activations_min_rows) {
  TORCH_CHECK_VALUE(has_int4_linear(),
                    "int4_linear: this CPU lacks AVX-512 (F, BW) or AVX512-VBMI");
  check_rows("x", x, true);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, "x: bfloat16 expected, got ",
                    x.scalar_type());
  const int64_t M = x.size(0);
  const auto [N, K] = check_int4_weight(packed, scale_and_zero, group_size);
  TORCH_CHECK_VALUE(K == x.size(1) && N % 64 == 0,
                    "packed: contiguous uint8 [N, K/2], N a multiple of 64, for x ", x.sizes(),
                    " expected, got ", packed.sizes());
  TORCH_CHECK_VALUE(scale_and_zero.scalar_type() == at::kBFloat16,
                    "scale_and_zero: contiguous bfloat16 [K/G, N, 2] expected, got ",
                    scale_and_zero.scalar_type(), " ", scale_and_zero.sizes());
  torch::Tensor out = at::empty({M, N}, x.options());
#if defined(CPU_INT8_ACT_LINEAR)
  if (int8_activations_min_rows > 0 && M >= int8_activations_min_rows && group_size % 16 == 0) {
    cpu_int8_act_linear::linear_int4(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                     M, K, packed.data_ptr<uint8_t>(),
                                     scale_and_zero.data_ptr<c10::BFloat16>(), N, group_size);
    return out;
  }
#endif
#if defined(CPU_AMX_LINEAR)
  if (M >= AMX_INT4_MIN_ROWS && K % cpu_amx_linear::K_STEP == 0 && group_size % 2 == 0 &&
      cpu_amx_linear::tiles_permitted()) {
    cpu_amx_linear::linear_int4(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), M, K,
                                packed.data_ptr<uint8_t>(),
                                scale_and_zero.data_ptr<c10::BFloat16>(), N, group_size);
    return out;
  }
#endif
#if defined(CPU_INT4_LINEAR)
  cpu_int4_linear::linear(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), M, K,
                          packed.data_ptr<uint8_t>(),
                          scale_and_zero.data_ptr<c10::BFloat16>(), N, group_size);
#endif
  return out;
}

// weight_address: the packed weight's data (torch.ops.mkldnn.data_ptr of the module's packed
// buffer, which owns it and never moves); N, K its logical shape, layout checked at load.
torch::Tensor packed_bf16_linear(torch::Tensor x, int64_t weight_address, int64_t N,
                                 int64_t K) {
  check_rows("x", x, true);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16 && x.size(1) == K && K % 2 == 0 &&
                        x.size(0) >= 1,
                    "x: bfloat16 [rows, ", K, "] expected, got ", x.scalar_type(), " ",
                    x.sizes());
  TORCH_CHECK_VALUE(N > 0 && N % PACK_ROWS == 0 && weight_address != 0,
                    "weight: N a multiple of 64 and a packed buffer expected, got N = ", N);
  torch::Tensor out = at::empty({x.size(0), N}, x.options());
  packed_bf16_linear_impl(out, x, reinterpret_cast<const c10::BFloat16*>(weight_address), N);
  return out;
}

}  // namespace

#include "cpu_decode_step.h"  // after the ops: its layer loop calls them

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * w");
  m.def("add_rms_norm", &add_rms_norm, "residual += x (in place); out = RMSNorm(residual) * w");
  m.def("rope_", &rope_, "rotate-half RoPE in place on the first num_heads heads of each row");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("rows_argmax", &rows_argmax, "each row's first index of its max (NaN counts as the max)");
  m.def("rows_sample", &rows_sample,
        "one sampled token per row: temperature, min-p, top-k, top-p, one uniform a row");
  m.def("dequant_int4", &dequant_int4, "int4 blocks -> the transposed 16/32-bit weight [K, rows]");
  m.def("dequant_int8", &dequant_int8, "int8 rows * per-row scales -> 16/32-bit rows");
  m.def("int8_linear", &int8_linear, "x @ (int8 weight * per-row scales).T for a few rows",
        pybind11::arg("x"), pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("int8_activations_min_rows") = 0);
  m.def("has_int4_linear", &has_int4_linear, "whether int4_linear runs on this CPU");
  m.def("has_int8_rows_linear", &has_int8_rows_linear,
        "whether int8_linear multiplies many bfloat16 rows with cpu_int8_rows.h here");
  m.def("has_amx_linear", &has_amx_linear,
        "whether int8_linear, int4_linear and packed_bf16_linear multiply many bfloat16 rows "
        "with AMX tiles here");
  m.def("int4_linear", &int4_linear,
        "x (bfloat16) @ W.T for few rows, W int4 in kernels/int4_pack.py's 64-row blocks",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale_and_zero"),
        pybind11::arg("group_size"), pybind11::arg("int8_activations_min_rows") = 0);
  m.def("has_int8_act_linear", &has_int8_act_linear,
        "whether int8_linear and int4_linear can take int8 activations (AVX512-VNNI) here");
  m.def("packed_bf16_linear", &packed_bf16_linear,
        "x @ W.T for few rows, W bfloat16 in oneDNN's 64-row, pairs-of-inputs packed layout");
  namespace step = cpu_decode_step;
  // module_local: another build of this extension in the same process (tests build variants,
  // tests/test_cpu_bf16_pairs.py) registers its own types of the same names.
  pybind11::class_<step::Linear>(
      m, "StepLinear", pybind11::module_local(),
      "a linear layer's few-row kernel with its weights, for DecodeStep");
  m.def("packed_bf16_call", &step::packed_bf16_call,
        "packed_bf16_linear's weights as a StepLinear");
  m.def("int8_call", &step::int8_call, "int8_linear's weights as a StepLinear",
        pybind11::arg("qweight"), pybind11::arg("scales"),
        pybind11::arg("int8_activations_min_rows") = 0);
  m.def("int4_call", &step::int4_call, "int4_linear's weights as a StepLinear",
        pybind11::arg("packed"), pybind11::arg("scale_and_zero"), pybind11::arg("group_size"),
        pybind11::arg("int8_activations_min_rows") = 0);
  pybind11::class_<step::DecodeStep>(m, "DecodeStep", pybind11::module_local(),
                                     "a decoder pass of few rows in one call (cpu_decode_step.h)")
      .def(pybind11::init<const pybind11::capsule&, int64_t, int64_t, int64_t, double,
                          torch::Tensor, double>())
      .def("add_layer", &step::DecodeStep::add_layer)
      // The GIL is released while the layers run: the server's and UI's Python threads go on.
      .def("forward", &step::DecodeStep::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
