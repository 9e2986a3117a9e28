"""compound's GPTQ/AWQ codes in llama.cpp against llama.cpp's own quantizer, judged by llama.cpp (SmolLM2-135M).

(Not named gguf.py: run as a script, that name would shadow the gguf package transformers imports.)

Every file is scored by llama.cpp itself (``tests/integration/llamacpp_judge.py`` in the venv of
``scripts/setup_llamacpp.sh``) on the same held-out ShareGPT windows (eval split, never calibrated on):

- the float reference: compound's F32 export of SmolLM2 (``compound convert --format gguf --outtype F32``);
- llama.cpp's quantizer (``llama_model_quantize``, its default per-tensor choices) from that F32 file: Q4_0, Q4_1,
  Q4_K_M, Q8_0;
- compound rtn / gptq / awq / awq+gptq, W4 g32 on ``--samples`` × ``--seq-len`` ShareGPT calibration tokens,
  symmetric → Q4_0 and asymmetric → Q4_1 (``compound quantize --gguf``: the codes compound chose, Q8_0 embeddings);
- the best compound Q4_0 file again with llama.cpp's Q8_0 KV cache (``type_k``/``type_v``).

Columns: perplexity, its increase over F32, file size, and llama.cpp greedy tokens/s (batch 1, ``--threads``
threads, ``--new-tokens`` after a 64-token prompt). Timings need a quiet machine; quantizations and scores do not:
``--beside "..."`` names what ran beside the run, and the table then says its tok/s were not measured quietly.

Caveat printed with the table: SmolLM2's weights came from a Q4_1 GGUF file, so asymmetric g32 round-to-nearest
recovers them almost exactly and flatters every Q4_1 row; judge the methods on Q4_0 and Q4_K_M.

    python benchmarks/llamacpp_gguf.py [--windows 16] [--seq-len 512] [--samples 128] [--threads 2] [--quantize-threads N] [--grids Q4_0,Q4_1] [--reuse]
                                      [--beside "what else ran"] [--cached-only] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from commands import quantize_argv  # noqa: E402
from report import command_line, markdown_table, update_section  # noqa: E402

MODEL = "smollm2-135m"
CACHE = ROOT / "benchmarks" / ".cache" / "gguf"
PYTHON = ROOT / ".venvs" / "llamacpp" / "bin" / "python"
JUDGE = ROOT / "tests" / "integration" / "llamacpp_judge.py"
LLAMACPP_TYPES = ("Q4_0", "Q4_1", "Q4_K_M", "Q8_0")
METHODS = ("rtn", "gptq", "awq", "awq+gptq")
GRIDS = {"Q4_0": True, "Q4_1": False}  # GGUF block type → compound's symmetric grid (Q4_1 has a minimum)


def judge(*args: str) -> dict:
    done = subprocess.run([str(PYTHON), str(JUDGE), *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"llama.cpp judge {args[0]} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def compound_file(method: str, block: str, args, make: bool = True) -> Path:
    """compound's ``method`` checkpoint of SmolLM2 in the ``block`` grid, with its GGUF file (made unless reused or
    ``make`` is False)."""
    name = f"{method.replace('+', '-')}-{block}"
    directory = CACHE / name
    gguf_file = directory / f"{name}-{block}.gguf"
    if make and not (args.reuse and gguf_file.is_file()):
        from toolkit.engine.threads import ThreadSettings
        from toolkit.quant.configs import make_config
        from toolkit.quantize import CalibrationSpec

        config = make_config(method, bits=4, group_size=32, sym=GRIDS[block], gguf=True)
        calibration = CalibrationSpec(samples=args.samples, seq_len=args.seq_len)
        threads = ThreadSettings(threads=str(args.quantize_threads or args.threads))
        subprocess.run(quantize_argv(config, calibration, threads, model=MODEL, output=directory),
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return gguf_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (scores and tok/s).")
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

    CACHE.mkdir(parents=True, exist_ok=True)
    f32 = CACHE / "smollm2-F32.gguf"
    if not (args.reuse and f32.is_file()):
        float_gguf(MODEL, f32, "F32", overwrite=True)
    files = {"F32 (compound's float export)": ("llama.cpp", "F32", f32)}
    for type_name in LLAMACPP_TYPES:
        out = CACHE / f"llamacpp-{type_name}.gguf"
        if not (args.reuse and out.is_file()):
            judge("quantize", f32, out, type_name, "--threads", args.threads)
        files[f"llama.cpp {type_name}"] = ("llama.cpp", type_name, out)
    not_run = []
    for block in args.grids.split(","):
        for method in METHODS:
            label = f"compound {method} {block}"
            if args.cached_only and not compound_file(method, block, args, make=False).is_file():
                not_run.append(label)
                continue
            files[label] = ("compound", block, compound_file(method, block, args))

    tokenizer = AutoTokenizer.from_pretrained(CACHE / "rtn-Q4_0")
    windows = eval_windows(tokenizer, "sharegpt", args.windows, args.seq_len)
    windows_file = CACHE / "windows.json"
    windows_file.write_text(json.dumps(windows.tolist()))
    prompt_file = CACHE / "prompt.json"
    prompt_file.write_text(json.dumps([windows[0, :64].tolist()]))

    def perplexity(path: Path, *kv: str) -> float:
        scores = judge("logprobs", path, windows_file, "--threads", args.threads, *kv)["logprobs"]
        return math.exp(-sum(map(sum, scores)) / sum(map(len, scores)))

    def speed(path: Path, *kv: str) -> float:
        return judge("speed", path, prompt_file, args.new_tokens, "--threads", args.threads, *kv)["tokens_per_s"]

    measured = {label: (tool, grid, path, perplexity(path), path.stat().st_size, speed(path))
                for label, (tool, grid, path) in files.items()}
    base = measured["F32 (compound's float export)"][3]
    best = min((label for label, (tool, grid, *_) in measured.items() if tool == "compound" and grid == "Q4_0"),
               key=lambda label: measured[label][3])
    rows = [[label, grid, f"{ppl:.3f}", f"{ppl - base:+.3f}", f"{size / 2**20:.1f}", f"{tok_s:.1f}"]
            for label, (tool, grid, path, ppl, size, tok_s) in measured.items()]
    _, grid, path, ppl, size, _ = measured[best]
    kv_ppl = perplexity(path, "--kv", "q8_0")
    rows.append([f"{best}, Q8_0 KV cache", grid, f"{kv_ppl:.3f}", f"{kv_ppl - base:+.3f}", f"{size / 2**20:.1f}",
                 f"{speed(path, '--kv', 'q8_0'):.1f}"])
    table = markdown_table(["file", "linears", "perplexity (llama.cpp)", "Δ vs F32", "MiB", "tok/s"], rows)

    own = measured["llama.cpp Q4_0"][3] - base
    ours = measured[best][3] - base
    k_m = measured["llama.cpp Q4_K_M"][3] - base
    quiet = (f"measured beside {args.beside}: not a quiet machine, so the tok/s column is indicative only (the load "
             f"changed during the run)" if args.beside else "nothing else running")
    body = (f"Command: `{command_line()}`\n\nSmolLM2-135M-Instruct, every file "
            f"scored by llama.cpp (llama-cpp-python 0.3.36 built from source) on the same {args.windows}×{args.seq_len} held-out ShareGPT tokens; compound "
            f"quantized W4 g32 on {args.samples}×{args.seq_len} calibration tokens and wrote its own codes "
            f"(`quantize --gguf`); llama.cpp's quantizer started from compound's F32 export. tok/s: llama.cpp greedy, "
            f"batch 1, {args.threads} threads, {args.new_tokens} tokens after a 64-token prompt, {quiet}.\n\n"
            f"{table}\n\n"
            f"Best compound Q4_0 ({best.removeprefix('compound ')}): perplexity increase {ours:+.3f} against llama.cpp "
            f"Q4_0's {own:+.3f}, a cut of {100 * (1 - ours / own):.0f} %; llama.cpp Q4_K_M (super-blocks of 256 with "
            f"6-bit sub-scales, Q6_K output) {k_m:+.3f}.\n\n"
            + (f"Not run this time (not in the cache): {', '.join(not_run)}.\n\n" if not_run else "") +
            "Caveat: SmolLM2's weights came from a Q4_1 GGUF file, so asymmetric g32 round-to-nearest recovers them "
            "almost exactly and flatters every Q4_1 row (and llama.cpp's own Q4_1); judge methods on Q4_0 and "
            "Q4_K_M.\n")
    print(body)
    if not args.no_write:
        update_section("GGUF in llama.cpp: compound's codes vs llama.cpp's quantizer (SmolLM2)", body)


if __name__ == "__main__":
    main()
