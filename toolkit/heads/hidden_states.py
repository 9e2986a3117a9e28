"""The target's hidden states for head training: cached to disk in safetensors shards, or computed on the fly.

What the heads read is the target's hidden state of every token: the final-norm output (what ``lm_head`` reads;
layer index -1) for Medusa and EAGLE-1/2, several decoder layers' outputs for EAGLE-3 (indices into transformers'
``hidden_states``: 0 = embeddings, i = output of decoder layer i). Run the target the heads will serve (float, or a
compound-quantized checkpoint loaded with ``toolkit.runtime.load``), so the heads learn the states they will see.

Cache layout (a directory, written in ``<dir>.partial`` and renamed when complete)::

    index.json               {"format": "compound-hidden-states", "version": 1, "layers": [...], "hidden_size": D,
                              "dtype": "bfloat16", "tokens": N, "shards": [file, ...],
                              "examples": [{"id", "shard", "length"}, ...], "target": {...}}
    shard-00000.safetensors  per example i: "{i}.hidden" [T, D] (or [T, n_layers, D]), "{i}.input_ids" [T] int64,
                              "{i}.loss_mask" [T] bool

Shards are written whole (temp file, then rename) and recorded in ``<dir>.partial/progress-<rank>.json``, so an
interrupted run resumes after its last complete shard. Under torchrun each rank writes the batches of its share
(``shard-r<rank>-<n>.safetensors``) and one rank then writes the index (``finish_hidden_cache``). Reading is lazy:
``HiddenStateDataset[i]`` opens one shard at a time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from toolkit.formats.checkpoint import atomic_directory
from toolkit.heads.data import Example
from toolkit.heads.streamed_target import StreamedTarget
from toolkit.quant.finite import all_finite

INDEX = "index.json"
FORMAT = "compound-hidden-states"
_PROGRESS = "progress-{rank}.json"


class HiddenStateError(ValueError):
    """A hidden-state cache that is missing, incomplete or does not match the run; the message says what to do."""


def cache_bytes(tokens: int, hidden_size: int, layers: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes a cache of ``tokens`` tokens takes: the hidden states plus 9 bytes per token of ids and mask."""
    return tokens * (hidden_size * layers * dtype.itemsize + 9)


@torch.no_grad()
def target_hidden_states(model: nn.Module, input_ids: torch.Tensor, layers: Sequence[int] = (-1,)) -> torch.Tensor:
    """Hidden states of ``input_ids`` [B, T] under ``model``: [B, T, D] for one layer, [B, T, len(layers), D] else.

    Right padding is harmless: attention is causal, so no real token sees the padding after it. ``model`` may be a
    ``StreamedTarget`` (``--stream-target``), which computes the same states one decoder layer at a time.
    """
    device = model.get_input_embeddings().weight.device
    if isinstance(model, StreamedTarget):
        picked = model.hidden_states(input_ids.to(device), layers)
    else:
        states = model(input_ids.to(device), output_hidden_states=True, use_cache=False).hidden_states
        picked = [states[i] for i in layers]
    out = picked[0] if len(picked) == 1 else torch.stack(picked, dim=2)
    if not all_finite(out):
        raise HiddenStateError("the target produced non-finite hidden states (NaN/inf); check the model and its dtype")
    return out


def _padded(examples: Sequence[Example]) -> torch.Tensor:
    length = max(len(e.input_ids) for e in examples)
    batch = torch.zeros(len(examples), length, dtype=torch.long)
    for row, example in enumerate(examples):
        batch[row, : len(example.input_ids)] = example.input_ids
    return batch


