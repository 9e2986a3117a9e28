"""compound's checks on one CUDA GPU, within a fixed budget, as one markdown report (run by ``scripts/gpu_check.sh``).

    bash scripts/gpu_check.sh            # on a GPU machine: install compound beside the image's packages, check
    bash scripts/gpu_check.sh --dry-run  # anywhere: the plan, what travels to a device machine, and whether it fits

Each check is a group of ``@pytest.mark.gpu`` tests (``tests/gpu``) run in a pytest process of its own with its own
timeout, so a failing or hanging check costs its own time and never stops the others; each test leaves its numbers
in ``$COMPOUND_GPU_RECORDS`` and the report collects them. The whole run keeps to ``BUDGET_S``: a check starts only
with ``MIN_START_S`` left, and its timeout is cut to what is left. The report (``gpu_check.md``), the numbers
(``gpu_check.json``) and the tail of every check's output (``gpu_check.log``) go to ``$OUT`` (default
``out/gpu-check``), written after every check, so a run killed from outside still leaves one.

Nothing here needs a package the device image lacks: compound is installed with ``--no-deps --no-build-isolation``
(the image has setuptools), its declared ``gguf`` and ``datasets`` are read only for GGUF files and Hub datasets,
which the checks do not use, and the models, tokenizer and conversations are built there from random weights
(``tests/gpu/gpu_models.py``). Wheels placed in ``WHEELS`` (an ignored folder) are installed first, for a package a
later check may need; the dry run counts them in what travels.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 480  # the whole run, install included: 8 minutes on one H100
MIN_START_S = 30  # a check starts only with this much of the budget left
REPORT_S = 10  # kept back from the last check for writing the report
TRAVEL_LIMIT = 64 * 2**20  # what the device tool carries: tracked and untracked-not-ignored files plus carried paths
WHEELS = ".whl"  # wheels to install before the checks (git-ignored; the device tool's `carry`)
DEFAULT_OUT = ROOT / "out" / "gpu-check"


@dataclass(frozen=True)
class Check:
    name: str
    tests: tuple[str, ...]  # pytest node ids under tests/gpu
    timeout_s: int
    measures: str


CHECKS = (  # in order of what matters most when the budget runs short
    Check("kernels", ("tests/gpu/test_kernels_gpu.py::test_every_layout_matches_the_reference_on_the_gpu",), 150,
          "gptq / awq / compressed-tensors Triton kernels against the torch reference, M = 1..64, g 32/64/128"),
    Check("bandwidth", ("tests/gpu/test_kernels_gpu.py::test_decode_product_reads_at_copy_bandwidth",), 60,
          "M = 1 product on 4096x14336 and 8192x28672 against a device-to-device copy of the same bytes"),
    Check("torchrun", ("tests/gpu/test_distributed_gpu.py",), 90,
          "torchrun --nproc_per_node=1: NCCL reductions, compound quantize --device cuda"),
    Check("heads", ("tests/gpu/test_heads_gpu.py",), 90, "train-heads --head eagle3, 30 steps on CUDA"),
    Check("quantize-1b", ("tests/gpu/test_quantize_gpu.py::test_a_1b_llama_quantizes_on_cuda",), 180,
          "GPTQ and AWQ W4 g128 of a random 1B Llama on CUDA: wall time, peak GPU memory"),
    Check("decode", ("tests/gpu/test_decode_gpu.py",), 150,
          "compound decode on CUDA (Triton) against the dequantized reference, tokens/s"),
    Check("agreement", ("tests/gpu/test_quantize_gpu.py::test_cuda_matches_the_cpu",), 150,
          "GPTQ and AWQ on CUDA against the same run on the CPU (1B widths, 2 layers)"),
)


def declared_dependencies() -> list[str]:
    """compound's runtime dependencies by distribution name, read from pyproject.toml."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("dependencies = [", 1)[1].split("]", 1)[0]
    return [re.split(r"[<>=!~ ]", item.strip().strip('",'))[0] for item in block.splitlines() if '"' in item]


