"""Greedy decoding under vLLM (CPU build) with draft heads (Medusa, EAGLE-1, EAGLE-3) and without: the independent
judge of compound's heads.

Run with the vLLM venv's python (made by scripts/setup_vllm.sh), not compound's:

    .venvs/vllm/bin/python tests/integration/vllm_spec.py --model DIR --heads DIR [DIR ...] --prompts prompts.json
        --max-tokens N [--method medusa|eagle|eagle3 ...] [--num-speculative-tokens K] [--dtype float32]

``prompts.json`` is a list of lists of token ids (already chat-templated). Each prompt is decoded greedily for exactly
N tokens (``ignore_eos``), once per draft directory with ``speculative_config={"method": method, "model": heads,
"num_speculative_tokens": K}`` (one engine each; ``--method`` once for all or once per directory; K defaults to a
Medusa directory's head count and is required for EAGLE), then without. Prints one JSON line on stdout:
{"drafts": [{"method", "heads", "tokens": [[ids]...], "num_drafts", "num_draft_tokens", "num_accepted_tokens",
"accepted_per_pos", "mean_accepted_length"} or {"method", "heads", "error"}, ...], "plain": [[ids]...], "vllm"}.
A draft vLLM refuses (an exception while building or running its engine) is reported with its error, and the other
drafts still run.

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
from pathlib import Path
import traceback

sys.path.insert(0, str(Path(__file__).resolve().parent))  # beside this script, also under PYTHONSAFEPATH (conftest)
from vllm_env import configure  # noqa: E402

configure()  # before vllm is imported

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--heads", required=True, nargs="+", help="draft directories (Medusa in vLLM's layout, EAGLE)")
    parser.add_argument("--method", nargs="+", default=["medusa"], choices=["medusa", "eagle", "eagle3"],
                        help="speculative method: one for all directories, or one per directory")
    parser.add_argument("--num-speculative-tokens", type=int, help="draft length (default: a Medusa head count)")
    parser.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)

    prompts = json.loads(open(args.prompts).read())
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    methods = args.method * len(args.heads) if len(args.method) == 1 else args.method
    if len(methods) != len(args.heads):
        parser.error(f"{len(args.method)} --method values for {len(args.heads)} --heads directories")
    if args.num_speculative_tokens is None and set(methods) != {"medusa"}:
        parser.error("--num-speculative-tokens is required for EAGLE drafts")
    drafts = [(method, heads, args.num_speculative_tokens or _medusa_heads(heads))
              for method, heads in zip(methods, args.heads)]
    engine = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        # room for the prompt, the new tokens and one more draft chain: vLLM drafts only while
        # sequence length + num_speculative_tokens fits max_model_len (GPUModelRunner._input_fits_in_drafter)
        max_model_len=max(map(len, prompts)) + args.max_tokens + max(k for _, _, k in drafts) + 16,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        disable_log_stats=False,  # the spec-decode counters are collected only with stats on
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(spec: dict | None) -> tuple[list[list[int]], dict | None]:
        llm = LLM(**engine, speculative_config=spec)
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        counts = None if spec is None else _spec_counters(llm.get_metrics())
        del llm
        _release_engine()
        return [list(o.outputs[0].token_ids) for o in outputs], counts

    result = {"drafts": []}
    for method, heads, k in drafts:
        entry = {"method": method, "heads": heads}
        try:
            tokens, counts = run({"method": method, "model": heads, "num_speculative_tokens": k})
            entry |= {"tokens": tokens, **counts}
        except Exception as err:  # reported, and the other drafts still run
            traceback.print_exc()
            entry["error"] = f"{type(err).__name__}: {err}"
        if "error" in entry:  # out of the except block, the failed engine (held by the traceback) can be freed
            _release_engine()
        result["drafts"].append(entry)
    result["plain"] = run(None)[0]
    result["vllm"] = __version__
    print(json.dumps(result), flush=True)
    return 0


def _medusa_heads(heads: str) -> int:
    """A Medusa directory's head count: its default draft length."""
    with open(os.path.join(heads, "config.json")) as f:
        return json.load(f)["num_heads"]


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
