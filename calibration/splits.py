"""Deterministic, disjoint splits of a source by record id.

Quantization calibration, speculative-head training and held-out evaluation each take their slice of
the same data. A record's split is a pure function of its id (no seed, no sample count), so the three
never share a record whatever sizes or seeds the callers choose, and a record stays in its split
across runs and machines.

sha256(id) maps to a bucket in 0..99:

====================  =========  =====
split                 buckets    share
====================  =========  =====
``"eval"``            0-4        5%
``"train"``           5-49       45%
``"calibration"``     50-99      50%
====================  =========  =====
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

from toolkit.calibration.sources import CalibrationError, Record

SPLITS = ("calibration", "train", "eval")
_EVAL_BUCKETS = 5  # buckets [0, 5)
_TRAIN_BUCKETS = 45  # buckets [5, 50); the remaining 50 are calibration


def split_of(record_id: str) -> str:
    """The split ("calibration", "train" or "eval") that owns ``record_id``."""
    digest = hashlib.sha256(record_id.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 100
    if bucket < _EVAL_BUCKETS:
        return "eval"
    if bucket < _EVAL_BUCKETS + _TRAIN_BUCKETS:
        return "train"
    return "calibration"


def iter_split(records: Iterable[Record], split: str) -> Iterator[Record]:
    """The records of ``split``, in their original order."""
    if split not in SPLITS:
        raise CalibrationError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    return (record for record in records if split_of(record.id) == split)
