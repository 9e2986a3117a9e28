"""``compound train-heads``: data → hidden states → training with selection by accepted length → export.

    job = HeadsJob(model="smollm2-135m", output=Path("out/smollm2-medusa"), data=DataOptions(samples=1000))
    job = HeadsJob(model="smollm2-135m", output=Path("out/smollm2-eagle3"), head="eagle3",
                   eagle=EagleOptions(draft_vocab=8192))
    result = train_heads(job, console)

Heads (``head``): the kinds of ``toolkit.heads.kinds``, ``medusa``, ``eagle`` (EAGLE-1) and ``eagle3``; each phase
below asks the job's kind what differs between them. The job holds one options object per concern
(``toolkit.heads.options``: Medusa's, EAGLE's, data, selection; and the training loop's ``TrainConfig``); the field
names below are theirs.

Phases, each resumable by rerunning the same command (the work directory ``<output>.work`` keeps their state):

1. data: the train split of ``dataset``; with ``self_distill`` its first user turns answered again by the target
   (``work/distill.jsonl``, appended per batch), rendered with the chat template, loss on assistant tokens only;
2. hidden states: the target (in ``target_dtype``) run over the examples, cached in ``work/hidden`` (final-norm states;
   eagle3's aux layers and the final one in ``work/hidden-<layers>``), or computed while training with ``online``;
3. training: ``toolkit.heads.train`` with checkpoints in ``work/train-<head shape>``; every ``eval_every`` steps the
   heads draft for the float32 target in compound's decode loop on ``eval_prompts`` held-out prompts, and the best by
   mean accepted length (``select_mode`` tree or chain; EAGLE-3's peaks before its loss stops falling) is kept;
4. export: the best heads in their kind's layouts (``HeadKind.export``: Medusa's ``layout``, vLLM or original; EAGLE:
   ``toolkit.heads.eagle_export``; EAGLE-3 also in the speculators layout in ``<output>/speculators`` when vLLM can
   load the target) with a manifest naming the target and its hash.

Every option is checked against the target's config (``check_job``) before any of this, ``--dry-run`` included. A
rerun reuses a piece of the work directory only when it was made for the same target weights, ``target_dtype`` and
answers (``toolkit.heads.reuse``); any other piece is rebuilt, saying why.

The target is loaded once per phase that needs it, never twice at a time, except with ``online`` (the
``target_dtype`` copy feeds training while the float32 copy judges acceptance).
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
from rich.console import Console

from toolkit.decode import greedy_outputs
from toolkit.engine import devices, distributed
from toolkit.engine.devices import device_option
from toolkit.evaluate import acceptance
from toolkit.formats.checkpoint import write_text_atomic
from toolkit.heads import reuse
from toolkit.heads.data import build_examples, check_trainable, self_distill, show_example
from toolkit.heads.eagle_draft import TreeShape
from toolkit.heads.hidden_states import (
    INDEX,
    HiddenStateDataset,
    OnlineHiddenStates,
    cache_bytes,
    finish_hidden_cache,
    write_hidden_shards,
)
from toolkit.heads.kinds import KINDS, HeadKind
from toolkit.heads.options import DataOptions, EagleOptions, MedusaOptions, SelectOptions
from toolkit.heads.train import TrainConfig, train
from toolkit.identity import target_identity, weights_sha256
from toolkit.models import ModelSource, resolve_model
from toolkit.options import check_choices, option
from toolkit.runtime.load import load_model_or_checkpoint

HEADS = tuple(KINDS)


@dataclass(frozen=True)
class HeadsJob:
    """Everything one ``train-heads`` run needs; the CLI fills it from its options. ``medusa`` is read only by Medusa
    heads, ``eagle`` only by EAGLE heads; both are validated whatever ``head`` is."""

    model: str
    output: Path
    head: str = option(HEADS[0], "Head type: " + " | ".join(f"{name} ({kind.title})" for name, kind in KINDS.items())
                       + ".", choices=HEADS)
    device: str = device_option()
    medusa: MedusaOptions = field(default_factory=MedusaOptions)
    eagle: EagleOptions = field(default_factory=EagleOptions)
    data: DataOptions = field(default_factory=DataOptions)
    train: TrainConfig = field(default_factory=TrainConfig)
    select: SelectOptions = field(default_factory=SelectOptions)
    work_dir: Path | None = None  # where data, hidden states and training checkpoints go (default: OUTPUT.work)
    overwrite: bool = False

    def __post_init__(self):
        check_choices(self)  # "--head must be one of medusa, eagle, eagle3, got 'x'", and --device likewise

    @staticmethod
    def parts() -> dict[str, type]:
        """The option dataclasses a job is made of, by field name (``medusa``, ``eagle``, ``data``, ``train``,
        ``select``): their fields and ``head`` are the ``train-heads`` flags and the recipe's heads keys."""
        return {f.name: f.default_factory for f in fields(HeadsJob) if f.default_factory is not MISSING}

    @property
    def work(self) -> Path:
        """Where data, hidden states and training state go: ``work_dir``, else ``<output>.work``."""
        return self.work_dir or self.output.with_name(self.output.name + ".work")

    @property
    def kind(self) -> HeadKind:
        """The registered kind of ``head``."""
        return KINDS[self.head]

    @property
    def head_options(self):
        """The part of the job the head's kind reads (``medusa`` or ``eagle``: the part of its options class)."""
        return next(getattr(self, name) for name, cls in self.parts().items() if cls is self.kind.options)

    @property
    def train_dir(self) -> Path:
        """Training state of this head shape: runs of other shapes can share the work directory's data."""
        return self.work / self.kind.train_dir(self.head_options)

    def hidden_layers(self, num_layers: int) -> list[int]:
        """The target hidden states the head trains on: the final-norm state (-1), after eagle3's aux layers."""
        return self.kind.hidden_layers(self.head_options, num_layers)

    @property
    def tree(self) -> TreeShape:
        """The EAGLE draft shape selected on: the dynamic tree, or the chain of ``depth`` (vLLM's)."""
        return self.eagle.shape(self.select.select_mode)


