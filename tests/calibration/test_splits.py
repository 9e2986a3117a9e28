import collections

import pytest

from toolkit.calibration import CalibrationError, Record, iter_split, load_records, split_of


def test_split_is_a_stable_function_of_the_id():
    ids = [f"record-{i}" for i in range(2000)]
    assert [split_of(i) for i in ids] == [split_of(i) for i in ids]
    assert {split_of(i) for i in ids} == {"calibration", "train", "eval"}


@pytest.mark.filterwarnings("ignore:.*is truncated")  # the packaged file's tail; tested in test_sources.py
def test_real_ids_split_disjointly_in_documented_proportions():
    records = list(load_records("sharegpt"))
    by_split = {s: {r.id for r in iter_split(records, s)} for s in ("calibration", "train", "eval")}
    assert not by_split["calibration"] & by_split["train"]
    assert not by_split["calibration"] & by_split["eval"]
    assert not by_split["train"] & by_split["eval"]
    assert set.union(*by_split.values()) == {r.id for r in records}

    counts = collections.Counter(split_of(r.id) for r in records)
    share = {s: counts[s] / len(records) for s in counts}
    assert share["eval"] == pytest.approx(0.05, abs=0.01)
    assert share["train"] == pytest.approx(0.45, abs=0.02)
    assert share["calibration"] == pytest.approx(0.50, abs=0.02)


def test_iter_split_keeps_order_and_rejects_unknown_split():
    records = [Record(id=f"r{i}", text="x") for i in range(200)]
    train = list(iter_split(records, "train"))
    assert train == [r for r in records if split_of(r.id) == "train"]
    with pytest.raises(CalibrationError, match="unknown split 'test'"):
        iter_split(records, "test")
