"""The ``validate`` verb: is a quantized checkpoint intact, does every runtime path compute the same model, and how
will serving engines run it?

1. Bytes: every file's SHA-256 against the ``compound.json`` manifest written with the checkpoint; a changed or
   missing file stops the run (``ChecksumError``, naming the files) before anything loads; once it loads, so does
   a float tensor (scales included) holding NaN or infinite values ("non-finite", naming the tensors).
2. Numerics: held-out tokens (``eval_windows``, one window per forward, so each linear sees ``seq_len`` rows) run
   through the model with every ``QuantLinear`` on the reference path (dequantize-then-matmul, fp32: the oracle),
   then on each faster path, compared by the largest |Δ logit| and top-1 agreement at every position:

   - cpu-int4: every linear, every window (the CPU int4 kernel, bf16 x); passes with top-1 agreement ≥ 0.9 and
     max |Δ logit| ≤ 10 % of max |logit|.
   - triton: on CUDA, every linear and every window; on CPU, Triton's interpreter in a child process, on the linears
     of the first ``triton_layers`` decoder layers (default 1, the others on the reference) and the first
     ``triton_tokens`` (default 16) tokens of window 0. fp32 in, fp32 accumulation, so only the summation order
     differs: passes with top-1 ≥ 0.999 and max |Δ logit| ≤ 0.1 % of max |logit|.

   The CPU interpreter runs each kernel program in numpy: one SmolLM2-135M decoder layer at 16 tokens takes about
   20 s, the whole model about 10 minutes, hence the default of one layer; it still reads that layer's packed
   tensors through the same kernel a GPU compiles, so a layout or nibble-order error shows in the logits. It runs
   in a child process because Triton decides compiled-vs-interpreted once, when ``triton.language`` is first
   imported (``TRITON_INTERPRET=1``): setting it here would be too late, or change every later Triton use here.
   The cpu-int4 tolerance: the op rounds every linear's input to bf16 (8 significant bits), which on SmolLM2-135M
   (30 layers, RTN W4 g64, 2×64 tokens) moved the logits by at most 3.9 % of their range and flipped 4 of 128
   top-1 tokens; a wrong nibble order or group index turns logits to noise (top-1 near chance).
3. Serving preview: which vLLM method and kernel the checkpoint gets (docs/formats.md §6), on GPU and on vLLM's CPU
   backend, and the exact ``vllm serve`` / SGLang ``launch_server`` command lines (no ``--quantization``: engines
   detect it, and forcing it took the slow path before vLLM 0.32, docs/formats.md §6).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from toolkit.evaluate.options import HeldOut
from toolkit.formats import Scheme, read_quantization_config
from toolkit.formats.checkpoint import MANIFEST, tensor_files, verify_manifest
from toolkit.options import option
from toolkit.quant.finite import all_finite
from toolkit.quant.configs import describe_act_order
from toolkit.runtime.load import CheckpointError

if TYPE_CHECKING:
    from toolkit.evaluate.suite import Phase

CPU_INT4_TOLERANCE = (0.9, 0.1)  # (min top-1 agreement, max |Δ logit| / max |logit|)
TRITON_TOLERANCE = (0.999, 1e-3)
INTERPRETER_LAYERS, INTERPRETER_TOKENS = 1, 16  # Triton on CPU: see the module docstring


class ChecksumError(CheckpointError):
    """A checkpoint file whose bytes differ from its manifest."""


@dataclass(frozen=True)
class PathResult:
    """One runtime path against the reference: ``positions`` logits compared, over ``layers`` decoder layers."""

    path: str
    positions: int
    layers: str
    max_logit_diff: float | None  # None: the path was skipped (see note)
    relative_diff: float | None  # max |Δ logit| / max |reference logit|
    top1_agreement: float | None
    ok: bool
    note: str = ""


@dataclass(frozen=True)
class ServingPreview:
    """How vLLM and SGLang will serve the checkpoint (docs/formats.md §6)."""

    quant_method: str
    scheme: str  # e.g. "4-bit, group 64, symmetric"
    vllm_gpu: str  # vLLM method → kernel
    vllm_gpu_why: str
    vllm_cpu: str
    vllm_cpu_why: str
    vllm_command: str
    vllm_cpu_command: str
    sglang_command: str
    problems: list[str] = field(default_factory=list)


@dataclass
class ValidationReport:
    directory: str
    manifest_files: int  # files whose hash was checked (0: no manifest)
    tokens: int  # held-out positions compared per full path
    paths: list[PathResult]
    serving: ServingPreview

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.paths) and not self.serving.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


@dataclass(frozen=True)
class ValidateOptions:
    """What a user sets for ``compound validate`` of a checkpoint (the flags are derived from these fields)."""

    windows: int = option(2, "Held-out windows run on every path.")
    seq_len: int = option(64, "Tokens per window (at most 256, where cpu-int4 hands over to the reference).")
    triton_layers: int | None = option(None, "Decoder layers run on the Triton kernels (default: all on CUDA, "
                                       f"{INTERPRETER_LAYERS} under the CPU interpreter).")
    triton_tokens: int | None = option(None, "Tokens of window 0 run on Triton (default: all on CUDA, "
                                       f"{INTERPRETER_TOKENS} under the CPU interpreter).")


def validate(directory: Path | str, *, dataset: str = HeldOut.dataset, windows: int = ValidateOptions.windows,
             seq_len: int = ValidateOptions.seq_len, triton_layers: int | None = None,
             triton_tokens: int | None = None,
             say: Callable[[str], None] = lambda _: None, progress: Phase | None = None) -> ValidationReport:
    """Check ``directory``'s bytes, run its held-out tokens on every runtime path, and preview serving.

    triton_layers / triton_tokens: decoder layers whose linears run the Triton kernel, and tokens of window 0 that
    run it (None: everything on CUDA; 1 layer and 16 tokens under the CPU interpreter). Raises ``ChecksumError``
    when a file changed, ``CheckpointError`` for a directory that is not a quantized checkpoint.
    say: one line per check as it finishes; progress(phase, total): starts a long check (windows through a path,
    tokens decoded) and returns what counts its steps done.
    """
    from toolkit.calibration import eval_windows
    from toolkit.runtime.load import load_quantized
    from toolkit.runtime.quant_linear import CPU_INT4_MAX_ROWS, QuantLinear, backend_problem, set_backend

    directory = Path(directory)
    checked = _check_manifest(directory)  # 1
    say(f"manifest: {checked} files, SHA-256 intact" if checked else "manifest: none (compound.json absent), bytes "
        "not checked")
    if seq_len > CPU_INT4_MAX_ROWS:
        raise ValueError(f"seq_len {seq_len} is above the {CPU_INT4_MAX_ROWS} rows up to which the cpu-int4 path runs "
                         f"the CPU int4 kernel (above, it runs the reference and would compare it with itself); "
                         f"pass --seq-len {CPU_INT4_MAX_ROWS} or less")
    model, tokenizer = load_quantized(directory, torch.float32, backend="reference")  # 2
    _check_finite_tensors(directory)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    say(f"loaded: {len(linears)} quantized linears, every tensor finite")
    tokens = eval_windows(tokenizer, dataset, windows, seq_len)  # (windows, seq_len)
    reference = _logits(model, tokens, _phase(progress, "reference path", tokens.shape[0]))
    if not all_finite(reference):
        raise CheckpointError(f"{directory}: the reference path produced non-finite logits (NaN or inf) from finite "
                              "tensors; the checkpoint's values overflow float32: re-quantize it")
    paths = []
    for path in ("cpu-int4", "triton"):  # a checkpoint neither runs (e.g. 8-bit) is served by the reference alone
        problem = next(filter(None, (backend_problem(path, m.bits, m.group_size, m.in_features) for m in linears)), None)
        if problem:
            paths.append(PathResult(path, 0, "-", None, None, None, True, f"skipped: {problem}"))
        elif path == "cpu-int4":
            set_backend(model, "cpu-int4")
            got = _logits(model, tokens, _phase(progress, "cpu-int4 path", tokens.shape[0]))
            paths.append(_compare("cpu-int4", got, reference, "all", CPU_INT4_TOLERANCE))
            set_backend(model, "reference")
        else:
            advance = _phase(progress, "triton path", 1)
            paths.append(_triton_path(directory, model, tokens, triton_layers, triton_tokens))
            advance(1)
        say(path_line(paths[-1]))
    paths.append(_decode_path(model, tokens[0, :32], _phase(progress, "decode loop vs transformers.generate", 2)))
    say(path_line(paths[-1]))
    serving = serving_preview(directory, [(m.in_features, m.out_features) for m in linears])  # 3
    say(f"serving preview: vLLM on GPU {serving.vllm_gpu}; on CPU {serving.vllm_cpu}"
        + (f"; {len(serving.problems)} problem(s)" if serving.problems else ""))
    return ValidationReport(str(directory), checked, tokens.numel(), paths, serving)


def path_line(p: PathResult) -> str:
    """One runtime path's result in a line: verdict, the numbers, the note."""
    verdict = "ok" if p.ok else "FAILED"
    numbers = "" if p.max_logit_diff is None else \
        f", max |Δ logit| {p.max_logit_diff:.3g} ({p.relative_diff:.1e} of max), top-1 {p.top1_agreement:.2%}"
    return f"{p.path}: {verdict}{numbers}" + (f"; {p.note}" if p.note else "")


