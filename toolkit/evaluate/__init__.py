"""Measuring models on held-out data: perplexity, divergence from a base (KL, agreement), slices of text, generation
checks, and the ``compound eval`` report that gathers them (``suite``)."""
