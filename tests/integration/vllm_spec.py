"""Greedy decoding under vLLM (CPU build) with Medusa heads and without: the independent judge of compound's heads.

Run with the vLLM venv's python (made by scripts/setup_vllm.sh), not compound's:

    .venvs/vllm/bin/python tests/integration/vllm_spec.py --model DIR --heads DIR --prompts prompts.json
        --max-tokens N [--dtype float32]

``prompts.json`` is a list of lists of token ids (already chat-templated). Each prompt is decoded greedily for exactly
N tokens (``ignore_eos``), first with ``speculative_config={"method": "medusa", "model": heads, ...}`` (one
speculative token per head), then without. Prints one JSON line on stdout:
{"medusa": [[ids]...], "plain": [[ids]...], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_pos", "mean_accepted_length", "vllm"}.

Counters are vLLM's spec-decode metrics (``vllm/v1/spec_decode/metrics.py``), fed by the scheduler
(``Scheduler.update_from_output``): one draft per request per verify step that carried drafts, accepted = tokens
the step emitted - 1 (the bonus token). ``mean_accepted_length`` = 1 + accepted / drafts, vLLM's own definition
(``SpecDecodingLogging.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_env import configure  # tests/integration, beside this script

configure()  # before vllm is imported

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--heads", required=True, help="Medusa heads in vLLM's layout")
    parser.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)

    prompts = json.loads(open(args.prompts).read())
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    with open(os.path.join(args.heads, "config.json")) as f:
        num_heads = json.load(f)["num_heads"]
    engine = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        # room for the prompt, the new tokens and one more draft chain: vLLM drafts only while
        # sequence length + num_speculative_tokens fits max_model_len (GPUModelRunner._input_fits_in_drafter)
        max_model_len=max(map(len, prompts)) + args.max_tokens + num_heads + 16,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        disable_log_stats=False,  # the spec-decode counters are collected only with stats on
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(heads: str | None) -> tuple[list[list[int]], dict | None]:
        spec = None if heads is None else {"method": "medusa", "model": heads, "num_speculative_tokens": num_heads}
        llm = LLM(**engine, speculative_config=spec)
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        counts = None if heads is None else _spec_counters(llm.get_metrics())
        del llm
        _release_engine()
        return [list(o.outputs[0].token_ids) for o in outputs], counts

    medusa, counts = run(args.heads)
    result = {"medusa": medusa, **counts}
    result["plain"] = run(None)[0]
    result["vllm"] = __version__
    print(json.dumps(result), flush=True)
    return 0


def _spec_counters(metrics) -> dict:
    """vLLM's spec-decode counters of this engine, and its mean accepted length."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {name.removeprefix("vllm:spec_decode_"): 0 for name in COUNTERS}
    for m in metrics:
        if isinstance(m, Counter) and m.name in COUNTERS:
            out[m.name.removeprefix("vllm:spec_decode_")] += m.value
        elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_pos"] = m.values
    drafts = out["num_drafts"]
    out["mean_accepted_length"] = 1 + out["num_accepted_tokens"] / drafts if drafts else None
    return out


def _release_engine() -> None:
    """Tear down the in-process engine's distributed state and memory so a second LLM can be built."""
    import gc

    from vllm.distributed import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


if __name__ == "__main__":
    sys.exit(main())
