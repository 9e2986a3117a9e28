// compound's W4A16 matmul for x86 CPUs with AVX2 and FMA (no AVX-512): y = x · Ŵᵀ, x and weights exact, fp32 sums.
// toolkit/runtime/cpu_int4.py packs the weights (``_pack_avx2``) and documents the layout; native.py
// builds this file. Per block of 8 output columns the codes stream once, front to back, from one contiguous run.
//
// packed uint8 [NB, K/8, 32]: chunk c of block b is 8 little-endian 32-bit lanes; lane n holds in its nibble j
//   (bits 4j..4j+3) the code q[k = 8c + j, column 8b + n]. Moved to bits 19..22 and OR-ed with 0x3F800000 (1.0f),
//   a code becomes the fp32 number 1 + q/16 exactly, so one FMA multiplies 8 columns by x[k].
// scale, offset fp32 [NB, G, 8]: with scale = 16·s and offset = −(16 + z)·s for W = s·(q − z),
//   y[n] = Σ_g scale[g,n]·Σ_{k∈g} x[k]·(1 + q[k,n]/16) + offset[g,n]·Σ_{k∈g} x[k].

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: a third less build time

namespace {

constexpr int64_t kBlockN = 8;       // output columns per block: one ymm of fp32
constexpr int64_t kChunkK = 8;       // input columns per 32-byte chunk
constexpr int64_t kPrefetch = 1024;  // bytes ahead in the block's stream
constexpr int kSums = 8;             // partial sums per row and group: FMA chains that hide its latency

// Code j of every lane of w as the fp32 number 1 + q/16: the nibble moved to bits 19..22, the exponent of 1.0 set.
template <int J>
inline __m256 code_as_float(__m256i w, __m256i mantissa, __m256i one) {
  constexpr int shift = 19 - 4 * J;
  const __m256i moved = shift >= 0 ? _mm256_slli_epi32(w, shift) : _mm256_srli_epi32(w, -shift);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(moved, mantissa), one));
}

// One row of x against one block of 8 columns. A row is summed in the same order whatever rows come with it, so it
// gets the same bits alone (decoding) as among others (prefill, speculative verification): that keeps speculative
// decoding lossless (tests/decode/test_model.py). Rows take a pass each: sharing a pass between two rows spills
// registers (measured slower at every batch).
void block_row(const float* x, const float* x_group_sums, int64_t G, int64_t group_size, const uint8_t* codes,
               const float* scale, const float* offset, float* y, int64_t columns) {
  const __m256i mantissa = _mm256_set1_epi32(0x00780000);
  const __m256i one = _mm256_set1_epi32(0x3F800000);
  const int64_t chunks = group_size / kChunkK;
  __m256 out = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 sums[kSums];  // independent FMA chains: code j goes to chain j % kSums
    for (int c = 0; c < kSums; ++c) sums[c] = _mm256_setzero_ps();
    const uint8_t* group_codes = codes + g * chunks * 32;
    const float* xg = x + g * group_size;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(group_codes + c * 32 + kPrefetch), _MM_HINT_T0);
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group_codes + c * 32));
      const __m256 v[kChunkK] = {code_as_float<0>(w, mantissa, one), code_as_float<1>(w, mantissa, one),
                                 code_as_float<2>(w, mantissa, one), code_as_float<3>(w, mantissa, one),
                                 code_as_float<4>(w, mantissa, one), code_as_float<5>(w, mantissa, one),
                                 code_as_float<6>(w, mantissa, one), code_as_float<7>(w, mantissa, one)};
      const float* xk = xg + c * kChunkK;
      for (int j = 0; j < kChunkK; ++j)
        sums[j % kSums] = _mm256_fmadd_ps(v[j], _mm256_broadcast_ss(xk + j), sums[j % kSums]);
    }
    __m256 total = sums[0];
    for (int c = 1; c < kSums; ++c) total = _mm256_add_ps(total, sums[c]);
    out = _mm256_fmadd_ps(_mm256_loadu_ps(scale + g * kBlockN), total, out);
    out = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g * kBlockN), _mm256_set1_ps(x_group_sums[g]), out);
  }
  if (columns == kBlockN) {
    _mm256_storeu_ps(y, out);
  } else {
    alignas(32) float lanes[kBlockN];
    _mm256_store_ps(lanes, out);
    for (int64_t n = 0; n < columns; ++n) y[n] = lanes[n];
  }
}

}  // namespace

// x [M, K] fp32, packed/scale/offset as above → y [M, N] fp32.
at::Tensor w4_mm(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor offset,
                    int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 32, "w4_mm: x [M, K], packed [NB, K/8, 32]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat &&
              offset.scalar_type() == at::kFloat, "w4_mm: packed uint8, scale and offset float32");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(group_size % kChunkK == 0 && K % group_size == 0 && packed.size(1) * kChunkK == K,
              "w4_mm: group_size a multiple of 8 dividing K, packed [NB, K/8, 32]");
  TORCH_CHECK(N > (NB - 1) * kBlockN && N <= NB * kBlockN, "w4_mm: N must lie in the last block of 8 columns");
  const int64_t G = K / group_size;
  TORCH_CHECK(scale.numel() == NB * G * kBlockN && offset.numel() == NB * G * kBlockN, "w4_mm: scale, offset [NB, G, 8]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "w4_mm: x contiguous fp32");
  const at::Tensor& xf = x;
  const at::Tensor codes = packed.contiguous(), sc = scale.contiguous(), off = offset.contiguous();
  const float* xp = xf.data_ptr<float>();
  std::vector<float> group_sums(M * G);  // Σ_{k∈g} x[k] in fp32, in k order
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) total += xp[m * K + k];
      group_sums[m * G + g] = total;
    }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = sc.data_ptr<float>(), *op = off.data_ptr<float>(), *gp = group_sums.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block_codes = cp + b * (K / kChunkK) * 32;
      const float *block_scale = sp + b * G * kBlockN, *block_offset = op + b * G * kBlockN;
      const int64_t columns = std::min(kBlockN, N - b * kBlockN);
      for (int64_t m = 0; m < M; ++m)
        block_row(xp + m * K, gp + m * G, G, group_size, block_codes, block_scale, block_offset, yp + m * N + b * kBlockN,
                  columns);
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("w4_mm", &w4_mm, "compound's AVX2-FMA W4A16 matmul (toolkit/runtime/cpu_int4.py packs its weights)");
}
