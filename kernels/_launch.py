"""What the W4A16 Triton kernels share: the autotune config space, input checks, and the launcher.

Two variants of every kernel run the same ``@triton.jit`` body:

- GEMM (M > ``SMALL_M``): 2-D tiles of y, the whole K range per program, y written in x's dtype.
- split-K (M ≤ ``SMALL_M``, decode): a 16-row tile (the smallest ``tl.dot`` takes) and K cut into ``SPLIT_K`` slices
  that ``tl.atomic_add`` into an fp32 buffer, so a short-and-wide problem still fills the GPU's SMs. Decode is
  memory-bound: the wasted MMA rows cost nothing measurable next to reading the packed weight.

Config space (kept small so first-call tuning stays within seconds), keyed on (M bucket, N, K), where the bucket is
M rounded up to a power of two, so a prefill of 300 and of 500 tokens share one tuning result:

| variant | BLOCK_M | BLOCK_N | BLOCK_K | SPLIT_K | warps | stages |
|---------|---------|---------|---------|---------|-------|--------|
| split-K | 16      | 64/128  | 128     | 1/2/4/8 | 4     | 3–4    |
| GEMM    | 32–128  | 64–128  | 32–64   | 1       | 4–8   | 3–4    |

Interpreter mode (``TRITON_INTERPRET=1`` set before the kernel modules are imported): ``triton.jit`` then returns an
``InterpretedFunction`` and every autotune candidate would run in numpy. The launcher detects that type and calls
the bare kernel with ``INTERPRETER_CONFIGS`` (one per variant) instead of the autotuner; nothing reads the
environment here.
"""

from __future__ import annotations

import torch
import triton

SMALL_M = 16  # rows up to which the split-K (decode) variant runs
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TUNING_KEY = ["M_BUCKET", "N", "K"]

SPLIT_K_CONFIGS = [
    triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": 128, "SPLIT_K": sk}, num_warps=4, num_stages=stages)
    for bn, sk, stages in [(64, 1, 4), (64, 4, 4), (128, 2, 3), (64, 8, 3), (128, 4, 3)]
]
GEMM_CONFIGS = [
    triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": 1}, num_warps=warps, num_stages=stages)
    for bm, bn, bk, warps, stages in [
        (32, 64, 64, 4, 4), (64, 64, 64, 4, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (128, 128, 32, 8, 3),
    ]
]
# Small tiles so the tests' N = 40/72 and K = 192 cross tile edges (masking) and decode exercises two K slices.
INTERPRETER_CONFIGS = {
    "split_k": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2},
    "gemm": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1},
}


def autotuned(kernel):
    """The (split-K, GEMM) autotuners of one ``@triton.jit`` kernel; split-K zeroes its fp32 buffer per trial."""
    split_k = triton.autotune(configs=SPLIT_K_CONFIGS, key=TUNING_KEY, reset_to_zero=["y_ptr"])(kernel)
    gemm = triton.autotune(configs=GEMM_CONFIGS, key=TUNING_KEY)(kernel)
    return split_k, gemm


def interpreting(kernel) -> bool:
    """Whether ``triton.jit`` built ``kernel`` for the CPU interpreter (it does when TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def m_bucket(M: int) -> int:
    """Autotune bucket of M: the next power of two, capped at 4096."""
    return min(triton.next_power_of_2(M), 4096)


# ---- input checks: each error says what was seen and what to pass instead --------------------------------------


def check_activation(x: torch.Tensor, K: int, layout: str) -> None:
    if x.dtype not in ACTIVATION_DTYPES:
        raise TypeError(f"{layout}: x must be fp16, bf16 or fp32, got {x.dtype}; cast it with x.to(torch.float16)")
    if x.shape[-1] != K:
        raise ValueError(f"{layout}: x has {x.shape[-1]} input features but the weight packs K = {K}; "
                         f"pass x of shape [..., {K}] (or check the packed tensors' orientation)")


def check_tensor(t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], layout: str) -> None:
    if t.dtype not in dtypes:
        raise TypeError(f"{layout}: {name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{layout}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} for this K, N and group size")


def groups(K: int, group_size: int, layout: str) -> int:
    """Number of groups G, refusing a group size that does not divide K."""
    if K % 8:
        raise ValueError(f"{layout}: K = {K} is not a multiple of 8, so it cannot be packed into int32 words of 4-bit codes")
    if group_size == -1:
        return 1
    if group_size <= 0 or K % group_size:
        raise ValueError(f"{layout}: group_size {group_size} does not divide K = {K}; pass -1 (per channel) or a divisor of K")
    return K // group_size


def check_device(kernel, x: torch.Tensor, tensors: list[torch.Tensor], layout: str) -> None:
    for t in tensors:
        if t.device != x.device:
            raise ValueError(f"{layout}: x is on {x.device} but a packed tensor is on {t.device}; move both to one device")
    if x.device.type != "cuda" and not interpreting(kernel):
        raise RuntimeError(f"{layout}: Triton kernels need CUDA tensors (x is on {x.device}); on CPU use "
                           "toolkit.runtime.cpu_int4, or set TRITON_INTERPRET=1 before importing toolkit.kernels")


# ---- launch -----------------------------------------------------------------------------------------------------


def launch(kernel, tuned, x: torch.Tensor, N: int, K: int, group_size: int,
           operands: tuple[torch.Tensor, ...], strides: tuple[int, ...], **constexprs) -> torch.Tensor:
    """Run ``kernel`` on x [..., K] → y [..., N] in x's dtype.

    ``operands`` = (qweight, qzeros, scales, g_idx) in the order of the kernel's pointers (unused ones may be any
    tensor), ``strides`` their strides in the order the kernel takes them, ``constexprs`` the layout flags.
    """
    x2 = x.reshape(-1, K)  # (M, K)
    M = x2.shape[0]
    split_k, gemm = tuned
    small = M <= SMALL_M
    # split-K accumulates slices with atomics, so it writes fp32; GEMM writes x's dtype directly.
    y = torch.zeros(M, N, device=x.device, dtype=torch.float32) if small else torch.empty(M, N, device=x.device, dtype=x.dtype)
    if M == 0:
        return y.to(x.dtype).reshape(*x.shape[:-1], N)

    def grid(meta):
        return triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]), meta["SPLIT_K"]

    args = (x2, *operands, y, M, N, K, K if group_size == -1 else group_size, m_bucket(M),
            x2.stride(0), x2.stride(1), *strides, y.stride(0), y.stride(1))
    interpret = interpreting(kernel)
    # fp32 x: IEEE fp32 products, not TF32, to match torch.matmul. bf16 x in the interpreter: its tl.dot multiplies
    # bf16 tiles as raw integer bit patterns (triton 3.9 ``create_dot``), so they are widened first; the values are
    # already rounded to bf16, and bf16 × bf16 products are exact in fp32, so the result is what the GPU computes.
    constexprs["DOT_FP32"] = x.dtype == torch.float32 or (interpret and x.dtype == torch.bfloat16)
    if interpret:
        kernel[grid](*args, **constexprs, **INTERPRETER_CONFIGS["split_k" if small else "gemm"])
    else:
        (split_k if small else gemm)[grid](*args, **constexprs)
    return y.to(x.dtype).reshape(*x.shape[:-1], N)
