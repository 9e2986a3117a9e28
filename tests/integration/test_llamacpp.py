"""llama.cpp itself as the judge of compound's GGUF files of the real SmolLM2: Q4_0 (symmetric RTN W4 g32) and Q4_1
(asymmetric), written by ``compound quantize --gguf`` from compound's own codes.

- llama.cpp loads each file and its next-token log-probabilities on held-out windows match compound's dequantized
  reference (``load_quantized(backend="reference")``, float32): |Δ mean NLL| ≤ ``TOLERANCE`` and top-1 agreement
  ≥ ``MIN_AGREEMENT``. llama.cpp multiplies Q4 blocks by activations rounded to 8 bits (its Q8 dot products), so it is
  close, not bit-exact (measured on the Q4_0 file: 0.002 nats apart, 94 % top-1 agreement).
- The same file with one tensor's bytes altered (every code of blk.0.ffn_down inverted) fails that comparison:
  the negative control.
- llama.cpp's greedy tokens equal compound's greedy decode of the same chat-templated prompt until they part, and
  they may part only at a step whose top-2 logit margin in compound's reference is under ``MARGIN`` (where 8-bit
  activations may flip the choice); the reply of llama.cpp's own chat completion (rendered with the file's
  ``tokenizer.chat_template``) starts with the text of those shared tokens.

Needs the llama.cpp venv made by ``bash scripts/setup_llamacpp.sh`` (.venvs/llamacpp): llama.cpp runs there in a
subprocess (tests/integration/llamacpp_judge.py), with numpy and no torch.
"""

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from integration.side_by_side import held_out_windows, run_side_by_side

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("llamacpp")]

ROOT = Path(__file__).resolve().parents[2]
LLAMACPP_PYTHON = ROOT / ".venvs" / "llamacpp" / "bin" / "python"
JUDGE = Path(__file__).with_name("llamacpp_judge.py")
TOLERANCE = 0.05  # nats, |Δ mean NLL| between llama.cpp and compound's reference, same weights
MIN_AGREEMENT = 0.9  # top-1 agreement between the two
MARGIN = 0.5  # logits: compound's top-2 margin under which a greedy step may flip in llama.cpp
WINDOWS, SEQ_LEN = 4, 128
QUANTIZE = ["compound", "quantize", "--model", "smollm2-135m", "--method", "rtn", "--bits", "4", "--group-size", "32",
            "--gguf", "--threads", "1"]
BUILDS = {"Q4_0": [*QUANTIZE, "--sym"], "Q4_1": [*QUANTIZE, "--asym"]}
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]

if not LLAMACPP_PYTHON.exists():
    pytest.skip(f"no llama.cpp venv at {LLAMACPP_PYTHON}: run scripts/setup_llamacpp.sh", allow_module_level=True)


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, Path]:
    """{block type: (checkpoint directory, its GGUF file)}, the two quantizations run side by side."""
    root = tmp_path_factory.mktemp("gguf")
    run_side_by_side({name: [*cmd, "--output", str(root / name)] for name, cmd in BUILDS.items()})
    return {name: (root / name, root / name / f"{name}-{name}.gguf") for name in BUILDS}


@pytest.fixture(scope="module")
def windows(gguf_files, tmp_path_factory):
    return held_out_windows(gguf_files["Q4_0"][0], WINDOWS, SEQ_LEN, tmp_path_factory.mktemp("tokens"))


def judge(verb: str, gguf_file: Path, data_file: Path, *extra: str) -> dict:
    done = subprocess.run([str(LLAMACPP_PYTHON), str(JUDGE), verb, str(gguf_file), str(data_file), *extra],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout)


def reference(directory: Path):
    from toolkit.runtime.load import load_quantized

    return load_quantized(directory, torch.float32, backend="reference")


