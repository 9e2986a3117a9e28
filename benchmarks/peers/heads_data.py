"""Convert compound's cached EAGLE-3 training data into the input forms of the peer trainers (speculators, SpecForge),
so all three train on the same self-distilled conversations and the same target hidden states.

Runs with any Python that has torch and safetensors (the system one, or a peer venv); ``--to speculators`` also needs
``datasets`` (the speculators venv has it). It never imports ``toolkit``: it reads compound's cache files directly.

    python benchmarks/peers/heads_data.py --cache OUT.work/hidden-2-15-27-final --model benchmarks/.cache/smollm2-135m-hf \\
        --draft-vocab 2048 --to speculators --out benchmarks/.cache/heads-peers-data/speculators
    python benchmarks/peers/heads_data.py --cache OUT.work/hidden-2-15-27-final --model benchmarks/.cache/smollm2-135m-hf \\
        --vocab-from OUT --to specforge --out benchmarks/.cache/heads-peers-data/specforge

What compound's cache holds (``toolkit/heads/hidden_states.py``; ``compound train-heads --head eagle3`` writes it to
``OUTPUT.work/hidden-<aux>-final``): per example i, ``{i}.hidden`` [T, n_aux + 1, H] (bfloat16) = the residual stream
entering each aux layer (transformers' ``hidden_states[l]`` = vLLM's aux id l = SGLang's capture id l - 1), then the
target's FINAL-NORM state (what ``lm_head`` reads); ``{i}.input_ids`` [T]; ``{i}.loss_mask`` [T] (assistant tokens).

speculators 0.9.0 (``speculators train --data-path OUT``, ``hidden_states_backend=file``; read in
``speculators/train/data.py``, ``hs_connectors/transfer.py``):

    OUT/                      a ``datasets`` save_to_disk: columns input_ids (int64), loss_mask (bool), seq_len
    OUT/hidden_states/hs_<i>.safetensors   {"hidden_states": [T, n_aux + 1, H], "token_ids": [T] int64}
    OUT/d2t-<V>.npy, OUT/t2d-<V>.npy       the draft vocabulary (target id = draft id + d2t[draft id]; t2d bool)
    OUT/token_freq.pt          {token id: count over loss-masked tokens} (speculators' own file; unused when d2t/t2d
                               exist, kept so a run without --draft-vocab-size maps still has it)
    OUT/compound_peer_data.json  what was converted (examples, tokens, layers, vocabulary, validation row)

  speculators reads the last layer as the PRE-norm output of the final decoder layer (vLLM captures it there) and
  applies the target's final norm itself (``verifier_norm``) to make the teacher logits. compound caches the
  post-norm state y = w * x / rms(x). The converter stores y / w instead: its rms is 1 (up to eps), so the target's
  norm maps it back to w * (y / w) / rms(y / w) = y / rms(y / w), i.e. speculators' teacher logits are compound's
  ``lm_head(y)`` scaled per token by 1 / rms(y / w): 1 up to the bfloat16 rounding of the cached y (|rms - 1| <= 0.4 %
  on SmolLM2-135M; ``prenorm_rms_max_abs_dev`` records it; the teacher's argmax is unchanged). Stored in float32 unless
  --dtype bfloat16.
  speculators always holds out a validation split (``--train-data-ratio`` must be in (0, 1)): the converter appends
  ONE extra row, a copy of the last example, so a ratio of (N + 0.5) / (N + 1) trains on exactly the N examples
  (``compound_peer_data.json`` gives that ratio as ``train_data_ratio``).

SpecForge 0.2.0 (``specforge train`` with ``data.hidden_states_path=OUT/features``; read in
``specforge/runtime/data_plane/offline_reader.py`` and ``specforge/algorithms/eagle3/data.py``):

    OUT/features/data_<i:08d>.ckpt   torch.save({"input_ids": [T] int64, "loss_mask": [T] int64,
                                                 "hidden_state": [1, T, H] (final-norm, as compound has it),
                                                 "aux_hidden_state": [1, T, 3H] (the aux layers concatenated)})
    OUT/vocab_mapping.pt             {"d2t": [V] int64, "t2d": [vocab] bool}   (model.vocab_mapping_path)
    OUT/compound_peer_data.json

  SpecForge's EAGLE-3 draft fuses exactly 3 aux layers (``fc`` is [H, 3H]); a cache with another count is refused.
  Its ``TargetHead`` applies ``lm_head`` to ``hidden_state`` directly, so the post-norm state is what it expects.

The draft vocabulary: ``--vocab-from HEAD_DIR`` takes compound's exported head's own ``t2d`` (the exact vocabulary
compound trained); ``--draft-vocab V`` recomputes it with compound's rule (``toolkit.heads.eagle.draft_vocabulary``:
the V most frequent loss-masked tokens, ties and a shortfall filled with the lowest ids), which is also speculators'
and SpecForge's own rule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from pathlib import Path

FORMAT = "compound-hidden-states"


def read_cache(cache: Path):
    """(index, iterator over (i, hidden [T, L, H], input_ids [T], loss_mask [T])) of a compound hidden-state cache."""
    from safetensors import safe_open

    index_path = cache / "index.json"
    if not index_path.exists():
        raise SystemExit(f"{cache}: no index.json (not a finished compound hidden-state cache)")
    index = json.loads(index_path.read_text())
    if index.get("format") != FORMAT:
        raise SystemExit(f"{index_path} is not a compound hidden-state index")
    if len(index["layers"]) < 2 or index["layers"][-1] != -1:
        raise SystemExit(f"{cache}: layers {index['layers']} are not an eagle3 cache (aux layers, then -1)")

    def items(hidden: bool = True, limit: int | None = None):
        """(i, hidden [T, L, H] or None, input_ids [T] int64, loss_mask [T] bool) of the first ``limit`` examples,
        read lazily (one shard open at a time)."""
        handles = {}
        for i, example in enumerate(index["examples"][:limit]):
            shard = example["shard"]
            if shard not in handles:
                handles.clear()
                handles[shard] = safe_open(str(cache / shard), framework="pt")
            h = handles[shard]
            yield (i, h.get_tensor(f"{i}.hidden") if hidden else None, h.get_tensor(f"{i}.input_ids").long(),
                   h.get_tensor(f"{i}.loss_mask").bool())

    return index, items


def find_cache(path: Path) -> Path:
    """``path`` itself when it is a cache, else the single ``hidden-*-final`` cache in a compound work directory."""
    if (path / "index.json").exists():
        return path
    found = sorted(p for p in path.glob("hidden-*-final") if (p / "index.json").exists())
    if len(found) != 1:
        raise SystemExit(f"{path}: expected one finished eagle3 hidden-state cache (hidden-*-final), found "
                         f"{[p.name for p in found]}; pass --cache DIR")
    return found[0]


def compound_vocabulary(label_ids, vocab_size: int, size: int):
    """compound's ``draft_vocabulary`` rule (toolkit/heads/eagle.py), re-stated so this file runs without toolkit."""
    import torch

    if not 0 < size <= vocab_size:
        raise SystemExit(f"--draft-vocab must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids in label_ids:
        counts += torch.bincount(ids.long(), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices[:size]
    return order.sort().values, counts


def vocabulary_from_head(head_dir: Path):
    """The sorted target ids of a compound-exported EAGLE-3 head (its ``t2d`` bool mask)."""
    import torch
    from safetensors import safe_open

    with safe_open(str(head_dir / "model.safetensors"), framework="pt") as f:
        t2d = f.get_tensor("t2d").bool()
    return torch.nonzero(t2d).flatten()


def mappings(vocab, vocab_size: int):
    """(d2t [V] int64 offsets, t2d [vocab_size] bool) of sorted target ids ``vocab``: the layout all three share."""
    import torch

    vocab = vocab.long()
    d2t = vocab - torch.arange(len(vocab), dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    return d2t, t2d


def target_facts(model_dir: Path) -> dict:
    """vocab size, hidden size, layer count and final-norm weight/eps of the target (float safetensors directory)."""
    import torch
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    norm = None
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for key in ("model.norm.weight", "model.language_model.norm.weight", "norm.weight"):
                if key in h.keys():
                    norm = h.get_tensor(key).float()
                    break
        if norm is not None:
            break
    if norm is None:
        raise SystemExit(f"{model_dir}: no final norm weight (model.norm.weight) in its safetensors files")
    if bool((norm.abs() < 1e-6).any()):
        raise SystemExit("the target's final norm has zero weights: the pre-norm state cannot be recovered")
    return {"vocab_size": int(config["vocab_size"]), "hidden_size": int(config["hidden_size"]),
            "num_layers": int(config["num_hidden_layers"]), "norm": norm,
            "rms_norm_eps": float(config.get("rms_norm_eps", 1e-6)), "dtype": torch.float32}


def load_labels(cache: Path, max_examples: int | None = None):
    """(index, items, [(input_ids, loss_mask)] of the examples): the token ids and masks only, no hidden state."""
    index, items = read_cache(cache)
    return index, items, [(ids, mask) for _, _, ids, mask in items(hidden=False, limit=max_examples)]


def resolve_vocab(examples, facts: dict, draft_vocab: int | None, vocab_from: Path | None):
    """(sorted target ids of the draft vocabulary, a record of it); ``examples``: [(input_ids, loss_mask)]."""
    import torch

    if vocab_from is not None:
        vocab = vocabulary_from_head(vocab_from)
        source = f"t2d of {vocab_from}"
        if draft_vocab is not None and draft_vocab != len(vocab):
            raise SystemExit(f"--draft-vocab {draft_vocab} != the {len(vocab)} tokens of {vocab_from}")
    elif draft_vocab is not None:
        vocab, _ = compound_vocabulary([ids[mask] for ids, mask in examples], facts["vocab_size"], draft_vocab)
        source = "compound's rule (most frequent loss-masked tokens, ties to the lowest ids)"
    else:
        raise SystemExit("give --draft-vocab V or --vocab-from COMPOUND_HEAD_DIR")
    labels = torch.cat([ids[mask] for ids, mask in examples])
    in_vocab = torch.zeros(facts["vocab_size"], dtype=torch.bool)
    in_vocab[vocab] = True
    covered = float(in_vocab[labels].float().mean()) if len(labels) else 0.0
    return vocab, {"draft_vocab": len(vocab), "source": source, "label_coverage": round(covered, 6)}


def token_frequencies(examples) -> dict[int, int]:
    import torch

    labels = torch.cat([ids[mask] for ids, mask in examples])
    ids, counts = labels.unique(return_counts=True)
    return dict(zip(ids.tolist(), counts.tolist()))


def to_speculators(cache: Path, model_dir: Path, out: Path, *, draft_vocab: int | None = None,
                   vocab_from: Path | None = None, dtype: str = "float32", max_examples: int | None = None) -> dict:
    """Write speculators' offline data directory (see the module docstring); returns what was written."""
    import numpy as np
    import torch
    from datasets import Dataset
    from safetensors.torch import save_file

    facts = target_facts(model_dir)
    index, items, examples = load_labels(cache, max_examples)
    vocab, vocab_info = resolve_vocab(examples, facts, draft_vocab, vocab_from)
    store = getattr(torch, dtype)
    if out.exists():
        shutil.rmtree(out)
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    norm = facts["norm"]
    worst_rms = 0.0
    n = len(examples)
    for i, hidden, ids, mask in items(limit=max_examples):
        hidden = hidden.float()  # [T, n_aux + 1, H]
        prenorm = hidden[:, -1] / norm  # rms 1: the target's final norm maps it back to the cached state
        worst_rms = max(worst_rms, float((prenorm.pow(2).mean(-1).sqrt() - 1).abs().max()))
        hidden[:, -1] = prenorm
        tensors = {"hidden_states": hidden.to(store).contiguous(), "token_ids": ids.contiguous()}
        # the last example once more as row n: speculators' obligatory validation row
        for row in (i, n) if i == n - 1 else (i,):
            save_file(tensors, str(hs_dir / f"hs_{row}.safetensors"))
    for ids, mask in [*examples, examples[-1]]:
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(len(ids))
    try:
        from datasets import List as Seq
    except ImportError:  # datasets < 4
        from datasets import Sequence as Seq
    from datasets import Features, Value

    features = Features({"input_ids": Seq(Value("int64")), "loss_mask": Seq(Value("bool")), "seq_len": Value("int64")})
    dataset = Dataset.from_dict(rows, features=features)
    dataset.set_format(type="torch")
    dataset.save_to_disk(str(out))
    d2t, t2d = mappings(vocab, facts["vocab_size"])
    np.save(out / f"d2t-{len(vocab)}.npy", d2t.numpy())
    np.save(out / f"t2d-{len(vocab)}.npy", t2d.numpy())
    torch.save(token_frequencies(examples), out / "token_freq.pt")
    info = _info(cache, index, examples, vocab_info, model_dir)
    info.update({"peer": "speculators", "rows": n + 1, "validation_row": f"row {n} = a copy of example {n - 1}",
                 "train_data_ratio": (n + 0.5) / (n + 1), "hidden_states_dtype": dtype,
                 "last_layer": "y / final_norm.weight (pre-norm reconstruction of compound's final-norm state y)",
                 "prenorm_rms_max_abs_dev": worst_rms,  # the teacher logits' per-token scale error, at most
                 "target_layer_ids": index["layers"][:-1]})
    (out / "compound_peer_data.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def to_specforge(cache: Path, model_dir: Path, out: Path, *, draft_vocab: int | None = None,
                 vocab_from: Path | None = None, dtype: str = "bfloat16", max_examples: int | None = None) -> dict:
    """Write SpecForge's offline feature directory (see the module docstring); returns what was written."""
    import torch

    facts = target_facts(model_dir)
    index, items, examples = load_labels(cache, max_examples)
    aux = index["layers"][:-1]
    if len(aux) != 3:
        raise SystemExit(f"SpecForge's EAGLE-3 draft fuses exactly 3 aux layers; the cache has {len(aux)} ({aux})")
    vocab, vocab_info = resolve_vocab(examples, facts, draft_vocab, vocab_from)
    store = getattr(torch, dtype)
    if out.exists():
        shutil.rmtree(out)
    features = out / "features"
    features.mkdir(parents=True)
    for i, hidden, ids, mask in items(limit=max_examples):
        T, L, H = hidden.shape
        torch.save({"input_ids": ids.contiguous(), "loss_mask": mask.long().contiguous(),
                    "hidden_state": hidden[:, -1].to(store).reshape(1, T, H).contiguous(),
                    "aux_hidden_state": hidden[:, :-1].to(store).reshape(1, T, (L - 1) * H).contiguous()},
                   features / f"data_{i:08d}.ckpt")
    d2t, t2d = mappings(vocab, facts["vocab_size"])
    torch.save({"d2t": d2t, "t2d": t2d}, out / "vocab_mapping.pt")
    info = _info(cache, index, examples, vocab_info, model_dir)
    info.update({"peer": "specforge", "rows": len(examples), "hidden_states_dtype": dtype,
                 "aux_layers_hf": aux, "aux_layers_sglang": [i - 1 for i in aux],
                 "last_layer": "final-norm state, as cached (SpecForge's TargetHead applies lm_head to it)"})
    (out / "compound_peer_data.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def _info(cache: Path, index: dict, examples, vocab_info: dict, model_dir: Path) -> dict:
    tokens = sum(len(ids) for ids, _ in examples)
    trained = sum(int(mask.sum()) for _, mask in examples)
    return {"source_cache": str(cache), "target": str(model_dir), "examples": len(examples), "tokens": tokens,
            "trained_tokens": trained, "mean_tokens": tokens / max(len(examples), 1),
            "cache_layers": index["layers"], "cache_dtype": index.get("dtype"), "vocabulary": vocab_info,
            "example_ids": [e["id"] for e in index["examples"][: len(examples)]]}


def tokens_per_step(info: dict, batch_size: int) -> int:
    """Packed tokens per optimizer step matching ``batch_size`` examples of the mean length (speculators packs a
    step to ``--total-seq-len`` tokens instead of counting examples)."""
    return max(int(math.ceil(info["mean_tokens"] * batch_size)), 1)


def add_data_options(ap: argparse.ArgumentParser) -> None:
    """The options that say what to convert and where (this file's, and the peer runners')."""
    ap.add_argument("--cache", required=True, type=Path, help="compound eagle3 cache (OUTPUT.work/hidden-*-final) or "
                    "the work directory holding it")
    ap.add_argument("--model", required=True, type=Path, help="float target directory (the cache's target)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--draft-vocab", type=int, default=None)
    ap.add_argument("--vocab-from", type=Path, default=None, help="compound eagle3 head directory: use its vocabulary")
    ap.add_argument("--max-examples", type=int, default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_data_options(ap)
    ap.add_argument("--to", required=True, choices=["speculators", "specforge"])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="stored dtype (default: float32 for speculators, whose last layer is recomputed; bfloat16, "
                         "the cache's own, for SpecForge)")
    args = ap.parse_args()
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    cache = find_cache(args.cache)
    convert = to_speculators if args.to == "speculators" else to_specforge
    dtype = args.dtype or ("float32" if args.to == "speculators" else "bfloat16")
    info = convert(cache, args.model, args.out, draft_vocab=args.draft_vocab, vocab_from=args.vocab_from,
                   dtype=dtype, max_examples=args.max_examples)
    info.pop("example_ids")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
