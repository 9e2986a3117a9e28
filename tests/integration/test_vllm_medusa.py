"""vLLM (CPU build) serves compound's Medusa heads: greedy output identical to vLLM's own non-speculative greedy
output, at the mean accepted length compound's decode loop predicts for vLLM's top-1 chain.

Target: the float SmolLM2-135M-Instruct (the embedded GGUF, written as a Hugging Face directory). Heads: three,
``MedusaHeads.from_target`` then fitted for a few seconds on the target's own greedy continuations of the first three
prompts (blocks only: the output layers stay copies of the target's ``lm_head``, each 28M parameters that these
few steps need not move); the fourth prompt is unseen, so acceptance is high on three prompts and ~1 on the fourth.
Exported in vLLM's layout (``toolkit.heads.medusa_export``), in float32 like both runs.

Counting (vLLM 0.32.0): ``Scheduler.update_from_output`` records one draft per request per verify step that carried
drafts, with accepted = tokens the step emitted - 1; the mean accepted length is 1 + accepted / drafts
(``SpecDecodingLogging.log``). The first draft chain is proposed from the prefill's last hidden state and the prefill
itself is not counted, like ``toolkit.decode.speculative_generate`` (``DecodeStats.mean_accepted_length``). At the
end of a request neither engine shortens the last chain to the tokens still wanted (vLLM's scheduler schedules whole
chains), so the last step may count accepted tokens that are then cut: the same in both. vLLM only drafts while the
sequence + num_speculative_tokens fits ``max_model_len`` (``GPUModelRunner._input_fits_in_drafter``), so the runner
leaves room; compound's cache likewise holds one more chain. Measured: identical counts (112 drafts, 142 accepted).

Needs the vLLM venv made by ``bash scripts/setup_vllm.sh`` (.venvs/vllm); vLLM runs there in a subprocess
(tests/integration/vllm_spec.py), the session's one process of every float head (``spec_runs``: these heads,
test_vllm_eagle.py's and test_vllm_speculators.py's, and the one plain run all are compared with).
"""

from pathlib import Path

import pytest
import torch

# on the xdist worker that runs spec_runs (test_vllm_eagle.py's float cases, test_vllm_speculators.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("spec_runs")]

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venvs" / "vllm" / "bin" / "python"
FITTED = 3  # the heads are fitted on the first FITTED prompts' continuations
NEW_TOKENS = 64
NUM_HEADS = 3
CHAIN = [(0,), (0, 0), (0, 0, 0)]  # vLLM's Medusa proposal: each head's argmax, one chain (no tree)
FIT_STEPS, FIT_LR = 12, 3e-3  # AdamW on the blocks; per-head top-1 accuracy ~0.9 on the fitted tokens
TOLERANCE = 0.10  # relative, vLLM's mean accepted length against compound's prediction

if not VLLM_PYTHON.exists():
    pytest.skip(f"no vLLM venv at {VLLM_PYTHON}: run scripts/setup_vllm.sh", allow_module_level=True)


def fit_heads(model, prompts: list[list[int]]):
    """Three heads fitted to the target's greedy continuations of ``prompts`` (labels: the continuation tokens)."""
    from toolkit.decode import Decoder, generate
    from toolkit.heads.medusa import MedusaHeads, medusa_loss

    sequences = [generate(Decoder.from_model(model, len(p) + NEW_TOKENS), p, NEW_TOKENS)[0] for p in prompts]
    T = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), T, dtype=torch.long)
    mask = torch.zeros(len(sequences), T, dtype=torch.bool)
    hidden = torch.zeros(len(sequences), T, model.config.hidden_size)
    with torch.no_grad():
        for i, (seq, prompt) in enumerate(zip(sequences, prompts)):
            ids[i, :len(seq)] = seq
            mask[i, len(prompt):len(seq)] = True
            hidden[i, :len(seq)] = model(seq[None], output_hidden_states=True).hidden_states[-1][0]  # final-norm
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(model, num_heads=NUM_HEADS)
    heads.lm_heads.requires_grad_(False)
    optimizer = torch.optim.AdamW(heads.blocks.parameters(), lr=FIT_LR, weight_decay=0.0)
    for _ in range(FIT_STEPS):
        loss, count, _ = medusa_loss(heads, hidden, ids, mask)
        optimizer.zero_grad()
        (loss / count).backward()
        optimizer.step()
    return heads.eval()


def compound_prediction(model, heads, prompts: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """(new tokens per prompt, verify steps, accepted drafts) of compound's loop with the heads' top-1 chain."""
    from toolkit.decode import Decoder, MedusaDrafter, speculative_generate

    drafter = MedusaDrafter(lambda hidden: heads(hidden), paths=CHAIN)
    outputs, steps, accepted = [], 0, 0
    for prompt in prompts:
        decoder = Decoder.from_model(model, len(prompt) + NEW_TOKENS + NUM_HEADS + 1)
        ids, stats = speculative_generate(decoder, drafter, prompt, NEW_TOKENS)
        outputs.append(ids[len(prompt):].tolist())
        steps += len(stats.accepted)
        accepted += sum(stats.accepted)
    return outputs, steps, accepted


def medusa_cases(spec_target, work: Path) -> dict[str, dict]:
    """{"medusa": {"method", "directory", "prediction", "head"}} (``spec_runs`` serves it in vLLM, as a chain of
    NUM_HEADS): the heads fitted on the target's continuations of the first FITTED prompts, exported under ``work``."""
    from toolkit.heads.medusa_export import export_medusa

    model, _, target_sha256, prompts = spec_target
    heads = fit_heads(model, prompts[:FITTED])
    directory = export_medusa(heads, work / "medusa", target="smollm2-135m", target_sha256=target_sha256,
                              dtype=torch.float32)
    return {"medusa": {"method": "medusa", "directory": directory, "head": heads, "num_speculative_tokens": NUM_HEADS,
                       "prediction": compound_prediction(model, heads, prompts)}}


def test_vllm_serves_compound_medusa_heads_losslessly_at_the_predicted_acceptance(spec_target, spec_runs):
    prompts = spec_target[3]
    theirs, (ours, steps, accepted) = spec_runs["medusa"]["vllm"], spec_runs["medusa"]["prediction"]
    predicted = 1 + accepted / steps
    medusa = theirs["drafts"]["medusa"]
    assert "error" not in medusa, medusa.get("error")

    same_as_compound = sum(a == b for a, b in zip(theirs["plain"], ours))
    print(f"\nvLLM {theirs['vllm']} Medusa: mean accepted length {medusa['mean_accepted_length']:.4f} "
          f"({medusa['num_drafts']} drafts, {medusa['num_accepted_tokens']} accepted, per position "
          f"{medusa['accepted_per_pos']}) | compound's prediction {predicted:.4f} ({steps} steps, {accepted} "
          f"accepted) | compound's greedy tokens = vLLM's for {same_as_compound}/{len(prompts)} prompts")
    assert medusa["tokens"] == theirs["plain"]  # lossless: speculation changes no token of greedy decoding
    assert all(len(ids) == NEW_TOKENS for ids in medusa["tokens"])
    assert predicted > 1.5  # the heads are not trivial
    assert abs(medusa["mean_accepted_length"] - predicted) <= TOLERANCE * predicted