@dataclass
class HeadsResult:
    output: Path | None
    examples: int
    tokens: int
    trained_tokens: int
    best_step: int | None = None
    best_metrics: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)


def check_job(job: HeadsJob, source: ModelSource) -> None:
    """Refuse, from the target's config alone (no weight is read), options the target ``source`` (``job.model``
    resolved) cannot serve: what the head's kind refuses (``HeadKind.check_target``: an EAGLE head for an
    architecture EAGLE does not support, eagle3's aux layers and draft vocabulary beyond the target's), ``max_len``
    beyond its context."""
    target = source.empty()
    config = target.config
    job.kind.check_target(job.head_options, config, target.get_output_embeddings().weight.shape[0])
    job.data.check_target(getattr(config, "max_position_embeddings", None))


def _claim_work(job: HeadsJob, source: ModelSource, cache: Path, console: Console) -> dict:
    """Record the pieces of the work directory this run reuses or builds as made from its target (identity, dtype)
    and answers, first removing those made from others; returns that record."""
    made_for = {**target_identity(source), "dtype": job.data.target_dtype,
                "answers": "self-distilled" if job.data.self_distill else "dataset"}
    pieces = ["distill.jsonl"] if job.data.self_distill else []
    if not job.data.online:
        pieces.append(cache.name)
    reuse.claim(job.work, [*pieces, job.train_dir.name], made_for, console)
    return made_for


def _examples(job: HeadsJob, model, tokenizer):
    from toolkit.calibration.render import train_records

    data = job.data
    records = train_records(data.dataset)
    if data.self_distill:
        records = self_distill(model, tokenizer, records, data.samples, job.work / "distill.jsonl",
                               max_new_tokens=data.distill_tokens, batch_size=data.distill_batch,
                               max_prompt_len=max(8, min(data.distill_prompt_tokens,
                                                         data.max_len - data.distill_tokens)))  # answers fit whole
    examples = build_examples(tokenizer, records, data.samples, data.max_len)
    check_trainable(examples)
    return examples


