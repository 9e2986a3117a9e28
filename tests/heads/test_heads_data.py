import io
import itertools
import json

import pytest
import torch
from conftest import tiny_model
from rich.console import Console

from toolkit.calibration.render import PlainTextConversations, train_records
from toolkit.calibration.sources import Record
from toolkit.heads.data import (
    ChatTemplateError,
    Example,
    build_examples,
    check_trainable,
    read_distilled,
    render_example,
    self_distill,
    show_example,
)

pytestmark = pytest.mark.usefixtures("one_thread")

END = "<|im_end|>"
TWO_TURNS = (
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, on the Seine."},
    {"role": "user", "content": "And of the assistant's country, Italy?"},
    {"role": "assistant", "content": "Rome. Not the end."},
)


def masked_runs(tokenizer, example: Example) -> list[str]:
    """The decoded text of each maximal run of trained tokens."""
    runs = []
    for trained, group in itertools.groupby(zip(example.input_ids.tolist(), example.loss_mask.tolist()),
                                            key=lambda pair: pair[1]):
        if trained:
            runs.append(tokenizer.decode([token for token, _ in group], skip_special_tokens=False))
    return runs


def sharegpt_conversations(count: int, max_chars: int = 4000) -> list[Record]:
    """The first ``count`` short train-split ShareGPT conversations with an assistant reply."""
    fitting = (r for r in train_records("sharegpt") if r.is_conversation
               and any(m["role"] == "assistant" for m in r.messages)
               and sum(len(m["content"]) for m in r.messages) < max_chars)
    return list(itertools.islice(fitting, count))


def test_mask_covers_exactly_the_assistant_contents_and_end_tokens(smol_tokenizer):
    example = render_example(smol_tokenizer, TWO_TURNS, max_len=1000, record_id="two")
    assert example.id == "two" and example.input_ids.dtype == torch.long and example.loss_mask.dtype == torch.bool
    assert example.input_ids.shape == example.loss_mask.shape
    assert masked_runs(smol_tokenizer, example) == ["Paris, on the Seine." + END, "Rome. Not the end." + END]
    prompt_side = smol_tokenizer.decode(example.input_ids[~example.loss_mask])
    assert "You answer briefly." in prompt_side and "capital of France" in prompt_side
    assert prompt_side.count("<|im_start|>assistant\n") == 2  # the role headers stay prompt side
    assert set(example.to_dict()) == {"input_ids", "loss_mask"}


def test_default_system_message_is_prompt_side(smol_tokenizer):
    example = render_example(smol_tokenizer, TWO_TURNS[1:3], max_len=1000)
    assert "SmolLM" in smol_tokenizer.decode(example.input_ids)  # the template's default system message
    assert masked_runs(smol_tokenizer, example) == ["Paris, on the Seine." + END]


def test_mask_on_real_sharegpt_conversations(smol_tokenizer):
    for record in sharegpt_conversations(3):
        example = render_example(smol_tokenizer, record.messages, max_len=100_000, record_id=record.id)
        expected = [m["content"] + END for m in record.messages if m["role"] == "assistant"]
        assert masked_runs(smol_tokenizer, example) == expected, record.id


def test_truncation_keeps_the_mask_aligned(smol_tokenizer):
    full = render_example(smol_tokenizer, TWO_TURNS, max_len=1000)
    mask = full.loss_mask.tolist()
    reply_starts = [i for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
    max_len = reply_starts[1] + 3  # three tokens into the second reply
    cut = render_example(smol_tokenizer, TWO_TURNS, max_len=max_len)
    assert torch.equal(cut.input_ids, full.input_ids[:max_len])
    assert torch.equal(cut.loss_mask, full.loss_mask[:max_len])
    second_reply_head = smol_tokenizer.decode(full.input_ids[reply_starts[1] : max_len])
    assert masked_runs(smol_tokenizer, cut) == ["Paris, on the Seine." + END, second_reply_head]
    first_trained = int(full.loss_mask.nonzero()[0])
    assert render_example(smol_tokenizer, TWO_TURNS, max_len=first_trained) is None  # cut before any reply


def test_no_assistant_turn_gives_none(smol_tokenizer):
    assert render_example(smol_tokenizer, TWO_TURNS[:2], max_len=1000) is None


class _UnstableTemplate:
    """A tokenizer stand-in whose template numbers the conversation up front, so prefixes are not stable."""

    chat_template = "numbered"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt=False):
        return f"{len(messages)} turns\n" + "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def test_prefix_unstable_template_is_refused():
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        render_example(_UnstableTemplate(), TWO_TURNS, max_len=100)


