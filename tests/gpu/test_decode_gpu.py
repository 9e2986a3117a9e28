"""``compound decode`` on CUDA: a W4 g128 checkpoint of a random-weight 1B Llama decodes through the Triton kernels
with the greedy tokens of the dequantized reference (the same model with every ``QuantLinear`` on its ``reference``
backend), and its tokens/s is recorded; the command itself runs with ``--device cuda`` and says the kernels ran."""

import json

import pytest
import torch
from gpu_models import GPU_REASON, LLAMA_1B, random_llama, record, work_dir
from typer.testing import CliRunner

from toolkit.cli import app

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=GPU_REASON)]

NEW_TOKENS = 64
PROMPT = "Name three colours and say why the sky is blue."


def _checkpoint(tmp_path):
    """The 1B Llama's GPTQ checkpoint that the quantize check left in the shared work folder, else an RTN one."""
    from toolkit.quant.configs import RTNConfig
    from toolkit.quantize import QuantizeSettings, quantize

    work = work_dir(tmp_path)
    if (work / "llama-1b-gptq-w4g128" / "compound.json").is_file():
        return work / "llama-1b-gptq-w4g128"
    output = work / "llama-1b-rtn-w4g128"
    if not (output / "compound.json").is_file():
        model = random_llama(work / "llama-1b", LLAMA_1B)
        quantize(str(model), RTNConfig(bits=4, group_size=128), output, settings=QuantizeSettings(device="cuda"),
                 overwrite=True)
    return output


def _greedy(decoder, ids, eos):
    """(tokens, stats) of a timed greedy run after a warm-up one (Triton tunes each new shape on its first call)."""
    from toolkit.decode import generate

    generate(decoder, ids, NEW_TOKENS, eos_token_id=eos)
    torch.cuda.synchronize()
    return generate(decoder, ids, NEW_TOKENS, eos_token_id=eos)


def test_triton_decode_equals_the_dequantized_reference(tmp_path):
    from toolkit.calibration import chat_prompt_ids
    from toolkit.decode import Decoder
    from toolkit.runtime.load import load_quantized
    from toolkit.runtime.quant_linear import QuantLinear

    checkpoint = _checkpoint(tmp_path)
    model, tokenizer = load_quantized(checkpoint)
    model.to("cuda")
    ids = chat_prompt_ids(tokenizer, PROMPT)
    decoder = Decoder.from_model(model, len(ids) + NEW_TOKENS)
    decoder.prepare()
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert all(m.path(torch.empty(1, m.in_features, device="cuda")) == "triton" for m in linears)
    triton_tokens, triton_stats = _greedy(decoder, ids, tokenizer.eos_token_id)
    for m in linears:
        m.backend = "reference"
    reference_tokens, reference_stats = _greedy(decoder, ids, tokenizer.eos_token_id)
    same = int((triton_tokens[: len(reference_tokens)] == reference_tokens[: len(triton_tokens)]).cumprod(0).sum())
    layout = json.loads((checkpoint / "config.json").read_text())["quantization_config"]["quant_method"]
    record("decode", {"model": f"random Llama 1.2B, {checkpoint.name} ({layout} layout), fp32 activations",
                      "new_tokens": triton_stats.new_tokens, "triton_tokens_per_s": round(triton_stats.tokens_per_s, 1),
                      "reference_tokens_per_s": round(reference_stats.tokens_per_s, 1),
                      "tokens_equal": bool(torch.equal(triton_tokens, reference_tokens)),
                      "equal_prefix": same - len(ids)})
    assert torch.equal(triton_tokens, reference_tokens), f"the tokens part after {same - len(ids)} new tokens"


def test_the_decode_command_runs_the_triton_kernels(tmp_path):
    result = CliRunner().invoke(app, ["decode", "--model", str(_checkpoint(tmp_path)), "--prompt", PROMPT,
                                      "--max-new-tokens", "16", "--device", "cuda"])
    assert result.exit_code == 0, result.output
    assert "int4 linears run the Triton kernels" in " ".join(result.output.replace("│", " ").split())
