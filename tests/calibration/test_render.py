import json

import pytest
import torch

from toolkit.calibration import (
    CalibrationError,
    calibration_batch,
    eval_windows,
    fingerprint,
    iter_split,
    load_records,
    split_of,
    train_records,
)


def _ids_in(split, n):
    return [i for i in (f"doc-{k}" for k in range(10_000)) if split_of(i) == split][:n]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_calibration_batch_shape_and_determinism(smol_tokenizer):
    a = calibration_batch(smol_tokenizer, "sharegpt", samples=8, seq_len=128, seed=0)
    b = calibration_batch(smol_tokenizer, "sharegpt", samples=8, seq_len=128, seed=0)
    c = calibration_batch(smol_tokenizer, "sharegpt", samples=8, seq_len=128, seed=1)
    assert a.shape == (8, 128) and a.dtype == torch.long
    assert torch.equal(a, b) and fingerprint(a) == fingerprint(b)
    assert not torch.equal(a, c) and fingerprint(a) != fingerprint(c)


def test_chat_template_is_applied_once(smol_tokenizer):
    tokens = calibration_batch(smol_tokenizer, "sharegpt", samples=16, seq_len=256)
    text = smol_tokenizer.decode(tokens.flatten())
    assert "<|im_start|>assistant" in text and "<|im_start|>user" in text
    assert "<|im_start|><|im_start|>" not in text


def test_eval_windows_fixed_and_disjoint_from_calibration_pool(smol_tokenizer):
    first = eval_windows(smol_tokenizer, windows=8, seq_len=128)
    calibration_batch(smol_tokenizer, samples=8, seq_len=128, seed=3)
    assert torch.equal(first, eval_windows(smol_tokenizer, windows=8, seq_len=128))
    assert first.shape == (8, 128)

    # Reference: the eval split rendered in file order; and its records never meet the calibration pool.
    eval_ids, reference = [], []
    for record in iter_split(load_records("sharegpt"), "eval"):
        if not any(m["content"].strip() for m in record.messages):
            continue
        text = smol_tokenizer.apply_chat_template(list(record.messages), tokenize=False)
        reference += smol_tokenizer(text, add_special_tokens=False)["input_ids"]
        eval_ids.append(record.id)
        if len(reference) >= 8 * 128:
            break
    assert first.flatten().tolist() == reference[: 8 * 128]
    pool = [r.id for _, r in zip(range(256), iter_split(load_records("sharegpt"), "calibration"))]
    assert not set(eval_ids) & set(pool)


def test_text_documents_are_separated_by_eos(smol_tokenizer, tmp_path):
    docs = ["The first document.", "A second, longer document about calibration.", "Third."]
    source = _write_jsonl(tmp_path / "docs.jsonl", [{"id": i, "text": d} for i, d in zip(_ids_in("eval", 3), docs)])
    expected = []
    for doc in docs:
        expected += smol_tokenizer(doc, add_special_tokens=False)["input_ids"] + [smol_tokenizer.eos_token_id]
    windows = eval_windows(smol_tokenizer, source, windows=1, seq_len=len(expected))
    assert windows.flatten().tolist() == expected


def test_too_few_tokens(smol_tokenizer, tmp_path):
    source = _write_jsonl(tmp_path / "small.jsonl", [{"id": i, "text": "short"} for i in _ids_in("calibration", 5)])
    with pytest.raises(CalibrationError, match=r"gives only 10 tokens in its calibration split; need .*= 64.*--samples"):
        calibration_batch(smol_tokenizer, source, samples=2, seq_len=32)
    with pytest.raises(CalibrationError, match=r"gives only 0 tokens in its eval split.*--windows or --seq-len"):
        eval_windows(smol_tokenizer, source, windows=1, seq_len=8)


def test_pool_grows_until_it_fills_the_batch(smol_tokenizer, tmp_path):
    records = [{"id": i, "text": f"document number {i}"} for i in _ids_in("calibration", 40)]
    source = _write_jsonl(tmp_path / "docs.jsonl", records)
    tokens = calibration_batch(smol_tokenizer, source, samples=4, seq_len=32, pool=2)
    assert tokens.shape == (4, 32)
    assert torch.equal(tokens, calibration_batch(smol_tokenizer, source, samples=4, seq_len=32, pool=2))


def test_unrenderable_and_empty_conversations_are_skipped(smol_tokenizer, tmp_path, monkeypatch):
    strict = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    monkeypatch.setattr(smol_tokenizer, "chat_template", strict)
    good = [{"role": "user", "content": "question " * 20}, {"role": "assistant", "content": "answer " * 20}]
    bad = [{"role": "assistant", "content": "starts wrong"}]
    ids = _ids_in("eval", 5)
    # eval_windows reads in file order: both bad ones and the empty one come before the good ones it needs.
    records = [{"id": ids[0], "messages": bad}, {"id": ids[1], "messages": []}, {"id": ids[2], "messages": bad}]
    records += [{"id": ids[3], "messages": good}, {"id": ids[4], "messages": good}]
    source = _write_jsonl(tmp_path / "chats.jsonl", records)
    rendered = smol_tokenizer.apply_chat_template(good, tokenize=False)
    per_good = len(smol_tokenizer(rendered, add_special_tokens=False)["input_ids"])
    with pytest.warns(UserWarning, match=r"skipped 2 conversation\(s\).*roles must alternate"):
        tokens = eval_windows(smol_tokenizer, source, windows=2, seq_len=per_good)
    assert tokens[0].tolist() == tokens[1].tolist()
    assert "starts wrong" not in smol_tokenizer.decode(tokens[0])


def test_tokenizer_without_chat_template(smol_tokenizer, monkeypatch):
    monkeypatch.setattr(smol_tokenizer, "chat_template", None)
    with pytest.raises(CalibrationError, match="no chat template"):
        calibration_batch(smol_tokenizer, samples=1, seq_len=8)


def test_invalid_sizes(smol_tokenizer):
    with pytest.raises(CalibrationError, match="samples must be a positive integer, got 0"):
        calibration_batch(smol_tokenizer, samples=0)


def test_train_records_are_train_split_conversations():
    records = [r for _, r in zip(range(50), train_records("sharegpt"))]
    assert len(records) == 50
    assert all(split_of(r.id) == "train" and r.is_conversation for r in records)


def test_fingerprint_hashes_shape_and_values():
    t = torch.arange(8, dtype=torch.long)
    assert len(fingerprint(t)) == 64
    assert fingerprint(t) == fingerprint(t.clone())
    assert fingerprint(t) != fingerprint(t.view(2, 4))
    assert fingerprint(t) != fingerprint(t + 1)