def test_build_examples_takes_the_first_n_and_warns_about_skips(smol_tokenizer):
    long_user = ({"role": "user", "content": "word " * 400}, {"role": "assistant", "content": "ok"})
    records = [
        Record(id="text", text="plain text"),
        Record(id="no-reply", messages=TWO_TURNS[:2]),
        Record(id="too-long", messages=long_user),
        Record(id="good-1", messages=TWO_TURNS),
        Record(id="good-2", messages=TWO_TURNS[1:3]),
        Record(id="never-read", messages=TWO_TURNS),
    ]
    with pytest.warns(UserWarning) as caught:
        examples = build_examples(smol_tokenizer, iter(records), n=2, max_len=64)
    assert [e.id for e in examples] == ["good-1", "good-2"]
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "skipped 3 record(s)" in message and "1 not a conversation" in message
    assert "1 no assistant turn" in message and "1 no assistant token within 64 tokens" in message


def test_build_examples_warns_when_records_run_out(smol_tokenizer):
    with pytest.warns(UserWarning, match="only 1 of the 3 examples"):
        assert len(build_examples(smol_tokenizer, [Record(id="a", messages=TWO_TURNS)], n=3, max_len=256)) == 1


def test_check_trainable_refuses_data_without_assistant_tokens(smol_tokenizer):
    untrained = Example("u", torch.tensor([1, 2, 3]), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="none of the 2 examples has an assistant token"):
        check_trainable([untrained, untrained])
    with pytest.raises(ValueError, match="no examples"):
        check_trainable([])
    check_trainable([untrained, render_example(smol_tokenizer, TWO_TURNS, max_len=1000)])


def test_show_example_highlights_the_trained_tokens(smol_tokenizer):
    example = render_example(smol_tokenizer, TWO_TURNS, max_len=1000, record_id="shown")
    console = Console(record=True, file=io.StringIO(), width=120, color_system="truecolor")
    show_example(console, smol_tokenizer, example)
    plain = console.export_text(clear=False)
    assert f"{int(example.loss_mask.sum())} of {len(example.input_ids)} tokens trained" in plain
    assert "example shown" in plain and "Paris, on the Seine." in plain
    html = console.export_html(inline_styles=True)
    assert "background-color: #008000" in html.split("Paris")[0].rsplit("<span", 1)[1]  # "Paris" is highlighted
    assert "background-color" not in html.split("capital")[0].rsplit("<span", 1)[-1]  # the user's text is not

    console = Console(record=True, file=io.StringIO(), width=120)
    show_example(console, smol_tokenizer, example, max_tokens=10)
    assert f"{int(example.loss_mask.sum())} of {len(example.input_ids)} tokens trained (showing the first 10)" \
        in console.export_text()


