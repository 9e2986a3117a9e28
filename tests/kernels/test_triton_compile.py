"""The kernels compile for real GPUs without one: ``triton.compile`` down to a cubin through Triton's bundled ptxas.

The interpreter forgives what the compiler refuses (mixed types across branches, dot operand shapes, layouts), so
this is the CPU-only check that the code the tests run is also code a GPU can run. It compiles in a subprocess:
in this process the kernels were built for the interpreter (``test_triton_interpret`` sets TRITON_INTERPRET=1).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton

STRIDES = ["stride_xm", "stride_xk", "stride_qk", "stride_qn", "stride_zg", "stride_zn", "stride_sg", "stride_sn",
           "stride_ym", "stride_yn"]


def compile_variants(arch: int = 90) -> int:
    """Compile one split-K and one GEMM variant per layout and activation dtype family; returns how many."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from toolkit.kernels._launch import GEMM_CONFIGS, SPLIT_K_CONFIGS, interpreting
    from toolkit.kernels.w4a16_awq import _awq_kernel
    from toolkit.kernels.w4a16_gptq import _gptq_kernel

    assert not interpreting(_gptq_kernel), "TRITON_INTERPRET leaked into the compile check"
    variants = [  # (kernel, x dtype, config, layout constexprs)
        (_gptq_kernel, "fp16", SPLIT_K_CONFIGS[1], {"ZERO_OFFSET": 1, "HAS_ZEROS": True, "HAS_G_IDX": True}),
        (_gptq_kernel, "bf16", GEMM_CONFIGS[-1], {"ZERO_OFFSET": 0, "HAS_ZEROS": False, "HAS_G_IDX": False}),  # CT sym
        (_awq_kernel, "fp32", GEMM_CONFIGS[0], {}),
    ]
    for kernel, x_dtype, config, layout in variants:
        split_k = config in SPLIT_K_CONFIGS
        signature = {"x_ptr": f"*{x_dtype}", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "g_ptr": "*i32",
                     "y_ptr": "*fp32" if split_k else f"*{x_dtype}",
                     **dict.fromkeys(["M", "N", "K", "group_size", "M_BUCKET", *STRIDES], "i32")}
        constexprs = {**layout, "DOT_FP32": x_dtype == "fp32", **config.kwargs}
        signature.update(dict.fromkeys(constexprs, "constexpr"))
        source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
        triton.compile(source, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return len(variants)


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9's default-change warning
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_triton_compile as t; print(t.compile_variants())"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("3")
