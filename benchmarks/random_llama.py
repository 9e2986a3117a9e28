"""The models the size benchmarks run on: SmolLM2 re-saved as bf16 shards, and random-initialised Llamas.

All carry SmolLM2's tokenizer (so vocab 49152), are written as bfloat16 safetensors shards (one per decoder layer)
under ``benchmarks/.cache/models/`` (made on first use, one layer in memory at a time, never shipped):

| size    | hidden | intermediate | layers | heads / KV heads | parameters | bf16 on disk |
|---------|--------|--------------|--------|------------------|------------|--------------|
| smollm2 | 576    | 1536         | 30     | 9 / 3            | 0.13 B     | 0.27 GB      |
| small   | 1024   | 2816         | 16     | 16 / 4           | 0.28 B     | 0.56 GB      |
| 1b      | 2048   | 8192         | 16     | 32 / 8           | 1.2 B      | 2.4 GB       |
| 3b      | 3072   | 8192         | 28     | 24 / 8           | 3.1 B      | 6.2 GB       |

``smollm2`` is the embedded SmolLM2-135M-Instruct (its GGUF dequantized, then saved; a GGUF file itself cannot
stream); ``1b`` and ``3b`` have the shapes of Llama-3.2-1B and -3B with SmolLM2's vocabulary and untied embeddings.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

CACHE = Path(__file__).resolve().parent / ".cache" / "models"
SIZES = {
    "smollm2": None,  # the embedded model
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=4),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8),
}
VOCAB = 49152  # SmolLM2's tokenizer, so calibration text tokenizes into ids the embeddings have


def make_model(size: str) -> Path:
    """The random ``size`` model's directory, written shard by shard (one layer in memory at a time) if missing."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from toolkit.models import embedded_gguf

    path = CACHE / size
    if (path / "config.json").is_file():
        return path
    staging = path.with_name(size + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gguf = embedded_gguf("smollm2-135m")
    if SIZES[size] is None:
        from toolkit.models import load_model

        gguf_model = load_model("smollm2-135m")  # transformers will not save a GGUF-loaded model: copy it over
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        plain.load_state_dict(gguf_model.state_dict())
        plain.save_pretrained(staging, max_shard_size="50MB")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        os.replace(staging, path)
        return path
    config = LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=False, dtype="bfloat16", **SIZES[size])
    with init_empty_weights():
        shapes = {name: t.shape for name, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    files = {name: f"layer-{name.split('.')[2]}.safetensors" if ".layers." in name else "outer.safetensors"
             for name in shapes}
    generator = torch.Generator().manual_seed(0)
    from safetensors.torch import save_file

    for filename in sorted(set(files.values())):
        tensors = {}
        for name in (n for n in shapes if files[n] == filename):
            tensor = torch.randn(shapes[name], generator=generator) * 0.02 if len(shapes[name]) > 1 else \
                torch.ones(shapes[name])
            tensors[name] = tensor.to(torch.bfloat16)
        save_file(tensors, staging / filename, metadata={"format": "pt"})
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (staging / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": files}, indent=1))
    config.save_pretrained(staging)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    os.replace(staging, path)
    return path
