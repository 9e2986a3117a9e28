"""The format registry (toolkit/formats/__init__.py): every format declares the kernels that run it (compound's
Triton kernel, vLLM's), every checkpoint layout reads back the numbers its quantization_config declares and refuses
the variants compound cannot decode, and ``auto`` picks the documented layout."""

import ast
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from toolkit.formats import (FORMATS, LAYOUTS, FormatError, awq, compressed_tensors, gguf, gptq, read_quantization_config,
                             resolve)
from toolkit.formats.scheme import TritonKernel
from toolkit.quant.configs import AWQConfig, ConfigError, GPTQConfig, RTNConfig
from toolkit.quant.primitives import quantize_rtn
from toolkit.runtime.quant_linear import QuantLinear

CONFIGS = [
    RTNConfig(bits=4, group_size=128, sym=True),
    RTNConfig(bits=4, group_size=32, sym=False),
    RTNConfig(bits=8, group_size=-1, sym=False),
    RTNConfig(bits=3, group_size=64, sym=True),
    GPTQConfig(bits=4, group_size=64),  # act-order with static groups: served as not act-ordered
    GPTQConfig(bits=4, group_size=-1, static_groups=False),  # dynamic act-order, per channel
    GPTQConfig(bits=8, group_size=128, act_order=False),
    AWQConfig(bits=4, group_size=64),
]


def test_the_registry_is_keyed_by_each_module_name():
    assert FORMATS == {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors, "gguf": gguf}
    assert all(name == module.NAME for name, module in FORMATS.items())
    assert LAYOUTS == {"gptq": gptq, "awq": awq, "compressed-tensors": compressed_tensors}  # GGUF is one file


KERNELS = Path(importlib.util.find_spec("toolkit.kernels").submodule_search_locations[0])


def _kernel_function(kernel: TritonKernel) -> ast.FunctionDef:
    """The kernel's definition, read from its source: importing it would import Triton compiled, which the
    interpreter tests must be first to import."""
    tree = ast.parse((KERNELS / f"{kernel.module}.py").read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == kernel.function)


def _scheme(module):
    return read_quantization_config(module.quantization_config(RTNConfig(bits=4, group_size=128, sym=module is gptq)))


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_declares_its_triton_and_vllm_kernel(name):
    """A checkpoint layout names a Triton kernel that exists and takes its tensors (every argument without a
    default declared, each from one of the layout's tensors); a file format names none. Each predicts vLLM's."""
    module = FORMATS[name]
    kernel = module.TRITON_KERNEL
    if module.CHECKPOINT:
        assert isinstance(kernel, TritonKernel)
        function = _kernel_function(kernel)
        positional = function.args.args
        required = {a.arg for a in positional[:len(positional) - len(function.args.defaults)]} - {"x", "group_size"}
        assert {a.arg for a in positional + function.args.kwonlyargs} >= {"x", "group_size", *kernel.arguments}
        assert required <= set(kernel.arguments)
        assert set(kernel.arguments.values()) <= set(module.SUFFIXES + module.OPTIONAL_SUFFIXES)
    else:
        assert kernel is None
    method, why = module.vllm_kernel(_scheme(module) if module.CHECKPOINT else None, {})
    assert method and why


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_triton_backend_runs_the_kernel_its_layout_names(name, monkeypatch):
    """QuantLinear's triton path calls the declared function with the declared tensors (a stand-in module takes the
    kernel's place, so no Triton runs)."""
    module = LAYOUTS[name]
    kernel = module.TRITON_KERNEL
    packed = module.pack(quantize_rtn(torch.randn(64, 128), 4, 32, sym=module is not awq))
    calls = []

    def stand_in(x, group_size, **tensors):
        calls.append((group_size, tensors))
        return x @ module.dequantize(packed, 4).t()

    monkeypatch.setitem(sys.modules, f"toolkit.kernels.{kernel.module}",
                        types.SimpleNamespace(**{kernel.function: stand_in}))
    linear = QuantLinear(module, 128, 64, 4, 32, packed, backend="triton")
    x = torch.randn(3, 128)
    assert torch.equal(linear(x), x @ module.dequantize(packed, 4).t())
    (group_size, tensors), = calls
    assert group_size == 32 and set(tensors) == set(kernel.arguments)
    assert all(tensors[argument] is linear.packed().get(suffix) for argument, suffix in kernel.arguments.items())


