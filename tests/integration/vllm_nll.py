"""Mean per-token NLL of token windows under vLLM (CPU build): the independent judge of a compound checkpoint.

Run with the vLLM venv's python (made by scripts/setup_vllm.sh), not compound's:

    .venvs/vllm/bin/python tests/integration/vllm_nll.py --model DIR --tokens windows.json [--dtype bfloat16]
        [--strict-weights] [--max-model-len N] [--kv-cache-dtype fp8] [--broken DIR]

``windows.json`` is a list of lists of token ids. Each window is one independent prompt; its first token has no
prediction, so every window is scored from its 2nd token (as compound's ``toolkit.evaluate.perplexity`` does).
Prints one JSON line on stdout: {"nll", "tokens", "quantization", "kernels", "dtype", "kv_cache_dtype",
"kv_scales", "vllm"} and, with ``--broken``, "broken_error". ``kv_cache_dtype``: the cache dtype vLLM resolved
("auto" = the model dtype); ``kv_scales``: the (k, v) scale every attention layer runs with, as vLLM loaded it
(1.0 each when the checkpoint has none its quantization config lets vLLM read).

``--broken DIR``: after scoring, in the same process (vLLM imported once), load DIR the same way and report the
error that refused it (``broken_error``; null if it loaded). ``--also DIR``: after scoring, in the same process,
score DIR the same way too (its own engine), reported under "also" with the same keys.

``--strict-weights`` forces vLLM's missing-weight check (``DefaultModelLoader.track_weights_loading``), which
by default runs only for unquantized models: it is switched on with
``model_loader_extra_config={"enable_weights_track": True}``, and vLLM then raises
"Following weights were not initialized from checkpoint: {...}" naming every parameter the checkpoint lacks.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside this script, also under PYTHONSAFEPATH (conftest)
from vllm_env import configure  # noqa: E402

configure()  # before vllm is imported

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
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto | float16 | bfloat16 | fp8 (E4M3, scaled "
                        "by the checkpoint's k_scale / v_scale). auto is fp8 for a checkpoint that declares a "
                        "compressed-tensors kv_cache_scheme, the model dtype otherwise")
    parser.add_argument("--broken", default=None, help="a checkpoint to load after scoring; its error is reported")
    parser.add_argument("--also", default=None, help="a checkpoint to score after the first, in the same process")
    args = parser.parse_args(argv)

    windows = json.loads(open(args.tokens).read())
    if not windows or not all(isinstance(w, list) and len(w) >= 2 for w in windows):
        parser.error("--tokens must hold a non-empty list of windows of at least 2 token ids")

    tee = sys.stderr = _Tee(sys.stderr)

    from vllm import LLM

    longest = max(map(len, windows))
    kwargs = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len or longest + 1,
        max_num_seqs=len(windows),
        max_num_batched_tokens=max(longest + 1, 2048),
        enable_prefix_caching=False,  # prompt logprobs of a cached prefix would not be recomputed
        kv_cache_dtype=args.kv_cache_dtype,
        seed=0,
    )
    if args.strict_weights:
        kwargs["model_loader_extra_config"] = {"enable_weights_track": True}
    llm = LLM(**kwargs)
    result = _score(llm, windows, args.dtype, tee.kernels)
    if args.also:
        del llm
        _release_engine()
        tee.kernels = {}
        llm = LLM(**{**kwargs, "model": args.also})
        result["also"] = _score(llm, windows, args.dtype, tee.kernels)
    if args.broken:
        del llm
        _release_engine()
        try:
            LLM(**{**kwargs, "model": args.broken})
            result["broken_error"] = None
        except Exception as err:  # vLLM raises ValueError / RuntimeError depending on where loading fails
            result["broken_error"] = f"{type(err).__name__}: {err}"
    print(json.dumps(result), flush=True)
    return 0


def _score(llm, windows: list[list[int]], dtype: str, kernels: dict[str, str]) -> dict:
    """The mean NLL of ``windows`` under ``llm`` and what vLLM ran it with."""
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

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

    return {
        "nll": total / count,
        "tokens": count,
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        "kernels": dict(kernels),
        "dtype": dtype,
        "kv_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,  # as resolved ("auto": model dtype)
        "kv_scales": llm.apply_model(_kv_scales)[0],
        "vllm": vllm.__version__,
    }


def _kv_scales(model) -> list[list[float]]:
    """(k, v) scale of every attention layer, as the attention backend reads them."""
    return [[m._k_scale_float, m._v_scale_float] for m in model.modules() if hasattr(m, "_k_scale_float")]


def _release_engine() -> None:
    """Tear down the in-process engine's distributed state and memory so a second LLM can be built."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


if __name__ == "__main__":
    sys.exit(main())
