"""Every family end to end on a tiny random model: quantize with each method into each format, then compound's loader
and decode loop against transformers over the weights an independent reader dequantizes from the same files.

Readers: compressed-tensors checkpoints through transformers' own integration (``CompressedTensorsConfig(
dequantize=True)``); AWQ ones through compressed-tensors' AutoAWQ converter and its decompressor; GPTQ ones through
``gptq_weight`` below, written from the GPTQ v1 layout (transformers' GPTQ integration needs optimum and GPTQModel,
which live in the venv of ``scripts/setup_gptqmodel.sh``; ``tests/integration/test_peer_loaders.py`` judges real
checkpoints with them). Each run checks the names written (every linear of a decoder layer, fused ones as they are:
what vLLM's loaders read), compound's logits against transformers' on the dequantized weights, and greedy tokens
of compound's loop against ``transformers.generate``.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import byte_tokenizer, perturb_biases_and_norms, tiny_config
from toolkit.architectures import FAMILIES, supporting
from toolkit.decode import Decoder, generate
from toolkit.experts import hub_name, unfuse_experts
from toolkit.models import layer_linears
from toolkit.quant.configs import make_config
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize
from toolkit.runtime.load import load_quantized

pytestmark = [pytest.mark.usefixtures("one_thread"),
              # transformers notes that the checkpoint's own quantization_config is kept beside dequantize=True
              pytest.mark.filterwarnings("ignore:You passed `quantization_config`:UserWarning")]

VOCAB = 256
# Four runs per family: every method and every format once each (the GPTQ layout stores symmetric grids only).
RUNS = [("rtn", "compressed-tensors", {}), ("gptq", "gptq", {"sym": True}), ("awq", "awq", {}),
        ("awq+gptq", "compressed-tensors", {})]
CALIBRATION = CalibrationSpec(samples=4, seq_len=32)
NEW_TOKENS = 12


def spread(model, logit_scale=40.0):
    """Make a random tiny model exercise everything: nonzero biases and norm weights, logits of order 1 to 10 (the
    final norm scaled, since the LM head may be the embedding: a scaled embedding would drown the layers' outputs)."""
    offset = FAMILIES[model.config.model_type].norm_offset
    perturb_biases_and_norms(model)
    with torch.no_grad():
        final = model.model.norm.weight
        final.copy_((offset + final) * logit_scale - offset)
    return model


def float_model(model_type):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return spread(AutoModelForCausalLM.from_config(tiny_config(model_type, vocab=VOCAB)).eval())


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """model_type → a Hugging Face directory of its spread tiny model with the byte tokenizer, made when first asked."""
    made = {}

    def directory(model_type):
        if model_type not in made:
            made[model_type] = tmp_path_factory.mktemp(model_type)
            float_model(model_type).save_pretrained(made[model_type])
            byte_tokenizer().save_pretrained(made[model_type])
        return made[model_type]

    return directory


def greedy_pair(compound_model, reference, prompt):
    """(compound's greedy tokens over ``compound_model``, transformers' generate over ``reference``), prompt included."""
    ours, _ = generate(Decoder.from_model(compound_model, max_len=len(prompt) + NEW_TOKENS), prompt, NEW_TOKENS)
    reference.generation_config.eos_token_id = None  # a random model's eos is a token like any other
    with torch.no_grad():
        theirs = reference.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0]
    return ours, theirs


def prompt_ids(seed=1):
    return torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", supporting("decode"))
