import json

import pytest
import torch

from toolkit.calibration import (
    CalibrationError,
    PlainTextConversations,
    calibration_batch,
    chat_prompt_ids,
    conversation_ids,
    eval_windows,
    fingerprint,
    iter_split,
    load_records,
    render_chat,
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


CONVERSATION = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile."},
                {"role": "user", "content": "Another?"}]


def test_a_base_model_renders_conversations_as_plain_text(smol_tokenizer, monkeypatch):
    """Without a chat template the turns are joined by a blank line, no role tags (SmolLM2's tokenizer adds no BOS), the
    generation prompt is the blank line before the reply, and a warning says so."""
    monkeypatch.setattr(smol_tokenizer, "chat_template", None)
    with pytest.warns(PlainTextConversations, match="no chat template"):
        text = render_chat(smol_tokenizer, CONVERSATION)
    assert text == "Name a river.\n\nThe Nile.\n\nAnother?"
    assert render_chat(smol_tokenizer, CONVERSATION, add_generation_prompt=True) == text + "\n\n"
    assert conversation_ids(smol_tokenizer, CONVERSATION) == smol_tokenizer(text + "\n\n")["input_ids"]
    assert chat_prompt_ids(smol_tokenizer, "Hi") == smol_tokenizer("Hi\n\n")["input_ids"]


def test_a_base_model_calibrates_on_conversations(smol_tokenizer, monkeypatch):
    """calibration_batch reads ShareGPT's conversations for a base model too: the same records, without the template's
    role tags."""
    templated = calibration_batch(smol_tokenizer, samples=2, seq_len=64)
    monkeypatch.setattr(smol_tokenizer, "chat_template", None)
    with pytest.warns(PlainTextConversations):
        plain = calibration_batch(smol_tokenizer, samples=2, seq_len=64)
    assert plain.shape == (2, 64) and not torch.equal(plain, templated)
    assert "<|im_start|>" in smol_tokenizer.decode(templated[0]) and "<|im_start|>" not in smol_tokenizer.decode(plain[0])


def test_the_plain_rendering_starts_with_bos_where_the_tokenizer_adds_it(gemma_tokenizer):
    """Gemma's tokenizer puts BOS first of its own accord (its model is unusable without it): so does the plain text."""
    ids = conversation_ids(gemma_tokenizer, CONVERSATION, add_generation_prompt=False)
    assert ids == gemma_tokenizer("Name a river.\n\nThe Nile.\n\nAnother?")["input_ids"]
    assert ids[0] == gemma_tokenizer.bos_token_id and ids.count(gemma_tokenizer.bos_token_id) == 1


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
