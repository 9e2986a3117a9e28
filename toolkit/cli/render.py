"""Rich tables that stay readable in a narrow terminal.

A table is drawn as Rich draws it when its natural width (every cell on one line) fits the console. Otherwise Rich
would wrap every cell over several lines and cut words to "…"; ``fit`` draws it instead one block per row, each
column's header beside its value, values wrapped at the console's width and never cut:

    runtime paths vs the reference (sharegpt, 2×64 held-out tokens)
    reference
      layers           all
      note             the torch reference: every layer dequantized
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

UNBOUNDED = 10**6  # a width no table reaches: what the table measures at it is its natural width


class Fitted:
    """``table`` as a table when it fits the console's width, else one block per row (``fit``)."""

    def __init__(self, table: Table):
        self.table = table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        natural = Measurement.get(console, options.update_width(UNBOUNDED), self.table).maximum
        if natural <= options.max_width:
            yield self.table
        else:
            yield from _blocks(self.table)


def fit(table: Table) -> Fitted:
    """``table``, drawn one block per row where the console is narrower than the table's natural width."""
    return Fitted(table)


def _blocks(table: Table) -> RenderResult:
    """The title, then per row: its first cell as a heading and the other columns as ``header  value`` lines (a
    two-column table is one list of ``first  second`` lines)."""
    if table.title:
        yield Text.from_markup(table.title, style="bold") if isinstance(table.title, str) else table.title
    columns = [list(column.cells) for column in table.columns]
    rows = list(zip(*columns))
    if len(table.columns) == 2:
        yield _pairs([(str(first), second) for first, second in rows])
        return
    headers = [str(column.header) for column in table.columns[1:]]
    for row, cells in zip(table.rows, rows):
        heading = Text.from_markup(cells[0]) if isinstance(cells[0], str) else Text(str(cells[0]))
        heading.stylize(f"bold {row.style or ''}")
        yield heading
        yield _pairs([(header, cell) for header, cell in zip(headers, cells[1:]) if cell != ""], indent=2)


def _pairs(pairs, indent: int = 0) -> Table:
    """A borderless grid of (label, value) lines: labels on one line, values wrapped (folded inside a long path)."""
    grid = Table.grid(padding=(0, 2), pad_edge=False)
    grid.add_column(no_wrap=True, style="dim")
    grid.add_column(overflow="fold")
    for label, value in pairs:
        grid.add_row(" " * indent + label, value)
    return grid
