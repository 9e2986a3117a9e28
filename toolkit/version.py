"""compound's version: the one declaration (pyproject.toml reads it; manifests and fingerprints record it)."""

__version__ = "0.1.0"
