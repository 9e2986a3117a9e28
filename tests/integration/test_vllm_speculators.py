"""vLLM (CPU build) serves compound's EAGLE-3 heads in the speculators layout from the head directory alone: given
``model=DIR`` and no speculative config, it loads the target the config names as verifier and drafts with the head;
greedy output identical to the target's own, acceptance counters non-zero, at the mean accepted length compound's
decode loop predicts for vLLM's chain of 3.

``LLM(model=DIR)`` takes the path ``vllm serve DIR`` takes: both build their config with
``EngineArgs.create_engine_config``, which calls ``maybe_override_with_speculators`` (see
``toolkit.heads.speculators_export``). The target, heads and prediction are test_vllm_eagle.py's: the float
SmolLM2-135M-Instruct written as a Hugging Face directory (``spec_target``), an eagle3 head with a 2048-token draft
vocabulary fitted on the first three prompts' continuations, and the same ``fc`` and layer over the full vocabulary
(no ``d2t``/``t2d`` on disk); exported with ``export_speculators`` in float32, the verifier being the target's
directory, ``speculative_tokens`` 3. One process runs the two heads' engines, then the target's without speculation.

Measured (mean accepted length, vLLM | compound): vocab2048 2.2456 | 2.2456 (114 drafts, 142 accepted in both),
full 1.5394 | 1.5394 (165, 89), as test_vllm_eagle.py measures the same heads in the EAGLE layout; vLLM's greedy
tokens equal compound's.

Needs the vLLM venv made by ``bash scripts/setup_vllm.sh`` (.venvs/vllm). About 4 minutes on a shared 2-core
machine (3 engines).
"""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from test_vllm_eagle import (
    DRAFT_VOCAB,
    FITTED,
    K,
    NEW_TOKENS,
    TOLERANCE,
    VLLM_PYTHON,
    compound_prediction,
    continuations,
    fit_head,
    with_full_vocabulary,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CASES = ["vocab2048", "full"]

# Run by the vLLM venv's python: each model in turn (a speculators directory, or the plain target), one JSON line out.
SERVE = """
import json, sys
args = json.loads(sys.argv[1])
sys.path.insert(0, args["scripts"])
from vllm_spec import _release_engine, _spec_counters  # importing it configures vLLM's environment (vllm_env)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

prompts = [TokensPrompt(prompt_token_ids=p) for p in args["prompts"]]
params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
result = {}
for name, model in args["models"].items():
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=args["max_model_len"],
              max_num_seqs=len(prompts), enable_prefix_caching=False, disable_log_stats=False, seed=0)
    config = llm.llm_engine.vllm_config
    spec = config.speculative_config
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "model": config.model_config.model,
                    "speculative": None if spec is None else
                    {"method": spec.method, "model": spec.model, "num_speculative_tokens": spec.num_speculative_tokens},
                    **(_spec_counters(llm.get_metrics()) if spec is not None else {})}
    del llm, config, spec
    _release_engine()
print(json.dumps(result), flush=True)
"""


@pytest.fixture(scope="module")
def runs(spec_target, tmp_path_factory):
    """(vLLM's results by case and "plain", compound's prediction by case, the head directories, the target's)."""
    from toolkit.heads.speculators_export import export_speculators

    model, target_dir, target_sha256, prompts = spec_target
    work = tmp_path_factory.mktemp("speculators")
    head, metrics = fit_head(model, "eagle3", *continuations(model, prompts[:FITTED]), DRAFT_VOCAB)
    print(f"\nfitted top-1 {metrics['correct_0'] / metrics['count_0']:.3f} on the fitted tokens")
    heads = {"vocab2048": head, "full": with_full_vocabulary(model, head)}
    architectures = json.loads((target_dir / "config.json").read_text())["architectures"]
    dirs = {case: export_speculators(heads[case], work / case, verifier=str(target_dir),
                                     verifier_architectures=architectures, speculative_tokens=K,
                                     target="smollm2-135m", target_sha256=target_sha256, dtype=torch.float32)
            for case in CASES}
    predictions = {case: compound_prediction(model, heads[case], prompts) for case in CASES}
    args = {"scripts": str(Path(__file__).parent), "prompts": prompts, "max_tokens": NEW_TOKENS,
            "max_model_len": max(map(len, prompts)) + NEW_TOKENS + K + 16,
            "models": {**{case: str(d) for case, d in dirs.items()}, "plain": str(target_dir)}}
    done = subprocess.run([str(VLLM_PYTHON), "-c", SERVE, json.dumps(args)], capture_output=True, text=True,
                          timeout=1800, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-6000:]
    vllm = json.loads(done.stdout.strip().splitlines()[-1])
    assert f"Using auxiliary layers from speculative config: {tuple(head.config.aux_layers)}" in done.stderr
    return vllm, predictions, dirs, target_dir


@pytest.mark.parametrize("case", CASES)
def test_vllm_serves_the_speculators_directory_alone_losslessly_at_the_predicted_acceptance(case, runs):
    vllm, predictions, dirs, target_dir = runs
    got, plain = vllm[case], vllm["plain"]
    ours, steps, accepted = predictions[case]
    predicted = 1 + accepted / steps
    print(f"\n{case}: vLLM mean accepted length {got['mean_accepted_length']:.4f} ({got['num_drafts']} drafts, "
          f"{got['num_accepted_tokens']} accepted, per position {got['accepted_per_pos']}) | compound's prediction "
          f"{predicted:.4f} ({steps} steps, {accepted} accepted) | compound's greedy tokens = vLLM's for "
          f"{sum(a == b for a, b in zip(plain['tokens'], ours))}/{len(ours)} prompts")
    assert plain["speculative"] is None
    assert got["model"] == str(target_dir)  # the verifier the config names, loaded as the target
    assert got["speculative"] == {"method": "eagle3", "model": str(dirs[case]), "num_speculative_tokens": K}
    assert got["tokens"] == plain["tokens"]  # lossless: speculation changes no token of greedy decoding
    assert all(len(ids) == NEW_TOKENS for ids in got["tokens"])
    assert got["num_drafts"] > 0 and got["num_accepted_tokens"] > 0
    assert abs(got["mean_accepted_length"] - predicted) <= TOLERANCE * predicted
