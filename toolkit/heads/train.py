"""The training loop for draft heads: any ``nn.Module`` with a summed token loss (Medusa's and EAGLE's heads).

``loss_fn(model, batch) -> (loss_sum, count, metrics)`` sums the loss over the ``count`` label tokens of a padded
batch (``collate``); the loop makes each step's loss the exact mean over every label token of the global batch. It
needs the global count before the first backward, so it gets it from ``count_fn(batch)`` (default: the
``loss_mask`` sum) and checks it against the counts ``loss_fn`` returns.

One optimizer step = one global batch of ``batch_size`` examples: the next ``batch_size`` indices of a stream of
per-epoch permutations drawn from (``seed``, epoch). Rank r of W takes ``indices[r::W]`` and splits them into
micro-batches of ``micro_batch_size`` (gradient accumulation), so the same global batch is seen at any world size.

Under ``torchrun`` (``WORLD_SIZE`` > 1) the loop joins the process group (gloo on CPU, nccl on CUDA) and all-reduces
the gradients itself after accumulation instead of wrapping the model in ``DistributedDataParallel``: DDP only syncs
when the forward goes through its wrapper, and loss functions such as ``medusa_loss`` call the heads' submodules.
Rank 0 alone writes files, evaluates and shows progress. Files under ``out_dir``::

    checkpoints/step-000100/model.pt     the model's state_dict
                            trainer.pt   optimizer, step, RNG states of every rank, best and last eval
                            config.json  the TrainConfig
    train.jsonl   every log_every steps: step, loss (mean over the window's label tokens), lr, tokens, tokens_per_s,
                  metrics (loss_fn's metrics summed over the window, all ranks)
    eval.jsonl    every eval_every steps and at step ``steps``: step and eval_fn's metrics
    best.pt       {"step", "metrics", "model": state_dict} of the best evaluation by select_metric (maximized)

Checkpoint directories are written whole (temp directory, then rename); the last two are kept. Resuming from the
latest gives bit-identical parameters to an uninterrupted run on the same hardware and thread count. The logs are
appended a line at a time; a run first rewrites them (atomically) without the steps it will train again, dropping a
last line torn by a crash.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import Progress, TextColumn
from torch import nn

from toolkit.engine import distributed
from toolkit.engine.devices import local_cuda
from toolkit.formats.checkpoint import atomic_directory, write_text_atomic
from toolkit.options import TRAIN_DTYPES, check_choices, flag_name, option, option_fields

LossFn = Callable[[nn.Module, dict], tuple[torch.Tensor, int, dict[str, float]]]
CHECKPOINTS = "checkpoints"
KEEP_CHECKPOINTS = 2
# TrainConfig fields a resumed run may change: when to log, save and evaluate; how a global batch is split into
# micro-batches (the same mean, summed in another order); and steps, raised to train on (the rest of the cosine
# decay then stretches to the new end). The others change what each step does.
RESUMABLE_CHANGES = frozenset({"steps", "micro_batch_size", "eval_every", "save_every", "log_every"})


@dataclass(frozen=True)
class TrainConfig:
    """Optimization of a set of heads: AdamW, linear warmup then cosine decay to 0 at ``steps``.

    batch_size: examples per optimizer step over all ranks and accumulation micro-steps; micro_batch_size: examples
    per forward on one rank (accumulation = batch_size / (micro_batch_size × world size)). grad_clip: max global
    gradient norm (``float("inf")`` turns clipping off). train_dtype: "bfloat16" for autocast (parameters stay
    float32), or "float32". seed: data order and, at a fresh start, the torch and ``random`` streams (seed + rank).
    select_metric: the eval_fn metric that picks ``best.pt`` (maximized); None keeps no best. The fields made with
    ``option`` are ``compound train-heads`` flags and recipe keys of the same names.
    """

    lr: float = option(1e-3, "Peak learning rate (AdamW, warmup then cosine).")
    weight_decay: float = 0.0
    warmup_steps: int = option(20, "Linear warmup steps.")
    steps: int = option(600, "Optimizer steps.")
    batch_size: int = option(8, "Examples per optimizer step (all ranks together).")
    micro_batch_size: int = option(4, "Examples per forward on one rank (gradient accumulation makes up the rest).")
    grad_clip: float = 1.0
    train_dtype: str = option("bfloat16", "Head training precision: bfloat16 (autocast) | float32.",
                              choices=TRAIN_DTYPES)
    eval_every: int = option(100, "Steps between acceptance evaluations (and checkpoint selection).")
    save_every: int = option(100, "Steps between resumable checkpoints.")
    log_every: int = 10
    seed: int = option(0, "Seed for data order and initialisation.")
    select_metric: str | None = None

    def __post_init__(self):
        if not self.lr > 0 or self.weight_decay < 0 or not self.grad_clip > 0:
            raise ValueError(f"need lr > 0, weight_decay >= 0 and grad_clip > 0, got {self.lr}, {self.weight_decay}, "
                             f"{self.grad_clip}")
        for name in ("steps", "batch_size", "micro_batch_size", "eval_every", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}{_flag(name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}{_flag('warmup_steps')}")
        self.check_world(1)
        check_choices(self)

    def check_world(self, world: int) -> None:
        """Refuse a global batch that ``world`` ranks cannot split into equal micro-batches."""
        if self.batch_size % (self.micro_batch_size * world):
            raise ValueError(f"batch_size must be a multiple of micro_batch_size × world size ({self.batch_size} % "
                             f"({self.micro_batch_size} × {world}) != 0); change --batch-size or --micro-batch-size")


def _flag(name: str) -> str:
    """`` (--name)`` for a field of ``TrainConfig`` that is a ``train-heads`` flag, else nothing."""
    return f" ({flag_name(name)})" if name in {f.name for f in option_fields(TrainConfig)} else ""


@dataclass
class TrainResult:
    """steps: the last step trained; final_metrics: the last evaluation ({} if none); best_step / best_metrics: the
    evaluation kept in best.pt (None without select_metric); seconds: wall time of this call."""

    steps: int
    final_metrics: dict[str, float]
    best_step: int | None
    best_metrics: dict[str, float] | None
    out_dir: Path
    seconds: float


PAD_MULTIPLE = 128  # batch lengths round up to this: a few sizes of activation buffers, not one per batch (below)


def collate(examples: Sequence[dict[str, torch.Tensor]], multiple: int = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """Stack examples of tensors with a leading time dim T (varying per example) into ``[B, T_pad, ...]`` per key,
    T_pad the longest T rounded up to ``multiple``, padded with zeros: input_ids 0, loss_mask False, floats 0.0.

    Padding is masked out of every loss and sits after each sequence, so causal attention never reads it. The
    rounding is for memory: with a new T_max in every batch, glibc's heap fragmented over a 300-step EAGLE-3 run on
    SmolLM2 until the process held 8.05 GiB; with a handful of buffer sizes the freed ones are reused and the same
    run peaked at 5.65 GiB."""
    if not examples:
        raise ValueError("collate needs at least one example")
    batch = {}
    for key in examples[0]:
        tensors = [example[key] for example in examples]
        if any(t.ndim == 0 or t.shape[1:] != tensors[0].shape[1:] for t in tensors):
            raise ValueError(f"{key!r} needs a leading time dim and equal trailing dims in every example, got "
                             f"{sorted({tuple(t.shape) for t in tensors})}")
        length = -(-max(t.shape[0] for t in tensors) // multiple) * multiple
        out = tensors[0].new_zeros((len(tensors), length, *tensors[0].shape[1:]))
        for row, tensor in enumerate(tensors):
            out[row, : tensor.shape[0]] = tensor
        batch[key] = out
    return batch


def count_label_tokens(batch: dict[str, torch.Tensor]) -> int:
    """The default ``count_fn``: how many label tokens ``loss_mask`` marks."""
    return int(batch["loss_mask"].sum())


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warmup (nanoGPT's (step + 1) / (warmup + 1)),
    then cosine decay reaching 0 at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def global_batch_indices(num_examples: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Dataset indices of optimizer step ``step`` (0-based): positions ``[step × batch_size, + batch_size)`` of the
    chained per-epoch permutations."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_examples)
        indices.append(_epoch_order(num_examples, seed, epoch)[offset])
    return indices


@lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed((seed << 32) + epoch)
    return torch.randperm(num_examples, generator=generator).tolist()


def train(model: nn.Module, loss_fn: LossFn, train_data: Sequence[dict[str, torch.Tensor]], config: TrainConfig,
          out_dir: Path, *, eval_fn: Callable[[nn.Module], dict[str, float]] | None = None,
          count_fn: Callable[[dict], int] = count_label_tokens, resume: bool = True, progress: bool = True,
          stop_after: int | None = None) -> TrainResult:
    """Train ``model``'s parameters that require grad on ``train_data`` with ``loss_fn``; write to ``out_dir``.

    train_data: a Sequence of examples (dicts of [T, ...] tensors, see ``collate``). eval_fn(model) -> metrics runs on
    rank 0 under no_grad in eval mode, with the random streams restored afterwards. count_fn(batch): the label tokens
    loss_fn sums over in a collated batch. resume: continue from the latest checkpoint in ``out_dir`` (refused when
    the saved config differs in a field that changes the trajectory); False refuses an ``out_dir`` with checkpoints.
    stop_after: stop (with a checkpoint) after this step without changing the schedule, to be resumed later.
    """
    if len(train_data) == 0:
        raise ValueError("train_data is empty: nothing to train on")
    if config.select_metric is not None and eval_fn is None:
        raise ValueError(f"select_metric={config.select_metric!r} needs an eval_fn that returns it")
    if stop_after is not None and stop_after < 1:
        raise ValueError(f"stop_after must be >= 1, got {stop_after}")
    started = time.perf_counter()
    rank, world, device = _join_process_group(model)
    config.check_world(world)
    state = _run(model, loss_fn, train_data, config, Path(out_dir), eval_fn, count_fn, resume, progress, stop_after,
                 rank, world, device)
    return TrainResult(state["step"], state["last_metrics"], state["best_step"], state["best_metrics"], Path(out_dir),
                       time.perf_counter() - started)


def _run(model, loss_fn, train_data, config, out_dir, eval_fn, count_fn, resume, progress, stop_after, rank, world,
         device) -> dict:
    """The loop of ``train`` once the process group is up; returns the trainer state at the end."""
    model.to(device).train()
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    state = {"step": 0, "best_step": None, "best_metrics": None, "last_metrics": {}}
    checkpoint = _latest_checkpoint(out_dir)
    if checkpoint is not None and not resume:
        raise FileExistsError(f"{checkpoint.parent} holds checkpoints; pass resume=True to continue, or use an empty "
                              f"out_dir")
    if checkpoint is not None:
        state = _load_checkpoint(checkpoint, model, optimizer, config, rank, world, device)
    if rank == 0:
        for log in ("train.jsonl", "eval.jsonl"):  # lines of steps that will run again (all of them at a fresh start)
            _drop_records_after(out_dir / log, state["step"])
    if checkpoint is None:
        torch.manual_seed(config.seed + rank)
        random.seed(config.seed + rank)
        if world > 1:
            for tensor in model.state_dict().values():
                dist.broadcast(tensor, src=0)
    # Every trainable parameter has a gradient at every step (zeros where the batch never reached it), so AdamW
    # treats a parameter alike whether or not some rank's micro-batch touched it.
    for p in params:
        p.grad = torch.zeros_like(p)

    end = config.steps if stop_after is None else min(config.steps, stop_after)
    micro_steps = config.batch_size // (config.micro_batch_size * world)
    window = _Window()
    warned_empty = False
    with Progress(*Progress.get_default_columns(), TextColumn("{task.fields[info]}"),
                  disable=not (progress and rank == 0)) as bar:
        task = bar.add_task("training", total=config.steps, completed=state["step"], info="")
        for step in range(state["step"] + 1, end + 1):
            tick = time.perf_counter()
            indices = global_batch_indices(len(train_data), config.batch_size, step - 1, config.seed)
            mine = indices[rank::world]  # collated up front: count_fn needs every micro-batch before the first backward
            micro_batches = [collate([train_data[i] for i in mine[k * config.micro_batch_size:
                                                                  (k + 1) * config.micro_batch_size]])
                             for k in range(micro_steps)]
            lr = config.lr * lr_factor(step - 1, config.warmup_steps, config.steps)
            for group in optimizer.param_groups:  # the schedule is a function of the step, as in nanoGPT
                group["lr"] = lr
            done = _optimizer_step(model, params, optimizer, loss_fn, count_fn, micro_batches, config, world, device,
                                   step)
            state["step"] = step
            if done is None and not warned_empty and rank == 0:
                warnings.warn(f"step {step}: the global batch has no label token; its update is skipped "
                              f"(warned once)", stacklevel=3)
                warned_empty = True
            window.add(done, time.perf_counter() - tick)
            bar.update(task, completed=step)

            if step % config.log_every == 0 or step == end:
                record = window.record(step, lr, world)
                if rank == 0:
                    _append_jsonl(out_dir / "train.jsonl", record)
                    loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"
                    bar.update(task, info=f"loss {loss} · {record['tokens_per_s']:,.0f} tok/s")
                window = _Window()
            if eval_fn is not None and (step % config.eval_every == 0 or step == config.steps):
                _evaluate_and_select(model, eval_fn, config, out_dir, state, rank, world, device)
            if step % config.save_every == 0 or step == end:
                rng_states = [_rng_state(device)]
                if world > 1:
                    rng_states = [None] * world
                    dist.all_gather_object(rng_states, _rng_state(device))
                if rank == 0:
                    _save_checkpoint(out_dir, model, optimizer, config, state, rng_states)
                if world > 1:
                    dist.barrier()
    return state


def _optimizer_step(model, params, optimizer, loss_fn, count_fn, micro_batches, config, world, device,
                    step) -> tuple[float, int, dict[str, float]] | None:
    """One update from this rank's micro-batches of a global batch. Returns (global loss sum, global label count,
    this rank's summed metrics), or None when the global batch has no label token (no update)."""
    count = torch.tensor(sum(count_fn(batch) for batch in micro_batches), dtype=torch.int64, device=device)
    if world > 1:
        dist.all_reduce(count)
    global_count = int(count)
    if global_count == 0:
        return None
    optimizer.zero_grad(set_to_none=False)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, label count as loss_fn reports them
    metrics: dict[str, float] = {}
    for batch in micro_batches:
        batch = {key: value.to(device) for key, value in batch.items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.train_dtype == "bfloat16"):
            loss_sum, batch_count, batch_metrics = loss_fn(model, batch)
        if loss_sum.requires_grad:  # a micro-batch without label tokens has no graph
            (loss_sum / global_count).backward()
        totals += torch.tensor([float(loss_sum.detach()), batch_count], dtype=torch.float64, device=device)
        for key, value in batch_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + float(value)
    if world > 1:
        for p in params:  # summed, not averaged: each rank's loss is already divided by the global count
            dist.all_reduce(p.grad)
        dist.all_reduce(totals)
    if int(totals[1]) != global_count:
        raise ValueError(f"step {step}: loss_fn counted {int(totals[1])} label tokens but count_fn {global_count}; "
                         f"pass a count_fn that counts the tokens loss_fn sums over (for medusa_loss, labels from "
                         f"position 2: lambda batch: int(batch['loss_mask'][:, 2:].sum()))")
    torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
    optimizer.step()
    return float(totals[0]), global_count, metrics


