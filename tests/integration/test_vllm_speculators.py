"""vLLM (CPU build) serves compound's EAGLE-3 heads in the speculators layout from the head directory alone: given
``model=DIR`` and no speculative config, it loads the target the config names as verifier and drafts with the head;
greedy output identical to the target's own, acceptance counters non-zero, at the mean accepted length compound's
decode loop predicts for vLLM's chain of 3.

``LLM(model=DIR)`` takes the path ``vllm serve DIR`` takes: both build their config with
``EngineArgs.create_engine_config``, which calls ``maybe_override_with_speculators`` (see
``toolkit.heads.speculators_export``). The target, heads and prediction are test_vllm_eagle.py's, the same objects
(``spec_runs`` fits them once): the float SmolLM2-135M-Instruct written as a Hugging Face directory
(``spec_target``), an eagle3 head with a 2048-token draft vocabulary fitted on the first three prompts'
continuations, and the same ``fc`` and layer over the full vocabulary (no ``d2t``/``t2d`` on disk); exported with
``export_speculators`` in float32, the verifier being the target's directory, ``speculative_tokens`` 3. The session's
one vllm_spec.py process of every float head runs the two directories' engines and the target's without speculation.

Measured (mean accepted length, vLLM | compound): vocab2048 2.2456 | 2.2456 (114 drafts, 142 accepted in both),
full 1.5394 | 1.5394 (165, 89), as test_vllm_eagle.py measures the same heads in the EAGLE layout; vLLM's greedy
tokens equal compound's.

Needs the vLLM venv made by ``bash scripts/setup_vllm.sh`` (.venvs/vllm).
"""

import json
from pathlib import Path

import pytest
import torch
from test_vllm_eagle import K, NEW_TOKENS, TOLERANCE

# on the xdist worker that runs spec_runs (test_vllm_eagle.py's float cases, test_vllm_medusa.py)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("spec_runs")]

CASES = ["vocab2048", "full"]
EAGLE_CASES = {"vocab2048": "eagle3-vocab2048", "full": "eagle3-full"}  # the same head in the EAGLE layout

def speculators_cases(spec_target, eagle: dict[str, dict], work: Path) -> dict[str, dict]:
    """Per case, "speculators-<case>": {"method", "directory", "prediction", "head"} (``spec_runs`` serves them in
    vLLM): test_vllm_eagle.py's eagle3 heads and predictions (``eagle``, its ``float_cases``), exported in the
    speculators layout under ``work``, the target's directory named as the verifier."""
    from toolkit.heads.speculators_export import export_speculators

    _, target_dir, target_sha256, _ = spec_target
    architectures = json.loads((target_dir / "config.json").read_text())["architectures"]
    cases = {}
    for case in CASES:
        head = eagle[EAGLE_CASES[case]]["head"]
        directory = export_speculators(head, work / case, verifier=str(target_dir),
                                       verifier_architectures=architectures, speculative_tokens=K,
                                       target="smollm2-135m", target_sha256=target_sha256, dtype=torch.float32)
        cases[f"speculators-{case}"] = {"method": "speculators", "directory": directory, "head": head,
                                        "num_speculative_tokens": K,
                                        "prediction": eagle[EAGLE_CASES[case]]["prediction"]}
    return cases


@pytest.mark.parametrize("case", CASES)
def test_vllm_serves_the_speculators_directory_alone_losslessly_at_the_predicted_acceptance(case, spec_target,
                                                                                            spec_runs):
    run = spec_runs[f"speculators-{case}"]
    vllm, (ours, steps, accepted), head = run["vllm"], run["prediction"], run["head"]
    got, plain = vllm["drafts"][f"speculators-{case}"], vllm["plain"]
    assert "error" not in got, f"vLLM {vllm['vllm']} refused {case}: {got['error']}"
    predicted = 1 + accepted / steps
    print(f"\n{case}: vLLM mean accepted length {got['mean_accepted_length']:.4f} ({got['num_drafts']} drafts, "
          f"{got['num_accepted_tokens']} accepted, per position {got['accepted_per_pos']}) | compound's prediction "
          f"{predicted:.4f} ({steps} steps, {accepted} accepted) | compound's greedy tokens = vLLM's for "
          f"{sum(a == b for a, b in zip(plain, ours))}/{len(ours)} prompts")
    assert vllm["plain_speculative"] is None
    assert got["model"] == str(spec_target[1])  # the verifier the config names, loaded as the target
    assert got["speculative"] == {"method": "eagle3", "model": str(run["directory"]), "num_speculative_tokens": K}
    assert f"Using auxiliary layers from speculative config: {tuple(head.config.aux_layers)}" in vllm["log"]
    assert got["tokens"] == plain  # lossless: speculation changes no token of greedy decoding
    assert all(len(ids) == NEW_TOKENS for ids in got["tokens"])
    assert got["num_drafts"] > 0 and got["num_accepted_tokens"] > 0
    assert abs(got["mean_accepted_length"] - predicted) <= TOLERANCE * predicted
