"""``QuantLinear``: a linear layer that holds one checkpoint format's packed integer weights and runs from them.

The buffers are the format's tensors under their on-disk suffixes (GPTQ ``qweight``/``qzeros``/``scales``/``g_idx``,
AWQ ``qweight``/``qzeros``/``scales``, compressed-tensors ``weight_packed``/``weight_scale``/``weight_shape``
[/``weight_zero_point``]), so a checkpoint's state dict loads without renaming. ``layout`` is the format module
(``toolkit.formats.gptq`` / ``awq`` / ``compressed_tensors``) that knows how to read them.

``backend`` chooses how a forward multiplies (an argument, never an environment variable):

| backend       | y = x Ŵᵀ computed by                                              | runs on                         |
|---------------|-------------------------------------------------------------------|---------------------------------|
| ``reference`` | dequantize to fp32, cast to x's dtype, ``F.linear``: the oracle   | anything, any bit width         |
| ``cpu-int4``  | the CPU int4 kernel (``toolkit.runtime.cpu_int4``: compound's     | CPU; 4-bit, group a multiple of |
|               | AVX512-BF16 or AVX2-FMA one, else torch's op) for                 |                                 |
|               | x of ≤ ``CPU_INT4_MAX_ROWS`` rows, the reference above            | 32                              |
| ``triton``    | the layout's W4A16 Triton kernel (its ``TRITON_KERNEL``)          | CUDA; CPU under TRITON_INTERPRET=1 (set by the caller before Triton is imported) |
| ``auto``      | ``triton`` for CUDA x, ``cpu-int4`` for CPU x, chosen per call;   | anything                        |
|               | the reference for a linear the chosen one cannot run              |                                 |

The cpu-int4 weight is prepared once per module, at its first cpu-int4 forward, from the packed buffers through the
format's ``unpack`` (later changes to the buffers are not seen). Crossover, measured on this project's 2-core AMD
EPYC (AVX-512 BF16, no AMX), SmolLM2-135M up_proj (576→1536, g64), CPU time of one call on one thread (the machine
is shared, so wall time was too noisy to use); ratio = int4 time / reference time (dequantize + F.linear):

| rows M              | 1    | 16   | 64   | 256  | 512  | 768  | 1024 | 4096 |
|---------------------|------|------|------|------|------|------|------|------|
| fp32 x              | 0.01 | 0.06 | 0.16 | 0.37 |      |      | 0.55 | 0.63 |
| bf16 x              | 0.01 | 0.06 | 0.21 | 0.3–0.7 | 0.70 | 1.08 | 1.54 | 2.15 |

In bf16 the reference (one dequantize, then a fast bf16 GEMM) overtakes the int4 op between 512 and 768 rows (k_proj,
576→192: at 512); in fp32 the reference's fp32 GEMM stays slower than the int4 op at every M measured, but the
int4 op computes in bf16. The table is torch's op; compound's AVX512-BF16 kernel, where it runs, is 1.3-1.4x
faster at 1-2 rows and within 9 % of it from 4 to 256 rows (8192×3072 g128), so the same limit holds; its
AVX2-FMA one decodes the codes once per row, 1.7-1.9x faster than torch's AVX2 op at one row and 1.2x slower at 16
(BENCHMARKS.md "Kernels (torch's op as on a CPU without AVX-512)"). ``CPU_INT4_MAX_ROWS = 256`` sits below the bf16 crossover on every SmolLM2 shape and keeps
long prefills and perplexity scoring of an fp32 model on the fp32-exact reference; decode (M = 1) and speculative
verification (M ≤ a few dozen) run the int4 op.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch
from torch import nn

BACKENDS = ("auto", "reference", "cpu-int4", "triton")
CPU_INT4_MAX_ROWS = 256  # above this many rows of x, cpu-int4 runs the reference (table in the module docstring)


def backend_problem(backend: str, bits: int, group_size: int, in_features: int | None = None) -> str | None:
    """Why ``backend`` cannot run a linear of these numerics (None when it can); ``auto`` always can.

    in_features None: the width is unknown, so a per-channel (``group_size`` -1) group is not checked.
    """
    if backend not in BACKENDS:
        return f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}"
    if backend in ("cpu-int4", "triton") and bits != 4:
        return f"backend {backend!r} runs 4-bit weights only, this checkpoint has {bits}-bit ones"
    group = in_features if group_size == -1 else group_size
    if backend == "cpu-int4" and group is not None and group % 32:
        return f"backend 'cpu-int4' needs groups of a multiple of 32 columns (torch's int4 op, its fallback), not {group}"
    return None


class QuantLinear(nn.Module):
    """A weight-only quantized linear: ``packed`` tensors of ``layout``'s format [, bias], ``y = x Ŵᵀ + b``.

    packed: {suffix: tensor} as the format writes them (placeholders of the right shape and dtype are enough; a
    ``load_state_dict(..., assign=True)`` then fills them). backend: see the module docstring.
    """

    def __init__(
        self,
        layout: ModuleType,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int,
        packed: dict[str, torch.Tensor],
        bias: torch.Tensor | None = None,
        backend: str = "reference",
    ):
        super().__init__()
        self.layout = layout
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        self.suffixes = tuple(packed)
        for suffix, tensor in packed.items():
            self.register_buffer(suffix, tensor)
        self.register_buffer("bias", bias)
        self.backend = backend
        self._int4 = None  # Int4CpuWeight, prepared at the first cpu-int4 forward

    @property
    def backend(self) -> str:
        return self._backend

    @backend.setter
    def backend(self, value: str) -> None:
        problem = backend_problem(value, self.bits, self.group_size, self.in_features)
        if problem:
            raise ValueError(f"{problem}; use backend='reference' or 'auto'")
        self._backend = value
        # what "auto" runs by device, worked out once: path() is asked on every forward
        self._auto = {kind: "reference" if backend_problem(kind, self.bits, self.group_size, self.in_features) else kind
                      for kind in ("triton", "cpu-int4")}

    def packed(self) -> dict[str, torch.Tensor]:
        """The packed tensors by suffix, as the format module reads them."""
        return {suffix: getattr(self, suffix) for suffix in self.suffixes}

    def dequantized_weight(self) -> torch.Tensor:
        """Float32 weight [N, K]."""
        return self.layout.dequantize(self.packed(), self.bits)

    def path(self, x: torch.Tensor) -> str:
        """The computation a forward on ``x`` runs: ``reference``, ``cpu-int4`` or ``triton``."""
        backend = self._backend
        if backend == "auto":
            backend = self._auto["triton" if x.is_cuda else "cpu-int4"]
        if backend == "cpu-int4" and x.numel() > CPU_INT4_MAX_ROWS * self.in_features:
            return "reference"
        return backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path(x)
        if path == "reference":
            W = self.dequantized_weight().to(x.dtype)
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return nn.functional.linear(x, W, bias)
        y = self._cpu_int4(x) if path == "cpu-int4" else self._triton(x)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def takes_cpu_int4(self) -> bool:
        """Whether a CPU forward of few rows runs the CPU int4 kernel (backend, bits, group and width allow it)."""
        return (self.backend in ("auto", "cpu-int4") and self.packed_device().type == "cpu"
                and not backend_problem("cpu-int4", self.bits, self.group_size, self.in_features))

    def packed_device(self) -> torch.device:
        """The device the packed tensors live on."""
        return getattr(self, self.suffixes[0]).device

    def prepare(self) -> None:
        """Pack the weight for the CPU int4 kernel now (else the first cpu-int4 forward does), if that path can run it."""
        from toolkit.runtime.cpu_int4 import prepare_int4_cpu

        if self._int4 is None and self.takes_cpu_int4():
            w = self.layout.unpack(self.packed(), self.bits, self.group_size)
            self._int4 = prepare_int4_cpu(w.codes, w.scale, w.zero, self.group_size, w.g_idx)

    def _cpu_int4(self, x: torch.Tensor) -> torch.Tensor:
        from toolkit.runtime.cpu_int4 import int4_mm_cpu

        self.prepare()
        return int4_mm_cpu(x, self._int4)

    def _triton(self, x: torch.Tensor) -> torch.Tensor:
        """The layout's own Triton kernel (``TRITON_KERNEL``), imported at call time: importing this module (or the
        loader) never imports Triton."""
        kernel = self.layout.TRITON_KERNEL
        function = getattr(importlib.import_module(f"toolkit.kernels.{kernel.module}"), kernel.function)
        packed = self.packed()
        return function(x, group_size=self.group_size,
                        **{argument: packed.get(suffix) for argument, suffix in kernel.arguments.items()})

    def extra_repr(self) -> str:
        return (f"layout={self.layout.NAME}, in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, backend={self.backend}")


class SharedInputLinears:
    """Linears that read the same input (q/k/v; gate/up), called as one: ``(y_1, ..., y_n) = linears(x)``.

    When they are all ``QuantLinear``s of the same numerics and each would take the cpu-int4 path on ``x``, their
    codes, scales and zeros are concatenated along the output dimension and run as one int4 matmul (prepared at the
    first such call, in place of the per-linear weights): at decode time on SmolLM2 three calls of q/k/v cost 32 µs,
    one fused 15 µs. Anything else (float linears, another path, different ``g_idx``) runs one call each.
    """

    def __init__(self, linears: list[nn.Module]):
        self.linears = linears
        first = linears[0]
        self._fusable = len(linears) > 1 and all(
            isinstance(m, QuantLinear) and (m.layout, m.bits, m.group_size, m.in_features)
            == (first.layout, first.bits, first.group_size, first.in_features) for m in linears)
        self._int4 = None  # Int4CpuWeight of the concatenated linears
        self._bias = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._runs_fused(x):
            return self._fused_product(x).split([m.out_features for m in self.linears], dim=-1)
        return tuple(m(x) for m in self.linears)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The outputs concatenated along the last dimension (one product where they run fused)."""
        if len(self.linears) == 1:
            return self.linears[0](x)
        if self._runs_fused(x):
            return self._fused_product(x)
        return torch.cat([m(x) for m in self.linears], dim=-1)

    def _runs_fused(self, x: torch.Tensor) -> bool:
        if not (self._fusable and all(m.path(x) == "cpu-int4" for m in self.linears)):
            return False
        self.prepare()
        return self._fusable  # prepare() finds act-order linears whose columns differ unfusable

    def _fused_product(self, x: torch.Tensor) -> torch.Tensor:
        from toolkit.runtime.cpu_int4 import int4_mm_cpu

        y = int4_mm_cpu(x, self._int4)
        return y if self._bias is None else y + self._bias.to(y.dtype)

    def prepare(self) -> None:
        """Pack for the CPU int4 kernel now (else the first call does): the concatenated linears when fusable, else each."""
        from toolkit.runtime.cpu_int4 import prepare_int4_cpu

        if self._int4 is not None:
            return
        if not (self._fusable and all(m.takes_cpu_int4() for m in self.linears)):
            for m in self.linears:
                if isinstance(m, QuantLinear):
                    m.prepare()
            return
        parts = [m.layout.unpack(m.packed(), m.bits, m.group_size) for m in self.linears]
        g_idx = [w.g_idx for w in parts]
        if any(g is None for g in g_idx) != all(g is None for g in g_idx) or (
                g_idx[0] is not None and not all(torch.equal(g_idx[0], g) for g in g_idx)):
            self._fusable = False  # act-order with a different column order per linear: no shared packing
            return
        self._int4 = prepare_int4_cpu(torch.cat([w.codes for w in parts]), torch.cat([w.scale for w in parts]),
                                      torch.cat([w.zero for w in parts]), self.linears[0].group_size, g_idx[0])
        biases = [m.bias for m in self.linears]
        if any(b is not None for b in biases):
            self._bias = torch.cat([b if b is not None else torch.zeros(m.out_features)
                                    for b, m in zip(biases, self.linears)])


def set_backend(model: nn.Module, backend: str) -> int:
    """Switch every ``QuantLinear`` of ``model`` to ``backend``; returns how many there are."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    for m in linears:
        m.backend = backend
    return len(linears)
