"""On-disk checkpoint formats: one module per layout, with its tensor table in the docstring."""
