// A sampled token per row of logits, in one pass per row: temperature, min-p, top-k, top-p and
// the inverse-transform draw of engine/runner/sampler.py (logits_to_probs + draw_tokens), on
// the LM head's logits as they are (float32 / bfloat16 / float16), for CPU. Included by
// cpu_fused_ops.cpp.
//
// Why: the playground's chat samples every token at temperature 0.7 with top-p 0.95. The torch
// path for it widens the row, divides it, runs a softmax, torch.topk(256), a dozen small ops on
// the candidates, a scatter into a zeroed [rows, vocab] tensor and the draw's passes over it:
// ~0.45 ms for one row of SmolLM2's 49,152 logits, 4 % of a bf16 token and 12 % of an int4 one
// (2-core EPYC), and ~10 ms for 64 rows. Here 0.07-0.10 ms and ~3 ms (docs/measurements/
// sampling.md).
//
// The same distribution, computed differently:
// - Softmax's normalization cancels out of every decision. With m the row's max of l / T and
//   e = exp(l / T - m), the most likely token has e = 1, so min-p drops e < min_p, and top-p's
//   prefix and the draw compare masses of e. So e is computed once, in a per-thread scratch
//   row, with the masses of blocks of DRAW_BLOCK tokens and, for top-k / top-p rows, how many
//   tokens reach each of LEVELS power-of-two thresholds, in the same vector pass.
// - top-k / top-p rank only the candidates: the tokens at or above the highest threshold that
//   `width` (max(256, top_k)) tokens reach. They are ranked lazily (nth_element, then a sort
//   of the next 64, 128, ... as the walk needs them: top-p's prefix is usually a few dozen of
//   a few thousand) and walked as the torch path's cumsum does. A row whose prefix reaches
//   past them (a flatter distribution) takes the next threshold down, and past the last one
//   every token with mass.
// - The draw: the first token, in vocabulary order, whose running mass (float64) exceeds
//   u x the kept mass, u the request's one uniform drawn in Python (its generator, so a seeded
//   request draws the same whatever shares its batch). An unfiltered row finds its block of
//   DRAW_BLOCK tokens from the block masses first.
// Rounding differs from the torch path (the exp, float64 sums instead of float32 ones), so a u
// within ~1e-6 of a boundary between two tokens can pick the neighbour: the chance of every
// token is the same to that precision. exp of l / T - m below -87 counts as 0 (a token under
// ~1e-38 of the top one's chance; torch's softmax keeps it as a float32 denormal).
#pragma once

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace cpu_sample_rows {

using cpu_simd::f32x16;
using cpu_simd::LANES;

constexpr int64_t TOP_CANDIDATES = 256;  // engine/runner/sampler.py's TOP_CANDIDATES
constexpr int64_t DRAW_BLOCK = 512;      // tokens a block of the draw's first level
constexpr float EXP_LOWEST = -87.0f;     // cpu_simd::exp_nonpositive's clamp
// Candidate thresholds on e (powers of two, highest first): the highest one that at least
// `width` tokens reach picks the candidates (the next one down when top-p's prefix runs past
// them); a row none of them serves ranks every token with mass.
constexpr int LEVELS = 8;
constexpr float LEVEL[LEVELS] = {0x1p-2f, 0x1p-4f, 0x1p-6f, 0x1p-8f,
                                 0x1p-11f, 0x1p-14f, 0x1p-18f, 0x1p-24f};

struct Row {
  float temperature;
  int64_t top_k;  // <= 0: off
  float top_p;    // 1: off
  float min_p;    // 0: off
  double uniform;  // in [0, 1)
};

// What a row's sampling found wrong, for the error message (0: nothing).
enum Problem : int { kFine = 0, kNaN = 1, kNoMass = 2 };

struct Scratch {
  std::vector<float> e;            // the row's e, padded to whole DRAW_BLOCKs with zeros
  std::vector<double> block_mass;  // sum of e per DRAW_BLOCK
  std::vector<int32_t> candidates;
  std::vector<int32_t> kept;
};

// The largest double below x (x > 0): the draw's target stays under the kept mass, so some
// token with mass is always past it (u x total can round up to total when u is near 1).
inline double below(double x) { return std::nextafter(x, 0.0); }

// Fills s.e with e = exp(l / T - m) for the row (0 where it underflows or min-p drops it) and
// s.block_mass with its sums per DRAW_BLOCK; returns the mass sum(e). With `counts` (top-k /
// top-p rows), counts[j] = the tokens with e >= LEVEL[j].
template <typename T>
double exps(const T* logits, int64_t V, const Row& row, Scratch& s, int64_t* counts,
            Problem* problem) {
  const int64_t blocks = (V + DRAW_BLOCK - 1) / DRAW_BLOCK, padded = blocks * DRAW_BLOCK;
  s.e.assign(size_t(padded), 0.f);
  s.block_mass.assign(size_t(blocks), 0.0);
  float* e = s.e.data();
  // l / T as the torch path divides (a float32 division, not a multiply by 1 / T).
  const int64_t vec_end = V / LANES * LANES;
  const f32x16 temperature = f32x16{} + row.temperature;
  f32x16 max_lanes = f32x16{} - std::numeric_limits<float>::infinity();
  cpu_simd::i32x16 unordered{};
  for (int64_t i = 0; i < vec_end; i += LANES) {
    const f32x16 x = cpu_simd::load16(logits + i) / temperature;
    cpu_simd::store_vec(e + i, x);
    max_lanes = x > max_lanes ? x : max_lanes;
    unordered |= x != x;
  }
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  for (int i = 0; i < LANES; ++i) {
    m = max_lanes[i] > m ? max_lanes[i] : m;
    nan |= unordered[i] != 0;
  }
  for (int64_t i = vec_end; i < V; ++i) {
    const float x = cpu_simd::to_float(logits[i]) / row.temperature;
    e[i] = x;
    nan |= x != x;
    m = x > m ? x : m;
  }
  if (nan) {
    *problem = kNaN;
    return 0;
  }
  if (!(m > -std::numeric_limits<float>::infinity()) || std::isinf(m)) {
    *problem = kNoMass;  // every logit -inf, or an infinite one: no finite distribution
    return 0;
  }
  for (int64_t i = vec_end; i < V; ++i) e[i] -= m;  // the tail, shifted like the vectors below
  const f32x16 max_v = f32x16{} + m, lowest = f32x16{} + EXP_LOWEST, zero = f32x16{};
  // min-p: under min_p x the top token's chance (e = 1).
  const f32x16 min_p = f32x16{} + row.min_p;
  cpu_simd::i32x16 level_counts[LEVELS] = {};
  double total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    f32x16 mass{};
    const int64_t begin = b * DRAW_BLOCK, end = std::min(V, begin + DRAW_BLOCK);
    for (int64_t i = begin; i < end; i += LANES) {
      // Past vec_end (V not a multiple of 16): the tail already holds l / T - m, the padding 0
      // (its e is set to 0 below, as it holds no token).
      const f32x16 x = i < vec_end ? cpu_simd::load_vec<f32x16>(e + i) - max_v
                                   : cpu_simd::load_vec<f32x16>(e + i);
      f32x16 v = cpu_simd::exp_nonpositive(x);
      v = x < lowest ? zero : v;
      v = v < min_p ? zero : v;
      if (i + LANES > V) {
        for (int64_t lane = V - i; lane < LANES; ++lane) v[lane] = 0.f;
      }
      cpu_simd::store_vec(e + i, v);
      mass += v;
      if (counts != nullptr) {
        for (int j = 0; j < LEVELS; ++j) level_counts[j] -= v >= LEVEL[j];
      }
    }
    s.block_mass[size_t(b)] = cpu_simd::hsum(mass);
    total += s.block_mass[size_t(b)];
  }
  if (counts != nullptr) {
    for (int j = 0; j < LEVELS; ++j) {
      counts[j] = 0;
      for (int lane = 0; lane < LANES; ++lane) counts[j] += level_counts[j][lane];
    }
  }
  return total;
}