def missing_dependencies() -> list[str]:
    """The declared dependencies this Python does not have installed."""
    missing = []
    for name in declared_dependencies():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def travelling_bytes() -> tuple[int, dict[str, int]]:
    """(bytes of the files git tracks or would track, bytes of each ignored path carried beside them)."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    tree = sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file() and not (ROOT / p).is_symlink())
    carried = {}
    wheels = ROOT / WHEELS
    if wheels.is_dir():
        carried[WHEELS] = sum(p.stat().st_size for p in wheels.rglob("*") if p.is_file())
    return tree, carried


def dry_run() -> int:
    """Print the plan and what would travel to a device machine; 1 when it is over the device tool's limit."""
    print(f"plan: {len(CHECKS)} checks within {BUDGET_S} s (install included); each in its own pytest process")
    for check in CHECKS:
        print(f"  {check.name:<12} timeout {check.timeout_s:>3} s  {check.measures}")
        for test in check.tests:
            print(f"  {'':<12} {test}")
    missing = missing_dependencies()
    print(f"declared dependencies missing here: {', '.join(missing) or 'none'} (the checks import none of gguf, "
          "datasets)")
    tree, carried = travelling_bytes()
    total = tree + sum(carried.values())
    print(f"working tree that travels: {tree / 2**20:.1f} MiB")
    for path, size in carried.items():
        print(f"carry {path}: {size / 2**20:.1f} MiB ({', '.join(sorted(p.name for p in (ROOT / path).iterdir()))})")
    if not carried:
        print(f"carry: nothing (no {WHEELS}/ folder of wheels)")
    fits = total <= TRAVEL_LIMIT
    print(f"total {total / 2**20:.1f} MiB of {TRAVEL_LIMIT / 2**20:.0f} MiB: {'fits' if fits else 'DOES NOT FIT'}")
    return 0 if fits else 1


class Report:
    """The markdown report, the numbers and the log, rewritten whole after every step."""

    def __init__(self, out: Path, started: float):
        self.out, self.started = out, started
        self.environment: dict[str, str] = {}
        self.results: list[dict] = []
        self.records: dict[str, dict] = {}
        self.log: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, result: dict, records: dict[str, dict], output: str) -> None:
        self.results.append(result)
        self.records.update(records)
        self.log.append(f"===== {result['check']} ({result['status']}, {result['seconds']:.0f} s)\n{output[-6000:]}")
        self.write()

    def write(self) -> None:
        lines = ["# compound GPU check", ""]
        lines += [f"- {key}: {value}" for key, value in self.environment.items()]
        lines += [f"- wall time so far: {time.monotonic() - self.started:.0f} s of {BUDGET_S} s", "",
                  "| check | status | seconds | measures |", "|---|---|---|---|"]
        lines += [f"| {r['check']} | {r['status']} | {r['seconds']:.0f} | {r['measures']} |" for r in self.results]
        for name, values in self.records.items():
            lines += ["", f"## {name}", ""] + _markdown(values)
        _write(self.out / "gpu_check.md", "\n".join(lines) + "\n")
        _write(self.out / "gpu_check.json", json.dumps({"environment": self.environment, "checks": self.results,
                                                        "records": self.records}, indent=1, default=str) + "\n")
        _write(self.out / "gpu_check.log", "\n".join(self.log) + "\n")


