"""Triton W4A16 kernels and their torch reference (installed as ``toolkit.kernels``).

| module          | entry point                                                                    | layout                 |
|-----------------|--------------------------------------------------------------------------------|------------------------|
| ``reference``   | ``dequantize_{gptq,awq,ct}``, ``pack_{gptq,awq,ct}``, ``w4a16_matmul_reference`` | all (the test oracle)  |
| ``w4a16_gptq``  | ``gptq_w4a16(x, qweight, qzeros, scales, g_idx, group_size, *, checkpoint_format)`` | GPTQ v1/v2, act-order |
| ``w4a16_awq``   | ``awq_w4a16(x, qweight, qzeros, scales, group_size)``                          | AWQ GEMM               |
| ``w4a16_ct``    | ``ct_w4a16(x, weight_packed, weight_scale, group_size, weight_zero_point, g_idx)`` | compressed-tensors  |

Nothing is imported here, so ``import toolkit.kernels.reference`` never pulls in Triton. The kernel modules decide
at import whether they run compiled (CUDA) or in Triton's CPU interpreter: set ``TRITON_INTERPRET=1`` before the
first ``import triton`` for the latter. The CPU fast path without Triton is ``toolkit.runtime.cpu_int4``.
"""
