"""Generation checks: the judges on labelled answers, the shipped prompt sets, and a run through the decode loop."""

import pytest

from conftest import tiny_model
from toolkit.evaluate.generation import SETS, passes, prompt_set, run_checks


@pytest.mark.parametrize("check,answer,expected,ok", [
    ("json", '```json\n{"name": "Alice", "age": 30}\n```', None, True),
    ("json", 'Sure! {"name": "Alice", "age": 30} Hope this helps.', None, True),
    ("json", '["apple", "pear", "fig"]', None, True),
    ("json", '{"name": "Alice", "age": }', None, False),
    ("json", "I cannot produce JSON.", None, False),
    ("code", "```python\ndef add(a, b):\n    return a + b\n```", None, True),
    ("code", "def add(a, b):\n    return a + b", None, True),
    ("code", "```python\ndef add(a, b)\n    return a + b\n```", None, False),
    ("code", "Here is how you add two numbers in Python.", None, False),
    ("code", "Paris", None, False),  # valid Python, but only a name
    ("code", "", None, False),
    ("code", "```python\nreturn 1\n```", None, False),  # compiles only inside a function
    ("factual", "The capital of France is Paris.", "Paris", True),
    ("factual", "paris", "Paris", True),
    ("factual", "It freezes at 10 degrees.", "0", False),
    ("factual", "Water freezes at 0 °C.", "0", True),
    ("factual", "Lyon", "Paris", False),
])
def test_judges_on_labelled_answers(check, answer, expected, ok):
    assert passes(check, answer, expected) is ok


def test_shipped_prompt_sets_are_well_formed():
    for name in SETS:
        prompts = prompt_set(name)
        assert len(prompts) >= 8 and len({p.id for p in prompts}) == len(prompts)
        assert all(p.prompt.strip() for p in prompts)
        assert all(p.answer for p in prompts) == (name == "factual")


def test_unknown_set_is_refused():
    with pytest.raises(ValueError, match="unknown prompt set"):
        prompt_set("poetry")


def test_a_model_against_itself_passes_what_its_base_passes(smol_tokenizer):
    model = tiny_model("llama")
    results = run_checks({"model": model, "base": model}, smol_tokenizer, max_new_tokens=4)
    assert [r.set for r in results] == list(SETS)
    for r in results:
        assert r.prompts == len(prompt_set(r.set)) and r.passed["model"] == r.passed["base"]
        assert r.outputs["model"] == r.outputs["base"] and all(r.outputs["model"].values())
        assert r.same_as_base == (1.0 if r.set == "factual" else None)
