"""compound's GGUF codes in llama.cpp against llama.cpp's own quantizer, judged by llama.cpp (SmolLM2, Gemma-3 270M).

(Not named gguf.py: run as a script, that name would shadow the gguf package transformers imports.)

Every file is scored by llama.cpp itself (``tests/integration/llamacpp_judge.py`` in the venv of
``scripts/setup_llamacpp.sh``) on the same held-out ShareGPT windows (eval split, never calibrated on):

- the float reference: compound's F32 export of the model (``compound convert --format gguf --outtype F32``);
- llama.cpp's quantizer (``llama_model_quantize``, its default per-tensor choices) from that F32 file: Q4_0, Q4_1,
  Q4_K_M, Q8_0;
- llama.cpp's importance-matrix Q4_0, the anchor: ``llama-imatrix`` over compound's calibration windows (the same
  ``--samples`` × ``--seq-len`` tokens, written out as text, which llama.cpp tokenizes again), then
  ``llama-quantize --imatrix``; both tools built from the judge's own llama.cpp source
  (``bash scripts/setup_llamacpp.sh --tools``);
- compound rtn / gptq / awq / awq+gptq, W4 g32 on those calibration tokens, symmetric → Q4_0 and asymmetric → Q4_1
  (``compound quantize --gguf``: the codes compound chose, Q8_0 embeddings);
- the best compound Q4_0 file again with llama.cpp's Q8_0 KV cache (``type_k``/``type_v``).

Columns: the GGUF types of the decoder linears as the file holds them (llama.cpp's K-quants need input widths that
are multiples of 256 and fall back to other types elsewhere) and their bits per weight, so files are compared at
equal size; perplexity, its increase over F32, file size, and llama.cpp greedy tokens/s (batch 1, ``--threads``
threads, ``--new-tokens`` after a 64-token prompt). Timings need a quiet machine; quantizations and scores do not:
``--beside "..."`` names what ran beside the run, and the table then says its tok/s were not measured quietly.

Caveat printed with the table: both embedded models were dequantized from 4-bit GGUF files (SmolLM2 from Q4_1,
Gemma-3 from Q4_K_M), which flatters an asymmetric small-group grid (Q4_1 most on SmolLM2); judge the methods on
Q4_0 first.

    python benchmarks/llamacpp_gguf.py [--model smollm2-135m|gemma3-270m] [--windows 16] [--seq-len 512]
        [--samples 128] [--threads 2] [--quantize-threads N] [--grids Q4_0,Q4_1] [--reuse]
        [--beside "what else ran"] [--cached-only] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from report import command_line, markdown_table, update_section  # noqa: E402

MODELS = {"smollm2-135m": "SmolLM2", "gemma3-270m": "Gemma-3 270M"}  # --model → its name in the section title
CACHE = ROOT / "benchmarks" / ".cache" / "gguf"
VENV = ROOT / ".venvs" / "llamacpp"
PYTHON = VENV / "bin" / "python"
JUDGE = ROOT / "tests" / "integration" / "llamacpp_judge.py"
LLAMACPP_TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q8_0")
IMATRIX_TYPES = ("Q4_0",)  # llama.cpp's quantizer guided by its importance matrix: the anchor for compound's Q4_0
METHODS = ("rtn", "gptq", "awq", "awq+gptq")
GRIDS = {"Q4_0": True, "Q4_1": False}  # GGUF block type → compound's symmetric grid (Q4_1 has a minimum)
F32_LABEL = "F32 (compound's float export)"


def judge(*args: str) -> dict:
    done = subprocess.run([str(PYTHON), str(JUDGE), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          check=False)
    if done.returncode:
        raise SystemExit(f"llama.cpp judge {args[0]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def tool(name: str, *args) -> None:
    """Run llama.cpp's command-line tool ``name`` (``scripts/setup_llamacpp.sh --tools`` builds it) to completion."""
    path = VENV / "bin" / name
    if not path.is_file():
        raise SystemExit(f"{path} is missing: build llama.cpp's tools with `bash scripts/setup_llamacpp.sh --tools`")
    done = subprocess.run([str(path), *map(str, args)], capture_output=True, text=True, cwd=ROOT, check=False)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")


