"""``compound doctor``: which of compound's CPU kernels this machine runs, and why (``toolkit.runtime.doctor``)."""

from __future__ import annotations

import typer

from toolkit.cli.common import app


@app.command()
def doctor():
    """Build compound's C++ CPU code, then print the CPU flags each file needs, each build's outcome with its reason,
    and what the int4 linears and float32 decoding run here. Exits 1 when a build the CPU allows failed."""
    from toolkit.runtime.doctor import report

    lines, healthy = report()
    typer.echo("\n".join(lines))
    raise typer.Exit(0 if healthy else 1)
