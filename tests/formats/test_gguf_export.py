"""GGUF export on a tiny Llama: what transformers' own GGUF loader (gguf-py's dequantizers, its un-permutation of
q/k rows) reads back equals what compound's loader runs; the metadata llama.cpp needs; refusals before any weight is
read; the file written atomically and hashed in the checkpoint's manifest. llama.cpp itself judges SmolLM2 files in
tests/integration/test_llamacpp.py."""

import json

import gguf
import pytest
import torch

from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app
from toolkit.formats.checkpoint import verify_manifest
from toolkit.formats.scheme import FormatError
from toolkit.gguf_export import export_gguf
from toolkit.quant.configs import make_config
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize
from toolkit.runtime.load import load_quantized
from toolkit.runtime.quant_linear import QuantLinear

pytestmark = pytest.mark.usefixtures("one_thread")
CALIBRATION = CalibrationSpec(samples=4, seq_len=32)


def _checkpoint(tmp_path, source, method, sym, fmt, gguf=False, **options):
    config = make_config(method, bits=4, group_size=32, sym=sym, gguf=gguf)
    settings = QuantizeSettings(format=fmt, dtype="float32", **options)
    return quantize(str(source), config, tmp_path / "ckpt", CALIBRATION, settings, overwrite=True).output


def _gguf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.mark.parametrize("method,sym,fmt,block", [
    ("rtn", True, "gptq", "Q4_0"),
    ("gptq", True, "gptq", "Q4_0"),
    ("awq", True, "compressed-tensors", "Q4_0"),
    ("awq+gptq", True, "gptq", "Q4_0"),
    ("awq", False, "awq", "Q4_1"),
    ("gptq", False, "compressed-tensors", "Q4_1"),
])
def test_transformers_reads_back_the_weights_compound_runs(tmp_path, tiny_llama_dir, method, sym, fmt, block):
    """Every method's codes under --gguf: what the GGUF file holds is what compound's loader runs from the
    safetensors checkpoint (Q4_0 bit for bit, negative scales included), chosen on fp16 scales."""
    out = _checkpoint(tmp_path, tiny_llama_dir, method, sym, fmt, gguf=True)
    path = out / f"ckpt-{block}.gguf"
    manifest = json.loads((out / "compound.json").read_text())
    assert not verify_manifest(out) and path.name in manifest["files"] and manifest["quantization"]["gguf"]

    ours, _ = load_quantized(out, backend="reference")
    theirs = _gguf_model(path)
    reader = gguf.GGUFReader(str(path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    signs = set()
    for name, module in ours.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        W = module.dequantized_weight()
        got = theirs.get_submodule(name).weight.detach()
        if block == "Q4_0":  # (q − 8)·d in float32 either way: bit for bit
            assert torch.equal(got, W), name
        else:  # Q4_1 stores the minimum −scale·zero in fp16: half an fp16 ulp of it at most
            assert (got - W).abs().max() <= 2.0**-11 * W.abs().max() * 8, name
        blocks = got.reshape(got.shape[0], -1, 32)
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True)).squeeze(-1)  # (N, G)
        signs |= {int(s) for s in extreme.sign().unique()}
    if block == "Q4_0":  # llama.cpp's rule: the extreme is −8 steps, so a positive extreme has a negative scale
        scales = [torch.tensor(t.data).view(torch.uint8) for t in reader.tensors if t.tensor_type.name == "Q4_0"]
        d = torch.cat([s.reshape(-1, 18)[:, :2].contiguous().view(torch.float16).flatten() for s in scales])
        assert bool((d < 0).any()) and bool((d > 0).any()) and signs >= {-1, 1}
        # torch's int4 op runs the same negative scales (cpu-int4 backend, float32 compute) as the reference
        fast, _ = load_quantized(out, backend="cpu-int4")
        x = torch.randn(3, ours.config.hidden_size)
        for name, module in ours.named_modules():
            if isinstance(module, QuantLinear) and module.in_features == x.shape[1]:
                want, got = module(x), fast.get_submodule(name)(x).float()
                assert fast.get_submodule(name).path(x) == "cpu-int4", name
                assert (got - want).norm() <= 0.01 * want.norm(), name  # bf16 activations: about 2⁻⁹ relative
    assert {types[f"blk.0.{n}.weight"] for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                                  "ffn_down")} == {block}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    embed = ours.get_input_embeddings().weight
    step = embed.abs().amax() / 127  # Q8_0: round to nearest, half a step at most
    assert (theirs.get_input_embeddings().weight - embed).abs().max() <= step / 2 + 1e-6
    for norm in ("model.norm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(theirs.state_dict()[norm], ours.state_dict()[norm].float())


def test_metadata_carries_what_llama_cpp_reads(tmp_path, tiny_llama_dir, smol_tokenizer):
    out = _checkpoint(tmp_path, tiny_llama_dir, "rtn", True, "gptq", gguf=True)
    fields = gguf.GGUFReader(str(out / "ckpt-Q4_0.gguf")).fields
    value = {name: field.contents() for name, field in fields.items() if name != "tokenizer.ggml.merges"}
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    assert value["general.architecture"] == "llama" and value["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_0
    assert value["llama.block_count"] == config["num_hidden_layers"]
    assert value["llama.attention.head_count_kv"] == config["num_key_value_heads"]
    assert value["llama.rope.dimension_count"] == config["head_dim"]
    assert value["tokenizer.ggml.model"] == "gpt2" and len(value["tokenizer.ggml.tokens"]) == len(smol_tokenizer)
    assert value["tokenizer.ggml.tokens"][42] == smol_tokenizer.convert_ids_to_tokens(42)
    assert value["tokenizer.ggml.eos_token_id"] == smol_tokenizer.eos_token_id
    assert value["tokenizer.chat_template"] == smol_tokenizer.chat_template
    assert len(fields["tokenizer.ggml.merges"].data) > 1000


def test_push_publishes_the_gguf_beside_the_checkpoint_and_the_card_says_so(tmp_path, tiny_llama_dir):
    import yaml

    from toolkit.hub import artifact_files
    from toolkit.model_card import model_card

    out = _checkpoint(tmp_path, tiny_llama_dir, "rtn", True, "gptq", gguf=True)
    assert "ckpt-Q4_0.gguf" in artifact_files(out)  # what push uploads
    card = model_card(out, repo_id="someone/tiny-w4")
    assert "gguf" in yaml.safe_load(card.split("---")[1])["tags"]
    assert "| GGUF for llama.cpp | `ckpt-Q4_0.gguf`" in card and "llama-server -hf someone/tiny-w4:Q4_0" in card


def test_float_export_is_exact_in_f32(tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    path = export_gguf(str(tiny_llama_dir), tmp_path / "tiny-F32.gguf", outtype="F32")
    ours = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    theirs = _gguf_model(path).state_dict()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(theirs[name], tensor), name


def test_what_gguf_cannot_hold_is_refused_before_any_weight_is_read(tmp_path, tiny_llama_dir):
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama_dir), "--method", "rtn", "--group-size",
                                      "64", "--gguf", "-o", str(tmp_path / "g64")])
    refused(result, "group_size 64 cannot be written exactly", "--group-size 32")
    assert not (tmp_path / "g64").exists()
    result = CliRunner().invoke(app, ["quantize", "--model", str(tiny_llama_dir), "--method", "rtn", "--gguf",
                                      "--format", "compressed-tensors", "--dtype", "bfloat16", "-o",
                                      str(tmp_path / "bf16")])
    refused(result, "compressed-tensors stores scales in --dtype bfloat16", "--dtype float16")
    assert not (tmp_path / "bf16").exists()
    out = _checkpoint(tmp_path, tiny_llama_dir, "rtn", True, "gptq")
    with pytest.raises(FormatError, match="name it \\*.gguf"):
        export_gguf(out, tmp_path / "x.bin")
    with pytest.raises(FileExistsError):
        export_gguf(out, out / "config.json")