def compound_file(cache: Path, method: str, block: str, args, make: bool = True) -> Path:
    """compound's ``method`` checkpoint of the model in the ``block`` grid, with its GGUF file (made unless reused or
    ``make`` is False)."""
    name = f"{method.replace('+', '-')}-{block}"
    directory = cache / name
    gguf_file = directory / f"{name}-{block}.gguf"
    if make and not (args.reuse and gguf_file.is_file()):
        from toolkit.engine.threads import ThreadSettings
        from toolkit.quant.configs import make_config
        from toolkit.quantize import CalibrationSpec

        config = make_config(method, bits=4, group_size=32, sym=GRIDS[block], gguf=True)
        calibration = CalibrationSpec(samples=args.samples, seq_len=args.seq_len)
        threads = ThreadSettings(threads=str(args.quantize_threads or args.threads))
        subprocess.run(quantize_argv(config, calibration, threads, model=args.model, output=directory),
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return gguf_file


def imatrix_files(cache: Path, f32: Path, tokenizer, args) -> dict[str, Path]:
    """llama.cpp's importance-matrix files, one per ``IMATRIX_TYPES``: ``llama-imatrix`` over compound's calibration
    windows as text (one window per chunk of ``--seq-len`` tokens), then ``llama-quantize --imatrix``."""
    from toolkit.calibration import calibration_batch
    from toolkit.quantize import CalibrationSpec

    spec = CalibrationSpec(samples=args.samples, seq_len=args.seq_len)
    imatrix = cache / f"imatrix-{spec.samples}x{spec.seq_len}.gguf"
    if not (args.reuse and imatrix.is_file()):
        text = cache / f"calibration-{spec.samples}x{spec.seq_len}.txt"
        windows = calibration_batch(tokenizer, spec.dataset, spec.samples, spec.seq_len)
        text.write_text("".join(tokenizer.decode(window) for window in windows))
        tool("llama-imatrix", "-m", f32, "-f", text, "-o", imatrix, "-c", spec.seq_len, "--chunks", spec.samples,
             "-t", args.threads)
    files = {}
    for type_name in IMATRIX_TYPES:
        out = cache / f"llamacpp-{type_name}-imatrix-{spec.samples}x{spec.seq_len}.gguf"
        if not (args.reuse and out.is_file()):
            tool("llama-quantize", "--imatrix", imatrix, f32, out, type_name, args.threads)
        files[type_name] = out
    return files


def linear_types(path: Path) -> tuple[Counter, float, Counter]:
    """The GGUF types of the file's decoder linears (2-D ``blk.*`` tensors) with their counts, the linears' bits per
    weight, and the input widths of those that are not K-quants (llama.cpp's fallbacks where a K-quant's super-block
    of 256 does not divide the width)."""
    from gguf import GGUFReader

    linears = [t for t in GGUFReader(str(path)).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    types = Counter(t.tensor_type.name for t in linears)
    bits = 8 * sum(int(t.n_bytes) for t in linears) / sum(int(t.n_elements) for t in linears)
    widths = Counter(int(t.shape[0]) for t in linears if not t.tensor_type.name.endswith("_K"))
    return types, bits, widths


def versus(ours: float, theirs: float) -> str:
    """compound's perplexity increase against another file's, in words: "compound's 54 % lower"."""
    return f"compound's {abs(1 - ours / theirs):.0%} {'lower' if ours < theirs else 'higher'}"


def type_list(types: Counter) -> str:
    """``Q5_0 ×150, Q8_0 ×30``: most frequent first."""
    return ", ".join(f"{name} ×{count}" for name, count in types.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", choices=MODELS, help="The embedded real model.")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (scores, tok/s, its tools).")
    parser.add_argument("--quantize-threads", type=int, default=None,
                        help="compound quantize's threads (default --threads): 1 when something runs beside it.")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--grids", default=",".join(GRIDS), help="compound's grids to write: Q4_0,Q4_1.")
    parser.add_argument("--reuse", action="store_true", help="Keep files already in benchmarks/.cache/gguf.")
    parser.add_argument("--beside", default="", help="What ran beside this run (its tok/s are then labelled as "
                        "measured beside it, not quietly).")
    parser.add_argument("--cached-only", action="store_true", help="With --reuse: leave out the compound files not "
                        "in the cache (named under the table as not run) instead of quantizing them.")
    parser.add_argument("--no-write", action="store_true", help="Print the table without updating BENCHMARKS.md.")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from toolkit.calibration import eval_windows
    from toolkit.gguf_export import float_gguf
    from toolkit.models import EMBEDDED, embedded_model_dir

    cache = CACHE / args.model
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir(args.model))
    f32 = cache / "F32.gguf"
    if not (args.reuse and f32.is_file()):
        float_gguf(args.model, f32, "F32", overwrite=True)
    files = {F32_LABEL: ("llama.cpp", f32)}
    for type_name in LLAMACPP_TYPES:
        out = cache / f"llamacpp-{type_name}.gguf"
        if not (args.reuse and out.is_file()):
            judge("quantize", f32, out, type_name, "--threads", args.threads)
        files[f"llama.cpp {type_name}"] = ("llama.cpp", out)
    for type_name, out in imatrix_files(cache, f32, tokenizer, args).items():
        files[f"llama.cpp {type_name}, importance matrix"] = ("llama.cpp", out)
    not_run = []
    for block in args.grids.split(","):
        for method in METHODS:
            label = f"compound {method} {block}"
            if args.cached_only and not compound_file(cache, method, block, args, make=False).is_file():
                not_run.append(label)
                continue
            files[label] = ("compound", compound_file(cache, method, block, args))

    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    windows_file = cache / "windows.json"
    windows_file.write_text(json.dumps(windows.tolist()))
    prompt_file = cache / "prompt.json"
    prompt_file.write_text(json.dumps([windows[0, :64].tolist()]))

    def perplexity(path: Path, *kv: str) -> float:
        scores = judge("logprobs", path, windows_file, "--threads", args.threads, *kv)["logprobs"]
        return math.exp(-sum(map(sum, scores)) / sum(map(len, scores)))

    def speed(path: Path, *kv: str) -> float:
        return judge("speed", path, prompt_file, args.new_tokens, "--threads", args.threads, *kv)["tokens_per_s"]

    measured = {label: (tool_name, path, *linear_types(path), perplexity(path), path.stat().st_size, speed(path))
                for label, (tool_name, path) in files.items()}
    base = measured[F32_LABEL][5]

    def row(label: str, types: Counter, bits: float, ppl: float, size: int, tok_s: float) -> list[str]:
        return [label, type_list(types), f"{bits:.2f}", f"{ppl:.3f}", f"{ppl - base:+.3f}", f"{size / 2**20:.1f}",
                f"{tok_s:.1f}"]

    rows = [row(label, types, bits, ppl, size, tok_s)
            for label, (_, _, types, bits, _, ppl, size, tok_s) in measured.items()]
    q4_0 = [label for label, (tool_name, _, types, *_) in measured.items()
            if tool_name == "compound" and set(types) == {"Q4_0"}]
    best = min(q4_0, key=lambda label: measured[label][5])
    _, path, types, bits, _, _, size, _ = measured[best]
    kv_ppl = perplexity(path, "--kv", "q8_0")
    rows.append(row(f"{best}, Q8_0 KV cache", types, bits, kv_ppl, size, speed(path, "--kv", "q8_0")))
    table = markdown_table(["file", "linears (GGUF type ×count)", "bits/weight (linears)", "perplexity (llama.cpp)",
                            "Δ vs F32", "MiB", "tok/s"], rows)

    def delta(label: str) -> float:
        return measured[label][5] - base

    ours, plain, guided = delta(best), delta("llama.cpp Q4_0"), delta("llama.cpp Q4_0, importance matrix")
    _, _, k_types, k_bits, k_widths, *_ = measured["llama.cpp Q4_K_M"]
    fallbacks = {name: count for name, count in k_types.items() if not name.endswith("_K")}
    k_m = (f"llama.cpp Q4_K_M is {k_bits:.2f} bits per linear weight, not a 4.5-bit file: "
           f"{sum(fallbacks.values())} of its {sum(k_types.values())} linears, those of input width "
           f"{' or '.join(map(str, sorted(k_widths)))} (not a multiple of a K-quant's 256-weight super-block), fall "
           f"back to {' and '.join(sorted(fallbacks))}; its Δ {delta('llama.cpp Q4_K_M'):+.3f} is no row's equal in "
           f"size" if fallbacks else
           f"llama.cpp Q4_K_M ({k_bits:.2f} bits per linear weight) {delta('llama.cpp Q4_K_M'):+.3f}")
    quiet = (f"measured beside {args.beside}: not a quiet machine, so the tok/s column is indicative only (the load "
             f"changed during the run)" if args.beside else "nothing else running")
    source = re.search(r"q\d_[a-z0-9_]+", EMBEDDED[args.model].filename.lower()).group().upper()
    version = subprocess.run([str(PYTHON), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    body = (f"Command: `{command_line()}`\n\n{EMBEDDED[args.model].source.split('/')[1]}, every file scored by "
            f"llama.cpp (llama-cpp-python {version} built from source) on the same {args.windows}×{args.seq_len} "
            f"held-out ShareGPT tokens; compound quantized W4 g32 on {args.samples}×{args.seq_len} calibration tokens "
            f"and wrote its own codes (`quantize --gguf`); llama.cpp's quantizer started from compound's F32 export, "
            f"its importance matrix from `llama-imatrix` over the same calibration windows as text (llama.cpp "
            f"tokenizes them again). Bits per weight count the decoder linears' bytes, scales included. tok/s: "
            f"llama.cpp greedy, batch 1, {args.threads} threads, {args.new_tokens} tokens after a 64-token prompt, "
            f"{quiet}.\n\n"
            f"{table}\n\n"
            f"At equal size (Q4_0, {measured[best][3]:.2f} bits per linear weight): the best compound file "
            f"({best.removeprefix('compound ')}) raises perplexity by {ours:+.3f}, llama.cpp's Q4_0 by {plain:+.3f} "
            f"({versus(ours, plain)}) and its importance-matrix Q4_0 by {guided:+.3f} ({versus(ours, guided)}). "
            f"{k_m}.\n\n"
            + (f"Not run this time (not in the cache): {', '.join(not_run)}.\n\n" if not_run else "") +
            f"Caveat: the model's weights came from a {source} GGUF file, which flatters an asymmetric small-group "
            f"grid (Q4_1's rows above all when the source is Q4_1); judge the methods on Q4_0 first.\n")
    print(body)
    if not args.no_write:
        update_section(f"GGUF in llama.cpp: compound's codes vs llama.cpp's quantizer ({MODELS[args.model]})", body)


if __name__ == "__main__":
    main()
