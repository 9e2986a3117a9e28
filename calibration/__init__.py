"""Calibration data: sources, chat rendering and packing, seeded disjoint splits."""

from toolkit.calibration.render import calibration_batch, chat_prompt_ids, eval_windows, fingerprint, train_records
from toolkit.calibration.sources import CalibrationError, Record, load_records
from toolkit.calibration.splits import iter_split, split_of

__all__ = [
    "chat_prompt_ids",
    "CalibrationError",
    "Record",
    "calibration_batch",
    "eval_windows",
    "fingerprint",
    "iter_split",
    "load_records",
    "split_of",
    "train_records",
]
