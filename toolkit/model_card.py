"""The model card of an artifact (``README.md`` with the Hub's YAML front matter), and its chart of acceptance per
draft depth (``acceptance.png``, drawn with matplotlib).

``results`` (optional, all measured; the card shows only what is given):

| key | content | written by |
|---|---|---|
| ``divergence`` | ``kl``, ``top1_agreement``, ``perplexity``, ``base_perplexity``, ``tokens`` [, ``dataset``, ``windows``, ``seq_len``] | ``toolkit.evaluate.divergence`` |
| ``eval`` | an ``eval.json`` report (schema ``compound.eval/1``, docs/usage.md "Evaluation report"); ``--results`` may name an ``eval.json`` itself | ``compound eval``, ``compound run`` |
| ``acceptance`` | ``[{"mode", "shape", "nodes", "mean_accepted_length", "acceptance_rate", "speculative_tokens_per_s", ...}]`` | ``compound validate --heads --json`` |
| ``heads_eval`` | the same reports keyed by mode | ``compound run`` |
| ``gates`` | the thresholds checked, as lines of text | ``compound run`` |
| ``command`` | the exact command line(s) that produced the artifact and the numbers | the caller |

Any other key is shown in a table of its numbers and strings.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import yaml

from toolkit.evaluate.report import SCHEMA, generation_lines, slice_lines
from toolkit.formats.checkpoint import MANIFEST
from toolkit.models import EMBEDDED
from toolkit.published import display, public, published

PLOT = "acceptance.png"
# Hub ids of the model aliases in toolkit.models.EMBEDDED (the GGUF's source model).
RESULT_KEYS = ("divergence", "eval", "acceptance", "heads_eval", "gates", "command")


def model_card(directory: Path | str, results: dict | None = None, *, repo_id: str | None = None,
               tags: tuple[str, ...] | list[str] = ()) -> str:
    """``README.md`` for the artifact in ``directory``: YAML front matter the Hub reads (base model, tags, library,
    pipeline), what it is, how to serve it (with ``repo_id``, else the directory name) and tables of ``results``
    (local paths in them cut to their last component)."""
    directory = Path(directory)
    kind, is_heads = describe(directory)
    head_kind = _head_kind(directory)
    source = json.loads((directory / MANIFEST).read_text()).get("target" if is_heads else "model")
    base = _base_model(source) if source else None  # the model itself, not its published name, tells its base
    manifest, results = published(directory)[0], public(results)  # what the card shows names no local path
    config = json.loads((directory / "config.json").read_text()) if (directory / "config.json").is_file() else {}
    name = repo_id or directory.name
    meta: dict = {}
    if base:
        meta["base_model"] = base
    if is_heads:
        meta["tags"] = _unique(["compound", head_kind.name, "speculative-decoding", *tags])
    else:
        quant = manifest.get("quantization") or {}
        method = (config.get("quantization_config") or {}).get("quant_method")
        bits = quant.get("bits")
        if base:
            meta["base_model_relation"] = "quantized"
        meta["library_name"] = "transformers"
        meta["pipeline_tag"] = "text-generation"
        gguf = "gguf" if _gguf_files(manifest) else None  # the Hub lists GGUF repos by this tag
        meta["tags"] = _unique(["compound", method, quant.get("method"), f"{bits}-bit" if bits else None, gguf,
                                *tags])
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {name.split('/')[-1]}", ""]
    lines += _heads_body(head_kind, manifest, config, name, base, source) if is_heads else \
        _checkpoint_body(manifest, config, name, base, source, kind)
    lines += _results_body(results)
    lines += ["## Files", "", f"`{MANIFEST}` holds the SHA-256 of every file (`compound validate` checks them).", "",
              "| file | SHA-256 |", "|---|---|"]
    lines += [f"| `{file}` | `{digest}` |" for file, digest in manifest.get("files", {}).items()]
    return "\n".join(lines) + "\n"


def _head_kind(directory: Path):
    """The head kind of ``directory`` (``toolkit.heads.load.detect_head``), None for a checkpoint."""
    from toolkit.heads.load import detect_head  # torch loads for heads only when a card is made

    return detect_head(directory)


def describe(directory: Path) -> tuple[str, bool]:
    """(a few words naming the artifact, whether it is draft heads)."""
    manifest = json.loads((directory / MANIFEST).read_text())
    head_kind = _head_kind(directory)
    if head_kind is not None:
        return head_kind.card_title(manifest), True
    quant = manifest.get("quantization") or {}
    method = str(quant.get("method", "")).upper()
    return f"{quant.get('bits', '?')}-bit {method} checkpoint ({manifest.get('format')})", False


def _checkpoint_body(manifest: dict, config: dict, name: str, base: str | None, source, kind: str) -> list[str]:
    quant = manifest.get("quantization") or {}
    calib = manifest.get("calibration") or {}
    kv = manifest.get("kv_cache") or {}
    rows = [("method", quant.get("method")), ("format", manifest.get("format")), ("bits", quant.get("bits")),
            ("group size", quant.get("group_size")), ("symmetric", quant.get("sym")),
            ("left unquantized", ", ".join(quant.get("skip", [])) or None),
            ("calibration", f"{calib['samples']} × {calib['seq_len']} tokens of {calib['dataset']}, "
                            f"seed {calib['seed']}"
             if {"samples", "seq_len", "dataset", "seed"} <= calib.keys() else None),
            ("calibration fingerprint", calib.get("fingerprint")),
            ("KV-cache scales", f"{kv.get('dtype')}, per {kv.get('strategy')}" if kv else None),
            ("dtype of unquantized tensors", config.get("torch_dtype")),
            *[("GGUF for llama.cpp", f"`{file}`: the same codes as {file.rpartition('-')[2].removesuffix('.gguf')} "
                                     "blocks, Q8_0 embeddings") for file in _gguf_files(manifest)],
            ("compound version", manifest.get("compound_version"))]
    dtype = f" --dtype {config['torch_dtype']}" if config.get("torch_dtype") else ""
    llama_cpp = [f"llama-server -hf {name}:{file.rpartition('-')[2].removesuffix('.gguf')}"
                 for file in _gguf_files(manifest)]
    return [f"A {kind} of {_link(base, source)}, made with compound. vLLM, SGLang and transformers read it; "
            "engines detect the quantization from `config.json`.", "",
            "## Quantization", "", "| setting | value |", "|---|---|",
            *[f"| {key} | {_fmt(value)} |" for key, value in rows if value is not None], "",
            "## Serve", "", "```bash", f"vllm serve {name}{dtype}", *llama_cpp, "```", ""]


def _gguf_files(manifest: dict) -> list[str]:
    """The GGUF files a checkpoint carries beside its safetensors (``compound quantize --gguf``)."""
    return sorted(file for file in manifest.get("files", {}) if file.endswith(".gguf"))


def _heads_body(head_kind, manifest: dict, config: dict, name: str, base: str | None, source) -> list[str]:
    training = manifest.get("training") or {}
    quantized_target = bool(source) and (Path(str(source)).expanduser() / MANIFEST).is_file()
    target = f"a compound checkpoint of {_link(base, source)}" if quantized_target else _link(base, source)
    served = base if base and not quantized_target else "TARGET"
    lines = head_kind.card_lines(manifest, config, name, target, served)
    if training:
        rows = [(key.replace("_", " "), training.get(key)) for key in
                ("examples", "tokens", "trained_tokens", "steps", "best_step", "select_mode", "self_distill")]
        rows += [(f"at best step: {key.replace('_', ' ')}", value)
                 for key, value in (training.get("best_metrics") or {}).items()]
        lines += ["## Training", "", "Measured by compound while training (selection prompts, its decode loop).", "",
                  "| measure | value |", "|---|---|", *[f"| {key} | {_fmt(v)} |" for key, v in rows if v is not None],
                  ""]
    return lines


def _results_body(results: dict | None) -> list[str]:
    if not results:
        return ["## Results", "", "No measurements were published with this artifact.", ""]
    source = "; the commands under Reproduce produced them" if results.get("command") else ""
    lines = ["## Results", "", f"Measured, not estimated{source}.", ""]
    if quality := _quality(results):
        where = f" on {quality['windows']}×{quality['seq_len']} held-out tokens of {quality['dataset']}" \
            if {"windows", "seq_len", "dataset"} <= quality.keys() else ""
        names = {"perplexity": "perplexity", "base_perplexity": "base perplexity",
                 "perplexity_ratio": "perplexity / base perplexity", "perplexity_increase": "perplexity − base",
                 "kl": "KL(base ‖ this), nats/token", "top1_agreement": "top-1 agreement with base",
                 "tokens": "tokens compared"}
        lines += [f"### Quality against the base model{where}", "", "| measure | value |", "|---|---|",
                  *[f"| {label} | {_fmt(quality[key])} |" for key, label in names.items() if key in quality], ""]
    if (report := results.get("eval")) and report.get("base"):
        lines += [f"### By slice of held-out text (`compound eval`, up to {report['windows_per_slice']}×"
                  f"{report['seq_len']} tokens per slice)", "", *slice_lines(report), ""]
    if report and report.get("generation"):
        lines += ["### Generation checks (greedy; JSON must parse, Python must compile, facts must match)", "",
                  *generation_lines(report), ""]
    if reports := acceptance_reports(results):
        lines += ["### Speculative decoding", "", "Accepted length: tokens per target forward (the target's own "
                  "token included). Acceptance at depth d: P(depth d accepted | depth d − 1 accepted). Break-even "
                  "length: the accepted length at which a step (draft + verify) costs what greedy decoding takes "
                  "for one token on the machine that measured it.", "",
                  "| mode | draft nodes | accepted length | acceptance per depth | tokens/s | greedy tokens/s | "
                  "speedup | break-even length | lossless |", "|---|---:|---:|---|---:|---:|---:|---:|---|"]
        for r in reports:
            speedup = f"{r['speedup']:.2f}×" if isinstance(r.get("speedup"), (int, float)) else "–"
            cells = [r.get("mode"), r.get("nodes") or "–", r.get("mean_accepted_length"),
                     " ".join(f"{a:.2f}" for a in r["acceptance_rate"]), r.get("speculative_tokens_per_s", "–"),
                     r.get("greedy_tokens_per_s", "–"), speedup, r.get("break_even_accepted_length", "–"),
                     r.get("lossless", "–")]
            lines.append("| " + " | ".join(_fmt(cell) for cell in cells) + " |")
        lines += ["", f"![acceptance per draft depth]({PLOT})", "",
                  "Acceptance per draft depth: one group of bars per depth (depth 1 at the left), one bar per mode in "
                  "the table's order; gridlines at 0.25, 0.5, 0.75 and 1.", ""]
    if gates := results.get("gates"):
        lines += ["### Gates", "", *[f"- {_fmt(gate)}" for gate in gates], ""]
    if flat := _flatten({key: value for key, value in results.items() if key not in RESULT_KEYS}):
        lines += ["### Other measurements", "", "| measure | value |", "|---|---|",
                  *[f"| {key} | {_fmt(value)} |" for key, value in flat], ""]
    if command := results.get("command"):
        lines += ["### Reproduce", "", "```bash", *([command] if isinstance(command, str) else command), "```", ""]
    return lines


def card_results(raw: dict) -> dict:
    """Results for ``model_card``/``push`` from a results file: one keyed as above, or an ``eval.json`` alone."""
    return {"eval": raw} if raw.get("schema") == SCHEMA else raw


def _quality(results: dict) -> dict | None:
    """Quality against the base, from ``divergence`` (Divergence fields) or an ``eval`` report's total."""
    if raw := results.get("divergence"):
        return raw
    report = results.get("eval")
    if not report or not report.get("base"):
        return None
    overall = report["overall"]
    return {**overall, "perplexity_increase": overall["perplexity"] - overall["base_perplexity"],
            "dataset": report["dataset"], "windows": overall["windows"], "seq_len": report["seq_len"]}


