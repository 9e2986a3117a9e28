// compound's W4A16 matmul for x86 CPUs with AVX512-BF16: y = x · Ŵᵀ, x rounded to bf16, weights exact, fp32 sums.
// toolkit/runtime/cpu_int4.py packs the weights (``_pack_avx512``) and documents the layout; native.py
// builds this file. Per block of 16 output columns the codes stream once, front to back, from one contiguous run.
//
// packed uint8 [NB, K/8, 64]: chunk c of block b is 32 little-endian 16-bit words; word 2n+i holds in its nibble s
//   (bits 4s..4s+3) the code q[k = 8c + 2s + i, column 16b + n]. So (word & 0xF) | 0x4300 is the bf16 number 128 + q
//   (exact: bf16 128.0 has a mantissa step of 1), and one vdpbf16ps multiplies 16 columns by the pair x[k], x[k+1].
// scale, offset fp32 [NB, G, 16]: W[n, k] = scale·q + offset', and with the +128 above
//   y[n] = Σ_g scale[g,n]·Σ_{k∈g} x[k]·(128 + q[k,n]) + offset[g,n]·Σ_{k∈g} x[k],  offset = offset' − 128·scale.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>  // lighter than torch/extension.h: a third less build time

namespace {

constexpr int64_t kBlockN = 16;      // output columns per block: one zmm of fp32
constexpr int64_t kChunkK = 8;       // input columns per 64-byte chunk
constexpr int64_t kPrefetch = 2048;  // bytes ahead in the block's stream (best of 512..8192 on a 2-core Xeon)
constexpr int kRowsPerPass = 2;      // rows of x that share one pass over a block's codes (all sums in registers)
constexpr int kSums = 4;             // partial sums per row and group: four independent chains of vdpbf16ps
// A code q is read as the bf16 number kCodeBias + q: its nibble OR-ed into the low mantissa bits of bf16 128.0,
// whose mantissa step is 1 (so the unit, q's step, is 1).
constexpr int64_t kCodeBias = 128, kCodeUnit = 1;
constexpr uint16_t kBf16CodeBias = 0x4300;  // bf16 128.0

// Rows [0, MB) of x against one block of 16 columns. Every row is summed in the same order whatever MB is, so a row
// gets the same bits alone (decoding) as among others (prefill, speculative verification): that keeps speculative
// decoding lossless (tests/decode/test_model.py).
template <int MB>
void block_rows(const at::BFloat16* x, int64_t K, const float* x_group_sums, int64_t G, int64_t group_size,
                const uint8_t* codes, const float* scale, const float* offset, float* y, int64_t ldy,
                int64_t columns) {
  const __m512i nibble = _mm512_set1_epi16(0x0f);
  const __m512i bf16_128 = _mm512_set1_epi16(kBf16CodeBias);
  const int64_t chunks = group_size / kChunkK;
  __m512 out[MB];
  for (int m = 0; m < MB; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m512 sums[MB][kSums];
    for (int m = 0; m < MB; ++m)
      for (int s = 0; s < kSums; ++s) sums[m][s] = _mm512_setzero_ps();
    const uint8_t* group_codes = codes + g * chunks * 64;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(group_codes + c * 64 + kPrefetch), _MM_HINT_T0);
      const __m512i w = _mm512_loadu_si512(group_codes + c * 64);
      // 0xEA: (a & b) | c
      const __m512bh v0 = (__m512bh)_mm512_ternarylogic_epi32(w, nibble, bf16_128, 0xEA);
      const __m512bh v1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 4), nibble, bf16_128, 0xEA);
      const __m512bh v2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(w, 8), nibble, bf16_128, 0xEA);
      const __m512bh v3 = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 12), bf16_128);
      const int64_t k = g * group_size + c * kChunkK;
      for (int m = 0; m < MB; ++m) {
        const int32_t* pairs = reinterpret_cast<const int32_t*>(x + m * K + k);
        sums[m][0] = _mm512_dpbf16_ps(sums[m][0], v0, (__m512bh)_mm512_set1_epi32(pairs[0]));
        sums[m][1] = _mm512_dpbf16_ps(sums[m][1], v1, (__m512bh)_mm512_set1_epi32(pairs[1]));
        sums[m][2] = _mm512_dpbf16_ps(sums[m][2], v2, (__m512bh)_mm512_set1_epi32(pairs[2]));
        sums[m][3] = _mm512_dpbf16_ps(sums[m][3], v3, (__m512bh)_mm512_set1_epi32(pairs[3]));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kBlockN);
    const __m512 o = _mm512_loadu_ps(offset + g * kBlockN);
    for (int m = 0; m < MB; ++m) {
      const __m512 total = _mm512_add_ps(_mm512_add_ps(sums[m][0], sums[m][1]), _mm512_add_ps(sums[m][2], sums[m][3]));
      out[m] = _mm512_fmadd_ps(s, total, out[m]);
      out[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(x_group_sums[m * G + g]), out[m]);
    }
  }
  const __mmask16 keep = columns >= kBlockN ? 0xFFFF : (__mmask16)((1u << columns) - 1);
  for (int m = 0; m < MB; ++m) _mm512_mask_storeu_ps(y + m * ldy, keep, out[m]);
}

}  // namespace

