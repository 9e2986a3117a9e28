import json
import warnings

import pytest

from conftest import cli, refused
from toolkit.calibration import CalibrationError, load_records, sources

RECORDS = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "2+2?"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "x " * 50}, {"from": "chatgpt", "value": "y"}]},
]


def _truncated_warnings(caught):
    return [w for w in caught if "truncated" in str(w.message)]


def test_sharegpt_reads_lazily_and_maps_roles():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = load_records("sharegpt")
        first = [next(records) for _ in range(100)]
    assert not _truncated_warnings(caught)  # the broken tail is never reached for the first records
    assert first[0].id == "QWJhYvA_0"
    assert first[0].messages[0]["role"] == "user" and first[0].messages[1]["role"] == "assistant"
    roles = {m["role"] for r in first for m in r.messages}
    assert roles <= {"system", "user", "assistant"}


def test_sharegpt_whole_file_warns_once_about_truncated_tail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = sum(1 for _ in load_records("sharegpt"))
    assert count > 17_000
    truncated = _truncated_warnings(caught)
    assert len(truncated) == 1
    assert f"after {count} complete records" in str(truncated[0].message)


def test_synthetic_truncated_file_yields_complete_records_and_warns(tmp_path):
    text = json.dumps(RECORDS, indent=2)
    cut = text[: text.index('"c"') + 20]  # inside the third record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    with pytest.warns(UserWarning, match="truncated.*after 2 complete records") as caught:
        records = list(load_records(str(path)))
    assert [r.id for r in records] == ["a", "b"]
    assert len(_truncated_warnings(caught)) == 1


def test_incremental_reader_matches_json_load_across_chunk_boundaries(tmp_path, monkeypatch):
    records = RECORDS + [{"id": str(i), "text": "é" * i + '"\\}]'} for i in range(40)] + [{"id": "n", "text": "1"}]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(records))
    monkeypatch.setattr(sources, "_CHUNK_CHARS", 7)  # every record spans several reads
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = [r.id for r in load_records(str(path))]
    assert ids == [r["id"] for r in records]


def test_json_array_of_strings_is_text_with_content_ids(tmp_path):
    path = tmp_path / "docs.json"
    path.write_text(json.dumps(["first doc", "second doc"]))
    records = list(load_records(str(path)))
    assert [r.text for r in records] == ["first doc", "second doc"]
    assert all(r.messages is None and len(r.id) == 16 for r in records)
    assert [r.id for r in load_records(str(path))] == [r.id for r in records]  # stable
    assert records[0].id != records[1].id


def test_jsonl_messages_and_text(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"id": 7, "body": "plain text"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    chat, text = load_records(str(path), text_field="body")
    assert chat.messages == ({"role": "user", "content": "q"}, {"role": "assistant", "content": "a"})
    assert text.id == "7" and text.text == "plain text"


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "p1", "text": "one"}, {"id": "p2", "text": "two"}]), path)
    assert [(r.id, r.text) for r in load_records(str(path))] == [("p1", "one"), ("p2", "two")]


def test_txt_blank_line_paragraphs(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("para one\nstill one\n\n\npara two\n  \npara three\n")
    assert [r.text for r in load_records(str(path))] == ["para one\nstill one", "para two", "para three"]
    single = tmp_path / "single.txt"
    single.write_text("line a\nline b\n")
    assert [r.text for r in load_records(str(single))] == ["line a\nline b"]


def test_missing_path(tmp_path):
    with pytest.raises(CalibrationError, match="does not exist"):
        load_records(str(tmp_path / "nope.jsonl"))


@pytest.mark.parametrize("name", ["data.csv", "data"])
def test_unsupported_extension(tmp_path, name):
    path = tmp_path / name
    path.write_text("a,b\n")
    with pytest.raises(CalibrationError, match=r"unsupported .*extension.*\.jsonl"):
        load_records(str(path))


def test_missing_field_names_field_index_and_present_fields(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "x", "meta": 1}\n')
    records = load_records(str(path))
    next(records)
    with pytest.raises(CalibrationError, match=r"record 1 has no 'text' field.*\['body', 'meta'\]"):
        next(records)


def test_unknown_role(tmp_path):
    path = tmp_path / "roles.json"
    path.write_text(json.dumps([{"messages": [{"role": "wizard", "content": "x"}]}]))
    with pytest.raises(CalibrationError, match="unknown role 'wizard'"):
        list(load_records(str(path)))


@pytest.mark.parametrize(("name", "content"), [("e.json", ""), ("e.json", " [ ] "), ("e.jsonl", "\n"), ("e.txt", "\n\n")])
def test_empty(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(CalibrationError, match="empty"):
        list(load_records(str(path)))


def test_malformed_json_is_an_error_not_truncation(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"id": "a", "text": "x"}, {"id": oops}, ' + '{"id": "c", "text": "y"}, ' * 10 + "]")
    with pytest.raises(CalibrationError, match="element 1 is not valid JSON"):
        list(load_records(str(path)))


def test_hub_errors_are_wrapped(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Hub unreachable")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(CalibrationError, match="could not load dataset org/name:cfg from the Hub: Hub unreachable"):
        load_records("org/name:cfg")


def test_hub_id_parsing(monkeypatch):
    import datasets

    calls = []

    def fake(name, config, split, streaming):
        calls.append((name, config, split))
        return [{"text": "t"}]

    monkeypatch.setattr(datasets, "load_dataset", fake)
    assert [r.text for r in load_records("teknium/OpenHermes-2.5")] == ["t"]
    list(load_records("org/name:cfg"))
    assert calls == [("teknium/OpenHermes-2.5", None, "train"), ("org/name", "cfg", "train")]


RUNS_END_EMPTY = True  # conftest's runs: every case here leaves it empty
run = cli


GPTQ = ["--method", "gptq", "--group-size", "32", "--samples", "2", "--seq-len", "16"]


EVAL = ["--windows", "1", "--seq-len", "16", "--no-generation"]




@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_missing_text_column_names_the_flag_and_the_columns(tmp_path, runs, tiny_llama_dir, suffix):
    rows = [{"body": f"document {i} " * 20, "meta": i} for i in range(64)]
    source = tmp_path / f"data{suffix}"
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), source)
    else:
        source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--dataset", source, "-o", runs / "q"),
                   "has no 'text' field", "['body', 'meta']", "--text-field")
    assert "text_field=" not in text


def test_tiny_calibration_text_asks_for_a_larger_dataset(tmp_path, runs, tiny_llama_dir):
    source = tmp_path / "tiny.txt"
    source.write_text("abc")
    text = refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--dataset", source, "-o", runs / "q"),
                   "pass a larger --dataset")
    assert "lower --samples" not in text


def test_tiny_eval_text_asks_for_a_larger_dataset(tmp_path, runs, tiny_llama_dir):
    source = tmp_path / "tiny.txt"
    source.write_text("abc")
    refused(run("eval", "--model", tiny_llama_dir, *EVAL, "--dataset", source, "-o", runs / "report"),
            "--dataset")
