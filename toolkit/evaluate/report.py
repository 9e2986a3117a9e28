"""The evaluation report: ``eval.json`` (machine-readable, read by recipe gates and the model card), ``eval.md`` with
PNG plots (matplotlib), and the terminal tables.

``eval.json`` follows schema ``compound.eval/1``: the keys ``KEYS``, each slice's and the total's metrics
``SLICE_KEYS``, every key always present (null where it does not apply). docs/usage.md ("Evaluation report") documents
each key; a test holds the two together.
"""

from __future__ import annotations

import json
from pathlib import Path

from rich import box
from rich.table import Table

SCHEMA = "compound.eval/1"
KEYS = ("schema", "model", "base", "heads", "dataset", "seq_len", "windows_per_slice", "kl_threshold", "slices",
        "overall", "worst_slice", "kl_histogram", "generation", "acceptance", "layer_errors", "seconds")
SLICE_KEYS = ("tokens", "windows", "perplexity", "perplexity_ci95", "base_perplexity", "perplexity_ratio", "ratio_ci95",
              "kl", "kl_above", "top1_agreement", "top5_agreement")
INTERVALS = ("perplexity_ci95", "ratio_ci95")  # [low, high]: 95 % over windows (toolkit.evaluate.perplexity)
JSON_FILE, MARKDOWN_FILE = "eval.json", "eval.md"
PLOTS = {"slices": "slices.png", "kl": "kl_histogram.png", "layers": "layer_errors.png"}


def write_report(report: dict, directory: Path) -> list[str]:
    """Write ``eval.json``, ``eval.md`` and its plots into ``directory``; returns the file names written."""
    missing = [key for key in KEYS if key not in report]
    if missing:
        raise ValueError(f"the report lacks {', '.join(missing)} (schema {SCHEMA})")
    (directory / JSON_FILE).write_text(json.dumps(report, indent=1) + "\n")
    plots = _plots(report, directory)
    (directory / MARKDOWN_FILE).write_text("\n".join(markdown(report, plots)) + "\n")
    return [JSON_FILE, MARKDOWN_FILE, *plots.values()]


def markdown(report: dict, plots: dict[str, str] | None = None) -> list[str]:
    """The lines of ``eval.md``: slices, generation checks, acceptance, and the plots in ``plots`` (kind → file)."""
    plots = plots or {}
    lines = [f"# Evaluation of {report['model']}", "",
             f"Held-out: eval split of `{report['dataset']}`, up to {report['windows_per_slice']} windows × "
             f"{report['seq_len']} tokens per slice" + (f"; base: `{report['base']}`." if report["base"] else "."), "",
             *slice_lines(report)]
    for kind, caption in (("slices", "perplexity change per slice"), ("kl", "KL histogram")):
        if kind in plots:
            lines += ["", f"![{caption}]({plots[kind]})"]
    if report["generation"]:
        lines += ["", "## Generation checks (greedy)", "", *generation_lines(report)]
    if report["acceptance"]:
        lines += ["", f"## Speculative decoding with `{report['heads']}`", "",
                  "| prompts | n | accepted length, tree | accepted length, chain | tree speedup | lossless |",
                  "|---|---:|---:|---:|---:|---|"]
        for name, acc in report["acceptance"].items():
            lines.append(f"| {name} | {acc['prompts']} | {acc['tree_accepted_length']:.3f} | "
                         f"{acc['chain_accepted_length']:.3f} | {acc['tree_speedup']:.2f}× | {acc['lossless']} |")
    if "layers" in plots:
        lines += ["", f"## Per-layer error ({report['layer_errors']['measure']})", "",
                  f"![per-layer error]({plots['layers']})"]
    return lines