class _Window:
    """Sums over the steps since the last log line: loss, label tokens, seconds, this rank's metrics."""

    def __init__(self):
        self.loss_sum, self.tokens, self.seconds, self.metrics = 0.0, 0, 0.0, {}

    def add(self, done: tuple[float, int, dict[str, float]] | None, seconds: float) -> None:
        self.seconds += seconds
        if done is not None:
            self.loss_sum += done[0]
            self.tokens += done[1]
            for key, value in done[2].items():
                self.metrics[key] = self.metrics.get(key, 0.0) + value

    def record(self, step: int, lr: float, world: int) -> dict:
        """The train.jsonl line; collective under torchrun (metrics summed over ranks), so every rank calls it."""
        metrics = self.metrics
        if world > 1:
            gathered = [None] * world
            dist.all_gather_object(gathered, self.metrics)
            metrics = {}
            for rank_metrics in gathered:
                for key, value in rank_metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + value
        return {"step": step, "loss": self.loss_sum / self.tokens if self.tokens else None, "lr": lr,
                "tokens": self.tokens, "tokens_per_s": self.tokens / self.seconds if self.seconds > 0 else 0.0,
                "metrics": metrics}


def _evaluate_and_select(model, eval_fn, config, out_dir, state, rank, world, device) -> None:
    """Run eval_fn on rank 0, share its metrics with every rank, log them, and keep best.pt by select_metric."""
    metrics = None
    if rank == 0:
        python_state = random.getstate()
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                metrics = {key: float(value) for key, value in eval_fn(model).items()}
        finally:
            model.train()
            random.setstate(python_state)
        _append_jsonl(out_dir / "eval.jsonl", {"step": state["step"], **metrics})
    if world > 1:  # also the barrier that holds the other ranks during the evaluation
        shared = [metrics]
        dist.broadcast_object_list(shared, src=0)
        metrics = shared[0]
    state["last_metrics"] = metrics
    name = config.select_metric
    if name is None:
        return
    if name not in metrics:
        raise ValueError(f"select_metric {name!r} is not among eval_fn's metrics {sorted(metrics)}")
    if state["best_metrics"] is None or metrics[name] > state["best_metrics"][name]:
        state["best_step"], state["best_metrics"] = state["step"], metrics
        if rank == 0:
            _save_atomically({"step": state["step"], "metrics": metrics, "model": model.state_dict()},
                             out_dir / "best.pt")