def acceptance_reports(results: dict | None) -> list[dict]:
    """Acceptance reports with a per-depth acceptance, from ``acceptance`` (a list) or ``heads_eval`` (by mode)."""
    raw = (results or {}).get("acceptance") or (results or {}).get("heads_eval") or []
    reports = [{"mode": mode, **report} for mode, report in raw.items()] if isinstance(raw, dict) else list(raw)
    return [r for r in reports if r.get("acceptance_rate")]


def acceptance_chart(reports: list[dict]) -> bytes | None:
    """A bar chart of acceptance per draft depth (one group per depth, one bar per report, in the reports' order and
    legend), as PNG bytes; the axis is fixed at [0, 1]. None without reports."""
    if not reports:
        return None
    from matplotlib.figure import Figure  # a Figure of its own, not pyplot: no display, no global state

    depths = max(len(r["acceptance_rate"]) for r in reports)
    width = 0.8 / len(reports)
    figure = Figure(figsize=(1.2 + 0.9 * depths, 2.6), dpi=100)
    axes = figure.subplots()
    for m, report in enumerate(reports):
        rates = [min(max(rate, 0.0), 1.0) for rate in report["acceptance_rate"]]
        axes.bar([d + 1 - 0.4 + (m + 0.5) * width for d in range(len(rates))], rates, width,
                 color=f"C{m % 10}", label=str(report.get("mode", m)))
    axes.set(ylim=(0, 1), xticks=range(1, depths + 1), xlabel="draft depth", ylabel="acceptance")
    axes.set_yticks([0.25, 0.5, 0.75, 1.0])
    axes.grid(axis="y", color="#dddddd")
    axes.set_axisbelow(True)
    axes.legend(fontsize="small", frameon=False)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _base_model(spec: str, follow: bool = True) -> str | None:
    """The Hub id a model spec stands for: an alias's source model, a Hub id as is, a compound checkpoint's own
    base (one level), else None (a local file the Hub cannot link)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if spec in EMBEDDED:
        return EMBEDDED[spec].source
    path = Path(spec).expanduser()
    if follow and (path / MANIFEST).is_file():
        inner = json.loads((path / MANIFEST).read_text()).get("model")
        return _base_model(inner, follow=False) if isinstance(inner, str) else None
    if path.exists() or spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or spec.count("/") != 1:
        return None
    try:
        validate_repo_id(spec)
    except HFValidationError:
        return None
    return spec


def _link(base: str | None, source) -> str:
    if base:
        return f"[{base}](https://huggingface.co/{base})"
    return f"`{display(source)}` (local files)" if source else "an unnamed model"


def _flatten(tree: dict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out += _flatten(value, f"{name}.")
        elif isinstance(value, (str, int, float, bool)):
            out.append((name, value))
    return out


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return re.sub(r"[|\n]", " ", str(value))


def _unique(items) -> list[str]:
    return list(dict.fromkeys(str(item) for item in items if item))
