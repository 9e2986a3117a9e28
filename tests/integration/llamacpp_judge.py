"""Run in the llama.cpp venv (scripts/setup_llamacpp.sh): llama.cpp's own view of a GGUF file, as JSON on stdout.

    python llamacpp_judge.py logprobs FILE.gguf IDS.json [--threads N]   → {"logprobs": [[...], ...], "top1": ...}
        per window: the log-probability llama.cpp gives each next token of each window of token ids (every position
        but the last), and its most likely token there, from its full logits (logits_all)
    python llamacpp_judge.py greedy FILE.gguf PROMPT_IDS.json N           → {"tokens": [[...], ...]}: N greedy tokens
        per prompt of token ids, through llama.cpp's sampler at temperature 0
    python llamacpp_judge.py chat FILE.gguf MESSAGES.json N               → {"text": ...}: a greedy chat reply rendered
        with the file's own chat template (tokenizer.chat_template)

No torch here: numpy and llama_cpp only. Every call is a fresh model (n_ctx sized to the longest input)."""

import json
import sys

import numpy as np
from llama_cpp import Llama


def _model(path: str, n_ctx: int, threads: int, logits_all: bool = False) -> Llama:
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False, seed=0)


def logprobs(path: str, windows: list[list[int]], threads: int) -> dict:
    llm = _model(path, max(len(w) for w in windows), threads, logits_all=True)
    out, top1 = [], []
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = np.asarray(llm.scores[: len(window)], dtype=np.float64)  # (T, V)
        logits -= logits.max(axis=-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        out.append([float(logp[t, window[t + 1]]) for t in range(len(window) - 1)])
        top1.append([int(i) for i in logits[:-1].argmax(axis=-1)])
    return {"logprobs": out, "top1": top1}


def greedy(path: str, prompts: list[list[int]], n: int, threads: int) -> dict:
    llm = _model(path, max(len(p) for p in prompts) + n, threads)
    out = []
    for prompt in prompts:
        llm.reset()
        tokens = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            if token == llm.token_eos() or len(tokens) == n:
                break
            tokens.append(int(token))
        out.append(tokens)
    return {"tokens": out}


def chat(path: str, messages: list[dict], n: int, threads: int) -> dict:
    llm = _model(path, 1024, threads)
    reply = llm.create_chat_completion(messages=messages, max_tokens=n, temperature=0.0, top_k=1)
    return {"text": reply["choices"][0]["message"]["content"]}


def main(argv: list[str]) -> None:
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 1
    verb, path, data = argv[1], argv[2], json.loads(open(argv[3]).read())
    if verb == "logprobs":
        result = logprobs(path, data, threads)
    elif verb == "greedy":
        result = greedy(path, data, int(argv[4]), threads)
    elif verb == "chat":
        result = chat(path, data, int(argv[4]), threads)
    else:
        sys.exit(f"unknown verb {verb!r}: logprobs, greedy or chat")
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
