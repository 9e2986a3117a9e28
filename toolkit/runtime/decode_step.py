"""compound's float32 CPU decode step (``cpu_decode_step.cpp``): the work between a decoder layer's linears in a few
C++ calls instead of some twenty torch operations each.

On a small model the decode step is dispatch-bound: SmolLM2-135M spent about 6 ms of a 13-15 ms two-thread step
(W4, batch 1) in the torch operations between its linears, 200 of them per layer at 1-3 µs each, more than its int4
matmuls. ``toolkit.decode.Decoder`` runs these instead where ``load()`` gives the module: a float32 model and cache
on a CPU with AVX2 and FMA where the file builds. Each function computes every row alone in one fixed order, so a
token's bits do not depend on how many rows come with it (lossless speculative decoding, float32 attention
included); the decoder's torch forward stays the reference they are tested against.

| function         | does                                                                                          |
|------------------|-----------------------------------------------------------------------------------------------|
| ``rms_norm``     | ``(x · r) · (offset + w)``, r = 1/sqrt(mean(x²) + eps), per row (the sum of squares in float64) |
| ``add_rms_norm`` | ``x + delta`` and its RMSNorm: the residual add ending one block and the norm starting the next |
| ``rope_and_cache`` | per-head q/k norms (if given), rotate-half RoPE, k and v written to the cache slots          |
| ``attention``    | per (row, head), keys in order: scaled (soft-capped) scores, softmax, weighted values; GQA     |
| ``silu_mul``     | ``silu(gate) · up`` of a fused gate/up output                                                 |
"""

from __future__ import annotations

from types import ModuleType

from toolkit.runtime import native

BUILD = native.NativeBuild("cpu_decode_step.cpp", ("avx2", "fma"), ("-mavx2", "-mfma", "-ffp-contract=off"))


def load() -> ModuleType | None:
    """The compiled decode step, or None where it does not run here (the reason logged once, see ``native``)."""
    return native.load(BUILD)
