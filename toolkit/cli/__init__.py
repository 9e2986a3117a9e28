"""The ``compound`` command line: parse options into a config, call one verb, render the result with Rich.

One module per group of commands (``quantize``: quantize, convert, decode; ``evaluate``: eval, validate; ``heads``:
train-heads; ``recipes``: run, push; ``doctor``: doctor); ``flags`` derives their options from the config dataclasses, ``common`` holds
the app, the console and the error exit.
"""

# Importing each module registers its commands, in the order --help lists them.
from toolkit.cli import quantize  # noqa: F401  isort: skip
from toolkit.cli import evaluate  # noqa: F401  isort: skip
from toolkit.cli import heads  # noqa: F401  isort: skip
from toolkit.cli import recipes  # noqa: F401  isort: skip
from toolkit.cli import doctor  # noqa: F401  isort: skip
from toolkit.cli.common import app

__all__ = ["app"]
