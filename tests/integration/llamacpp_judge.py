"""Run in the llama.cpp venv (scripts/setup_llamacpp.sh): llama.cpp's own view of a GGUF file, as JSON on stdout.

    python llamacpp_judge.py logprobs FILE.gguf IDS.json [--kv q8_0]     → {"logprobs": [[...], ...], "top1": ...}
        per window: the log-probability llama.cpp gives each next token of each window of token ids (every position
        but the last), and its most likely token there, from its full logits (logits_all)
    python llamacpp_judge.py greedy FILE.gguf PROMPT_IDS.json N           → {"tokens": [[...], ...]}: N greedy tokens
        per prompt of token ids, through llama.cpp's sampler at temperature 0
    python llamacpp_judge.py chat FILE.gguf MESSAGES.json N               → {"text": ...}: a greedy chat reply rendered
        with the file's own chat template (tokenizer.chat_template)
    python llamacpp_judge.py speed FILE.gguf PROMPT_IDS.json N [--kv q8_0] → {"tokens_per_s": ...}: greedy decoding
        of N tokens after the first prompt, batch 1 (the prompt's prefill not counted)

Options: --threads N (default 1); --kv q8_0 stores the KV cache as Q8_0 (type_k/type_v, with flash attention, which
a quantized V cache needs).
    python llamacpp_judge.py quantize F32.gguf OUT.gguf TYPE              → {"file": OUT}: llama.cpp's own quantizer
        (llama_model_quantize) at TYPE, one of Q4_0, Q4_1, Q4_K_M, Q8_0 (its default choices per tensor)

No torch here: numpy and llama_cpp only. Every call is a fresh model (n_ctx sized to the longest input)."""

import json
import sys

import numpy as np
from llama_cpp import Llama


def _without_extra_buffers_on_amx() -> None:
    """On a CPU with AMX tiles, load models without llama.cpp's extra CPU buffer types (its AMX weight repacking):
    with them llama-cpp-python 0.3.36 built GGML_NATIVE segfaults in ``llama_decode`` on every model, SmolLM2's own
    Q4_1 file included (seen 2026-12-04 on a 2-core Xeon). ``use_extra_bufts`` is a field of llama.cpp's model
    parameters that ``Llama`` does not take as an argument, so its defaults are wrapped; the plain CPU buffers hold the
    same weights (only the matmul kernel changes)."""
    import llama_cpp.llama_cpp as api

    with open("/proc/cpuinfo") as cpuinfo:
        if "amx_tile" not in cpuinfo.read():
            return
    defaults = api.llama_model_default_params

    def params():
        chosen = defaults()
        chosen.use_extra_bufts = False
        return chosen

    api.llama_model_default_params = params


def _model(path: str, n_ctx: int, threads: int, logits_all: bool = False, kv: str | None = None) -> Llama:
    """llama.cpp's model of ``path``; kv "q8_0": a Q8_0 KV cache (with flash attention, which a quantized V needs)."""
    import llama_cpp

    _without_extra_buffers_on_amx()
    cache = {"type_k": llama_cpp.GGML_TYPE_Q8_0, "type_v": llama_cpp.GGML_TYPE_Q8_0, "flash_attn": True} if kv else {}
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                 logits_all=logits_all, verbose=False, seed=0, **cache)


def logprobs(path: str, windows: list[list[int]], threads: int, kv: str | None = None) -> dict:
    llm = _model(path, max(len(w) for w in windows), threads, logits_all=True, kv=kv)
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


def speed(path: str, prompts: list[list[int]], n: int, threads: int, kv: str | None) -> dict:
    import time

    llm = _model(path, len(prompts[0]) + n + 8, threads, kv=kv)
    llm.eval(prompts[0])
    started, token = time.perf_counter(), None
    for _ in range(n):
        token = llm.sample(temp=0.0, top_k=1)
        llm.eval([token])
    return {"tokens_per_s": n / (time.perf_counter() - started)}


def quantize(source: str, output: str, type_name: str, threads: int) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.nthread = threads
    if llama_cpp.llama_model_quantize(source.encode(), output.encode(), params) != 0:
        sys.exit(f"llama_model_quantize failed for {type_name}")
    return {"file": output}


def main(argv: list[str]) -> None:
    threads = int(argv[argv.index("--threads") + 1]) if "--threads" in argv else 1
    kv = argv[argv.index("--kv") + 1] if "--kv" in argv else None
    verb, path = argv[1], argv[2]
    if verb == "quantize":
        json.dump(quantize(path, argv[3], argv[4], threads), sys.stdout)
        return
    data = json.loads(open(argv[3]).read())
    if verb == "logprobs":
        result = logprobs(path, data, threads, kv)
    elif verb == "greedy":
        result = greedy(path, data, int(argv[4]), threads)
    elif verb == "chat":
        result = chat(path, data, int(argv[4]), threads)
    elif verb == "speed":
        result = speed(path, data, int(argv[4]), threads, kv)
    else:
        sys.exit(f"unknown verb {verb!r}: logprobs, greedy, chat, speed or quantize")
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main(sys.argv)
