"""Slice detection on labelled examples, and per-slice packing of the eval split."""

import json

import pytest

from toolkit.calibration.splits import split_of
from toolkit.evaluate.slices import RECORD_WINDOWS, SLICES, slice_of, slice_windows

LABELLED = {
    "prose": [
        "Can you explain how photosynthesis works in simple terms? Plants take in light, water and carbon dioxide.",
        "Write a short story about a dragon who is afraid of the dark and learns to love the night sky.",
        "Keywords: * Pullout * Wingtips * Wind * Boat * Crowd * Gulls * Collision * Sunrise * Roaring * Shriek",
        "VXIgc3BlY2llcyBoYXZlIHNlbnNvcnkgb3JnYW5zIHRoYXQgYWxsb3cgdXMgdG8gZGV0ZWN0IHRoZSBzcGVjdHJ1bQ==",
    ],
    "code": [
        "Here is the fix:\n```python\ndef add(a, b):\n    return a + b\n```",
        "Why does this crash?\n#include <stdio.h>\nint main() {\n  printf(\"hi\");\n  return 0;\n}",
        "function greet(name) {\n  console.log('hello ' + name);\n}",
    ],
    "structured": [
        "| Name | Age |\n|---|---|\n| Alice | 30 |\n| Bob | 25 |",
        'The response is {"name": "Alice", "age": 30, "city": "Paris"} as requested.',
        "| Feature | Plan A | Plan B |\n| :--- | :---: | ---: |\n| Price | $5 | $9 |",
    ],
    "non-english": [
        "请解释一下量子计算的基本原理，以及它和经典计算有什么不同。",
        "Объясните, пожалуйста, как работает двигатель внутреннего сгорания в автомобиле.",
        "¿Puedes explicarme cómo funciona la fotosíntesis en las plantas y por qué es importante para la vida?",
        "Je voudrais savoir comment préparer une bonne soupe à l'oignon pour le dîner de ce soir avec des amis.",
        "Kannst du mir bitte erklären, wie die Photosynthese funktioniert und warum sie für das Leben wichtig ist?",
    ],
}


@pytest.mark.parametrize("label,text", [(label, text) for label, texts in LABELLED.items() for text in texts])
def test_labelled_examples(label, text):
    assert slice_of(text) == label


def test_code_wins_over_structured_and_language():
    assert slice_of('```json\n{"a": 1, "b": 2}\n```') == "code"
    assert slice_of("¿Cómo hago esto?\n```python\nprint('hola')\n```") == "code"


def _eval_ids(n):
    return [i for i in (f"rec-{k}" for k in range(20_000)) if split_of(i) == "eval"][:n]


def test_slice_windows_pack_each_slice_from_its_own_records_in_file_order(tmp_path, smol_tokenizer):
    ids = iter(_eval_ids(100))
    records = [{"id": next(ids), "text": text} for _ in range(3) for texts in LABELLED.values() for text in texts]
    outside = next(i for i in (f"other-{k}" for k in range(100)) if split_of(i) != "eval")
    records.insert(0, {"id": outside, "text": "A held-in record never reaches an eval window."})
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    seq_len, windows = 16, 3
    got = slice_windows(smol_tokenizer, str(source), windows=windows, seq_len=seq_len)
    assert set(got) == set(SLICES)
    for name in SLICES:
        stream = []
        for record in records[1:]:
            if slice_of(record["text"]) == name and len(stream) < windows * seq_len:
                tokens = smol_tokenizer(record["text"], add_special_tokens=False)["input_ids"]
                tokens = (tokens + [smol_tokenizer.eos_token_id])[: RECORD_WINDOWS * seq_len]
                stream += tokens[: windows * seq_len - len(stream)]
        whole = len(stream) // seq_len * seq_len
        assert got[name].shape == (whole // seq_len, seq_len) and got[name].flatten().tolist() == stream[:whole]
    assert sum(t.numel() for t in got.values()) > 0


def test_unknown_slice_is_refused(smol_tokenizer):
    with pytest.raises(ValueError, match="unknown slice"):
        slice_windows(smol_tokenizer, "sharegpt", slices=("poetry",))
