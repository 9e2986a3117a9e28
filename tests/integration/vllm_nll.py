"""Mean per-token NLL of token windows under vLLM (CPU build): the independent judge of a compound checkpoint.

Run with the vLLM venv's python (made by scripts/setup_vllm.sh), not compound's:

    .venvs/vllm/bin/python tests/integration/vllm_nll.py --model DIR --tokens windows.json [--dtype bfloat16]
        [--strict-weights] [--max-model-len N]

``windows.json`` is a list of lists of token ids. Each window is one independent prompt; its first token has no
prediction, so every window is scored from its 2nd token (as compound's ``toolkit.evaluate.perplexity`` does).
Prints one JSON line on stdout: {"nll", "tokens", "quantization", "kernels", "dtype", "vllm"}.

``--strict-weights`` forces vLLM's missing-weight check (``DefaultModelLoader.track_weights_loading``), which
by default runs only for unquantized models: it is switched on with
``model_loader_extra_config={"enable_weights_track": True}``, and vLLM then raises
"Following weights were not initialized from checkpoint: {...}" naming every parameter the checkpoint lacks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

# Before vllm is imported: CPU backend, the true W4A16 kernel (not the W4A8 AMX path), the engine in this process
# (so its log lines reach our handler), no telemetry, nothing from the Hub.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_INT4_W4A8", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; windows are short
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries only the JSON result

KERNEL_LINE = re.compile(r"Using (\w+Kernel\w*) for ([\w\- ]+)")


class _Tee:
    """Stands in for sys.stderr: passes everything through and keeps the lines naming vLLM's chosen kernels.

    vLLM (re)configures its "vllm" logger when the engine starts, replacing any handler added before, but its
    StreamHandler writes to whatever ``sys.stderr`` is when that happens, so the lines are read here.
    """

    def __init__(self, stream):
        self._stream = stream
        self.kernels: dict[str, str] = {}

    def write(self, text):
        for m in KERNEL_LINE.finditer(text):
            self.kernels[m.group(2)] = m.group(1)
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--strict-weights", action="store_true", help="force vLLM's missing-weight check")
    parser.add_argument("--max-model-len", type=int, default=None)
    args = parser.parse_args(argv)

    windows = json.loads(open(args.tokens).read())
    if not windows or not all(isinstance(w, list) and len(w) >= 2 for w in windows):
        parser.error("--tokens must hold a non-empty list of windows of at least 2 token ids")

    tee = sys.stderr = _Tee(sys.stderr)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt


    longest = max(map(len, windows))
    kwargs = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len or longest + 1,
        max_num_seqs=len(windows),
        max_num_batched_tokens=max(longest + 1, 2048),
        enable_prefix_caching=False,  # prompt logprobs of a cached prefix would not be recomputed
        seed=0,
    )
    if args.strict_weights:
        kwargs["model_loader_extra_config"] = {"enable_weights_track": True}
    llm = LLM(**kwargs)

    # prompt_logprobs=0: for each prompt position, only the logprob of the actual prompt token (the top-0
    # candidates plus the token itself); position 0 is None (no context). Raw logprobs of the model's logits.
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)

    total, count = 0.0, 0
    for window, out in zip(windows, outputs):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(window) and plp[0] is None, "unexpected prompt_logprobs layout"
        for tok, entry in zip(window[1:], plp[1:]):
            lp = entry[tok].logprob
            if not math.isfinite(lp):
                raise FloatingPointError(f"vLLM returned a non-finite logprob ({lp}) for token {tok}")
            total -= lp
            count += 1

    quant = llm.llm_engine.vllm_config.model_config.quantization
    print(json.dumps({
        "nll": total / count,
        "tokens": count,
        "quantization": quant,
        "kernels": tee.kernels,
        "dtype": args.dtype,
        "vllm": vllm.__version__,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
