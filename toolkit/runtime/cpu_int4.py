"""W4A16 on CPU from the int4 codes, no Triton, no dense weight: one of compound's own kernels, or torch's int4 op.

Three kernels (``KERNELS``, fastest first), chosen per process by ``default_kernel`` (the first that runs here) or
per weight by ``prepare_int4_cpu(kernel=)``:

| kernel          | what multiplies                                                  | where                                 |
|-----------------|------------------------------------------------------------------|---------------------------------------|
| ``avx512-bf16`` | ``cpu_int4_avx512.cpp``: codes become bf16 128 + q, one          | x86 CPUs with AVX512-BF16 and a C++   |
|                 | ``vdpbf16ps`` per 16 columns × 2 inputs, exact fp32 scale and    | compiler; 1.3-1.4x torch's op at 1-2  |
|                 | offset per group; x rounded to bf16                              | rows, 0.91-1.00x from 4 to 256 rows   |
|                 |                                                                  | (8192×3072 g128, 1 and 2 threads)     |
| ``avx2-fma``    | ``cpu_int4_avx2.cpp``: codes become fp32 1 + q/16 (three integer | x86 CPUs with AVX2 and FMA and a C++  |
|                 | ops per 8), one FMA per 8 columns × 1 input, exact fp32 scale    | compiler (BENCHMARKS.md "Kernels"     |
|                 | and offset per group; x read in fp32, not rounded                | gives its speed against torch's op)   |
| ``torch``       | ``aten::_weight_int4pack_mm_for_cpu`` (the "tinygemm" convention) | any CPU torch runs on                 |

Every kernel reads the integer zero point z of GPTQ, AWQ and compressed-tensors (CT: zp + 8) with W = scale · (q − z).

compound's kernels (``NATIVE``, each with its source, instruction sets and numerics; ``native`` builds
them): a code q is read as the number (bias + q) / unit (avx512-bf16: bias 128,
unit 1; avx2-fma: bias 16, unit 16), so ``W = (unit·scale)·(bias + q)/unit + offset`` with ``offset = −(z + bias)·scale``
per (group, column), computed in float64 and stored in fp32: the weight is exact to fp32 rounding. ``_pack_avx512``
and ``_pack_avx2`` give the code layouts.

torch: unsigned codes q in 0..15 and, per (group, output channel), a pair (scale, zero) in ``qScaleAndZeros``
[G, N, 2] with ``W[n, k] = (q[n, k] − 8) · scale + zero`` (an additive offset in float, not a code), so

    scale · (q − z) = (q − 8) · scale + (8 − z) · scale   ⇒   torch_scale = scale,  torch_zero = (8 − z) · scale

(symmetric: z = 8 ⇒ torch_zero = 0). ``tests/kernels/test_cpu_int4.py`` proves every kernel's conversion by multiplying the identity.

Limits, and how ``prepare_int4_cpu`` meets them:

| requirement                                      | here                                                             |
|--------------------------------------------------|------------------------------------------------------------------|
| torch: ``qGroupSize`` ∈ {32, 64, 128, 256}       | a group of g = 96, 192, … or per-channel (g = K) is cut into g/32.. sub-groups sharing its scale; g must be a multiple of 32 (for every kernel, so that each runs every weight) |
| N divisible by 16 (compound's: by their block)   | rows padded with zero scale (output columns sliced off)          |
| torch: ``qScaleAndZeros`` dtype = x dtype        | kept in fp32, cast once per compute dtype and cached             |
| torch: fast only in bf16 (fp32/fp16 x: scalar fallback) | ``int4_mm_cpu`` computes in bf16 by default, returns x's dtype |
| groups contiguous along K                        | act-order: columns sorted by ``g_idx`` and x permuted to match (``x[:, perm]``), valid when every group has exactly ``group_size`` columns, as GPTQ ``desc_act`` makes them; otherwise refused |

Precision: every kernel sums in fp32; avx512-bf16 and torch's op (in its default bf16) round x to bf16, avx2-fma
reads it exact in fp32. torch's op also stores its zero (8 − z)·scale in bf16, an error of
at most |8 − z|·scale·2⁻⁹ ≤ 1/64 of a quantization step per weight; ``compute_dtype=torch.float32`` runs it exact
to fp32 rounding (the tests' identity proof of the torch kernel runs that way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from toolkit.runtime import native

TORCH_GROUP_SIZES = (256, 128, 64, 32)  # what _weight_int4pack_mm_for_cpu accepts, largest first
_N_MULTIPLE = 16  # torch: "expect N to be dividable by 16"
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Int4CpuWeight:
    """One linear packed for ``int4_mm_cpu`` by one of ``KERNELS``.

    compound's kernels: packed uint8 [N_pad/B, K/8, 8B/2] (``NATIVE``: block B = 16 for avx512-bf16, 8 for
    avx2-fma), scales and offsets fp32 [N_pad/B, G, B], group_size the weight's own group. torch: packed uint8
    [N_pad, K/2], scales = qScaleAndZeros fp32 [K/group_size, N_pad, 2], offsets None, group_size the sub-group torch runs (32..256). perm int64 [K] or None
    (input-column order the groups are contiguous in); N, K the true output/input widths.
    """

    kernel: str
    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    group_size: int
    N: int
    K: int
    perm: torch.Tensor | None = None
    _cast: dict = field(default_factory=dict, repr=False)  # torch: compute dtype → scales in that dtype

    def read_bytes(self) -> int:
        """Bytes one product reads from the weight: codes and scales as the kernel reads them (torch's: in bf16)."""
        if self.offsets is None:
            return self.packed.nbytes + self.scales.numel() * 2
        return self.packed.nbytes + self.scales.nbytes + self.offsets.nbytes

    def scales_for(self, dtype: torch.dtype) -> torch.Tensor:
        """torch kernel: qScaleAndZeros in the compute dtype (cast once)."""
        if dtype not in self._cast:
            self._cast[dtype] = self.scales.to(dtype).contiguous()
        return self._cast[dtype]


def available_kernels() -> list[str]:
    """The ``KERNELS`` that run on this machine, fastest first: torch's op always, compound's where it builds."""
    return [kernel for kernel in KERNELS if kernel == "torch" or NATIVE[kernel].load() is not None]


def default_kernel() -> str:
    """The fastest kernel this machine runs: the first of compound's that builds here (``native``), else torch's."""
    return available_kernels()[0]


def _torch_scale_and_zero(scale: torch.Tensor, zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, integer zero z) with W = scale·(q − z) → torch's (scale, additive zero) with W = (q − 8)·scale + zero."""
    scale = scale.double()
    return scale.float(), ((8 - zero.double()) * scale).float()


def _torch_group_size(group_size: int, K: int) -> int:
    size = K if group_size == -1 else group_size
    for candidate in TORCH_GROUP_SIZES:
        if size % candidate == 0:
            return candidate
    raise ValueError(
        f"torch's CPU int4 kernel takes groups of 32, 64, 128 or 256 columns; a group of {size} "
        f"({'per channel, K' if group_size == -1 else 'group_size'} = {size}) is not a multiple of 32. "
        "Quantize with group_size 32/64/128, or run the dequantized weight with torch.matmul"
    )


def _act_order_perm(g_idx: torch.Tensor, group_size: int, K: int, G: int) -> torch.Tensor | None:
    """Column order in which each group is contiguous, or None when g_idx is already k // group_size."""
    g_idx = g_idx.long().cpu()
    if group_size == -1 or torch.equal(g_idx, torch.arange(K) // group_size):
        return None
    counts = torch.bincount(g_idx, minlength=G)
    if g_idx.min() < 0 or len(counts) != G or not bool((counts == group_size).all()):
        raise ValueError(
            f"g_idx does not put exactly {group_size} columns in each of the {G} groups (counts {counts.tolist()[:8]}...), "
            "so no column permutation makes the groups contiguous; run this layer with the dequantized weight instead"
        )
    return torch.argsort(g_idx, stable=True)


def prepare_int4_cpu(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                     g_idx: torch.Tensor | None = None, kernel: str | None = None) -> Int4CpuWeight:
    """Pack one linear for ``int4_mm_cpu``.

    codes [N, K] uint8 (0..15), scale [N, G] float, zero [N, G] integer zero point (W = scale·(code − zero), the
    ``QuantizedWeight`` convention: GPTQ zero after the v1 +1, AWQ zero as stored, CT zp + 8 or 8 when symmetric),
    group_size (-1: per channel), g_idx [K] optional (act-order), kernel one of ``KERNELS`` (None: ``default_kernel``).
    """
    if codes.dim() != 2:
        raise ValueError(f"codes must be 2-D [N, K], got shape {tuple(codes.shape)}")
    N, K = codes.shape
    G = 1 if group_size == -1 else K // max(group_size, 1)
    if group_size != -1 and (group_size <= 0 or K % group_size):
        raise ValueError(f"group_size {group_size} does not divide K = {K}; pass -1 (per channel) or a divisor of K")
    if tuple(scale.shape) != (N, G) or tuple(zero.shape) != (N, G):
        raise ValueError(f"scale and zero must be [N, G] = [{N}, {G}], got {tuple(scale.shape)} and {tuple(zero.shape)}")
    if codes.dtype.is_floating_point or int(codes.max()) > 15 or int(codes.min()) < 0:
        raise ValueError("codes must be integers in 0..15 (unsigned 4-bit); CT's signed q must be passed as q + 8")
    torch_group_size = _torch_group_size(group_size, K)
    kernel = default_kernel() if kernel is None else kernel
    if kernel not in KERNELS:
        raise ValueError(f"unknown CPU int4 kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if kernel in NATIVE and NATIVE[kernel].load() is None:
        raise ValueError(f"compound's {kernel} kernel does not run on this machine (see the log); use kernel='torch'")
    perm = None if g_idx is None else _act_order_perm(g_idx, group_size, K, G)

    if perm is not None:
        codes = codes[:, perm]  # (N, K) with groups contiguous
    if kernel in NATIVE:
        return _prepare_native(kernel, codes, scale, zero, K if group_size == -1 else group_size, perm)
    codes = codes.to(torch.int32)
    torch_scale, torch_zero = _torch_scale_and_zero(scale.float(), zero)  # (N, G)
    repeat = (K if group_size == -1 else group_size) // torch_group_size
    torch_scale = torch_scale.repeat_interleave(repeat, dim=1)  # (N, K / torch_group_size)
    torch_zero = torch_zero.repeat_interleave(repeat, dim=1)

    pad = -N % _N_MULTIPLE  # padded rows: code 8, scale 0, zero 0 → weight 0
    if pad:
        codes = torch.cat([codes, torch.full((pad, K), 8, dtype=torch.int32)])
        torch_scale = torch.cat([torch_scale, torch.zeros(pad, torch_scale.shape[1])])
        torch_zero = torch.cat([torch_zero, torch.zeros(pad, torch_zero.shape[1])])
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)  # (N_pad, K/2) uint8
    scale_and_zero = torch.stack([torch_scale.t(), torch_zero.t()], dim=-1).contiguous()  # (G', N_pad, 2)
    return Int4CpuWeight("torch", packed, scale_and_zero, None, torch_group_size, N, K, perm)


_CHUNK_K = 8  # input columns per packed chunk, in both layouts


def _pack_avx512(codes: torch.Tensor) -> torch.Tensor:
    """codes int [N_pad, K] → uint8 [N_pad/16, K/8, 64]: in chunk c of block b, byte 2·(2n + i) + h holds the codes
    of column 16b + n at k = 8c + 4h + i (low nibble) and k = 8c + 4h + 2 + i (high nibble), i.e. 16-bit word 2n + i
    holds k = 8c + 2s + i in its nibble s (the layout ``cpu_int4_avx512.cpp`` reads)."""
    N, K = codes.shape
    q = codes.to(torch.uint8).view(N // 16, 16, K // _CHUNK_K, 4, 2)  # [block, n, chunk, s, i]: k = 8·chunk + 2s + i
    low_byte, high_byte = q[:, :, :, 0] | (q[:, :, :, 1] << 4), q[:, :, :, 2] | (q[:, :, :, 3] << 4)  # [b, n, c, i]
    words = torch.stack([low_byte, high_byte], dim=-1)  # [b, n, c, i, byte]: little-endian word
    return words.permute(0, 2, 1, 3, 4).reshape(N // 16, K // _CHUNK_K, 64).contiguous()


def _pack_avx2(codes: torch.Tensor) -> torch.Tensor:
    """codes int [N_pad, K] → uint8 [N_pad/8, K/8, 32]: in chunk c of block b, the little-endian 32-bit lane n holds
    in its nibble j the code of column 8b + n at k = 8c + j (the layout ``cpu_int4_avx2.cpp`` reads)."""
    N, K = codes.shape
    q = codes.to(torch.uint8).view(N // 8, 8, K // _CHUNK_K, 4, 2)  # [block, n, chunk, byte, nibble]: j = 2·byte + nibble
    lanes = q[..., 0] | (q[..., 1] << 4)  # [b, n, c, byte]
    return lanes.permute(0, 2, 1, 3).reshape(N // 8, K // _CHUNK_K, 32).contiguous()


@dataclass(frozen=True)
class NativeKernel:
    """One of compound's kernels: how it is built (``native``) and how it reads a weight. Blocks of ``block``
    output columns packed by ``pack``; each code q read as the number (bias + q) / unit, so that
    W = s·(q − z) = (unit·s)·(bias + q)/unit − (z + bias)·s: stored scale unit·s and offset −(z + bias)·s per (group,
    column); x rounded to ``x_dtype`` (to nearest even, by the kernel itself for fp32 x). Block, bias and unit are
    the build's ``constants``, which its C++ exports and ``native`` checks at load."""

    build: native.NativeBuild
    pack: Callable[[torch.Tensor], torch.Tensor]
    x_dtype: torch.dtype

    @property
    def block(self) -> int:
        return self.build.constants["BLOCK_N"]

    @property
    def bias(self) -> int:
        return self.build.constants["CODE_BIAS"]

    @property
    def unit(self) -> int:
        return self.build.constants["CODE_UNIT"]

    def load(self):
        """The compiled module (its ``w4_mm``), or None where it does not run here (see ``native``)."""
        return native.load(self.build)


# compound's kernels, fastest first: ``default_kernel`` takes the first that loads.
NATIVE = {
    "avx512-bf16": NativeKernel(  # a code is the bf16 number 128 + q
        native.NativeBuild("cpu_int4_avx512.cpp", ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                           ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
                           {"BLOCK_N": 16, "CHUNK_K": _CHUNK_K, "CODE_BIAS": 128, "CODE_UNIT": 1}),
        pack=_pack_avx512, x_dtype=torch.bfloat16),
    "avx2-fma": NativeKernel(  # a code is the fp32 number 1 + q/16
        native.NativeBuild("cpu_int4_avx2.cpp", ("avx2", "fma"), ("-mavx2", "-mfma"),
                           {"BLOCK_N": 8, "CHUNK_K": _CHUNK_K, "CODE_BIAS": 16, "CODE_UNIT": 16}),
        pack=_pack_avx2, x_dtype=torch.float32),
}
KERNELS = (*NATIVE, "torch")  # fastest first


def _prepare_native(kernel: str, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    perm: torch.Tensor | None) -> Int4CpuWeight:
    """codes int [N, K] (groups contiguous), scale/zero [N, G] → a native kernel's weight (see ``NativeKernel``)."""
    packing = NATIVE[kernel]
    N, K = codes.shape
    scale = scale.double()
    offset = -(zero.double() + packing.bias) * scale  # float64, so the weight is exact to fp32 rounding
    scale = scale * packing.unit
    pad = -N % packing.block  # padded rows: scale 0, offset 0 → weight 0
    if pad:
        codes = torch.cat([codes, torch.zeros(pad, K, dtype=codes.dtype)])
        scale, offset = (torch.cat([t, torch.zeros(pad, t.shape[1], dtype=t.dtype)]) for t in (scale, offset))
    blocks = (N + pad) // packing.block
    scale, offset = (t.float().view(blocks, packing.block, -1).transpose(1, 2).contiguous() for t in (scale, offset))
    return Int4CpuWeight(kernel, packing.pack(codes), scale, offset, group_size, N, K, perm)


def int4_mm_cpu(x: torch.Tensor, weight: Int4CpuWeight, compute_dtype: torch.dtype | None = torch.bfloat16) -> torch.Tensor:
    """``x @ W.T`` for x [..., K] fp32/bf16/fp16 on CPU → y [..., N] in x's dtype.

    ``compute_dtype``: the dtype torch's op runs in (x and the scales are cast to it). bf16, the default, is torch's
    vectorized path; fp32 and fp16 run a scalar fallback, 50–300× slower (AVX512-BF16 EPYC, one thread, 4096→4096 at
    M = 1: 87 ms in fp32 vs 0.45 ms in bf16), so pass ``None`` (x's own dtype) only when fp32 exactness matters more
    than speed. compound's kernels read x in their own ``NATIVE[kernel].x_dtype``: avx2-fma (fp32) serves
    any request, avx512-bf16 refuses one for more than bf16.
    """
    if x.dtype not in _X_DTYPES:
        raise TypeError(f"x must be fp32, bf16 or fp16, got {x.dtype}")
    if x.shape[-1] != weight.K:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects K = {weight.K}")
    if not x.is_cpu:
        raise ValueError(f"int4_mm_cpu runs on CPU tensors; x is on {x.device} (use toolkit.kernels on CUDA)")
    x2 = x if x.dim() == 2 else x.reshape(-1, weight.K)  # (M, K)
    if weight.perm is not None:
        x2 = x2[:, weight.perm]  # same column order as the packed codes
    dtype = x.dtype if compute_dtype is None else compute_dtype
    native = NATIVE.get(weight.kernel)
    if native is not None:  # the checks and casts of a decode step's every linear: kept to the few it needs
        if native.x_dtype != torch.float32 and dtype != native.x_dtype:
            raise ValueError(f"the {weight.kernel} kernel computes in {native.x_dtype} only; prepare with "
                             f"kernel='torch' for compute_dtype {dtype}")
        if x2.dtype != torch.float32:  # fp32 x: every native kernel rounds it to its x dtype itself
            x2 = x2.to(native.x_dtype)
        y = native.load().w4_mm(x2.contiguous(), weight.packed, weight.scales, weight.offsets, weight.group_size,
                                weight.N)  # (M, N) fp32
        if x.dtype != torch.float32:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], weight.N)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2.to(dtype).contiguous(), weight.packed, weight.group_size, weight.scales_for(dtype)
    )  # (M, N_pad)
    return y[:, : weight.N].to(x.dtype).reshape(*x.shape[:-1], weight.N)
