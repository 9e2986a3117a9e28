"""vLLM (CPU build) as the independent judge of deployability: for every layout compound writes (GPTQ symmetric,
AWQ asymmetric, compressed-tensors symmetric and asymmetric) vLLM must load compound's checkpoint of the real model
and score held-out windows like compound's own loader does (|Δ mean NLL| ≤ 0.02 nats), and must refuse the same
checkpoint with one tensor missing. A compressed-tensors checkpoint with FP8 KV-cache scales is also served with an
FP8 KV cache, and must run with exactly those scales.

Checkpoints: ``tests/integration/smollm2_checkpoints.py`` (RTN W4 g64, symmetric GPTQ with FP8 KV-cache scales and
asymmetric AWQ, each also converted to compressed-tensors, and symmetric GPTQ over the full code range, whose scales
are negative where a group's extreme is positive), shared with the other loaders' tests.

Needs the vLLM venv made by ``bash scripts/setup_vllm.sh`` (.venvs/vllm); vLLM runs there in a subprocess
(tests/integration/vllm_nll.py), since it pins its own torch/transformers. One vLLM process per checkpoint: it scores
the checkpoint, then loads the broken copy with vLLM already imported (``--broken``). 7.5 CPU-minutes in all
(15 minutes wall on a shared 2-core machine at load ~10; the two quantizations run side by side).

dtype: vLLM runs in float16 and compound in float32. The checkpoint stores its scales, embeddings and norms in
fp16 (``config.json`` dtype float16), so vLLM in fp16 holds every checkpoint tensor exactly, and with fp16
activations (10 mantissa bits, fp32 accumulation in the CPUWNA16 kernel) it lands within ~1e-4 nats of compound's
exact fp32 dequantize-then-matmul reference. In bfloat16 vLLM first rounds every fp16 scale and weight to 7
mantissa bits and the gap grows to ~5e-3 nats (still under the 0.02 bound, but with less margin). fp16 also keeps
the test on the true W4A16 path on any CPU: vLLM's W4A8 (AMX) path is taken only for bf16 activations.

FP8 KV cache: vLLM 0.32's CPU attention backend stores an fp8 (E4M3) cache scaled by each layer's ``_k_scale_float``
/ ``_v_scale_float``; it needs x86 with AVX-512 or AMX and a head size divisible by 32 (SmolLM2: 64), and the test
skips where the CPU lacks both. vLLM reads KV scales only through compressed-tensors, and a declared
``kv_cache_scheme`` switches its default (``--kv-cache-dtype auto``) to fp8; the parity test therefore pins the
cache to float16. GPTQ and AWQ checkpoints load with their ``k_scale`` tensors dropped and, under
``--kv-cache-dtype fp8``, run at scale 1.0 (measured: mean NLL 2.9609 at scale 1.0, 2.9538 with compound's scales,
2.9191 with a float cache, 4 × 256 tokens). The fp8 cache costs ~0.02-0.035 nats on this model, hence its bound.
"""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import skip_where_vllm_has_no_w4_kernel
import torch
from safetensors.torch import load_file, save_file
from smollm2_checkpoints import SEQ_LEN, WINDOWS

# one xdist worker for every module that uses the shared smollm2_checkpoints, so they are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("smollm2_checkpoints")]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venvs" / "vllm" / "bin" / "python"
VLLM_NLL = Path(__file__).with_name("vllm_nll.py")
VLLM_DTYPE = "float16"
TOLERANCE = 0.02  # nats, |Δ mean NLL| between compound and vLLM, same weights, float KV cache
FP8_KV_TOLERANCE = 0.1  # nats, vLLM with an fp8 KV cache against compound's float one
DROPPED = "model.layers.3.mlp.down_proj"  # + the layout's first suffix (qweight / weight_packed)
# name: (first suffix of a quantized linear, the quantization vLLM must report)
CHECKPOINTS = {
    "gptq": ("qweight", ("gptq", "gptq_marlin", "auto_gptq")),
    "gptq-full-range": ("qweight", ("gptq", "gptq_marlin", "auto_gptq")),  # negative scales
    "awq": ("qweight", ("awq", "awq_marlin", "auto_awq")),
    "compressed-tensors-sym": ("weight_packed", ("compressed-tensors",)),
    "compressed-tensors-asym": ("weight_packed", ("compressed-tensors",)),
}