// x [M, K] bf16, or fp32 rounded to bf16 here (to nearest even, as torch rounds: one torch call less per product
// on a decode step), packed/scale/offset as above → y [M, N] fp32.
at::Tensor w4_mm(at::Tensor x, at::Tensor packed, at::Tensor scale, at::Tensor offset,
                    int64_t group_size, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == 64, "w4_mm: x [M, K], packed [NB, K/8, 64]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && scale.scalar_type() == at::kFloat &&
              offset.scalar_type() == at::kFloat, "w4_mm: packed uint8, scale and offset float32");
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(group_size % kChunkK == 0 && K % group_size == 0 && packed.size(1) * kChunkK == K,
              "w4_mm: group_size a multiple of 8 dividing K, packed [NB, K/8, 64]");
  TORCH_CHECK(N > (NB - 1) * kBlockN && N <= NB * kBlockN, "w4_mm: N must lie in the last block of 16 columns");
  const int64_t G = K / group_size;
  TORCH_CHECK(scale.numel() == NB * G * kBlockN && offset.numel() == NB * G * kBlockN, "w4_mm: scale, offset [NB, G, 16]");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.is_contiguous(),
              "w4_mm: x contiguous bf16 or fp32");
  std::vector<at::BFloat16> rounded;
  if (x.scalar_type() == at::kFloat) {
    const float* xf = x.data_ptr<float>();
    rounded.assign(xf, xf + M * K);  // c10::BFloat16(float): round to nearest even
  }
  const at::Tensor codes = packed.contiguous(), sc = scale.contiguous(), off = offset.contiguous();
  const at::BFloat16* xp = rounded.empty() ? x.data_ptr<at::BFloat16>() : rounded.data();
  std::vector<float> group_sums(M * G);  // Σ_{k∈g} x[k] of the bf16-rounded x, in fp32
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) total += static_cast<float>(xp[m * K + k]);
      group_sums[m * G + g] = total;
    }
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = sc.data_ptr<float>(), *op = off.data_ptr<float>(), *gp = group_sums.data();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* block_codes = cp + b * (K / kChunkK) * 64;
      const float *block_scale = sp + b * G * kBlockN, *block_offset = op + b * G * kBlockN;
      const int64_t columns = std::min(kBlockN, N - b * kBlockN);
      for (int64_t m = 0; m < M; m += kRowsPerPass) {
        const at::BFloat16* xm = xp + m * K;
        const float* gm = gp + m * G;
        float* ym = yp + m * N + b * kBlockN;
        if (M - m >= kRowsPerPass)
          block_rows<kRowsPerPass>(xm, K, gm, G, group_size, block_codes, block_scale, block_offset, ym, N, columns);
        else
          block_rows<1>(xm, K, gm, G, group_size, block_codes, block_scale, block_offset, ym, N, columns);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // the layout and code numbers toolkit/runtime/cpu_int4.py packs for (it checks them at load)
  module.attr("BLOCK_N") = kBlockN;
  module.attr("CHUNK_K") = kChunkK;
  module.attr("CODE_BIAS") = kCodeBias;
  module.attr("CODE_UNIT") = kCodeUnit;
  module.def("w4_mm", &w4_mm, "compound's AVX512-BF16 W4A16 matmul (toolkit/runtime/cpu_int4.py packs its weights)");
}