def prepare(job: HeadsJob, source: ModelSource, console: Console, dry_run: bool = False):
    """Phases 1-2: examples and hidden states of the target ``source`` (or the online source); with ``dry_run``
    only shows one example of the dataset's own conversations (no model is loaded).

    Under torchrun rank 0 builds the examples first (self-distillation writes ``distill.jsonl``) while the others
    wait and then read them back; every rank then caches its share of the hidden states on its own device, and rank
    0 writes the index once all are done.
    """
    options = job.data
    if dry_run:
        from toolkit.calibration.render import train_records

        tokenizer = source.tokenizer()
        examples = build_examples(tokenizer, train_records(options.dataset), min(options.samples, 8), options.max_len)
        check_trainable(examples)
        show_example(console, tokenizer, examples[0])
        return examples, None, None
    device = devices.resolve(job.device)
    rank, world = distributed.join(device)
    if rank > 0:
        distributed.barrier()  # rank 0's examples first
    dtype = getattr(torch, options.target_dtype)
    if options.stream_target:
        from toolkit.heads.streamed_target import StreamedTarget

        model, tokenizer = StreamedTarget(source, dtype), source.tokenizer()
    else:
        _check_target_fits(source, dtype)
        model, tokenizer = load_model_or_checkpoint(source, dtype)
        model.to(device)
    layers = job.hidden_layers(model.config.num_hidden_layers)
    cache = job.work / ("hidden" if layers == [-1] else
                        "hidden-" + "-".join("final" if i == -1 else str(i) for i in layers))
    made_for = _claim_work(job, source, cache, console) if rank == 0 else None  # before self-distillation appends
    examples = _examples(job, model, tokenizer)
    if rank == 0:
        distributed.barrier()
    tokens = sum(len(e.input_ids) for e in examples)
    hidden_size = model.get_input_embeddings().weight.shape[1]
    console.print(f"{len(examples)} examples, {tokens:,} tokens ({sum(int(e.loss_mask.sum()) for e in examples):,} "
                  f"trained); hidden-state cache {cache_bytes(tokens, hidden_size, len(layers)) / 2**20:,.0f} MiB"
                  + (" (not written: --online)" if options.online else f" in {cache}")
                  + (f", written by {world} ranks" if world > 1 and not options.online else ""))
    if options.online:
        return examples, OnlineHiddenStates(model, examples, layers), model
    if not (cache / INDEX).exists():
        write_hidden_shards(model, examples, cache, layers=layers, batch_tokens=options.batch_tokens, rank=rank,
                            world=world, progress=rank == 0)
        distributed.barrier()
        if rank == 0:
            finish_hidden_cache(cache, examples, layers, hidden_size, target=made_for)
        distributed.barrier()
    data = HiddenStateDataset(cache)
    if [e["id"] for e in data.examples] != [e.id for e in examples] or data.layers != layers:
        raise ValueError(f"{cache} holds hidden states of other examples; remove it or use another --work-dir")
    del model
    return examples, data, None


