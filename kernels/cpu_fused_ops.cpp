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
//
// Where the code is: those ops' loops and the weight dequantizations in cpu_row_ops.h, the
// products with a prepacked bf16 weight in cpu_packed_bf16.h, the quantized products and the
// sampler in their own headers (kernels/README.md lists them); this file has the int8 few-row
// products, the argument checks (in C++: cheaper than in Python at decode's few rows) and the
// Python bindings.

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

#include "cpu_amx_linear.h"
#include "cpu_f32_tiles.h"
#include "cpu_int4_linear.h"
#include "cpu_int8_act_linear.h"
#include "cpu_int8_rows.h"
#include "cpu_packed_bf16.h"
#include "cpu_row_ops.h"
#include "cpu_sample_rows.h"
#include "cpu_simd.h"

namespace {

using namespace cpu_simd;
using namespace cpu_row_ops;      // rms_norm_impl & co., the dequantizations
using namespace cpu_packed_bf16;  // packed_bf16_linear_impl

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
