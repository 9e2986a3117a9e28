"""``validate`` on tiny checkpoints: a good one passes with every runtime path agreeing, a changed byte is named,
and the serving preview follows docs/formats.md §6."""

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

from conftest import refused
from toolkit.cli import app
from toolkit.formats.checkpoint import MANIFEST, sha256_file
from toolkit.quant.configs import RTNConfig
from toolkit.quantize import quantize
from toolkit.validate import ChecksumError, serving_preview, validate

runner = CliRunner()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_llama_dir):
    return quantize(str(tiny_llama_dir), RTNConfig(group_size=32, sym=True), tmp_path_factory.mktemp("validate") / "q").output


def test_good_checkpoint_passes_with_every_path_agreeing(checkpoint):
    report = validate(checkpoint, windows=2, seq_len=64, triton_layers=2)
    assert report.ok, report.to_dict()
    assert report.manifest_files >= 5 and report.tokens == 128
    paths = {p.path: p for p in report.paths}
    assert set(paths) == {"cpu-int4", "triton", "decode loop"}
    assert paths["decode loop"].ok and paths["decode loop"].top1_agreement == 1.0  # identical greedy tokens
    assert paths["cpu-int4"].positions == 128 and paths["cpu-int4"].relative_diff < 0.02
    assert paths["triton"].layers == "all" and paths["triton"].relative_diff < 1e-5
    assert paths["triton"].top1_agreement == 1.0
    assert report.serving.vllm_gpu.startswith("gptq_marlin")
    assert report.serving.vllm_command == f"vllm serve {checkpoint} --dtype float16"


def test_cli_prints_the_tables_and_writes_json(checkpoint, tmp_path):
    out = tmp_path / "report.json"
    result = runner.invoke(app, ["validate", "--model", str(checkpoint), "--json", str(out)])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for expected in ("SHA-256 intact", "cpu-int4", "triton", "CPUWNA16LinearKernel", "python -m sglang.launch_server"):
        assert expected in text
    report = json.loads(out.read_text())
    assert report["ok"] and report["serving"]["quant_method"] == "gptq"


def test_flipped_byte_fails_naming_the_file(checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor data: the file still parses
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="model.safetensors changed"):
        validate(broken)
    result = runner.invoke(app, ["validate", "--model", str(broken)])
    assert result.exit_code == 2
    assert "model.safetensors" in result.output and "SHA-256" in " ".join(result.output.split())


def test_paths_a_checkpoint_cannot_take_are_skipped_and_long_windows_refused(tmp_path, tiny_llama_dir, checkpoint):
    w8 = quantize(str(tiny_llama_dir), RTNConfig(bits=8, group_size=32), tmp_path / "w8").output
    report = validate(w8, windows=1, seq_len=32)
    kernels = [p for p in report.paths if p.path != "decode loop"]
    assert report.ok and all(p.note.startswith("skipped") and p.max_logit_diff is None for p in kernels)
    assert report.serving.vllm_cpu == "none"  # vLLM's CPU kernel is 4-bit only
    with pytest.raises(ValueError, match="pass --seq-len 256 or less"):
        validate(checkpoint, seq_len=512)


def _preview(tmp_path, quantization_config, shapes=((576, 1536), (1536, 576)), dtype="float16"):
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": dtype, "quantization_config": quantization_config}))
    return serving_preview(tmp_path, list(shapes))


def test_serving_preview_follows_the_vllm_rules(tmp_path):
    awq = _preview(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"})
    assert awq.vllm_gpu.startswith("awq_marlin") and awq.vllm_cpu == "CPUWNA16LinearKernel"
    no_zero = _preview(tmp_path, {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False})
    assert no_zero.vllm_gpu == "awq → AWQ GEMM" and "zero_point false" in no_zero.vllm_gpu_why
    gptq_g32 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    preview = _preview(tmp_path, gptq_g32)
    assert preview.vllm_gpu.startswith("gptq_marlin → Marlin") and "Machete needs" in preview.vllm_gpu
    bf16 = _preview(tmp_path, gptq_g32 | {"group_size": 128}, dtype="bfloat16")
    assert "Machete on Hopper" in bf16.vllm_gpu and bf16.vllm_command.endswith("--dtype bfloat16")
    no_sym = _preview(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False})
    assert no_sym.vllm_gpu == "refused" and "['sym'] missing" in no_sym.vllm_gpu_why  # vLLM 0.32 requires the key
    assert no_sym.vllm_cpu == "none"
    w8 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"group_0": {"weights": {"num_bits": 8, "symmetric": True, "group_size": None}}}}
    preview = _preview(tmp_path, w8, dtype="float32")
    assert preview.vllm_gpu.startswith("compressed-tensors WNA16 → Marlin")
    assert preview.vllm_cpu == "none" and "8-bit" in preview.vllm_cpu_why
    assert preview.vllm_command.endswith("--dtype float16")  # fp32 checkpoints are served in half precision
    narrow = _preview(tmp_path, gptq_g32, shapes=[(576, 200)])
    assert narrow.vllm_cpu == "none" and "576→200" in narrow.vllm_cpu_why
    odd = _preview(tmp_path, gptq_g32 | {"group_size": 64}, shapes=[(96, 64)])
    assert odd.problems and "96-wide input" in odd.problems[0]


TINY = ["--group-size", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_validate_says_non_finite_for_a_nan_scale(tmp_path, tiny_llama_dir):
    from safetensors.torch import load_file, save_file

    out = tmp_path / "q"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", *TINY, "-o", out).exit_code == 0
    weights = out / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_proj.scales"][0, 0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    manifest = json.loads((out / MANIFEST).read_text())  # re-hashed: the bytes are as written, the values are not
    manifest["files"]["model.safetensors"] = sha256_file(weights)
    (out / MANIFEST).write_text(json.dumps(manifest))
    result = run("validate", "--model", out)
    refused(result, "non-finite", "model.layers.0.self_attn.q_proj.scales")


def test_validate_marks_a_path_with_non_finite_logits():
    from toolkit.validate import CPU_INT4_TOLERANCE, _compare

    reference = torch.randn(1, 4, 8)
    got = reference.clone()
    got[0, 1, 2] = float("nan")
    result = _compare("cpu-int4", got, reference, "all", CPU_INT4_TOLERANCE)
    assert not result.ok and "non-finite" in result.note