def test_a_family_gguf_does_not_write_is_refused_naming_the_one_it_does(tmp_path, family_dir):
    with pytest.raises(FormatError, match="llama.cpp has an architecture for: .*'qwen2' is not supported for gguf; "
                                          "supported: gemma3_text, llama"):
        export_gguf(str(family_dir("qwen2")), tmp_path / "q.gguf")


def test_a_failed_write_leaves_neither_file_nor_leftover(tmp_path, tiny_llama_dir, monkeypatch):
    from toolkit.formats.checkpoint import OutputError

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", full_disk)
    with pytest.raises(OutputError, match="No space left on device"):
        export_gguf(str(tiny_llama_dir), tmp_path / "tiny.gguf")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def family_dir(tmp_path):
    from conftest import byte_tokenizer, tiny_model

    def directory(model_type):
        path = tmp_path / model_type
        tiny_model(model_type, vocab=256).save_pretrained(path)
        byte_tokenizer().save_pretrained(path)
        return path

    return directory


def test_kv_cache_scales_stay_in_the_checkpoint_only(tmp_path, tiny_llama_dir):
    out = _checkpoint(tmp_path, tiny_llama_dir, "rtn", True, "gptq", gguf=True, kv_cache="int8")
    names = {t.name for t in gguf.GGUFReader(str(out / "ckpt-Q4_0.gguf")).tensors}
    assert "blk.0.attn_q.weight" in names and not any("scale" in name for name in names)