def _phase(progress: Phase | None, name: str, total: int) -> Callable[[int], None]:
    return progress(name, total) if progress else (lambda n: None)


def _decode_path(model, prompt: torch.Tensor, advance: Callable[[int], None], new_tokens: int = 16) -> PathResult:
    """compound's decode loop (static KV cache) against transformers' ``generate``, greedy, on the reference path:
    the loop that measures speculative decoding must produce exactly the model's own tokens. ``advance(1)`` after
    each of the two."""
    from toolkit.decode import Decoder, generate

    ours, stats = generate(Decoder.from_model(model, prompt.numel() + new_tokens), prompt, new_tokens)
    advance(1)
    with torch.inference_mode():
        theirs = model.generate(prompt[None], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)[0]
    advance(1)
    same = int((ours == theirs).long().cumprod(0).sum()) - prompt.numel()
    return PathResult("decode loop", new_tokens, "all", None, None, same / new_tokens, same == new_tokens,
                      f"greedy: {same}/{new_tokens} tokens identical to transformers.generate, "
                      f"{stats.tokens_per_s:.1f} tok/s")


def _check_finite_tensors(directory: Path) -> None:
    """Refuse a checkpoint whose float tensors (scales included) hold NaN or infinite values, naming them; read one
    tensor at a time."""
    from safetensors import safe_open

    bad = []
    for path in tensor_files(directory):
        with safe_open(path, "pt") as f:
            names = f.keys()
            bad += [name for name in names if not _finite_or_integer(f.get_tensor(name))]
    if bad:
        raise CheckpointError(f"{directory}: non-finite values (NaN or inf) in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:4])}; the checkpoint cannot run: re-quantize a finite model")


