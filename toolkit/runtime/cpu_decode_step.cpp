// compound's float32 CPU decode step between a decoder layer's linears: RMSNorm (with the residual add before it),
// RoPE with the KV-cache write, attention over the cache, and the SiLU-gated product. toolkit/decode/model.py calls
// these in place of some twenty torch operations each, whose dispatch dominated a small model's step; its torch
// forward is their reference (tests/decode/test_native_step.py compares the two on every family).
//
// Every row is computed alone, in one fixed order, whatever the number of rows: a token gets the same bits decoded
// alone as among the rows of a prefill or a speculative tree, which keeps speculative decoding lossless. Built with
// -ffp-contract=off, so the element-wise formulas round as torch's element-wise operations do.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: a third less build time

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kHeadStep = 8;  // attention reads a head in steps of 8 floats (one ymm)

// out = (x · r) · (offset + w), r = 1 / sqrt(mean(x²) + eps): Llama's w · x̂ (offset 0), Gemma's (1 + w) · x̂.
void norm_row(const float* x, const float* w, float offset, float eps, int64_t D, float* out) {
  double squares = 0.0;
  for (int64_t d = 0; d < D; ++d) squares += static_cast<double>(x[d]) * x[d];
  const float r = 1.0f / std::sqrt(static_cast<float>(squares / D) + eps);
  for (int64_t d = 0; d < D; ++d) out[d] = (x[d] * r) * (offset + w[d]);
}

// Rotate-half RoPE of one head in place: x · cos + (−x₂, x₁) · sin.
void rope_head(float* x, const float* cos, const float* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] + (-x2) * sin[i];
    x[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
  }
}

// scores[j] = q · k_j for four keys at once: one FMA chain per key over the head in 8-float steps, then one fixed
// tree of horizontal adds, so a key's score is the same bits in every call (hd a multiple of 8).
void dot4(const float* q, const float* k0, const float* k1, const float* k2, const float* k3, int64_t hd, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k0 + d), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k1 + d), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k2 + d), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k3 + d), a3);
  }
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  // per 128-bit half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
}

// q · k for each of n keys (key_rows[j] points at key j), eight at a time as two interleaved groups of four (their
// FMA chains hide each other's latency); a short last group reads key 0 again.
void scores_of(const float* q, const float* const* key_rows, int64_t n, int64_t hd, float* out) {
  float eight[8];
  for (int64_t j = 0; j < n; j += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = key_rows[j + i < n ? j + i : 0];
    dot4(q, k[0], k[1], k[2], k[3], hd, eight);
    dot4(q, k[4], k[5], k[6], k[7], hd, eight + 4);
    for (int i = 0; i < 8 && j + i < n; ++i) out[j + i] = eight[i];
  }
}

// e^x for 8 floats x ≤ 0 (Cephes' expf: x = n·ln 2 + r, a degree-7 polynomial in r, 2^n in the exponent bits),
// within 2 ulp of the true value; below −87 it returns e^−87 (an attention weight of 1e−38 is zero in any sum).
__m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), name, ": contiguous float32 [T, D]");
}

}  // namespace

// x [T, D] → RMSNorm(x) [T, D] with weight w [D].
at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps, double offset) {
  check_rows(x, "rms_norm x");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "rms_norm: w float32 [D]");
  at::Tensor out = at::empty_like(x);
  for (int64_t t = 0; t < T; ++t)
    norm_row(x.data_ptr<float>() + t * D, w.data_ptr<float>(), offset, eps, D, out.data_ptr<float>() + t * D);
  return out;
}

// (x + delta, RMSNorm(x + delta)): the residual add that ends one block and the norm that starts the next.
std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor delta, at::Tensor w, double eps,
                                        double offset) {
  check_rows(x, "add_rms_norm x");
  check_rows(delta, "add_rms_norm delta");
  TORCH_CHECK(x.sizes() == delta.sizes(), "add_rms_norm: x and delta of one shape");
  const int64_t T = x.size(0), D = x.size(1);
  TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "add_rms_norm: w float32 [D]");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *op = out.data_ptr<float>();
  for (int64_t i = 0; i < T * D; ++i) sp[i] = xp[i] + dp[i];
  for (int64_t t = 0; t < T; ++t) norm_row(sp + t * D, w.data_ptr<float>(), offset, eps, D, op + t * D);
  return {sum, out};
}

// qkv [T, (H + 2·KVH)·hd] (rows q | k | v, as the fused projection writes them), cos and sin [T, hd] at each row's
// position, caches [KVH, S, hd]. Optional per-head norms of q and k (weights [hd]; undefined: none) come before
// RoPE. Writes k and v of row t to cache slot start + t; returns q [T, H, hd] after its norm and RoPE.
at::Tensor rope_and_cache(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                             at::Tensor v_cache, int64_t start, int64_t H, int64_t KVH,
                             c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm, double eps,
                             double offset) {
  check_rows(qkv, "rope_and_cache qkv");
  check_rows(cos, "rope_and_cache cos");
  check_rows(sin, "rope_and_cache sin");
  const int64_t T = qkv.size(0), hd = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * hd && cos.size(0) == T && sin.sizes() == cos.sizes(),
              "rope_and_cache: qkv [T, (H + 2·KVH)·hd], cos and sin [T, hd]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == at::kFloat && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(0) == KVH && k_cache.size(2) == hd && start >= 0 && start + T <= k_cache.size(1),
              "rope_and_cache: caches float32 [KVH, S, hd] with room for slots [start, start + T)");
  const int64_t S = k_cache.size(1);
  const bool qk_norm = q_norm.has_value() && q_norm->defined();
  at::Tensor q = at::empty({T, H, hd}, qkv.options());
  const float *in = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = in + t * (H + 2 * KVH) * hd;
    const float *c = cp + t * hd, *s = sp + t * hd;
    for (int64_t h = 0; h < H; ++h) {
      float* out = qp + (t * H + h) * hd;
      if (qk_norm)
        norm_row(row + h * hd, q_norm->data_ptr<float>(), offset, eps, hd, out);
      else
        std::copy(row + h * hd, row + (h + 1) * hd, out);
      rope_head(out, c, s, hd);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      float* k = kc + (h * S + start + t) * hd;
      if (qk_norm)
        norm_row(row + (H + h) * hd, k_norm->data_ptr<float>(), offset, eps, hd, k);
      else
        std::copy(row + (H + h) * hd, row + (H + h + 1) * hd, k);
      rope_head(k, c, s, hd);
      std::copy(row + (H + KVH + h) * hd, row + (H + KVH + h + 1) * hd, vc + (h * S + start + t) * hd);
    }
  }
  return q;
}

