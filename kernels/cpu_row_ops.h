// The per-row ops of cpu_fused_ops.cpp: RMSNorm (with its residual add), RoPE, SiLU-and-mul,
// each row's argmax, and the one-pass dequantization of int4 / int8 weights for the many-rows
// path of quantized linears. cpu_fused_ops.cpp says what each op replaces and where its
// roundings sit; this header holds their loops, templated on the model dtype.
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_simd.h"

namespace cpu_row_ops {

using namespace cpu_simd;

constexpr int64_t GRAIN_ELEMENTS = 32768;  // per thread: below this a row range runs serially

inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(1, row_elements));
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

}  // namespace cpu_row_ops