# Self-distillation on a random-init tiny Llama with SmolLM2's vocabulary and template. Prompts of different
# lengths share a left-padded batch; greedy tokens must match each prompt generated alone, unpadded.
PROMPTS = [
    Record(id="short", messages=({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "old"})),
    Record(id="text", text="not a conversation"),
    Record(id="system", messages=({"role": "system", "content": "Be terse."},
                                  {"role": "user", "content": "Name three rivers in Europe, please."},
                                  {"role": "assistant", "content": "old"},
                                  {"role": "user", "content": "a second question is not used"})),
    Record(id="long", messages=({"role": "user", "content": "Tell me a story about a lighthouse keeper " * 3},)),
    Record(id="reply-first", messages=({"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "Why?"})),
    Record(id="fifth", messages=({"role": "user", "content": "One more"},)),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def unpadded_greedy_reply(model, tokenizer, prompt, max_new_tokens):
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    new = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=[2], pad_token_id=2)[0, ids.shape[1]:].tolist()
    new = new[: new.index(2)] if 2 in new else new
    return tokenizer.decode(new, skip_special_tokens=True)


def test_self_distill_greedy_matches_unpadded_generation(model, smol_tokenizer, tmp_path):
    distilled = self_distill(model, smol_tokenizer, PROMPTS, n=4, out_path=tmp_path / "d.jsonl", max_new_tokens=8,
                             progress=False)
    assert [r.id for r in distilled] == ["short", "system", "long", "reply-first"]
    assert distilled == read_distilled(tmp_path / "d.jsonl")
    system = distilled[1].messages
    assert [m["role"] for m in system] == ["system", "user", "assistant"]
    assert system[1]["content"] == "Name three rivers in Europe, please."
    assert [m["role"] for m in distilled[3].messages] == ["user", "assistant"]  # prompt = the first user message
    for record in distilled:
        prompt = list(record.messages[:-1])
        assert record.messages[-1]["content"] == unpadded_greedy_reply(model, smol_tokenizer, prompt, 8), record.id


def count_generated_rows(model, monkeypatch) -> list[int]:
    rows = []
    generate = model.generate

    def counting_generate(**kwargs):
        rows.append(kwargs["input_ids"].shape[0])
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", counting_generate)
    return rows


def test_self_distill_resumes_without_regenerating(model, smol_tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    rows = count_generated_rows(model, monkeypatch)
    self_distill(model, smol_tokenizer, PROMPTS, n=2, out_path=path, max_new_tokens=4, batch_size=1, progress=False)
    first_two = path.read_bytes()
    distilled = self_distill(model, smol_tokenizer, PROMPTS, n=4, out_path=path, max_new_tokens=4, batch_size=16)
    assert rows == [1, 1, 2]  # the second run generated only the two new records, in one batch
    assert path.read_bytes().startswith(first_two)
    assert [r.id for r in distilled] == ["short", "system", "long", "reply-first"]
    assert [r.id for r in self_distill(model, smol_tokenizer, PROMPTS, n=3, out_path=path, progress=False)] == \
        ["short", "system", "long"]
    assert rows == [1, 1, 2]  # nothing left to generate


def test_self_distill_drops_a_truncated_last_line(model, smol_tokenizer, tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    self_distill(model, smol_tokenizer, PROMPTS, n=3, out_path=path, max_new_tokens=4, progress=False)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1] + lines[2][:20])  # interrupted while writing the third line
    with pytest.warns(UserWarning, match="line 3 is truncated"):
        assert [r.id for r in read_distilled(path)] == ["short", "system"]
    rows = count_generated_rows(model, monkeypatch)
    with pytest.warns(UserWarning, match="line 3 is truncated"):
        distilled = self_distill(model, smol_tokenizer, PROMPTS, n=3, out_path=path, max_new_tokens=4, progress=False)
    assert rows == [1] and [r.id for r in distilled] == ["short", "system", "long"]
    assert [json.loads(line)["id"] for line in path.read_text().splitlines()] == ["short", "system", "long"]


def test_self_distill_refuses_a_corrupt_middle_line(model, smol_tokenizer, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"id": "a", "messages": []}\nnot json\n{"id": "b", "messages": []}\n')
    with pytest.raises(ValueError, match="line 2 is not a self-distilled record"):
        self_distill(model, smol_tokenizer, PROMPTS, n=3, out_path=path, progress=False)


def test_self_distill_skips_long_prompts_and_warns_when_short(model, smol_tokenizer, tmp_path):
    # Prompt lengths with the template's framing: short 31, system 26, long 55, reply-first 32, fifth 32 tokens.
    with pytest.warns(UserWarning, match="only 4 of the 9 prompts"):
        distilled = self_distill(model, smol_tokenizer, PROMPTS, n=9, out_path=tmp_path / "d.jsonl",
                                 max_new_tokens=2, max_prompt_len=40, progress=False)
    assert [r.id for r in distilled] == ["short", "system", "reply-first", "fifth"]


def test_self_distill_sampling_is_seeded(model, smol_tokenizer, tmp_path):
    def sample(name, seed):
        return self_distill(model, smol_tokenizer, PROMPTS, n=2, out_path=tmp_path / name, max_new_tokens=6,
                            temperature=1.0, seed=seed, progress=False)

    assert sample("a.jsonl", 0) == sample("b.jsonl", 0)
    assert sample("a.jsonl", 0) != sample("c.jsonl", 1)


def test_a_base_model_trains_on_the_assistant_contents_of_plain_text(gemma_tokenizer):
    """Gemma-3 (a base model, no chat template): the conversation is plain text and the mask covers each assistant
    content, not the blank line that starts its turn nor any user text."""
    messages = [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "The Nile flows north."},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "The Amazon."}]
    with pytest.warns(PlainTextConversations):
        example = render_example(gemma_tokenizer, messages, max_len=64)
    ids = example.input_ids.tolist()
    assert ids == gemma_tokenizer("Name a river.\n\nThe Nile flows north.\n\nAnother?\n\nThe Amazon.")["input_ids"]
    assert masked_runs(gemma_tokenizer, example) == ["The Nile flows north.", "The Amazon."]
