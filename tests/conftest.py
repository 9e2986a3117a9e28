"""Shared fixtures. The Hub is never reachable from tests: its endpoint points at a closed local port and the
clients run offline, set before anything imports huggingface_hub, transformers or datasets. Under pytest-xdist
(the README's ``-n 2``) each worker, and every process it starts, computes on one thread: two workers with torch's
default of one thread per core would oversubscribe the cores, and OpenMP then stalls for milliseconds per op."""

import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

# `python -m pytest` puts the working directory first on sys.path; from the repository root, the source folder
# `kernels/` (installed as `toolkit.kernels`) would then shadow the PyPI package `kernels` that transformers imports
# when it is installed (a dependency of transformers 5.25). Moved to the end, the root still provides this
# checkout's `toolkit` (site-packages holds none; an editable install's finder comes after the path) but no longer
# hides an installed `kernels`.
REPO = Path(__file__).resolve().parent.parent
sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO] + [str(REPO)]
os.environ["PYTHONSAFEPATH"] = "1"  # the same for every `python -c` / `-m` the tests start

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported; inherited by the CLI and vLLM subprocesses
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from toolkit.models import embedded_gguf  # noqa: E402

SMOL_VOCAB = 49152
# pytest-timeout for a test marked slow that sets none of its own: the slowest took 16 minutes (the demo recipe, an
# AVX2-only CPU, README "Tests"), and a session fixture shared by several (11 minutes) counts in the first.
SLOW_TIMEOUT_S = 3600


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's hook reads the xdist_group marks (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """Give each slow test without a timeout of its own ``SLOW_TIMEOUT_S`` instead of pyproject's default, and each
    slow test in no xdist group its module's group: a module's tests share its module-scoped fixtures (a real model
    quantized, heads fitted, a vLLM run: minutes), which xdist would otherwise build again on each worker that gets
    one of them. Groups that span modules (such as ``smollm2_checkpoints``) are marked where they are used."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        if item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
# real-model checkpoints, and vLLM's runs of the draft heads, that several integration modules share
pytest_plugins = ["integration.smollm2_checkpoints", "integration.gemma3_checkpoints", "integration.spec_runs"]


@contextmanager
def torch_threads(count: int):
    """Torch on ``count`` threads inside the block (a session fixture's: ``one_thread`` is module-scoped)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module of tiny-tensor tests: with 2 busy cores, tiny matmuls spend their time in
    OpenMP barriers (100x slower)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def smol_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer (with its chat template), read from the embedded GGUF; ~5 s, once."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf("smollm2-135m")
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


@pytest.fixture(scope="session")
def gemma_tokenizer():
    """Gemma-3 270M's tokenizer (a base model's: no chat template, BOS first), read from the embedded GGUF (assembled
    from its chunk packages on first use); ~10 s, once."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf("gemma3-270m")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert tokenizer.chat_template is None
    return tokenizer


# What each family's tiny config sets beyond the common shapes, so that what sets it apart from Llama is exercised:
# windows shorter than the test sequences, Gemma 2's score scale and caps at the size of a random model's scores and
# logits, Gemma 3's two layer types with RoPE schemes of their own.
FAMILY_EXTRAS = {
    "mistral": dict(sliding_window=6),
    "phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    "gemma2": dict(sliding_window=6, query_pre_attn_scalar=32, attn_logit_softcapping=0.05,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(sliding_window=6, query_pre_attn_scalar=32,
                        layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}}),
    # Mixture-of-Experts: 4 experts, top 2 (one dense layer in Qwen's, as mlp_only_layers allows)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                      shared_expert_intermediate_size=128, mlp_only_layers=[1]),
}

# A tiny Gemma 3 as llama.cpp's gemma3 computes it (what the architecture fixes: a full layer every sixth, scores scaled
# by head_dim^-0.5), with the window, the global RoPE's linear scaling and the final logit cap it reads from keys.
GEMMA3_GGUF = dict(layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"], query_pre_attn_scalar=16,
                   final_logit_softcapping=5.0)


def tiny_config(model_type: str, hidden: int = 64, layers: int = 2, vocab: int = SMOL_VOCAB, **overrides):
    """A small random-init config of a supported family (shapes chosen so group sizes 32/64 divide every width), built
    from its transformers config class with ``FAMILY_EXTRAS`` (sized for hidden 64) and ``overrides``."""
    from transformers import AutoConfig

    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=hidden // 4, vocab_size=vocab, max_position_embeddings=256)
    return AutoConfig.for_model(model_type, **{**common, **FAMILY_EXTRAS.get(model_type, {}), **overrides})