if not VLLM_PYTHON.exists():
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: run scripts/setup_vllm.sh", allow_module_level=True)


def run_vllm(model: Path, tokens: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VLLM_PYTHON), str(VLLM_NLL), "--model", str(model), "--tokens", str(tokens), "--dtype", VLLM_DTYPE,
         *extra],
        capture_output=True, text=True, timeout=900, cwd=ROOT,
    )


def vllm_result(result: subprocess.CompletedProcess) -> dict:
    if result.returncode:
        skip_where_vllm_has_no_w4_kernel(result.stderr)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def compound_nll(smollm2_checkpoints, smollm2_windows):
    """Mean NLL of each checkpoint under compound's loader (fp32), computed once per checkpoint."""
    from toolkit.evaluate.perplexity import perplexity
    from toolkit.runtime.load import load_quantized

    cache = {}

    def score(name):
        if name not in cache:
            model, _ = load_quantized(smollm2_checkpoints[name], dtype=torch.float32)
            cache[name] = perplexity(model, smollm2_windows[0])  # each window scored from its 2nd token
        return cache[name]

    return score


def _broken_copy(checkpoint: Path, dropped: str, directory: Path) -> Path:
    broken = directory / f"{checkpoint.name}-broken"
    shutil.copytree(checkpoint, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    return broken


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_vllm_scores_every_layout_like_compound_and_refuses_a_missing_tensor(
    name, smollm2_checkpoints, smollm2_windows, compound_nll, tmp_path
):
    suffix, methods = CHECKPOINTS[name]
    dropped = f"{DROPPED}.{suffix}"
    ours = compound_nll(name)
    broken = _broken_copy(smollm2_checkpoints[name], dropped, tmp_path)
    # the cache pinned to the activation dtype: judged on weights alone (compressed-tensors-sym declares an FP8
    # kv_cache_scheme, which vLLM would otherwise honour by default)
    theirs = vllm_result(run_vllm(smollm2_checkpoints[name], smollm2_windows[1], "--strict-weights",
                                  "--kv-cache-dtype", VLLM_DTYPE, "--broken", str(broken)))

    print(f"\n{name}: compound fp32 NLL {ours.nll:.5f} | vLLM {VLLM_DTYPE} NLL {theirs['nll']:.5f} "
          f"| Δ {theirs['nll'] - ours.nll:+.5f} | {theirs['quantization']} {theirs['kernels']}")
    assert theirs["tokens"] == ours.tokens == WINDOWS * (SEQ_LEN - 1)
    assert theirs["quantization"] in methods
    assert abs(theirs["nll"] - ours.nll) <= TOLERANCE
    error = theirs["broken_error"]
    assert error is not None, f"vLLM loaded a {name} checkpoint without {dropped}"
    assert "were not initialized from checkpoint" in error and dropped in error, error


def test_vllm_serves_an_fp8_kv_cache_with_the_checkpoint_scales(smollm2_checkpoints, smollm2_windows, compound_nll):
    checkpoint = smollm2_checkpoints["compressed-tensors-sym"]
    result = run_vllm(checkpoint, smollm2_windows[1])  # no --kv-cache-dtype: the kv_cache_scheme alone selects fp8
    if result.returncode != 0 and "FP8 KV cache on CPU requires" in result.stderr:
        pytest.skip("this CPU has neither AVX-512 nor AMX, which vLLM's CPU backend needs for an fp8 KV cache")
    theirs = vllm_result(result)
    ours = compound_nll("compressed-tensors-sym")

    tensors = load_file(checkpoint / "model.safetensors")
    layers = sum(name.endswith(".self_attn.k_scale") for name in tensors)
    written = [[tensors[f"model.layers.{i}.self_attn.{s}_scale"].float().item() for s in "kv"] for i in range(layers)]
    print(f"\nfp8 KV cache: compound fp32 (float cache) NLL {ours.nll:.5f} | vLLM {VLLM_DTYPE} fp8 cache NLL "
          f"{theirs['nll']:.5f} | Δ {theirs['nll'] - ours.nll:+.5f} | k_scale layer 0 {written[0][0]:.4g}")
    assert theirs["kv_cache_dtype"] == "fp8" and theirs["quantization"] == "compressed-tensors"
    assert theirs["kv_scales"] == written  # the checkpoint's scales, not the default 1.0
    assert abs(theirs["nll"] - ours.nll) <= FP8_KV_TOLERANCE