@pytest.mark.parametrize("name", LAYOUTS)
def test_the_serving_preview_is_the_formats_vllm_prediction(name, tmp_path, monkeypatch):
    from toolkit.validate import serving_preview

    module = LAYOUTS[name]
    monkeypatch.setattr(module, "vllm_kernel", lambda scheme, quant: (f"{name} kernel", f"{scheme.bits}-bit "
                                                                                        f"{quant['quant_method']}"))
    config = {"torch_dtype": "float16",
              "quantization_config": module.quantization_config(RTNConfig(bits=4, group_size=128, sym=module is gptq))}
    (tmp_path / "config.json").write_text(json.dumps(config))
    preview = serving_preview(tmp_path, [(256, 256)])
    assert (preview.vllm_gpu, preview.vllm_gpu_why) == (f"{name} kernel", f"4-bit {name}")


def _stores(module, config) -> bool:
    try:
        module.check_supported(config)
    except ConfigError:
        return False
    return True


STORED = [(name, config) for name, module in LAYOUTS.items() for config in CONFIGS if _stores(module, config)]


@pytest.mark.parametrize("name,config", STORED, ids=[f"{name}-{i}" for i, (name, _) in enumerate(STORED)])
def test_read_config_gives_back_the_numbers_written(name, config):
    module = LAYOUTS[name]
    quant = json.loads(json.dumps(module.quantization_config(config)))  # as config.json holds it
    scheme = read_quantization_config(quant)
    assert scheme == module.read_config(quant)
    assert scheme.format is module and scheme.bits == config.bits and scheme.group_size == config.group_size
    if module is awq:  # symmetric weights are stored as zero points of 8 (awq module docstring)
        assert (scheme.sym, scheme.zero_point, scheme.desc_act) == (False, True, False)
        assert scheme.required == awq.SUFFIXES
        return
    assert scheme.sym == config.sym and scheme.zero_point == (not config.sym)
    dynamic = config.act_order and not config.static_groups
    assert scheme.desc_act == (dynamic if module is gptq else False)  # compressed-tensors writes actorder "weight"
    zero_points = () if module is gptq or config.sym else ("weight_zero_point",)
    assert scheme.required == module.SUFFIXES + zero_points


def test_awq_reads_autoawq_spellings():
    scheme = read_quantization_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 128, "zero_point": True,
                                       "version": "GEMM"})
    assert (scheme.bits, scheme.group_size, scheme.zero_point) == (4, 128, True)


def _ct(**changes) -> dict:
    return {**compressed_tensors.quantization_config(RTNConfig(group_size=128)), **changes}


@pytest.mark.parametrize("quant,message", [
    ({"quant_method": "exl2"}, "quant_method 'exl2' is not supported; expected one of gptq, awq, compressed-tensors"),
    ({**gptq.quantization_config(RTNConfig(group_size=128)), "checkpoint_format": "gptq_v2"},
     "GPTQ checkpoint_format 'gptq_v2' is not supported; only v1 zeros (checkpoint_format 'gptq') are read"),
    ({**awq.quantization_config(RTNConfig(group_size=128)), "version": "gemv"},
     "AWQ version 'gemv' is not supported; only the GEMM layout is read"),
    (_ct(format="int-quantized"), "only single-scheme pack-quantized compressed-tensors checkpoints are read "
                                  "(format 'int-quantized', 1 config groups)"),
    (_ct(config_groups={}), "(format 'pack-quantized', 0 config groups)"),
])
def test_unsupported_variants_are_refused(quant, message):
    with pytest.raises(FormatError) as err:
        read_quantization_config(quant)
    assert message in str(err.value)


@pytest.mark.parametrize("config,expected", [
    (RTNConfig(bits=4, sym=True), "gptq"),
    (RTNConfig(bits=8, group_size=-1, sym=True), "gptq"),
    (RTNConfig(bits=4, group_size=64, sym=False), "awq"),
    (RTNConfig(bits=4, group_size=-1, sym=False), "compressed-tensors"),
    (RTNConfig(bits=8, sym=False), "compressed-tensors"),
    (RTNConfig(bits=5, sym=True), "compressed-tensors"),
])
def test_auto_chooses_the_widest_supported_layout(config, expected):
    layout, why = resolve("auto", config)
    assert layout.NAME == expected and why.startswith("auto: ")
    assert resolve(expected, config) == (layout, f"--format {expected}")


@pytest.mark.parametrize("name", ["gguf", "exl2"])
def test_resolve_refuses_what_is_no_checkpoint_layout(name):
    with pytest.raises(ConfigError, match=f"unknown format '{name}'; choose auto or one of gptq, awq, compressed-tensors"):
        resolve(name, RTNConfig())
