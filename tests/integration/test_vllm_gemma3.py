"""vLLM (CPU build) serves compound's W4 checkpoints of the real Gemma-3 270M (``Gemma3ForCausalLM``: sliding and
full layers, q/k norms, the 262k vocabulary): the symmetric GPTQ layout and the asymmetric AWQ layout
(``gemma3_checkpoints``) each score held-out windows like compound's own loader does, |Δ mean NLL| ≤ ``TOLERANCE``
(test_vllm.py's bound for SmolLM2). Both are scored in one vLLM process (``vllm_nll.py --also``): vLLM imported once,
one engine per checkpoint.

dtype: bfloat16, not test_vllm.py's float16. vLLM 0.32 refuses float16 for this model type ("The model type
'gemma3_text' does not support float16. Reason: Numerical instability. Please use bfloat16 or float32 instead.") and
its GPTQ method refuses float32 ("torch.float32 is not supported for quantization method auto_gptq. Supported dtypes:
[torch.float16, torch.bfloat16]"). In bfloat16 vLLM rounds the fp16 scales to 7 mantissa bits: measured 2026-12-06,
compound fp32 against vLLM bf16, GPTQ 3.99656 → 3.98804 (Δ −0.0085), AWQ 3.66923 → 3.66610 (Δ −0.0031), 2 × 127
tokens, both on the CPUWNA16 kernel."""

import pytest
import torch
from gemma3_checkpoints import SEQ_LEN, WINDOWS
from test_vllm import TOLERANCE, run_vllm, vllm_result

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3_checkpoints")]
VLLM_DTYPE = "bfloat16"
METHODS = {"gptq": ("gptq", "gptq_marlin", "auto_gptq"), "awq": ("awq", "awq_marlin", "auto_awq")}


def test_vllm_scores_gemma3_gptq_and_awq_like_compound(gemma3_checkpoints, gemma3_windows):
    from toolkit.evaluate.perplexity import perplexity
    from toolkit.runtime.load import load_quantized

    tokens, tokens_file = gemma3_windows
    first = vllm_result(run_vllm(gemma3_checkpoints["gptq"], tokens_file, "--strict-weights", "--dtype", VLLM_DTYPE,
                                 "--also", str(gemma3_checkpoints["awq"])))
    for name, theirs in (("gptq", first), ("awq", first["also"])):
        model, _ = load_quantized(gemma3_checkpoints[name], dtype=torch.float32)
        ours = perplexity(model, tokens)
        print(f"\n{name}: compound fp32 NLL {ours.nll:.5f} | vLLM {VLLM_DTYPE} NLL {theirs['nll']:.5f} "
              f"| Δ {theirs['nll'] - ours.nll:+.5f} | {theirs['quantization']} {theirs['kernels']}")
        assert theirs["tokens"] == ours.tokens == WINDOWS * (SEQ_LEN - 1)
        assert theirs["quantization"] in METHODS[name]
        assert abs(theirs["nll"] - ours.nll) <= TOLERANCE, name