// The kept tokens of a filtered row into s.kept (any order), their mass returned, ranking the
// tokens at or above LEVEL[level] (level == LEVELS: every token with mass).
inline double keep_top(const Row& row, int64_t V, double total, int level, Scratch& s,
                       bool* reached_past) {
  const float* e = s.e.data();
  const int64_t k = row.top_k > 0 && row.top_k < V ? row.top_k : V;
  const float threshold = level < LEVELS ? LEVEL[level] : 0.f;
  s.candidates.clear();
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 at a time, a lane mask each: most of a peaked row's vectors hold no candidate.
  const __m512 floor_v = _mm512_set1_ps(threshold > 0.f ? threshold : 0x1p-149f);  // e > 0
  for (; i + LANES <= V; i += LANES) {
    for (uint32_t hits = _mm512_cmp_ps_mask(_mm512_loadu_ps(e + i), floor_v, _CMP_GE_OQ); hits;
         hits &= hits - 1) {
      s.candidates.push_back(int32_t(i + __builtin_ctz(hits)));
    }
  }
#endif
  for (; i < V; ++i) {
    if (e[i] > 0.f && e[i] >= threshold) s.candidates.push_back(int32_t(i));
  }
  const bool every_token = threshold == 0.f;  // every token with mass is a candidate
  // Ranked lazily: top-p's prefix is usually a few dozen tokens of a few thousand candidates,
  // so candidates[0, ranked) are put in order only as far as the walk below goes.
  const auto by_rank = [e](int32_t a, int32_t b) { return e[a] > e[b] || (e[a] == e[b] && a < b); };
  const auto first = s.candidates.begin(), last = s.candidates.end();
  const int64_t n = int64_t(s.candidates.size());
  int64_t ranked = 0;
  const auto rank_upto = [&](int64_t upto) {
    upto = std::min(upto, n);
    if (upto <= ranked) return;
    if (upto < n) std::nth_element(first + ranked, first + upto, last, by_rank);
    std::sort(first + ranked, first + upto, by_rank);
    ranked = upto;
  };
  // top-k's mass when it cuts the row (the torch path: the first k of the ranked row), else
  // the whole row's; top-p's prefix is measured against it.
  double kept_total = total;
  if (k < V) {
    if (k > n && !every_token) {
      *reached_past = true;
      return 0;
    }
    if (k < n) std::nth_element(first, first + k, last, by_rank);  // the k best in front
    kept_total = 0;
    for (int64_t j = 0; j < std::min(k, n); ++j) kept_total += e[s.candidates[size_t(j)]];
  }
  const double reach = double(row.top_p) * kept_total;
  const bool top_p = row.top_p < 1.f;
  s.kept.clear();
  double before = 0;  // mass of the ranked tokens before this one
  int64_t j = 0;
  for (; j < std::min(k, n); ++j) {
    if (top_p && before >= reach) break;  // the prefix reached top_p: the rest is dropped
    if (j == ranked) rank_upto(std::max<int64_t>(64, 2 * ranked));
    const int32_t token = s.candidates[size_t(j)];
    s.kept.push_back(token);
    before += e[token];
  }
  if (j == n && j < k && !every_token && top_p && before < reach) {
    *reached_past = true;  // the prefix goes on past the candidates
    return 0;
  }
  return before;
}