def _finite_or_integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() or all_finite(tensor)


def _check_manifest(directory: Path) -> int:
    """How many files the manifest lists, all intact; raises ``ChecksumError`` naming the ones that changed."""
    if not (directory / MANIFEST).is_file():
        return 0
    changed = verify_manifest(directory)
    if changed:
        raise ChecksumError(
            f"{directory}: {', '.join(changed)} changed since the checkpoint was written (SHA-256 differs from "
            f"{MANIFEST}, or the file is missing); copy the checkpoint again or re-run compound quantize")
    return len(json.loads((directory / MANIFEST).read_text()).get("files", {}))


@torch.inference_mode()
def _logits(model, tokens: torch.Tensor, advance: Callable[[int], None] = lambda n: None) -> torch.Tensor:
    """Float32 logits [windows, T, vocab], one window per forward (each linear sees T rows); ``advance(1)`` after
    each window."""
    out = []
    for window in tokens:
        out.append(model(window[None]).logits.float())
        advance(1)
    return torch.cat(out)


def _compare(path: str, got: torch.Tensor, reference: torch.Tensor, layers: str, tolerance: tuple[float, float],
             note: str = "") -> PathResult:
    if not all_finite(got):
        return PathResult(path, reference.shape[0] * reference.shape[1], layers, None, None, None, False,
                          "; ".join(filter(None, ["non-finite logits (NaN or inf)", note])))
    diff = (got - reference).abs().max().item()
    relative = diff / reference.abs().max().clamp_min(1e-30).item()
    top1 = (got.argmax(-1) == reference.argmax(-1)).float().mean().item()
    ok = top1 >= tolerance[0] and relative <= tolerance[1]
    return PathResult(path, reference.shape[0] * reference.shape[1], layers, diff, relative, top1, ok, note)


