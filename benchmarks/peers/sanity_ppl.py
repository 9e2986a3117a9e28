"""Quick sanity perplexity of one or more HF model dirs on a token tensor (NOT the benchmark's
evaluator; only to see that a dequantized copy is sane: close to the float model, not garbage).

    python benchmarks/peers/sanity_ppl.py --tokens benchmarks/.cache/heldout_8x512.pt DIR [DIR ...]
"""

from __future__ import annotations

import argparse

from _common import perplexity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("dirs", nargs="+")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    toks = torch.load(args.tokens, weights_only=True).long()
    for d in args.dirs:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        print(f"ppl={perplexity(model, toks):.4f}  {d}", flush=True)


if __name__ == "__main__":
    main()
