"""The ``quantize`` verb: model spec + config + calibration data → a deployable checkpoint directory."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from toolkit.engine import devices, distributed, memory
from toolkit.engine.devices import device_option
from toolkit.engine.loop import Progress, check_finite_weights, input_widths, quantize_layers
from toolkit.engine.resume import LayerCheckpoints
from toolkit.engine.session import capture_layer_inputs
from toolkit.engine.shards import is_safetensors_dir
from toolkit.engine.streaming import StreamedLayers, outer_names, outer_tensors, stream_model
from toolkit.formats import AUTO, LAYOUTS, compressed_tensors, resolve
from toolkit.formats.checkpoint import (
    ShardWriter,
    atomic_directory,
    check_output,
    export_config,
    float_state_dict,
    float_tensors,
    model_extras,
    packed_tensors,
    remove_leftovers,
    scratch_directory,
    write_checkpoint,
    write_metadata,
)
from toolkit.methods import driver_for, error_measure
from toolkit.models import FLOAT_DTYPES, ModelSource, arch_spec, decoder_layers, resolve_model
from toolkit.experts import hub_name, hub_tensors
from toolkit.options import check_choices, flag_name, option
from toolkit.quant import kv_cache as kv
from toolkit.quant.configs import ConfigError, WeightQuantConfig, methods_that
from toolkit.rotate import rotate_model
from toolkit.version import __version__


@dataclass(frozen=True)
class CalibrationSpec:
    """Where calibration tokens come from: a source the calibration pipeline reads, and how many."""

    dataset: str = option("sharegpt", "Calibration data: sharegpt, a .json/.jsonl/.parquet/.txt file, or a datasets id.")
    samples: int = option(128, "Calibration sequences.")
    seq_len: int = option(512, "Tokens per calibration sequence.")
    text_field: str = option("text", "The text column of a .json/.jsonl/.parquet file or datasets id.")

    def __post_init__(self):
        for name, least in (("samples", 1), ("seq_len", 2)):
            if getattr(self, name) < least:
                raise ConfigError(f"{name} must be >= {least}, got {getattr(self, name)} ({flag_name(name)})")

    def check_source(self) -> None:
        """Refuse, before any work, a source that cannot be read: a missing file or directory, an unsupported
        extension, a Hub dataset that cannot be reached (``CalibrationError`` naming --dataset's value)."""
        from toolkit.calibration import CalibrationError, load_records

        try:
            load_records(self.dataset, self.text_field)
        except CalibrationError as err:
            raise CalibrationError(f"--dataset {self.dataset}: {err}") from err


@dataclass(frozen=True)
class QuantizeSettings:
    """How a quantize run writes its checkpoint and uses memory, whatever the method (``quantize`` documents each)."""

    format: str = option(AUTO, "Checkpoint layout: auto | gptq | awq | compressed-tensors (auto: gptq when symmetric, "
                         "awq when asymmetric 4-bit).", choices=(AUTO, *LAYOUTS), flag="--format")
    dtype: str = option("float16", "dtype of unquantized tensors and scales: float16 | bfloat16 | float32 (vLLM's "
                        "int4 kernels take half precision only).", choices=FLOAT_DTYPES)
    kv_cache: str | None = option(None, "Also calibrate static KV-cache scales: fp8 (vLLM --kv-cache-dtype fp8; read "
                                  "from compressed-tensors checkpoints) | int8 (`compound decode --kv-cache-dtype "
                                  "int8-static` stores its cache with them).",
                                  choices=tuple(kv.QMAX))
    kv_cache_strategy: str = option("tensor", "KV-cache scales per layer (tensor) or per KV head (attn_head).",
                                    choices=kv.STRATEGIES)
    stream: bool = option(False, "Load each decoder layer from the safetensors shards of a local model directory only "
                          "when it is quantized, and write it out at once: for models larger than memory.",
                          flag="--stream/--no-stream")
    offload_activations: bool = option(False, "Keep calibration activations between layers on disk (next to "
                                       "--output) instead of in memory.")
    batch_size: int = option(8, "Calibration sequences run through a layer at once; fewer need less memory.")
    trust_remote_code: bool = option(False, "Allow model code from the checkpoint (off by default).")
    device: str = device_option()

    def __post_init__(self):
        check_choices(self, ConfigError)


@dataclass
class QuantizeResult:
    """What a quantize run produced and what it cost."""

    output: Path
    seconds: float
    peak_rss_mb: float
    errors: dict[str, float] = field(default_factory=dict)
    memory: memory.MemoryEstimate | None = None
    config: WeightQuantConfig | None = None  # as run: the group size fitted to the model
    choices: dict[str, str] = field(default_factory=dict)  # "format" / "group size" → what was chosen and why
    experts: dict | None = None  # Mixture-of-Experts calibration: ``expert_report``
    model: ModelSource | None = None  # the model quantized, as resolved (``quantize --eval`` scores it)


def quantize(
    target: str | ModelSource,
    config: WeightQuantConfig,
    output: Path | str,
    calibration: CalibrationSpec | None = None,
    settings: QuantizeSettings | None = None,
    *,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> QuantizeResult:
    """Quantize ``target`` (a model spec, resolved once at step 2, or its ``ModelSource``) with ``config`` and write a
    ``settings.format`` checkpoint to ``output`` (atomically).

    kv_cache: ``"fp8"`` or ``"int8"`` also calibrates static KV-cache scales (``toolkit.quant.kv_cache``): the absmax
    of every layer's post-RoPE keys and values on the calibration batch, run through the quantized model, over 448
    or 127; per layer (``kv_cache_strategy="tensor"``) or per KV head (``"attn_head"``). They are written as
    ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale``. compressed-tensors declares them in ``kv_cache_scheme``
    (FP8 only), which makes vLLM serve an fp8 KV cache with them by default. GPTQ and AWQ configs have no such field
    and vLLM 0.32 does not load KV scales for them (``--kv-cache-dtype fp8`` then runs with scale 1.0, or
    ``--calculate-kv-scales``): there the scales serve compound's runtime, and the manifest records their type.

    stream: read each decoder layer from the safetensors shards of a local model directory when the engine reaches
    it and write it out quantized as soon as it is done (``toolkit.engine.streaming``): peak memory about one float layer
    plus the activations and embeddings instead of the whole model. The checkpoint holds the same tensors, one shard
    per decoder layer plus one for the rest. No KV-cache scales in this mode yet.
    offload_activations: keep the calibration activations between layers on disk (next to ``output``).
    batch_size: calibration sequences run through a layer at once (memory for one batch's attention and MLP).
    device: where each layer is calibrated and quantized (``toolkit.engine.devices``: ``auto`` is CUDA where present);
    the model stays in host memory between its layers' turns, and the checkpoint is written from there.

    Under ``torchrun`` (data parallel; RTN and GPTQ): every rank builds the same calibration batch and runs the
    engine on its device over every world-th sequence of it; GPTQ's Hessians and the KV-cache absmax are reduced
    over ranks (``toolkit.engine.distributed``), so each rank quantizes with the whole batch's statistics, and rank 0
    alone writes the checkpoint while the others wait for it.

    Steps: 1. refuse unsupported format settings, an existing output and a calibration source that cannot be read
    (when the run reads one), and remove what killed runs for the same output left beside it (reported);
    2. load the model's shapes; 3. fit the group size to every quantized linear (an unset one becomes the largest
    standard size dividing every input width; a given one is checked), then load the tokenizer; 4. estimate memory and
    disk, and refuse a run that cannot fit or whose output cannot be written; 5. load the model (whole, or only its
    embeddings when streamed), refuse NaN or infinite weights, and fold ``config.rotate``'s rotation into the float
    weights (``toolkit.rotate``; whole models only); 6. build calibration tokens (methods that need them, KV scales);
    7. quantize layer by layer, packing each linear as it finishes (streamed: writing each layer) and saving each
    finished layer beside ``output`` (``layers_directory``; one process only), so that a rerun of a killed run loads
    the layers it finished instead of quantizing them again; 8. calibrate KV-cache scales on the quantized model (if
    asked); 9. write the checkpoint, then delete the saved layers.
    """
    started = time.perf_counter()
    calibration = calibration or CalibrationSpec()
    settings = settings or QuantizeSettings()
    fmt, kv_cache, kv_cache_strategy = settings.format, settings.kv_cache, settings.kv_cache_strategy
    stream, offload_activations, batch_size = settings.stream, settings.offload_activations, settings.batch_size
    trust_remote_code, dtype = settings.trust_remote_code, getattr(torch, settings.dtype)
    output = Path(output)
    layout, fmt_reason = resolve(fmt, config)
    fmt = layout.NAME
    layout.check_supported(config)  # 1
    _check_kv_cache(kv_cache, fmt)
    if stream and kv_cache:
        raise ConfigError("--kv-cache needs the in-memory mode for now: run without --stream")
    if stream and config.rotate != "none":
        raise ConfigError(f"--rotate {config.rotate} rotates the embeddings and the LM head with every layer, so it "
                          "needs the whole model in memory: run without --stream, or with --rotate none")
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")
    needs_tokens = config.needs_activations or bool(kv_cache)
    if needs_tokens:
        calibration.check_source()
    device = devices.resolve(settings.device)
    rank, world = distributed.join(device)
    if world > 1:
        _check_data_parallel(config, calibration, world)
    if rank == 0:
        _remove_leftovers(output, progress)
    source = resolve_model(target, trust_remote_code)
    skeleton = source.empty(torch.float32)  # 2
    config = with_routers(config, skeleton)
    config, group_reason = config.fitted(input_widths(skeleton, config))  # 3
    choices = {"format": f"{fmt} ({fmt_reason})"}
    if group_reason:
        choices["group size"] = f"{config.group_size} ({group_reason})"
        if progress:
            progress.step(f"group size {choices['group size']}")
    gguf_file = _gguf_file(output, config, skeleton.config, fmt, settings.dtype, source) if config.gguf else None
    if gguf_file is not None:
        choices["gguf"] = f"{gguf_file.path.name} (--gguf)"
    tokenizer = source.tokenizer()
    if needs_tokens:  # RTN without KV scales reads no calibration tokens, so its --seq-len is unused
        source.check_seq_len(calibration.seq_len)
    samples = calibration.samples if needs_tokens else 0
    plan = _memory_plan(skeleton, config, samples, calibration.seq_len,  # 4
                        stream, offload_activations, batch_size, is_safetensors_dir(source.spec))
    if progress:
        progress.step(plan.summary())
    check_output(output, memory.disk_estimate(skeleton, config, samples, calibration.seq_len, dtype.itemsize,
                                              offload=offload_activations))
    del skeleton
    if stream:  # 5
        model, shards = stream_model(source)
    else:
        model = source.load(torch.float32)
    check_finite_weights(model.named_parameters(), arch_spec(model).layers)
    if config.rotate != "none":
        choices["rotation"] = rotate_model(model, config.seed).summary(dtype.itemsize)
        if gguf_file is not None:  # the rotation may untie the LM head: the file then writes its own output tensor
            gguf_file.tensors.config = model.config
        if progress:
            progress.step(f"rotated the float weights: {choices['rotation']}")
    tokens, calib_info = None, {}
    if needs_tokens:  # 6
        from toolkit.calibration import calibration_batch, fingerprint

        if progress:
            progress.step(f"building {calibration.samples}×{calibration.seq_len} calibration tokens")
        tokens = calibration_batch(
            tokenizer, calibration.dataset, calibration.samples, calibration.seq_len, config.seed,
            text_field=calibration.text_field,
        )
        calib_info = {**vars(calibration), "seed": config.seed, "fingerprint": fingerprint(tokens)}
        tokens = tokens[rank::world]  # this rank's share
    checkpoints = _layer_checkpoints(output, source, config, calib_info, batch_size) if world == 1 else None
    packed: dict[str, dict[str, torch.Tensor]] = {}
    routed: dict[str, int] = {}  # MoE: calibration tokens per expert
    writes = rank == 0

    def sink(name, qweight):
        if writes:
            qweight = qweight.cpu()
            packed[name] = layout.pack(qweight, dtype)
            if gguf_file is not None:
                gguf_file.tensors.add_linear(name, qweight)

    def run_layers(source=None):  # 7
        weight_tokens = tokens if config.needs_activations else None
        with scratch_directory(output) if offload_activations else contextlib.nullcontext() as offload_dir:
            return quantize_layers(model, config, driver_for(config), weight_tokens, sink, batch_size=batch_size,
                                   device=device, progress=progress, source=source, offload_dir=offload_dir,
                                   routed=routed, checkpoints=checkpoints)

    quantization_config = layout.quantization_config(config)

    def manifest(errors, kv_info=None):
        return {
            "compound_version": __version__,
            "format": fmt,
            "model": source.spec,
            "quantization": config.to_dict(),
            "calibration": calib_info or None,
            "kv_cache": kv_info,
            "layer_errors": {"measure": error_measure(config), "linears": errors},
            "experts": expert_report(config, routed) if routed else None,
        }

    if stream and not writes:
        errors = run_layers(StreamedLayers(model, shards, lambda index, layer: None))
        distributed.barrier()  # rank 0 is writing the checkpoint
        return _result(output, started, errors, plan, config, choices, routed, source)
    with _resumable(checkpoints):
        if stream:
            errors = _quantize_streamed(output, model, shards, tokenizer, packed, run_layers, dtype, overwrite,
                                        quantization_config, manifest, gguf_file)
        else:
            errors = run_layers()
            kv_tensors, kv_info = {}, None
            if kv_cache:  # 8
                if progress:
                    progress.step(f"calibrating {kv_cache} KV-cache scales")
                amax = [(distributed.max_over_ranks(k), distributed.max_over_ranks(v))
                        for k, v in observe_kv_absmax(model, tokens, per_head=kv_cache_strategy == "attn_head")]
                kv_tensors = kv.checkpoint_tensors(amax, kv_cache, arch_spec(model).layers, dtype)
                kv_info = {"dtype": kv_cache, "strategy": kv_cache_strategy,
                           "scale": f"amax / {kv.QMAX[kv_cache]:g}"}
                if fmt == compressed_tensors.NAME:
                    quantization_config["kv_cache_scheme"] = kv.kv_cache_scheme(kv_cache, kv_cache_strategy)
            if writes:
                if gguf_file is not None:
                    gguf_file.tensors.add_floats(float_state_dict(model, set(packed), dtype))  # as the checkpoint holds
                write_checkpoint(output, model, tokenizer, packed, quantization_config, manifest(errors, kv_info),  # 9
                                 dtype, overwrite, extra_tensors=kv_tensors, then=gguf_file and gguf_file.write)
    distributed.barrier()
    return _result(output, started, errors, plan, config, choices, routed, source)


@contextlib.contextmanager
def _resumable(checkpoints: LayerCheckpoints | None):
    """Steps 7-9 with per-layer checkpoints: deleted once the checkpoint is written, and when the run fails (a rerun
    would fail the same way, or the user changes something); kept when it is interrupted (Ctrl-C, or killed), for the
    rerun to resume from."""
    try:
        yield
    except Exception:
        if checkpoints is not None:
            checkpoints.remove()
        raise
    if checkpoints is not None:
        checkpoints.remove()


def with_routers(config: WeightQuantConfig, model: torch.nn.Module) -> WeightQuantConfig:
    """``config`` with the routers of a Mixture-of-Experts model (``Experts.routers`` of every sparse layer, by full
    Hub name) added to ``skip``: they stay in float, and every format's list of modules left unquantized names them.
    Full names, because AWQ's ``modules_to_not_convert`` matches substrings: ``mlp.gate`` would also keep a dense
    layer's ``mlp.gate_proj`` in float."""
    layout = arch_spec(model).experts
    if layout is None:
        return config
    prefix = arch_spec(model).layers
    routers = tuple(hub_name(layout, f"{prefix}.{i}.{name}") for i, layer in enumerate(decoder_layers(model))
                    if hasattr(layer.mlp, "experts") for name in layout.routers)
    return dataclasses.replace(config, skip=config.skip + tuple(r for r in routers if r not in config.skip))


def expert_report(config: WeightQuantConfig, routed: dict[str, int]) -> dict:
    """The manifest's account of a Mixture-of-Experts calibration: the mode, the calibration tokens routed to each
    expert (min / median / max and each one's), and the experts rounded to nearest for having too few."""
    counts = sorted(routed.values())
    starved = [] if config.moe_calibration == "all" else sorted(
        name for name, n in routed.items() if n < max(config.moe_min_tokens, 1))
    return {"calibration": config.moe_calibration, "min_tokens": config.moe_min_tokens,
            "tokens_per_expert": {"min": counts[0], "median": counts[len(counts) // 2], "max": counts[-1]},
            "rounded_to_nearest": starved, "routed_tokens": routed}


def _gguf_file(output: Path, config: WeightQuantConfig, model_config, fmt: str, dtype: str, source: ModelSource):
    """``--gguf``'s file inside ``output`` (a ``QuantizedGGUF``, filled from the weights in hand); FormatError
    (before any weight is read) for a grid, family or scale dtype GGUF cannot hold (the file holds the checkpoint's
    fp16 scales, which a bfloat16 checkpoint would re-round)."""
    from toolkit.formats.scheme import FormatError
    from toolkit.gguf_export import QuantizedGGUF

    gguf_file = QuantizedGGUF(output, config, model_config, source.gguf_file)
    if fmt == compressed_tensors.NAME and dtype == "bfloat16":
        raise FormatError("--gguf stores fp16 scales, and compressed-tensors stores scales in --dtype bfloat16, "
                          "which would re-round them: use --dtype float16 or float32, or --format gptq / awq")
    return gguf_file


def _remove_leftovers(output: Path, progress: Progress | None) -> None:
    """Step 1's clean-up: remove what killed runs for ``output`` left beside it, and say so."""
    removed = remove_leftovers(output)
    if removed and progress:
        progress.step(f"removed {len(removed)} leftover(s) of killed runs for {output.name} in {output.parent}: "
                      f"{', '.join(removed)}")


def layers_directory(output: Path) -> Path:
    """Where a quantize run for ``output`` keeps its finished layers until the checkpoint is written
    (``.<name>.layers`` beside it)."""
    return output.parent / f".{output.name}.layers"


def _layer_checkpoints(output: Path, source: ModelSource, config: WeightQuantConfig, calibration: dict,
                       batch_size: int) -> LayerCheckpoints:
    """Step 7's per-layer checkpoints (``toolkit.engine.resume``), keyed by everything the layers' results depend on:
    the compound version, the model's identity, the config, the calibration tokens and the batch size. A rerun with the
    same key after a kill resumes after the last finished layer."""
    from toolkit.identity import target_identity

    key = json.dumps({"compound_version": __version__, "model": target_identity(source),
                      "quantization": config.to_dict(), "calibration": calibration, "batch_size": batch_size},
                     sort_keys=True, default=str)
    return LayerCheckpoints(layers_directory(output), hashlib.sha256(key.encode()).hexdigest())


def _check_data_parallel(config: WeightQuantConfig, calibration: CalibrationSpec, world: int) -> None:
    """Refuse, before any work, what a torchrun quantize run cannot split over ``world`` ranks."""
    if not config.data_parallel:
        raise ConfigError(f"under torchrun compound quantizes with {' or '.join(methods_that('data_parallel'))}; "
                          f"{config.method}'s search runs in one process: start it without torchrun")
    if config.needs_activations and calibration.samples < world:
        raise ConfigError(f"{calibration.samples} calibration sequences cannot be split over {world} ranks; use at "
                          f"least {world} --samples")


def _memory_plan(skeleton, config, samples, seq_len, stream, offload, batch_size,
                 streamable) -> memory.MemoryEstimate:
    """Step 4 of ``quantize``: the estimate of this run, refused (``MemoryLimitError``) when it cannot fit."""
    options = dict(offload=offload, batch_size=batch_size)
    plan = memory.estimate(skeleton, config, samples, seq_len, streamed=stream, **options)
    alternative = None
    if not stream and streamable:
        alternative = memory.estimate(skeleton, config, samples, seq_len, streamed=True, **options)
    memory.check_fits(plan, memory.available_memory(), alternative)
    return plan


def _quantize_streamed(output, model, shards, tokenizer, packed, run_layers, dtype, overwrite, quantization_config,
                       manifest, gguf_file=None) -> dict[str, float]:
    """Steps 7 and 9 of ``quantize`` when streamed: inside the atomic output directory, each decoder layer is written
    to its own shard (packed linears + its float tensors) as the engine releases it, then each tensor outside the
    layers to a shard of its own, the index, configs, tokenizer, ``gguf_file`` (a ``QuantizedGGUF`` given the float
    tensors as they are written) and manifest."""
    add_floats = gguf_file.tensors.add_floats if gguf_file is not None else lambda floats: None
    prefix = arch_spec(model).layers
    with atomic_directory(output, overwrite) as staging:
        writer = ShardWriter(staging, len(decoder_layers(model)) + len(outer_names(model)))

        def save_layer(index, layer):
            name = f"{prefix}.{index}"
            quantized = {k: packed.pop(k) for k in [k for k in packed if k.startswith(name + ".")]}
            state = {f"{name}.{k}": t for k, t in layer.state_dict().items()}
            floats = float_tensors(state, set(quantized), dtype)
            add_floats(floats)
            writer.write(hub_tensors(model, {**floats, **packed_tensors(quantized)}))

        errors = run_layers(StreamedLayers(model, shards, save_layer))
        for name, tensor in outer_tensors(model, shards):  # one shard each: one float tensor in memory at a time
            check_finite_weights([(name, tensor)], prefix)
            floats = float_tensors({name: tensor}, set(), dtype)
            add_floats(floats)
            writer.write(floats)
        writer.write_index()
        write_metadata(staging, export_config(model, dtype, quantization_config), manifest(errors),
                       model_extras(model, tokenizer, gguf_file and gguf_file.write))
    return errors


def _result(output, started, errors, plan, config, choices, routed, source) -> QuantizeResult:
    return QuantizeResult(output, time.perf_counter() - started, peak_rss_mb(), errors, plan, config, choices,
                          expert_report(config, routed) if routed else None, source)


def peak_rss_mb() -> float:
    """This process's peak resident memory in MiB: ``VmHWM``, which belongs to its own address space. (``ru_maxrss``
    is the fallback where /proc is missing: Linux carries a parent's peak into it across fork + exec, so a run
    started from a large process would report that process's peak.)"""
    try:
        status = Path("/proc/self/status").read_text()
        return int(status.split("VmHWM:")[1].split()[0]) / 1024
    except (OSError, IndexError, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def observe_kv_absmax(
    model: torch.nn.Module, tokens: torch.Tensor, per_head: bool = False, batch_size: int = 8
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(K amax, V amax) of every decoder layer over ``tokens`` [samples, seq_len], each a scalar or [n_kv].

    Layer by layer like the engine: capture what enters the first layer, then run each layer with a ``KVAbsMax``
    passed as its KV cache (the attention hands it the keys after RoPE and the values it would cache) and feed its
    outputs to the next. Run after ``quantize_layers``, so the keys are those of the quantized model.
    """
    inputs = capture_layer_inputs(model, tokens, batch_size)
    observed = []
    with torch.no_grad():
        for index, layer in enumerate(decoder_layers(model)):
            observer = kv.KVAbsMax(per_head)
            cache = {_cache_keyword(layer): observer}
            outputs = [layer(hidden, **kwargs, **cache) for hidden, kwargs in zip(inputs.hidden, inputs.kwargs)]
            inputs.hidden = [out[0] if isinstance(out, tuple) else out for out in outputs]
            if observer.k_amax is None:
                raise RuntimeError(f"decoder layer {index} ({type(layer).__name__}) never updated its KV cache; "
                                   "KV-cache scales cannot be calibrated for this architecture")
            observed.append((observer.k_amax, observer.v_amax))
    return observed


def _cache_keyword(layer: torch.nn.Module) -> str:
    """The decoder layer's KV-cache argument: ``cache`` in current transformers (which deprecates the older
    ``past_key_values``), ``past_key_values`` in releases before the rename."""
    return "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"


def _check_kv_cache(kv_cache: str | None, fmt: str) -> None:
    """Refuse KV-cache settings the format cannot hold, before any work, naming the way out (the values themselves are
    ``QuantizeSettings``' choices, checked when it was made)."""
    if kv_cache == "int8" and fmt == compressed_tensors.NAME:
        raise ConfigError("compressed-tensors declares KV scales in kv_cache_scheme, and vLLM refuses any but FP8 "
                          "(num_bits 8, type float); use --kv-cache fp8 to serve them, or --format gptq / awq to "
                          "keep INT8 scales for compound's decode loop")
