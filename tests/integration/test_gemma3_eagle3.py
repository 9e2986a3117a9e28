"""An EAGLE-3 head for the real Gemma-3 270M (the W4 GPTQ checkpoint of ``gemma3_checkpoints``): ``train-heads --head
eagle3`` on a tiny budget, then ``validate --heads`` decodes with it in every draft shape, each losslessly (the
speculative output equals plain greedy decoding). The head is a Llama layer over the target's features with the RoPE
of Gemma's global layers; its quality is not judged here (two steps), only that drafting never changes the output."""

import json

import pytest
from conftest import cli, run_train_heads

from toolkit.heads.eagle_export import load_eagle

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gemma3_checkpoints")]


def test_train_heads_eagle3_on_gemma3_decodes_losslessly(gemma3_checkpoints, tmp_path):
    target, out = gemma3_checkpoints["gptq"], tmp_path / "heads"
    result = run_train_heads(target, out, "--head", "eagle3", "--depth", "3", "--top-k", "2", "--draft-tokens", "4",
                             "--ttt-steps", "2", "--draft-vocab", "300")
    assert result.exit_code == 0, result.output
    head = load_eagle(out)
    assert head.config.hidden_size == 640 and head.config.draft_vocab_size == 300
    assert head.config.rope["rope_parameters"]["rope_theta"] == 1e6  # the global layers' scheme

    checked = cli("validate", "--model", target, "--heads", out, "--prompts", "1", "--max-new-tokens", "8",
                  "--json", tmp_path / "v.json")
    assert checked.exit_code == 0, checked.output
    reports = json.loads((tmp_path / "v.json").read_text())
    assert reports and all(r["lossless"] for r in reports), reports
