"""Weight quantization math: tensors in, tensors out.

Glossary (the ecosystem's spelling, used in every file):
  W           weight, shape [N, K] = [out_features, in_features]
  X           activations entering a linear, shape [tokens, K]
  H           Hessian proxy 2·XᵀX accumulated over calibration tokens, shape [K, K]
  bits        code width b; codes are unsigned integers in [0, 2^b - 1]
  group_size  input columns sharing one scale and zero (-1: one group per output row)
  g_idx       group index of every input column, shape [K]
  scale, zero per group and output row, shape [N, G]; W ≈ scale · (code − zero)
  sym         symmetric: zero fixed at 2^(b−1), the range centred on 0
"""
