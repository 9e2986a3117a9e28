"""llama.cpp itself as the judge of compound's GGUF files of Gemma 3 (llama.cpp's ``gemma3`` architecture: the norm
weights stored as 1 + w, the embedding scaled by llama.cpp, sliding layers with their own RoPE base, the 262k
SentencePiece vocabulary carried over from the source GGUF).

- A tiny random Gemma 3 exported in F32 (a window shorter than the windows scored, linear RoPE scaling on the full
  layer, a final logit cap, norm weights away from their init): llama.cpp's log-probabilities equal transformers'
  within ``FLOAT_TOLERANCE`` per token (measured: 3e-4 nats at most).
- The real Gemma-3 270M, W4 g32 from ``quantize --gguf`` (Q4_0 in the GPTQ checkpoint, Q4_1 in the AWQ one):
  llama.cpp's scores on held-out windows match compound's dequantized reference like SmolLM2's do
  (tests/integration/test_llamacpp.py: |Δ mean NLL| ≤ ``TOLERANCE``, top-1 agreement ≥ ``MIN_AGREEMENT``).

Needs the llama.cpp venv (scripts/setup_llamacpp.sh).
"""

import json

import pytest
import torch
from gemma3_checkpoints import gemma3_gguf
from test_llamacpp import MIN_AGREEMENT, TOLERANCE, judge, reference

# the worker that builds the shared Gemma-3 checkpoints for the vLLM and EAGLE-3 tests, so they are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3_checkpoints")]
FLOAT_TOLERANCE = 2e-3  # nats per token, llama.cpp against transformers, F32 weights


def test_llama_cpp_runs_a_tiny_gemma3_like_transformers(tmp_path, smol_tokenizer, one_thread):
    from conftest import GEMMA3_GGUF, SMOL_VOCAB, perturb_biases_and_norms, tiny_model
    from toolkit.gguf_export import export_gguf

    model = perturb_biases_and_norms(tiny_model("gemma3_text", **GEMMA3_GGUF))
    model.save_pretrained(tmp_path / "tiny")
    smol_tokenizer.save_pretrained(tmp_path / "tiny")  # a byte-level BPE vocabulary llama.cpp loads (gpt2)
    path = export_gguf(str(tmp_path / "tiny"), tmp_path / "tiny-F32.gguf", outtype="F32")
    torch.manual_seed(1)
    ids = torch.randint(0, SMOL_VOCAB, (2, 24))  # 24 positions: past the window of 6
    (tmp_path / "ids.json").write_text(json.dumps(ids.tolist()))
    theirs = torch.tensor(judge("logprobs", path, tmp_path / "ids.json")["logprobs"], dtype=torch.float64)
    with torch.no_grad():
        ours = model(ids).logits.double().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    assert (ours - theirs).abs().max() <= FLOAT_TOLERANCE, (ours - theirs).abs().max()


@pytest.mark.parametrize("name", ["gptq", "awq"])
def test_llama_cpp_scores_compound_gemma3_w4_like_compound(gemma3_checkpoints, gemma3_windows, name):
    tokens, tokens_file = gemma3_windows
    llamacpp = judge("logprobs", gemma3_gguf(gemma3_checkpoints, name), tokens_file)
    model, _ = reference(gemma3_checkpoints[name])
    ours, agree = [], []
    with torch.no_grad():
        for i, window in enumerate(tokens):  # one window at a time: 262k-entry logits
            logp = model(window[None]).logits[0, :-1].double().log_softmax(-1)
            ours.append(logp.gather(-1, window[1:, None])[:, 0])
            agree.append(logp.argmax(-1) == torch.tensor(llamacpp["top1"][i]))
    gap = abs(torch.cat(ours).mean().item() - torch.tensor(llamacpp["logprobs"]).mean().item())
    agreement = torch.cat(agree).double().mean().item()
    print(f"\n{name}: |Δ mean NLL| {gap:.4f}, top-1 agreement {agreement:.3f}")
    assert gap <= TOLERANCE and agreement >= MIN_AGREEMENT, (gap, agreement)