def cache_hidden_states(model: nn.Module, examples: Sequence[Example], out_dir: Path, *, layers: Sequence[int] = (-1,),
                        dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 4096,
                        shard_bytes: int = 512 * 2**20, target: dict | None = None,
                        progress: bool = True) -> HiddenStateDataset:
    """Run ``model`` over ``examples`` and write their hidden states to ``out_dir``; return the dataset reading it.

    batch_tokens: padded tokens per forward. shard_bytes: target shard size. target: what to record about the model
    (name, hash) in the index. An interrupted run resumes from ``<out_dir>.partial``. One process; under torchrun
    every rank calls ``write_hidden_shards`` for its share and one then calls ``finish_hidden_cache``.
    """
    write_hidden_shards(model, examples, out_dir, layers=layers, dtype=dtype, batch_tokens=batch_tokens,
                        shard_bytes=shard_bytes, progress=progress)
    hidden_size = model.get_input_embeddings().weight.shape[1]
    return finish_hidden_cache(out_dir, examples, layers, hidden_size, dtype=dtype, target=target)


def write_hidden_shards(model: nn.Module, examples: Sequence[Example], out_dir: Path, *,
                        layers: Sequence[int] = (-1,), dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 4096,
                        shard_bytes: int = 512 * 2**20, rank: int = 0, world: int = 1,
                        progress: bool = True) -> None:
    """Write this rank's share of the hidden states into ``<out_dir>.partial``: the examples are sorted by length
    and cut into batches of at most ``batch_tokens`` padded tokens (the same batches on every rank), and rank r
    computes batches r, r + world, ... Shards and their record (``progress-<rank>.json``) are written whole, so a
    rerun with the same ranks resumes after each rank's last complete shard."""
    out_dir = Path(out_dir)
    if (out_dir / INDEX).exists():
        raise FileExistsError(f"{out_dir} already holds a hidden-state cache; remove it or choose another directory")
    if not examples:
        raise HiddenStateError("no examples to compute hidden states for")
    partial = out_dir.with_name(out_dir.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    settings = {"layers": list(layers), "dtype": str(dtype).removeprefix("torch."), "ids": [e.id for e in examples],
                "batch_tokens": batch_tokens, "world": world}
    done = _read_progress(partial, settings, rank)
    mine = _batches(examples, batch_tokens)[rank::world]
    finished = sum(len(s["examples"]) for s in done["shards"])
    while finished:  # shards end at batch boundaries
        finished -= len(mine.pop(0))

    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("hidden states", total=sum(len(examples[i].input_ids) for b in mine for i in b))
        shard: dict[str, torch.Tensor] = {}
        shard_examples: list[int] = []
        for n, batch_ids in enumerate(mine):
            batch = [examples[i] for i in batch_ids]
            hidden = target_hidden_states(model, _padded(batch), layers).to("cpu", dtype)
            for row, (i, example) in enumerate(zip(batch_ids, batch)):
                T = len(example.input_ids)
                shard[f"{i}.hidden"] = hidden[row, :T].contiguous()
                shard[f"{i}.input_ids"] = example.input_ids.to(torch.long).contiguous()
                shard[f"{i}.loss_mask"] = example.loss_mask.to(torch.bool).contiguous()
                shard_examples.append(i)
            bar.advance(task, sum(len(e.input_ids) for e in batch))
            if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes or n == len(mine) - 1:
                _write_shard(partial, done, shard, shard_examples, rank, world)
                shard, shard_examples = {}, []


def finish_hidden_cache(out_dir: Path, examples: Sequence[Example], layers: Sequence[int], hidden_size: int, *,
                        dtype: torch.dtype = torch.bfloat16, target: dict | None = None) -> HiddenStateDataset:
    """Move every rank's shards from ``<out_dir>.partial`` into ``out_dir`` with the index, once all are written;
    refuses a partial cache that misses examples (a rank that has not finished)."""
    out_dir = Path(out_dir)
    partial = out_dir.with_name(out_dir.name + ".partial")
    records = [json.loads(path.read_text()) for path in sorted(partial.glob(_PROGRESS.format(rank="*")))]
    shards = [s for record in records for s in record["shards"]]
    example_shard = {i: s["file"] for s in shards for i in s["examples"]}
    if len(example_shard) != len(examples):
        raise HiddenStateError(f"{partial} holds hidden states of {len(example_shard)} of {len(examples)} examples; "
                               "rerun to finish it")
    index = {
        "format": FORMAT, "version": 1, "layers": list(layers), "hidden_size": hidden_size,
        "dtype": str(dtype).removeprefix("torch."), "tokens": sum(len(e.input_ids) for e in examples),
        "shards": [s["file"] for s in shards],
        "examples": [{"id": e.id, "shard": example_shard[i], "length": len(e.input_ids)}
                     for i, e in enumerate(examples)],
        "target": target or {},
    }
    with atomic_directory(out_dir, overwrite=True) as staging:
        for s in shards:
            os.replace(partial / s["file"], staging / s["file"])
        (staging / INDEX).write_text(json.dumps(index, indent=1))
    _remove(partial)
    return HiddenStateDataset(out_dir)


def _batches(examples: Sequence[Example], batch_tokens: int) -> list[list[int]]:
    """Example indices sorted by length (similar lengths pad little), cut into batches of at most ``batch_tokens``
    padded tokens (an example longer than that is a batch of its own)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].input_ids))
    batches: list[list[int]] = []
    for i in order:
        if batches and (len(batches[-1]) + 1) * len(examples[i].input_ids) <= batch_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _read_progress(partial: Path, settings: dict, rank: int) -> dict:
    path = partial / _PROGRESS.format(rank=rank)
    if not path.exists():
        return {"settings": settings, "shards": []}
    done = json.loads(path.read_text())
    if done["settings"] != settings:
        raise HiddenStateError(f"{partial} holds an interrupted run with other examples, layers, dtype, batches or "
                               "number of processes; rerun it as it was, or remove it to start over")
    return done


def _write_shard(partial: Path, done: dict, tensors: dict[str, torch.Tensor], example_ids: list[int], rank: int,
                 world: int) -> None:
    count = len(done["shards"])
    name = f"shard-{count:05d}.safetensors" if world == 1 else f"shard-r{rank:03d}-{count:05d}.safetensors"
    tmp = partial / f".{name}.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, partial / name)
    done["shards"].append({"file": name, "examples": example_ids})
    record = partial / _PROGRESS.format(rank=rank)
    tmp = partial / f".{record.name}.tmp"
    tmp.write_text(json.dumps(done))
    os.replace(tmp, record)


def _remove(partial: Path) -> None:
    for path in partial.iterdir():
        path.unlink()
    partial.rmdir()


class HiddenStateDataset(Sequence):
    """A written cache, read lazily: item i is {"hidden", "input_ids", "loss_mask"} of example i."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        index_path = self.directory / INDEX
        if not index_path.exists():
            partial = self.directory.with_name(self.directory.name + ".partial")
            hint = f" (an interrupted run is in {partial}: rerun to finish it)" if partial.exists() else ""
            raise HiddenStateError(f"no hidden-state cache at {self.directory}{hint}")
        self.index = json.loads(index_path.read_text())
        if self.index.get("format") != FORMAT:
            raise HiddenStateError(f"{index_path} is not a compound hidden-state index")
        self.examples = self.index["examples"]
        self._open: tuple[str, object] | None = None

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        shard = self.examples[i]["shard"]
        if self._open is None or self._open[0] != shard:
            self._open = (shard, safe_open(str(self.directory / shard), framework="pt"))
        handle = self._open[1]
        return {key: handle.get_tensor(f"{i}.{key}") for key in ("hidden", "input_ids", "loss_mask")}

    @property
    def layers(self) -> list[int]:
        return self.index["layers"]


class OnlineHiddenStates(Sequence):
    """The same items as ``HiddenStateDataset``, computed by running ``model`` when an item is read (``--online``)."""

    def __init__(self, model: nn.Module, examples: Sequence[Example], layers: Sequence[int] = (-1,),
                 dtype: torch.dtype = torch.bfloat16):
        self.model, self.examples, self.layers, self.dtype = model, examples, list(layers), dtype

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        example = self.examples[i]
        hidden = target_hidden_states(self.model, example.input_ids[None], self.layers)[0]
        return {"hidden": hidden.to("cpu", self.dtype), "input_ids": example.input_ids, "loss_mask": example.loss_mask}