// The row's token: inverse transform over `tokens` (vocabulary order) with masses e.
inline int64_t draw(const float* e, const int32_t* tokens, int64_t n, double mass, double u) {
  const double target = std::min(u * mass, below(mass));
  double running = 0;
  int64_t last_with_mass = -1;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t token = tokens[j];
    if (e[token] <= 0.f) continue;
    running += e[token];
    last_with_mass = token;
    if (running > target) return token;
  }
  return last_with_mass;  // float64 sums in another order than `mass`: the last with mass
}

// An unfiltered row's token: every token with its mass, in vocabulary order, the block of
// DRAW_BLOCK tokens found from the block masses first, then the token inside it.
inline int64_t draw_unfiltered(const Scratch& s, int64_t V, double total, double u) {
  const double target = std::min(u * total, below(total));
  double running = 0;
  size_t b = 0;
  while (b + 1 < s.block_mass.size() && running + s.block_mass[b] <= target) {
    running += s.block_mass[b++];
  }
  const float* e = s.e.data();
  int64_t token = -1;
  const int64_t block_end = std::min(V, int64_t(b + 1) * DRAW_BLOCK);
  for (int64_t i = int64_t(b) * DRAW_BLOCK; i < block_end; ++i) {
    if (e[i] <= 0.f) continue;
    running += e[i];
    token = i;
    if (running > target) return token;
  }
  // The block sums rounded another way than this scan's: the last token with mass.
  for (int64_t i = V - 1; token < 0 && i >= 0; --i) token = e[i] > 0.f ? i : -1;
  return token;
}

template <typename T>
void sample_rows_impl(torch::Tensor out, torch::Tensor logits, const std::vector<Row>& rows) {
  const int64_t R = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  const T* lp = logits.data_ptr<T>();
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<int> problems(size_t(R), kFine);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    static thread_local Scratch s;
    for (int64_t r = begin; r < end; ++r) {
      const Row& row = rows[size_t(r)];
      int64_t counts[LEVELS] = {};
      Problem problem = kFine;
      const bool filtered = (row.top_k > 0 && row.top_k < V) || row.top_p < 1.f;
      const double total = exps(lp + r * stride, V, row, s, filtered ? counts : nullptr, &problem);
      if (problem != kFine || !(total > 0)) {
        problems[size_t(r)] = problem != kFine ? problem : kNoMass;
        op[r] = -1;
        continue;
      }
      if (!filtered) {
        op[r] = draw_unfiltered(s, V, total, row.uniform);
        continue;
      }
      // The highest level `width` tokens reach; a level whose candidates top-k or top-p's
      // prefix runs past gives way to the next one down (a flatter row than the counts told).
      const int64_t width = std::min(V, std::max(TOP_CANDIDATES, row.top_k > 0 ? row.top_k : 0));
      int level = 0;
      while (level < LEVELS && counts[level] < width) ++level;
      bool reached_past = true;
      double mass = 0;
      for (; reached_past; ++level) {
        reached_past = false;
        mass = keep_top(row, V, total, level, s, &reached_past);  // never past at LEVELS
      }
      std::sort(s.kept.begin(), s.kept.end());  // the draw goes in vocabulary order
      op[r] = draw(s.e.data(), s.kept.data(), int64_t(s.kept.size()), mass, row.uniform);
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_VALUE(problems[size_t(r)] != kNaN, "logits: row ", r,
                      " holds NaN: no distribution to sample from");
    TORCH_CHECK_VALUE(problems[size_t(r)] != kNoMass, "logits: row ", r,
                      " gives no token a finite positive chance (every logit -inf, or one +inf)");
  }
}

}  // namespace cpu_sample_rows