def _triton_path(directory: Path, model, tokens: torch.Tensor, layers: int | None, count: int | None) -> PathResult:
    from toolkit.models import decoder_layers
    from toolkit.runtime.quant_linear import set_backend

    total = len(decoder_layers(model))
    if torch.cuda.is_available():
        layers, count = layers or total, count or tokens.shape[1]
        subset = tokens[:, :count]
        model.cuda()
        reference = _logits(model, subset.cuda()).cpu()
        for layer in decoder_layers(model)[:layers]:
            set_backend(layer, "triton")
        got = _logits(model, subset.cuda()).cpu()
        set_backend(model, "reference")
        model.cpu()
        note = "compiled, CUDA"
    else:
        layers, count = layers or INTERPRETER_LAYERS, count or INTERPRETER_TOKENS
        subset = tokens[:1, :count]
        reference = _logits(model, subset)
        got = _interpreted_triton_logits(directory, subset, layers)
        note = "Triton CPU interpreter (child process)"
    which = "all" if layers >= total else ("0" if layers == 1 else f"0–{layers - 1}")
    return _compare("triton", got, reference, which, TRITON_TOLERANCE, f"{note}; other layers on the reference")


# A `python -c` child puts its working directory first on sys.path; in compound's source tree, the folder `kernels/`
# would then shadow the PyPI package `kernels` that transformers imports (Python 3.11+ honours this variable).
SAFE_PATH = {"PYTHONSAFEPATH": "1"}