def compare(model, tokens: torch.Tensor, llamacpp: dict) -> tuple[float, float]:
    """(|Δ mean NLL|, top-1 agreement) of llama.cpp's scores against ``model``'s on ``tokens``."""
    with torch.no_grad():
        logp = model(tokens).logits.double().log_softmax(-1)[:, :-1]  # (W, T-1, V)
    ours = logp.gather(-1, tokens[:, 1:, None])[..., 0]
    theirs = torch.tensor(llamacpp["logprobs"], dtype=torch.float64)
    agreement = (logp.argmax(-1) == torch.tensor(llamacpp["top1"])).double().mean().item()
    return abs(ours.mean().item() - theirs.mean().item()), agreement


@pytest.mark.parametrize("block", list(BUILDS))
def test_llama_cpp_scores_compound_gguf_like_compound(gguf_files, windows, tmp_path, block):
    directory, gguf_file = gguf_files[block]
    tokens, tokens_file = windows
    model, _ = reference(directory)
    gap, agreement = compare(model, tokens, judge("logprobs", gguf_file, tokens_file))
    assert gap <= TOLERANCE and agreement >= MIN_AGREEMENT, (gap, agreement)

    broken = tmp_path / gguf_file.name
    shutil.copy(gguf_file, broken)
    _invert_codes(broken, "blk.0.ffn_down.weight", block)
    gap, agreement = compare(model, tokens, judge("logprobs", broken, tokens_file))
    assert gap > TOLERANCE or agreement < MIN_AGREEMENT, (gap, agreement)


def _invert_codes(path: Path, tensor: str, block: str) -> None:
    """Replace every 4-bit code q of ``tensor`` in the GGUF file at ``path`` by 15 − q, in place."""
    import gguf

    from toolkit.formats.gguf_blocks import BLOCK_BYTES

    info = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == tensor)
    size = BLOCK_BYTES[block]
    data = np.memmap(path, dtype=np.uint8, mode="r+", offset=info.data_offset, shape=(info.n_bytes // size, size))
    data[:, size - 16:] ^= 0xFF  # the 16 code bytes end each block: both nibbles inverted
    data.flush()


def test_greedy_chat_through_llama_cpp_template_equals_compound(gguf_files, tmp_path):
    from toolkit.decode import Decoder

    directory, gguf_file = gguf_files["Q4_0"]
    model, tokenizer = reference(directory)
    checked = 0
    for i, messages in enumerate(CHATS):
        prompt = torch.tensor(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=False))
        ours, margins = _greedy_with_margins(Decoder.from_model(model, len(prompt) + 16), prompt, 16)
        ends = (ours == tokenizer.eos_token_id).nonzero()
        ours = ours[: int(ends[0])] if len(ends) else ours  # llama.cpp stops at end-of-sequence, unreturned
        path = tmp_path / f"chat{i}.json"
        path.write_text(json.dumps([prompt.tolist()]))
        theirs = judge("greedy", gguf_file, path, "16")["tokens"][0]
        same = next((t for t, (a, b) in enumerate(zip(ours.tolist(), theirs)) if a != b), min(len(ours), len(theirs)))
        if same < min(len(ours), len(theirs)):  # a different choice only where compound's own top two nearly tie
            assert margins[same] < MARGIN, (same, margins[same], ours.tolist(), theirs)
        path.write_text(json.dumps(messages))
        reply = judge("chat", gguf_file, path, "16")["text"]
        expected = tokenizer.decode(ours[:same], skip_special_tokens=True)
        assert reply.strip().startswith(expected.strip()), (reply, expected)
        checked += same
    assert checked >= 4  # the comparison covered some tokens


def _greedy_with_margins(decoder, prompt: torch.Tensor, n: int) -> tuple[torch.Tensor, list[float]]:
    """n greedy tokens of ``decoder`` after ``prompt`` and the top-2 logit margin at each step."""
    logits, _ = decoder(prompt, 0)
    last, position, tokens, margins = logits[-1], len(prompt), [], []
    for _ in range(n):
        top = last.float().topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        logits, _ = decoder(top.indices[:1], position)
        last, position = logits[-1], position + 1
    return torch.tensor(tokens), margins
