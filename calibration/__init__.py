"""Calibration data: sources, chat rendering and packing, seeded disjoint splits."""