def _interpreted_triton_logits(directory: Path, tokens: torch.Tensor, layers: int) -> torch.Tensor:
    with tempfile.TemporaryDirectory() as tmp:
        tokens_path, logits_path = Path(tmp) / "tokens.pt", Path(tmp) / "logits.pt"
        torch.save(tokens, tokens_path)
        code = "import sys; from toolkit.validate import _triton_child; _triton_child(*sys.argv[1:])"
        proc = subprocess.run([sys.executable, "-c", code, str(directory), str(tokens_path), str(layers), str(logits_path)],
                              env={**os.environ, "TRITON_INTERPRET": "1", **SAFE_PATH}, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"the Triton interpreter run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return torch.load(logits_path, weights_only=True)


def _triton_child(directory: str, tokens_path: str, layers: str, logits_path: str) -> None:
    """Child-process entry: logits with the first ``layers`` decoder layers on the (interpreted) Triton kernels."""
    from toolkit.kernels._launch import interpreting
    from toolkit.kernels.w4a16_gptq import _gptq_kernel
    from toolkit.models import decoder_layers
    from toolkit.runtime.load import load_quantized
    from toolkit.runtime.quant_linear import set_backend

    if not interpreting(_gptq_kernel):
        raise RuntimeError("TRITON_INTERPRET=1 did not reach Triton in the child process")
    model, _ = load_quantized(directory, torch.float32, backend="reference")
    for layer in decoder_layers(model)[: int(layers)]:
        set_backend(layer, "triton")
    torch.save(_logits(model, torch.load(tokens_path, weights_only=True)), logits_path)


# ---- serving preview (docs/formats.md §6) --------------------------------------------------------------------------


def serving_preview(directory: Path | str, shapes: list[tuple[int, int]]) -> ServingPreview:
    """vLLM's method and kernel for the checkpoint in ``directory`` and the serve commands; ``shapes`` lists every
    quantized linear's (in_features, out_features)."""
    config = json.loads((Path(directory) / "config.json").read_text())
    q = config["quantization_config"]
    method = q["quant_method"]
    scheme = read_quantization_config(q)
    bits, group_size = scheme.bits, scheme.group_size
    problems = [f"{K}-wide input is not a multiple of group_size {group_size} (vLLM checks every linear)"
                for K, _ in sorted(set(shapes)) if group_size != -1 and K % group_size]

    vllm_gpu, why = scheme.format.vllm_kernel(scheme, q)
    cpu_problems = ([f"{bits}-bit weights (its kernel runs 4-bit only)"] if bits != 4 else []) + \
        ([f"odd group size {group_size}"] if group_size != -1 and group_size % 2 else []) + \
        [f"a {K}→{N} linear (widths must be multiples of 32)" for K, N in sorted(set(shapes)) if K % 32 or N % 32]
    if vllm_gpu == "refused":
        cpu_problems.insert(0, "the quantization config itself is refused (see GPU)")
    if cpu_problems:
        vllm_cpu, cpu_why = "none", "vLLM's CPU backend refuses it: " + "; ".join(cpu_problems)
    else:
        vllm_cpu = "CPUWNA16LinearKernel"
        cpu_why = ("4-bit, even group, widths multiples of 32; fp16/bf16 activations only (fp32 fails); "
                   "VLLM_CPU_INT4_W4A8=0 keeps true W4A16 (else AMX CPUs quantize bf16 activations to int8)")

    saved = str(config.get("torch_dtype") or config.get("dtype") or "float16")
    dtype = saved if saved in ("float16", "bfloat16") else "float16"  # the W4A16 kernels take half activations only
    path = str(directory)
    return ServingPreview(
        quant_method=method,
        scheme=f"{bits}-bit, {'per-channel' if group_size == -1 else f'group {group_size}'}, "
               f"{'symmetric' if scheme.sym else 'asymmetric (zero points)'}, "
               f"act-order {_act_order(directory, scheme)}{_rotation(directory)}",
        vllm_gpu=vllm_gpu, vllm_gpu_why=why, vllm_cpu=vllm_cpu, vllm_cpu_why=cpu_why,
        vllm_command=f"vllm serve {path} --dtype {dtype}",
        vllm_cpu_command=f"VLLM_CPU_INT4_W4A8=0 vllm serve {path} --dtype {dtype}",
        sglang_command=f"python -m sglang.launch_server --model-path {path} --dtype {dtype}",
        problems=problems,
    )


def _recorded(directory: Path | str) -> dict | None:
    """The quantization config the checkpoint's manifest records (None without a manifest)."""
    manifest = Path(directory) / MANIFEST
    return json.loads(manifest.read_text()).get("quantization") if manifest.is_file() else None


def _act_order(directory: Path | str, scheme: Scheme) -> str:
    """The act-order of a checkpoint as its manifest records it (the quantization_config alone says only whether
    groups are dynamic: ``desc_act``)."""
    quantization = _recorded(directory)
    if quantization:
        return describe_act_order(quantization.get("act_order", False), quantization.get("static_groups", True),
                                  quantization.get("group_size"))
    return "on (dynamic groups)" if scheme.desc_act else "off or static groups (no manifest to tell)"


def _rotation(directory: Path | str) -> str:
    """The rotation the manifest records (``--rotate``), as the end of the scheme's description; "" for none."""
    rotate = (_recorded(directory) or {}).get("rotate", "none")
    return "" if rotate == "none" else f", {rotate} rotation folded into the weights (nothing to undo when serving)"