def tiny_model(model_type: str = "llama", **kwargs):
    """A seeded random-init causal LM of ``model_type`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type, **kwargs)).eval()


BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def int4_linears(model):
    """Replace every linear of ``model``'s decoder layers by the runtime's int4 QuantLinear (GPTQ layout, W4 g32,
    the CPU int4 kernel), whose rows are computed alone: the model speculative decoding is lossless on, bit for bit."""
    from torch import nn

    from toolkit.formats import gptq
    from toolkit.quant.primitives import quantize_rtn
    from toolkit.runtime.quant_linear import QuantLinear

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    packed = gptq.pack(quantize_rtn(child.weight.detach(), 4, 32, True))
                    setattr(parent, name, QuantLinear(gptq, child.in_features, child.out_features, 4, 32, packed,
                                                      child.bias, backend="cpu-int4"))
    return model


def perturb_biases_and_norms(model):
    """Give a random tiny model nonzero biases (N(0, 0.2)) and norm weights away from their init (+ N(0, 0.2)), so
    that a forward that drops a bias or a norm weight shows in its logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def byte_tokenizer():
    """A byte-level tokenizer of exactly 256 ids (one per byte, no merges, no special tokens) with a plain chat
    template, built in memory: calibration data for models of ``vocab=256``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE({char: i for i, char in enumerate(sorted(alphabet))}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=BYTE_CHAT_TEMPLATE)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer):
    """A tiny Llama saved as a Hugging Face directory with the SmolLM2 tokenizer (so chat templates render)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


SPEC_PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain what a hash table is.",
                "Give three tips for learning to cook."]


@pytest.fixture(scope="session")
def spec_target(tmp_path_factory):
    """(the float SmolLM2 model, its Hugging Face directory for vLLM, the SHA-256 of its weights, the chat-templated
    token ids of ``SPEC_PROMPTS``); once per session (its users do not change the model)."""
    from toolkit.formats.checkpoint import sha256_file, write_checkpoint
    from toolkit.models import load_model, load_tokenizer

    model, tokenizer = load_model("smollm2-135m"), load_tokenizer("smollm2-135m")
    directory = write_checkpoint(tmp_path_factory.mktemp("vllm-spec") / "target", model, tokenizer, {}, None,
                                 {"model": "smollm2-135m"}, torch.float32)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for text in SPEC_PROMPTS]
    return model, directory, sha256_file(directory / "model.safetensors"), prompts


# What vLLM's CPU build raises where it was compiled without its W4A16 GEMM (CPUs without AVX-512: seen on one of
# this project's machines, while another ran every format); the engine cannot judge W4 checkpoints there.
VLLM_NO_W4_KERNEL = "object has no attribute 'cpu_gemm_wna16'"


def skip_where_vllm_has_no_w4_kernel(stderr: str) -> None:
    """Skip the calling test, quoting vLLM's own line, when vLLM refused because this CPU has no W4A16 kernel."""
    line = next((line for line in stderr.splitlines() if VLLM_NO_W4_KERNEL in line), None)
    if line is not None:
        pytest.skip(f"vLLM CPU cannot run W4 on this CPU: {line.strip()}")


def refused(result, *needles: str, usage: bool = False) -> str:
    """Assert a clean refusal of a CLI run and return its message unwrapped: exit 2, no traceback, compound's one
    ``error:`` line (``usage``: typer's usage error, drawn in a box, instead), and every needle in the message.
    Rich wraps long lines (mid-word, inside paths too), so needles are compared with all whitespace removed."""
    text = " ".join(re.sub("[│╭╮╰╯─]", " ", result.output).split())
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output, result.output
    if not usage:
        assert text.count("error:") == 1, result.output
    squeezed = "".join(text.split())
    for needle in needles:
        assert "".join(needle.split()) in squeezed, (needle, result.output)
    return text


@pytest.fixture
def runs(tmp_path, request):
    """An empty directory to hold a CLI case's output (a refused case must leave it as empty as it found it); in a
    module that sets ``RUNS_END_EMPTY = True`` it is checked to be empty again when the case ends."""
    path = tmp_path / "runs"
    path.mkdir()
    yield path
    if getattr(request.module, "RUNS_END_EMPTY", False):
        assert list(path.iterdir()) == []


def cli(*args, **env):
    """The ``compound`` command run in this process (typer's runner), every argument as text; ``env`` is added to
    the environment."""
    from typer.testing import CliRunner

    from toolkit.cli import app

    return CliRunner().invoke(app, [str(a) for a in args], env=env or None)


# The cheap settings of tests/test_train_heads.py, as train-heads flags; a flag given again after them wins.
CHEAP_HEADS = ["--num-heads", "2", "--samples", "4", "--max-len", "96", "--distill-tokens", "6", "--target-dtype",
               "float32", "--steps", "2", "--batch-size", "2", "--micro-batch-size", "1", "--eval-every", "2",
               "--save-every", "2", "--eval-prompts", "1", "--eval-tokens", "4"]


def run_train_heads(model, output, *args):
    """``compound train-heads`` of ``model`` into ``output`` with ``CHEAP_HEADS`` and then ``args``."""
    return cli("train-heads", "--model", model, "-o", output, *CHEAP_HEADS, *args)


def text_of(result) -> str:
    """A CLI run's output with its wrapping undone."""
    return " ".join(result.output.split())