def _join_process_group(model: nn.Module) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun (``toolkit.engine.distributed.join``) on CUDA each rank takes
    cuda:LOCAL_RANK; otherwise the model stays on its device."""
    rank, world = distributed.join()
    device = next(model.parameters()).device
    if world > 1 and dist.get_backend() == "nccl":
        device = local_cuda()
        torch.cuda.set_device(device)
    return rank, world, device


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _save_checkpoint(out_dir: Path, model, optimizer, config: TrainConfig, state: dict,
                     rng_states: list[dict]) -> None:
    """Write ``checkpoints/step-NNNNNN`` atomically, then remove all but the newest ``KEEP_CHECKPOINTS``."""
    root = out_dir / CHECKPOINTS
    with atomic_directory(root / f"step-{state['step']:06d}", overwrite=True) as staging:
        torch.save(model.state_dict(), staging / "model.pt")
        torch.save({"optimizer": optimizer.state_dict(), **state, "rng": rng_states}, staging / "trainer.pt")
        (staging / "config.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    for old in _checkpoints(out_dir)[:-KEEP_CHECKPOINTS]:
        for file in old.iterdir():
            file.unlink()
        old.rmdir()


def _checkpoints(out_dir: Path) -> list[Path]:
    """Complete step checkpoints, oldest first (temporary directories start with a dot and never match)."""
    root = out_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if re.fullmatch(r"step-\d{6}", p.name))


def _latest_checkpoint(out_dir: Path) -> Path | None:
    found = _checkpoints(out_dir)
    return found[-1] if found else None


def _load_checkpoint(path: Path, model, optimizer, config: TrainConfig, rank: int, world: int,
                     device: torch.device) -> dict:
    """Restore model, optimizer and this rank's random streams from ``path``; returns the trainer state."""
    saved = json.loads((path / "config.json").read_text())
    for f in fields(TrainConfig):
        if f.name not in RESUMABLE_CHANGES and saved.get(f.name) != getattr(config, f.name):
            raise ValueError(f"cannot resume from {path}: {f.name} was {saved.get(f.name)!r} and is now "
                             f"{getattr(config, f.name)!r}, which changes the training; use the saved value or a new "
                             f"out_dir")
    if config.steps < saved["steps"]:
        raise ValueError(f"cannot resume from {path}: steps may be raised, not lowered ({saved['steps']} → "
                         f"{config.steps})")
    model.load_state_dict(torch.load(path / "model.pt", map_location=device, weights_only=True))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    optimizer.load_state_dict(trainer["optimizer"])
    rng_states = trainer["rng"]
    if len(rng_states) == world:
        torch.set_rng_state(rng_states[rank]["torch"])
        random.setstate(rng_states[rank]["python"])
        if "cuda" in rng_states[rank] and device.type == "cuda":
            torch.cuda.set_rng_state(rng_states[rank]["cuda"], device)
    else:
        if rank == 0:
            warnings.warn(f"{path} was written by {len(rng_states)} ranks, this run has {world}: random streams "
                          f"(dropout, noise) restart from seed + rank; data order is unchanged", stacklevel=4)
        torch.manual_seed(config.seed + rank)
        random.seed(config.seed + rank)
    return {key: trainer[key] for key in ("step", "best_step", "best_metrics", "last_metrics")}


def _save_atomically(obj, path: Path) -> None:
    """torch.save to a temporary sibling, then rename over ``path``."""
    fd, staging = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        torch.save(obj, staging)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise


def _append_jsonl(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrite ``path`` (JSON lines with a "step") without the lines logged after ``step``, atomically. A torn last
    line (an append cut off by a crash) is dropped with a warning; any other unreadable line is refused."""
    if not path.exists():
        return
    lines = path.read_text(errors="replace").splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            logged = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if number == len(lines) and not line.endswith("\n"):
                warnings.warn(f"{path} line {number} is truncated (an interrupted write); dropping it", stacklevel=2)
                break
            raise ValueError(f"{path} line {number} is not a record with a step; fix or delete the file") from None
        if logged <= step:
            kept.append(line.rstrip("\n") + "\n")
    write_text_atomic(path, "".join(kept))
