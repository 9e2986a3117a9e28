"""Turning a compound artifact into a runnable model: ``QuantLinear`` and the loader."""
