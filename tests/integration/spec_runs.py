"""vLLM's runs of compound's draft heads for the float SmolLM2 (``spec_target``), shared by test_vllm_medusa.py,
test_vllm_eagle.py (its float cases) and test_vllm_speculators.py; a pytest plugin (``tests/conftest.py``), built once
per session on the xdist worker of their group "spec_runs".

Each module declares its cases (``medusa_cases``, ``float_cases``, ``speculators_cases``: heads fitted on the
target's greedy continuations, exported, and compound's prediction of their acceptance); the speculators layout reuses
the EAGLE-3 heads and predictions, the same objects. One vllm_spec.py process serves them all, one engine each, then
decodes without speculation once: the reference every head's output must equal. One process instead of three saves
two imports of vLLM and two plain runs (each engine takes about a CPU minute), and the EAGLE-3 head is fitted once.
"""

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_SPEC = Path(__file__).with_name("vllm_spec.py")


@pytest.fixture(scope="session")
def spec_runs(spec_target, tmp_path_factory) -> dict[str, dict]:
    """{case: {"method", "directory", "prediction", "head", "num_speculative_tokens", "vllm"}} for the cases of the
    three modules; "vllm": {"drafts": {case: vllm_spec.py's entry}, "plain", "plain_speculative", "vllm", "log": the
    case's engine's log lines that name the speculative config}."""
    from conftest import torch_threads
    from test_vllm_eagle import NEW_TOKENS, VLLM_PYTHON, float_cases  # skips where vLLM's venv is missing
    from test_vllm_medusa import medusa_cases
    from test_vllm_speculators import speculators_cases

    prompts = spec_target[3]
    work = tmp_path_factory.mktemp("spec-heads")
    with torch_threads(1):  # as one_thread: the predictions were measured on one thread
        eagle = float_cases(spec_target, work)
        cases = {**medusa_cases(spec_target, work), **eagle, **speculators_cases(spec_target, eagle, work)}
    prompt_file = work / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    done = subprocess.run(
        [str(VLLM_PYTHON), str(VLLM_SPEC), "--model", str(spec_target[1]), "--prompts", str(prompt_file),
         "--max-tokens", str(NEW_TOKENS), "--dtype", "float32",
         "--heads", *(str(case["directory"]) for case in cases.values()),
         "--method", *(case["method"] for case in cases.values()),
         "--num-speculative-tokens", *(str(case["num_speculative_tokens"]) for case in cases.values())],
        capture_output=True, text=True, timeout=3000, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-6000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    drafts = dict(zip(cases, out["drafts"]))
    for name, case in cases.items():
        case["vllm"] = {"drafts": drafts, "plain": out["plain"], "plain_speculative": out["plain_speculative"],
                        "vllm": out["vllm"], "log": "\n".join(drafts[name].get("spec_log", []))}
    return cases