def _markdown(values: dict) -> list[str]:
    """A record as bullet lines; a dict of dicts (one row per case) as a table."""
    lines = []
    for key, value in values.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            columns = list(next(iter(value.values())))
            lines += ["", f"{key}:", "", f"| case | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
            lines += [f"| {case} | {' | '.join(_number(row.get(c)) for c in columns)} |" for case, row in value.items()]
            lines.append("")
        elif isinstance(value, dict):
            lines.append(f"- {key}: " + ", ".join(f"{k} {_number(v)}" for k, v in value.items()))
        else:
            lines.append(f"- {key}: {_number(value)}")
    return lines


def _number(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def _run(command: list[str], timeout: float, env: dict | None = None) -> tuple[str, int | None, str]:
    """(status, exit code, output) of ``command`` killed with its process group after ``timeout`` seconds."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, 9)
        output, _ = process.communicate()
        return f"timed out after {timeout:.0f} s", None, output
    return ("passed" if process.returncode == 0 else f"failed (exit {process.returncode})"), process.returncode, output


def install(report: Report) -> bool:
    """Carried wheels (if any) into a target folder on PYTHONPATH, then compound itself, editable and without its
    dependencies; False when compound cannot be imported afterwards."""
    wheels = sorted((ROOT / WHEELS).glob("*.whl"))
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir"]
    if wheels:
        site = Path(tempfile.gettempdir()) / "compound-gpu-site"
        status, _, output = _run([*pip, "--upgrade", "--target", str(site), *map(str, wheels)], 120)
        report.environment["carried wheels"] = f"{', '.join(w.name for w in wheels)}: {status}"
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    status, _, output = _run([*pip, "--no-build-isolation", "-e", str(ROOT)], 180)
    report.environment["pip install --no-deps -e ."] = status if status == "passed" else f"{status}: {output[-500:]}"
    os.environ["PATH"] = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])  # `compound`
    if status != "passed":
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(linked_package()), os.environ.get("PYTHONPATH")]))
        report.environment["import path"] = "toolkit linked from the checkout (no `compound` command for torchrun)"
    probe = subprocess.run([sys.executable, "-c", "import toolkit.kernels.reference, toolkit.cli"], cwd=ROOT / "tests",
                           capture_output=True, text=True)
    if probe.returncode:
        report.environment["import toolkit"] = f"failed: {probe.stderr[-500:]}"
    return probe.returncode == 0


DESCRIBE = ("import torch; p = torch.cuda.get_device_properties(0); "
            "print(f'{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs; "
            "torch {torch.__version__} (CUDA {torch.version.cuda})')")


def linked_package() -> Path:
    """Where pip cannot install compound: a folder holding ``toolkit`` as pyproject's package-dir lays it out
    (``kernels/`` and ``calibration/`` inside it), built of links to the checkout, for PYTHONPATH."""
    folder = Path(tempfile.mkdtemp(prefix="compound-linked-"))
    package = folder / "toolkit"
    package.mkdir()
    for entry in (ROOT / "toolkit").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in ("kernels", "calibration"):
        if not (package / name).exists():
            (package / name).symlink_to(ROOT / name)
    return folder


def describe_machine(report: Report) -> None:
    """The GPU and the versions that matter, asked in a child process: a CUDA context held here would take GPU
    memory from every check."""
    status, _, output = _run([sys.executable, "-c", DESCRIBE], 60)
    report.environment.update({
        "device": output.strip().splitlines()[-1] if status == "passed" and output.strip() else status,
        "triton": _version("triton"), "transformers": _version("transformers"), "python": sys.version.split()[0],
        "compound dependencies missing": ", ".join(missing_dependencies()) or "none",
    })


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_checks(out: Path) -> int:
    started = time.monotonic()
    report = Report(out, started)
    describe_machine(report)
    report.write()
    if not install(report):
        report.write()
        print(f"compound could not be installed; see {out / 'gpu_check.md'}")
        return 1
    records_dir = Path(tempfile.mkdtemp(prefix="compound-gpu-records-"))
    work = Path(tempfile.mkdtemp(prefix="compound-gpu-work-"))  # models the checks share (the 1B Llama is built once)
    env = os.environ | {"COMPOUND_GPU_RECORDS": str(records_dir), "COMPOUND_GPU_WORK": str(work),
                        "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("TRITON_INTERPRET", None)
    failed = 0
    for check in CHECKS:
        left = BUDGET_S - (time.monotonic() - started) - REPORT_S
        if left < MIN_START_S:
            report.add({"check": check.name, "status": "not run (budget spent)", "seconds": 0.0,
                        "measures": check.measures}, {}, "")
            continue
        tick = time.monotonic()
        print(f"[{tick - started:5.0f} s] {check.name}: {check.measures}", flush=True)
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
                   "--basetemp", str(work / f"pytest-{check.name}"), *check.tests]
        status, code, output = _run(command, min(check.timeout_s, left), env)
        failed += status != "passed"
        records = {}
        for path in sorted(records_dir.glob("*.json")):
            records[path.stem] = json.loads(path.read_text())
            path.unlink()
        report.add({"check": check.name, "status": status, "seconds": time.monotonic() - tick,
                    "measures": check.measures}, records, output)
        print(f"          {status}", flush=True)
    report.write()
    print(f"report: {out / 'gpu_check.md'} ({failed} of {len(CHECKS)} checks did not pass, "
          f"{time.monotonic() - started:.0f} s)")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print the plan and what would travel, run nothing")
    args = parser.parse_args()
    if args.dry_run:
        return dry_run()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (the gpu tests skip on this machine; "
              "`bash scripts/gpu_check.sh --dry-run` shows the plan)")
        return 0
    return run_checks(Path(os.environ.get("OUT") or DEFAULT_OUT))


if __name__ == "__main__":
    sys.exit(main())