// q [T, H, hd] at cache slots start + t; caches [KVH, S, hd] holding slots [0, start + T). Row t sees key s where
// mask[t, s] (bool [T, start + T]; undefined: s <= start + t). Per (row, head), in key order: score
// scale · q·k (soft-capped c · tanh(score / c) when softcap > 0), softmax, the weighted sum of values; query head h
// reads key/value head h / (H / KVH). Returns [T, H·hd].
at::Tensor attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, int64_t start,
                        c10::optional<at::Tensor> mask, double scale, double softcap) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kFloat, "attention: q float32 [T, H, hd]");
  const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), KVH = k_cache.size(0), S = k_cache.size(1);
  const int64_t end = start + T;
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(2) == hd &&
                  v_cache.sizes() == k_cache.sizes() && H % KVH == 0 && end <= S && hd % kHeadStep == 0,
              "attention: caches float32 [KVH, S, hd] holding slots [0, start + T), H a multiple of KVH, hd of 8s");
  const bool masked = mask.has_value() && mask->defined();
  if (masked)
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->is_contiguous() && mask->size(0) == T && mask->size(1) == end,
                "attention: mask bool [T, start + T]");
  at::Tensor out = at::empty({T, H * hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const bool* mp = masked ? mask->data_ptr<bool>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t groups = H / KVH;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, end * hd));  // small work stays serial
  at::parallel_for(0, T * H, grain, [&](int64_t begin, int64_t stop) {
    std::vector<float> scores(end + 8);
    std::vector<int64_t> keys(end);
    std::vector<const float*> key_rows(end);
    for (int64_t item = begin; item < stop; ++item) {
      const int64_t t = item / H, h = item % H, kv = h / groups;
      const float* qv = qp + item * hd;
      const float *kh = kc + kv * S * hd, *vh = vc + kv * S * hd;
      int64_t n = 0;
      for (int64_t s = 0; s < end; ++s)
        if (masked ? mp[t * end + s] : s <= start + t) {
          keys[n] = s;
          key_rows[n++] = kh + s * hd;
        }
      scores_of(qv, key_rows.data(), n, hd, scores.data());
      float best = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        float score = scores[j] * fscale;
        if (cap > 0.f) score = std::tanh(score / cap) * cap;
        scores[j] = score;
        best = std::max(best, score);
      }
      // weights e^(score − best), eight at a time (the scores padded to a multiple of 8), summed in key order
      for (int64_t j = n; j < ((n + 7) & ~int64_t{7}); ++j) scores[j] = best;
      const __m256 shift = _mm256_set1_ps(best);
      for (int64_t j = 0; j < n; j += 8)
        _mm256_storeu_ps(&scores[j], exp8(_mm256_sub_ps(_mm256_loadu_ps(&scores[j]), shift)));
      float total = 0.f;
      for (int64_t j = 0; j < n; ++j) total += scores[j];
      const __m256 inverse = _mm256_set1_ps(1.f / total);
      float* o = op + item * hd;
      for (int64_t d = 0; d < hd; d += 64) {  // 64 outputs at a time in registers, each summing its keys in order
        const int chunks = static_cast<int>(std::min<int64_t>(8, (hd - d) / 8));
        __m256 sums[8];
        for (int c = 0; c < 8; ++c) sums[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
          const __m256 p = _mm256_set1_ps(scores[j]);
          const float* v = vh + keys[j] * hd + d;
          for (int c = 0; c < chunks; ++c) sums[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), sums[c]);
        }
        for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(o + d + 8 * c, _mm256_mul_ps(sums[c], inverse));
      }
    }
  });
  return out;
}

// gate_up [T, 2F] (rows gate | up) → silu(gate) · up [T, F].
at::Tensor silu_mul(at::Tensor gate_up) {
  check_rows(gate_up, "silu_mul gate_up");
  const int64_t T = gate_up.size(0), F = gate_up.size(1) / 2;
  at::Tensor out = at::empty({T, F}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t f = 0; f < F; ++f) {
      const float g = in[t * 2 * F + f];
      op[t * F + f] = g / (1.f + std::exp(-g)) * in[t * 2 * F + F + f];
    }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.attr("HEAD_STEP") = kHeadStep;  // head_dim must be a multiple of it (toolkit/decode/model.py reads it)
  module.def("rms_norm", &rms_norm, "RMSNorm of each row");
  module.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm of each row");
  module.def("rope_and_cache", &rope_and_cache, "q/k norms and RoPE; k and v written to the cache");
  module.def("attention", &attention, "attention of each row over the cache");
  module.def("silu_mul", &silu_mul, "silu(gate) * up");
}