def slice_lines(report: dict) -> list[str]:
    """A markdown table of the slices and their total, and which slice degrades most (with a base); a key an older
    report lacks (the intervals) is a dash."""
    lines = [f"| slice | tokens | perplexity | 95 % CI | base | ratio | 95 % CI (paired) | KL | "
             f"KL > {report['kl_threshold']:g} | top-1 | top-5 |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, row in [*report["slices"].items(), ("overall", report["overall"])]:
        lines.append("| " + " | ".join([f"**{name}**" if name == "overall" else name, str(row["tokens"]),
                                         *(_cell(row.get(key), key) for key in SLICE_KEYS[2:])]) + " |")
    if report["worst_slice"]:
        worst = report["slices"][report["worst_slice"]]
        lines += ["", f"Degrades most: **{report['worst_slice']}** (perplexity ×{worst['perplexity_ratio']:.3f}, "
                      f"KL {worst['kl']:.4f})."]
    return lines


def generation_lines(report: dict) -> list[str]:
    """A markdown table of the generation checks' pass rates, the model's next to the base's."""
    lines = ["| set | prompts | model passed | base passed | same as base |", "|---|---:|---:|---:|---:|"]
    for name, check in report["generation"].items():
        lines.append(f"| {name} | {check['prompts']} | {_cell(check['passed'].get('model'))} | "
                     f"{_cell(check['passed'].get('base'))} | {_cell(check['same_as_base'])} |")
    return lines


def console_tables(report: dict) -> list[Table]:
    """The report as Rich tables: slices, then generation checks and acceptance when measured."""
    base = report["base"] is not None
    slices = Table(title=f"held-out slices ({report['dataset']}, eval split)", box=box.SIMPLE, pad_edge=False)
    columns = ["slice", "tokens", "ppl"] + (["base", "ratio", "KL", f">{report['kl_threshold']:g}",
                                             "top-1", "top-5"] if base else [])
    for column in columns:
        if column == "slice":
            slices.add_column(column, min_width=max(map(len, report["slices"])))
        else:
            slices.add_column(column, justify="right")
    keys = [key for key in (SLICE_KEYS[2:] if base else SLICE_KEYS[2:3]) if key not in INTERVALS]
    rows = [*report["slices"].items(), ("overall", report["overall"])]
    for name, row in rows:
        slices.add_row(name, str(row["tokens"]), *(_cell(row[key], key, compact=True) for key in keys),
                       style="bold" if name == report["worst_slice"] else None)
    intervals = Table(title="95 % intervals over windows (ratio: paired window by window)", box=box.SIMPLE,
                      pad_edge=False)
    for column in ("slice", "windows", "ppl", *(["ratio"] if base else [])):
        intervals.add_column(column, justify="left" if column == "slice" else "right")
    for name, row in rows:
        if row["tokens"]:
            intervals.add_row(name, str(row["windows"]), *(_cell(row.get(key), key) for key in INTERVALS[:1 + base]))
    tables = [slices, intervals]
    if report["generation"]:
        gen = Table(title="generation checks (greedy, pass rate)", box=box.SIMPLE)
        for column in ("set", "prompts", "model", "base", "same as base"):
            gen.add_column(column, justify="left" if column == "set" else "right")
        for name, check in report["generation"].items():
            gen.add_row(name, str(check["prompts"]), _cell(check["passed"].get("model")),
                        _cell(check["passed"].get("base")), _cell(check["same_as_base"]))
        tables.append(gen)
    if report["acceptance"]:
        acc = Table(title=f"accepted length with {report['heads']}", box=box.SIMPLE)
        for column in ("prompts", "n", "tree", "chain", "tree speedup", "lossless"):
            acc.add_column(column, justify="left" if column == "prompts" else "right")
        for name, row in report["acceptance"].items():
            acc.add_row(name, str(row["prompts"]), f"{row['tree_accepted_length']:.3f}",
                        f"{row['chain_accepted_length']:.3f}", f"{row['tree_speedup']:.2f}×", str(row["lossless"]))
        tables.append(acc)
    return tables


_FORMATS = {"perplexity": "{:.3f}", "base_perplexity": "{:.3f}", "perplexity_ratio": "×{:.3f}", "kl": "{:.4f}",
            "kl_above": "{:.1%}", "top1_agreement": "{:.1%}", "top5_agreement": "{:.1%}", "rate": "{:.0%}"}


def _cell(value, key: str = "rate", compact: bool = False) -> str:
    """A table cell; ``compact`` (the terminal) gives perplexities two decimals so the table fits 80 columns."""
    if value is None:
        return "–"
    if key in INTERVALS:
        return ("×" if key == "ratio_ci95" else "") + "–".join(f"{v:.3f}" for v in value)
    if not isinstance(value, float):
        return str(value)
    return ("{:.2f}" if compact and key.endswith("perplexity") else _FORMATS[key]).format(value)


def _plots(report: dict, directory: Path) -> dict[str, str]:
    """Draw the plots the report has data for; kind → file name."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    drawn = {}
    if report["base"]:
        names = [n for n, row in report["slices"].items() if row["tokens"]]
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.bar(names, [100 * (report["slices"][n]["perplexity_ratio"] - 1) for n in names], color="tab:red")
        ax.set_ylabel("perplexity change vs base (%)")
        ax.set_title("perplexity change per held-out slice")
        ax.axhline(0, color="black", linewidth=0.8)
        drawn["slices"] = _save(fig, directory, PLOTS["slices"])
        hist = report["kl_histogram"]
        fig, ax = plt.subplots(figsize=(6, 3))
        labels = [f"≥{edge:g}" for edge in hist["lower_edges"]]
        ax.bar(labels, hist["counts"], color="tab:blue")
        ax.set_yscale("log")
        ax.set_xlabel("KL(base ‖ model) per token, nats")
        ax.set_ylabel("tokens")
        ax.set_title("KL divergence from the base, per token")
        drawn["kl"] = _save(fig, directory, PLOTS["kl"])
    if report["layer_errors"]:
        fig, ax = plt.subplots(figsize=(6, 3))
        layers = report["layer_errors"]["layers"]
        ax.plot(range(len(layers)), layers, marker="o")
        if all(e > 0 for e in layers):  # errors grow by orders of magnitude with depth: linear shows the last few
            ax.set_yscale("log")
        ax.set_xlabel("decoder layer")
        ax.set_ylabel("mean error per linear")
        ax.set_title(f"quantization error per layer: {report['layer_errors']['measure']}", fontsize=9)
        drawn["layers"] = _save(fig, directory, PLOTS["layers"])
    return drawn


def _save(fig, directory: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(directory / name, dpi=100)
    plt.close(fig)
    return name
