"""Calibration data: sources, chat rendering and packing, seeded disjoint splits."""

from toolkit.calibration.render import (
    PlainTextConversations,
    calibration_batch,
    chat_prompt_ids,
    conversation_ids,
    eval_windows,
    fingerprint,
    render_chat,
    train_records,
)
from toolkit.calibration.sources import CalibrationError, Record, load_records
from toolkit.calibration.splits import iter_split, split_of

__all__ = [
    "chat_prompt_ids",
    "CalibrationError",
    "PlainTextConversations",
    "Record",
    "calibration_batch",
    "conversation_ids",
    "eval_windows",
    "fingerprint",
    "iter_split",
    "load_records",
    "render_chat",
    "split_of",
    "train_records",
]