def train_heads(job: HeadsJob, console: Console, dry_run: bool = False) -> HeadsResult:
    """Run all phases of ``job``; returns what was trained and where it was written."""
    import time

    if job.output.exists() and not job.overwrite:
        raise FileExistsError(f"{job.output} already exists; pass --overwrite to replace it")
    source = resolve_model(job.model)
    check_job(job, source)
    started = time.perf_counter()
    device = devices.resolve(job.device)
    rank, world = distributed.join(device)
    job.train.check_world(world)
    examples, data, online_model = prepare(job, source, console if rank == 0 else Console(quiet=True), dry_run)
    tokens = sum(len(e.input_ids) for e in examples)
    trained = sum(int(e.loss_mask.sum()) for e in examples)
    if dry_run:
        return HeadsResult(None, len(examples), tokens, trained)
    prepared = time.perf_counter()

    target, tokenizer = load_model_or_checkpoint(source, torch.float32)
    target.to(device)  # the heads are built beside it, and train and draft there
    torch.manual_seed(job.train.seed)
    kind, options, select = job.kind, job.head_options, job.select
    heads, loss_fn, count_fn = kind.build(options, target, examples, console if rank == 0 else Console(quiet=True))
    heads.to(device)  # the training loop trains a model where its parameters are
    shape = kind.selection_shape(options, select.select_mode)
    prompts = acceptance.heldout_prompts(tokenizer, select.eval_prompts)
    greedy_cache: dict = {}

    def eval_fn(model) -> dict[str, float]:
        if not greedy_cache:  # plain greedy is the same at every evaluation
            greedy_cache["out"], greedy_cache["s"] = greedy_outputs(target, prompts, select.eval_tokens,
                                                                               tokenizer.eos_token_id)
        report = acceptance.measure_head(kind, target, model, prompts, select.eval_tokens, shape, select.select_mode,
                                         tokenizer.eos_token_id, greedy_cache["out"], greedy_cache["s"])
        if not report.lossless:
            raise RuntimeError("speculative decoding with the heads changed the greedy output: a decode-loop bug")
        return {"mean_accepted_length": report.mean_accepted_length,
                **{f"acceptance_{d + 1}": a for d, a in enumerate(report.acceptance_rate)}}

    config = replace(job.train, select_metric="mean_accepted_length")
    result = train(heads, loss_fn, data, config, job.train_dir, eval_fn=eval_fn, count_fn=count_fn)
    if rank > 0:
        return HeadsResult(None, len(examples), tokens, trained, result.best_step, result.best_metrics)
    trained_at = time.perf_counter()
    if result.best_step is not None:
        best = torch.load(job.train_dir / "best.pt", weights_only=True)
        heads.load_state_dict(best["model"])
    heads.cpu()  # the exporters write host tensors
    del online_model
    extra = {"training": {"examples": len(examples), "tokens": tokens, "trained_tokens": trained,
                          "self_distill": job.data.self_distill, "dataset": job.data.dataset, "steps": result.steps,
                          "best_step": result.best_step, "best_metrics": result.best_metrics,
                          "select_mode": job.select.select_mode, "config": asdict(config), "head": job.head}}
    extra["training"].update(kind.training_record(options))
    kind.export(heads, job.output, options, target=job.model, target_sha256=weights_sha256(source),  # every byte
                target_architectures=target.config.architectures or [], overwrite=job.overwrite,
                extra_manifest=extra, console=console)
    seconds = {"data_and_hidden_states": prepared - started, "training": trained_at - prepared,
               "total": time.perf_counter() - started}
    write_text_atomic(job.train_dir / "timings.json", json.dumps(seconds, indent=1))
    return HeadsResult(job.output, len(examples), tokens, trained, result.best_step, result.best_metrics, seconds)




def _check_target_fits(source: ModelSource, dtype: torch.dtype) -> None:
    """Refuse, before loading it, a float safetensors target larger than the memory available, naming
    ``--stream-target``."""
    from toolkit.engine import memory
    from toolkit.engine.shards import is_safetensors_dir

    spec = source.spec
    if not is_safetensors_dir(spec) or (Path(spec).expanduser() / "compound.json").exists():
        return
    needed = sum(p.numel() for p in source.empty(dtype).parameters()) * dtype.itemsize
    available = memory.available_memory()
    if available is not None and needed > available:
        raise memory.MemoryLimitError(
            f"the target {spec} needs about {needed / memory.GiB:.1f} GiB in {str(dtype).removeprefix('torch.')} but "
            f"{available / memory.GiB:.1f} GiB is available; cache its hidden states one layer at a time with "
            "--stream-target --dataset-answers")
