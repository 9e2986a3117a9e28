"""A model spec is resolved once per verb run (``toolkit.models.resolve_model``): every step of a verb reads the one
``ModelSource`` (config, tokenizer, weights location, family), and no step reads the spec's config again."""

import pytest

from conftest import CHEAP_HEADS, cli
from toolkit import models


@pytest.fixture
def resolved(monkeypatch):
    """The specs resolved (config read, family checked) while a test runs, in order."""
    specs = []
    real = models._resolve
    monkeypatch.setattr(models, "_resolve", lambda spec, trust_remote_code: specs.append(spec)
                        or real(spec, trust_remote_code))
    return specs


def test_each_verb_resolves_each_model_it_is_given_once(tiny_llama_dir, tmp_path, resolved, one_thread):
    target, checkpoint, heads = str(tiny_llama_dir), tmp_path / "gptq", tmp_path / "heads"
    verbs = [  # (argv, the specs it names, each to be resolved once: quantize --eval scores the model it quantized)
        (["quantize", "--model", target, "--method", "gptq", "--group-size", "32", "--samples", "2", "--seq-len",
          "16", "-o", checkpoint, "--eval", "--eval-windows", "1"], [target, str(checkpoint)]),
        (["train-heads", "--model", target, "-o", heads, *CHEAP_HEADS], [target]),
        (["eval", "--model", checkpoint, "--base", target, "--windows", "1", "--seq-len", "16", "--no-generation",
          "-o", tmp_path / "eval"], [str(checkpoint), target]),
        (["validate", "--model", checkpoint, "--windows", "1", "--seq-len", "16"], [str(checkpoint)]),
        (["validate", "--model", target, "--heads", heads, "--prompts", "1", "--max-new-tokens", "4"], [target]),
        (["decode", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "2"], [str(checkpoint)]),
    ]
    for argv, specs in verbs:
        resolved.clear()
        result = cli(*argv)
        assert result.exit_code == 0, result.output
        assert resolved == specs, argv[0]


def test_a_resolved_model_reads_its_tokenizer_once(tiny_llama_dir, monkeypatch):
    import transformers

    source = models.resolve_model(str(tiny_llama_dir))
    reads = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: reads.append(a) or real(*a, **k))
    assert source.tokenizer() is source.tokenizer()
    assert reads == [(str(tiny_llama_dir),)]
    assert models.resolve_model(source) is source  # a resolved model is passed on as it is
