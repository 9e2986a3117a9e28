"""Greedy decoding under vLLM (CPU build) with draft heads (Medusa, EAGLE-1, EAGLE-3) and without: the independent
judge of compound's heads.

Run with the vLLM venv's python (made by scripts/setup_vllm.sh), not compound's:

    .venvs/vllm/bin/python tests/integration/vllm_spec.py --model DIR --heads DIR [DIR ...] --prompts prompts.json
        --max-tokens N [--method medusa|eagle|eagle3|speculators ...] [--num-speculative-tokens K ...]
        [--dtype float32]

``prompts.json`` is a list of lists of token ids (already chat-templated). Each prompt is decoded greedily for exactly
N tokens (``ignore_eos``), once per draft directory with ``speculative_config={"method": method, "model": heads,
"num_speculative_tokens": K}`` (one engine each; ``--method`` and ``--num-speculative-tokens`` once for all or once
per directory; K defaults to a Medusa directory's head count and is required for EAGLE), then without. Method
``speculators`` serves a speculators-layout directory alone, ``LLM(model=heads)`` with no speculative config (vLLM
loads the verifier its config names and takes the draft settings from it, as ``vllm serve DIR`` does). Prints one
JSON line on stdout: {"drafts": [{"method", "heads", "model", "speculative", "spec_log", "tokens": [[ids]...],
"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos", "mean_accepted_length"} or {"method",
"heads", "error"}, ...], "plain": [[ids]...], "plain_speculative", "vllm"}. ``model`` and ``speculative`` (method,
model, num_speculative_tokens, or null) are the engine's resolved config; ``spec_log``: vLLM's log lines that name
the speculative config, written while that engine ran (which aux layers an EAGLE-3 head reads).
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


class _LogLines:
    """Stands in for sys.stderr: passes everything through and keeps the lines that mention the speculative config.

    vLLM (re)configures its "vllm" logger when an engine starts, but its StreamHandler writes to whatever
    ``sys.stderr`` is then, so the lines are read here; ``lines`` is emptied for each engine by the caller.
    """

    def __init__(self, stream):
        self._stream = stream
        self.lines: list[str] = []

    def write(self, text):
        self.lines += [line for line in text.splitlines() if "speculative config" in line]
        return self._stream.write(text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--heads", required=True, nargs="+", help="draft directories (Medusa in vLLM's layout, EAGLE)")
    parser.add_argument("--method", nargs="+", default=["medusa"],
                        choices=["medusa", "eagle", "eagle3", "speculators"],
                        help="speculative method: one for all directories, or one per directory")
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+",
                        help="draft length, one for all directories or one per directory (default: a Medusa head "
                             "count; a speculators directory's own count)")
    parser.add_argument("--prompts", required=True, help="JSON file: list of lists of token ids")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)

    prompts = json.loads(open(args.prompts).read())
    log = sys.stderr = _LogLines(sys.stderr)
    from vllm import LLM, SamplingParams, __version__
    from vllm.inputs import TokensPrompt

    methods = _per_directory(parser, "--method", args.method, len(args.heads))
    lengths = _per_directory(parser, "--num-speculative-tokens", args.num_speculative_tokens or [None],
                             len(args.heads))
    if any(k is None and method in ("eagle", "eagle3") for method, k in zip(methods, lengths)):
        parser.error("--num-speculative-tokens is required for EAGLE drafts")
    drafts = [(method, heads, k or (_medusa_heads(heads) if method == "medusa" else None))
              for method, heads, k in zip(methods, args.heads, lengths)]
    engine = dict(
        model=args.model,
        dtype=args.dtype,
        enforce_eager=True,
        # room for the prompt, the new tokens and one more draft chain: vLLM drafts only while
        # sequence length + num_speculative_tokens fits max_model_len (GPUModelRunner._input_fits_in_drafter)
        max_model_len=max(map(len, prompts)) + args.max_tokens + max(k or 0 for _, _, k in drafts) + 16,
        max_num_seqs=len(prompts),
        enable_prefix_caching=False,
        disable_log_stats=False,  # the spec-decode counters are collected only with stats on
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]

    def run(**model) -> dict:
        """Greedy tokens of an engine built with ``model`` (its model and speculative config), with its resolved
        config, its spec-decode counters where it speculates, and its log lines about the speculative config."""
        log.lines = []
        llm = LLM(**{**engine, **model})
        outputs = llm.generate(token_prompts, params, use_tqdm=False)
        config = llm.llm_engine.vllm_config
        spec = config.speculative_config
        out = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "model": config.model_config.model,
               "speculative": None if spec is None else {"method": spec.method, "model": spec.model,
                                                         "num_speculative_tokens": spec.num_speculative_tokens},
               "spec_log": log.lines}
        if spec is not None:
            out |= _spec_counters(llm.get_metrics())
        del llm, config, spec
        _release_engine()
        return out

    result = {"drafts": []}
    for method, heads, k in drafts:
        entry = {"method": method, "heads": heads}
        try:
            if method == "speculators":  # the directory alone: its config names the verifier and the draft
                entry |= run(model=heads, speculative_config=None)
            else:
                entry |= run(speculative_config={"method": method, "model": heads, "num_speculative_tokens": k})
        except Exception as err:  # reported, and the other drafts still run
            traceback.print_exc()
            entry["error"] = f"{type(err).__name__}: {err}"
        if "error" in entry:  # out of the except block, the failed engine (held by the traceback) can be freed
            _release_engine()
        result["drafts"].append(entry)
    plain = run(speculative_config=None)
    result |= {"plain": plain["tokens"], "plain_speculative": plain["speculative"], "vllm": __version__}
    print(json.dumps(result), flush=True)
    return 0


def _per_directory(parser, flag: str, values: list, count: int) -> list:
    """``values`` of ``flag`` for each of ``count`` directories: one value for all, or one each."""
    if len(values) == 1:
        return values * count
    if len(values) != count:
        parser.error(f"{len(values)} {flag} values for {count} --heads directories")
    return values


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