def test_float_greedy_equals_transformers_generate(model_type):
    model = float_model(model_type)
    for seed in (1, 2):
        ours, theirs = greedy_pair(model, model, prompt_ids(seed))
        assert torch.equal(ours, theirs), seed


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C], 32/bits codes per word along R, lowest bits first → codes [R · 32/bits, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # (R, 32/bits, C)
    return codes.reshape(-1, packed.shape[1])


def gptq_weight(tensors: dict, bits: int) -> torch.Tensor:
    """W [out, in] of one linear in the GPTQ v1 layout: qweight [in·bits/32, out], qzeros [G, out·bits/32] holding
    zero − 1, scales [G, out], g_idx [in] (the group of each input column); W = scale · (q − zero)."""
    q = _unpack(tensors["qweight"], bits)  # (in, out)
    zero = _unpack(tensors["qzeros"].T.contiguous(), bits).T + 1  # (G, out)
    g = tensors["g_idx"].long()
    return (tensors["scales"].float()[g] * (q - zero[g]).float()).T


def awq_weights(tensors: dict, quantization_config: dict) -> dict:
    """{module: W} through compressed-tensors' AutoAWQ converter and its pack-quantized decompressor."""
    from compressed_tensors.entrypoints.convert.converters import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(quantization_config)
    scheme = next(iter(converter.update_config(None).config_groups.values()))
    return decompressed(converter.process(dict(tensors)), scheme)


def compressed_tensors_weights(tensors: dict, quantization_config: dict) -> dict:
    """{module: W} of a compressed-tensors checkpoint through compressed-tensors' own decompressor."""
    from compressed_tensors.quantization import QuantizationScheme

    (group,) = quantization_config["config_groups"].values()
    scheme = QuantizationScheme(**group)
    scheme.format = scheme.format or quantization_config["format"]
    return decompressed(tensors, scheme)


def decompressed(tensors: dict, scheme) -> dict:
    """{module: W} of every ``weight_packed`` module, by compressed-tensors' decompressor for ``scheme``."""
    from compressed_tensors.compressors import BaseCompressor

    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    weights = {}
    for key in [k for k in tensors if k.endswith(".weight_packed")]:
        module = key.removesuffix(".weight_packed")
        own = {k.removeprefix(module + "."): v for k, v in tensors.items() if k.startswith(module + ".weight_")}
        own["weight_scale"] = own["weight_scale"].float()  # (q − zero) · scale in fp32, as compound's reference
        weights[module] = compressor.decompress(own, scheme)["weight"]
    return weights


def dense_reference(directory, fmt):
    """transformers' model of ``directory`` with the weights an independent reader dequantizes from its files.

    compressed-tensors: transformers' own integration for dense families. For Mixture-of-Experts ones compressed-
    tensors' decompressor per expert instead: transformers 5.24's MoE path (``CompressedTensorsDequantize`` on merged
    experts) drops the zero points, and refuses asymmetric checkpoints ("Asymmetric quant requires zero-point
    values")."""
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    config = AutoConfig.from_pretrained(directory)
    if fmt == "compressed-tensors" and FAMILIES[config.model_type].experts is None:
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                    quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    quant = config.quantization_config
    del config.quantization_config
    tensors = load_file(directory / "model.safetensors")
    marker = ".weight_packed" if fmt == "compressed-tensors" else ".qweight"
    modules = [k.removesuffix(marker) for k in tensors if k.endswith(marker)]
    if fmt == "awq":
        weights = awq_weights(tensors, quant)
    elif fmt == "compressed-tensors":
        weights = compressed_tensors_weights(tensors, quant)
    else:
        weights = {m: gptq_weight({k.removeprefix(m + "."): v for k, v in tensors.items() if k.startswith(m + ".")},
                                  quant["bits"]) for m in modules}
    suffixes = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_zero_point",
                "weight_shape")
    state = {k: v.float() for k, v in tensors.items() if k.rpartition(".")[2] not in suffixes}
    state.update({f"{m}.weight": weights[m].contiguous() for m in modules})
    # a float checkpoint of the dequantized weights, read by transformers (which fuses per-expert tensors itself)
    dense = directory.parent / f"{directory.name}-dense"
    config.save_pretrained(dense)
    save_file(state, dense / "model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    return model


@pytest.mark.parametrize("method,fmt,options", RUNS, ids=[f"{m}-{f}" for m, f, _ in RUNS])
@pytest.mark.parametrize("model_type", supporting())
def test_quantize_load_decode(tmp_path, family_dirs, model_type, method, fmt, options):
    source = family_dirs(model_type)
    config = make_config(method, bits=4, group_size=32, **options)
    out = quantize(str(source), config, tmp_path / "q", CALIBRATION, QuantizeSettings(format=fmt, dtype="float32"),
                   overwrite=True).output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == fmt

    reference = dense_reference(out, fmt)
    # the names on disk: every linear of every decoder layer, fused ones kept fused (vLLM's Phi-3 loader reads
    # qkv_proj and gate_up_proj as they are), each expert's projections under the Hub's per-expert names (what
    # vLLM's and transformers' loaders read), and nothing else quantized (routers stay float)
    marker = "weight_packed" if fmt == "compressed-tensors" else "qweight"
    on_disk = {k.removesuffix("." + marker) for k in load_file(out / "model.safetensors") if k.endswith(marker)}
    layout = FAMILIES[model_type].experts
    routers = layout.routers if layout else ()
    expected = {hub_name(layout, f"model.layers.{i}.{name}")
                for i, layer in enumerate(unfuse_experts(float_model(model_type)).model.layers)
                for name in layer_linears(layer) if name not in routers}
    assert on_disk == expected

    compound, _ = load_quantized(out, backend="reference")
    ids = prompt_ids(2).repeat(2, 2)  # (2, 16): longer than the tiny windows
    with torch.no_grad():
        ours, theirs = compound(ids).logits, reference(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    float_logits = float_model(model_type)(ids).logits.detach()
    assert (theirs - float_logits).abs().max() > 1e-3 * float_logits.abs().max()  # the weights were quantized

    ours, theirs = greedy_pair(compound, reference, prompt_ids())
    assert torch.equal(ours, theirs)
