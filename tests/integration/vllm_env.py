"""The environment vLLM's CPU build runs under in compound's test scripts (``vllm_nll.py``, ``vllm_spec.py``); call
``configure()`` before ``vllm`` is imported: CPU backend, the true W4A16 kernel (not the W4A8 AMX path), the engine in
this process (so its log lines reach the script), a 1 GiB KV cache (prompts are short), no telemetry, nothing from
the Hub, and vLLM's logging on stderr, so that stdout carries only the script's JSON result."""

import os


def configure() -> None:
    for key, value in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_INT4_W4A8": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                       "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1",
                       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
