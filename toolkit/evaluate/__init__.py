"""Measuring models: perplexity on held-out tokens (more metrics grow here)."""
