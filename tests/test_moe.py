"""Mixture-of-Experts (``toolkit.experts``): the per-expert view of transformers' fused experts, calibration on routed
or on every token, each expert's rows weighed by their routing weight, the round-to-nearest policy for experts routed
too few tokens, routers kept in float and named in every format's list of unquantized modules, Mixtral's Hub block
name, streaming a MoE model layer by layer, and compressed-tensors' own decompressor reproducing every expert's
weights bit for bit.

Every family runs through every method and format in ``tests/test_family_matrix.py``; these are the MoE specifics."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import byte_tokenizer, tiny_model
from toolkit.experts import ExpertLinears, every_token, moe_layout, unfuse_experts, weighing_rows
from toolkit.formats.checkpoint import read_tensors
from toolkit.quant.configs import make_config
from toolkit.quant.primitives import quantize_rtn
from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize

pytestmark = pytest.mark.usefixtures("one_thread")

CALIBRATION = CalibrationSpec(samples=4, seq_len=32)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    """model_type → a saved tiny MoE model (Hub per-expert names) with the byte tokenizer, made when first asked."""
    made = {}

    def directory(model_type):
        if model_type not in made:
            made[model_type] = tmp_path_factory.mktemp(model_type)
            tiny_model(model_type, vocab=256).save_pretrained(made[model_type])
            byte_tokenizer().save_pretrained(made[model_type])
        return made[model_type]

    return directory


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_unfused_experts_are_views_computing_the_same_function(model_type):
    fused = tiny_model(model_type, vocab=256)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = fused(ids).logits
    storage = {p.untyped_storage().data_ptr() for n, p in fused.named_parameters() if "experts" in n}
    model = unfuse_experts(fused)
    blocks = [m for m in model.modules() if isinstance(m, ExpertLinears)]
    assert len(blocks) == sum(hasattr(layer.mlp, "experts") for layer in model.model.layers) > 0
    # no copy: every expert linear is a view of the fused parameters
    assert {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if "experts" in n} == storage
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_every_token_feeds_every_expert_all_tokens_and_keeps_the_routing():
    model = unfuse_experts(tiny_model("mixtral", vocab=256))
    block = model.model.layers[0].mlp
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(1))
    rows = {}
    hooks = [expert.w1.register_forward_pre_hook(lambda m, a, e=e: rows.__setitem__(e, a[0].shape[0]))
             for e, expert in enumerate(block.experts)]
    with torch.no_grad():
        routed = block(x)
        routed_rows = dict(rows)
        rows.clear()
        with every_token(block):
            everyone = block(x)
    for h in hooks:
        h.remove()
    assert sum(routed_rows.values()) == 10 * 2  # top-2 of 4: each token reaches two experts
    assert rows == {e: 10 for e in range(4)}
    torch.testing.assert_close(everyone, routed, rtol=0, atol=1e-6)
    assert not block.experts.every_token  # restored


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])  # renormalised top-k, and plain top-k softmax
@pytest.mark.parametrize("everyone", [False, True])
def test_weighing_rows_gives_each_expert_row_the_weight_its_output_gets(model_type, everyone):
    model = unfuse_experts(tiny_model(model_type, vocab=256))
    layer = model.model.layers[0]
    block = layer.mlp
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(2))
    seen = {}
    hooks = [expert.get_submodule(expert.names[2]).register_forward_pre_hook(
        lambda m, a, e=e, expert=expert: seen.__setitem__(e, (a[0].shape[0], expert.row_weights)))
        for e, expert in enumerate(block.experts)]
    with torch.no_grad():
        logits, scores, index = block.gate(x.reshape(-1, 64))  # the router, called as the block calls it
        with every_token(layer, everyone), weighing_rows(layer, moe_layout(model)):
            block(x)
    for h in hooks:
        h.remove()
    probs = torch.softmax(logits.float(), dim=-1)
    for e in range(len(block.experts)):
        token, slot = torch.where(index == e)
        expected = torch.zeros(10)
        expected[token] = scores[token, slot].float()  # a routed token: the weight the block gives its output
        rows, got = seen[e]
        if everyone:
            # every token; one not routed to e gets what it would have had: p_e scaled as its routed weights are
            unrouted = torch.ones(10, dtype=torch.bool)
            unrouted[token] = False
            scale = scores.float().sum(-1) / probs.gather(1, index).sum(-1)
            expected[unrouted] = (probs[:, e] * scale)[unrouted]
            assert rows == 10
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        else:
            order = torch.where((index == e).T)[1]  # the rows in the order the expert reads them
            assert rows == len(order)
            torch.testing.assert_close(got, expected[order], rtol=0, atol=0)
    assert block.experts.router_probs is None and all(expert.row_weights is None for expert in block.experts)


def test_experts_run_without_their_router_record_no_stale_weights():
    """AWQ's scale search calls the experts module on captured inputs, with no router call before: the router's
    probabilities of an earlier forward (of another token count) must not be reused."""
    model = unfuse_experts(tiny_model("mixtral", vocab=256))
    layer = model.model.layers[0]
    x = torch.randn(1, 10, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        _, scores, index = layer.mlp.gate(x[0, :6])
    with torch.no_grad(), every_token(layer), weighing_rows(layer, moe_layout(model)):
        layer.mlp(x)
        direct = layer.mlp.experts(x[0, :6], index, scores)  # six tokens, no router hook before it
        assert all(expert.row_weights is None for expert in layer.mlp.experts)
    torch.testing.assert_close(direct, layer.mlp(x[:, :6]).reshape(6, 64))


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_an_experts_gptq_hessian_weighs_each_token_by_its_routing_weight(mode):
    from toolkit.engine.loop import quantize_layers
    from toolkit.methods import gptq

    model = unfuse_experts(tiny_model("mixtral", vocab=256))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    checked = []

    def driver(session):
        if session.index == 0:
            name = "mlp.experts.1.w1"
            got = gptq._hessians(session, [[name]], {})[0][name]
            block_inputs = []
            session.collect(["mlp"], lambda n, args, kwargs: block_inputs.append(args[0].reshape(-1, 64)))
            x = torch.cat(block_inputs)
            with torch.no_grad():
                logits, scores, index = session.layer.mlp.gate(x)
            probs = torch.softmax(logits.float(), dim=-1)
            token, slot = torch.where(index == 1)
            if mode == "routed":
                x, weights = x[token], scores[token, slot]
            else:  # every token, at the weight expert 1's output would get
                weights = probs[:, 1] * scores.sum(-1) / probs.gather(1, index).sum(-1)
            expected = 2 / len(x) * (x * weights[:, None]).T @ (x * weights[:, None])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
            checked.append(mode)
        return {}

    config = make_config("gptq", bits=4, group_size=32, moe_calibration=mode)
    quantize_layers(model, config, driver, tokens, lambda *a: None, batch_size=1)
    assert checked == [mode]


def expert_codes_equal_rtn(directory, config) -> tuple[int, int]:
    """(expert linears whose codes equal round-to-nearest of the float weights, expert linears) in a
    compressed-tensors checkpoint quantized from ``directory``."""
    from toolkit.runtime.load import load_quantized

    float_model = unfuse_experts(tiny_model("mixtral", vocab=256))
    quantized, _ = load_quantized(directory, backend="reference")
    same = total = 0
    for name, module in float_model.named_modules():
        if ".experts." in name and isinstance(module, torch.nn.Linear):
            total += 1
            W = module.weight.data
            expected = quantize_rtn(W, config.bits, config.group_size, config.sym).dequantize()
            got = quantized.get_submodule(name).dequantized_weight()
            same += torch.equal(got.float(), expected.float())
    return same, total


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_experts_with_too_few_routed_tokens_are_rounded_to_nearest_and_listed(moe_dirs, tmp_path, method):
    source = moe_dirs("mixtral")
    settings = QuantizeSettings(format="compressed-tensors", dtype="float32")
    starved = make_config(method, bits=4, group_size=32, sym=True, moe_min_tokens=10**6)
    result = quantize(str(source), starved, tmp_path / "starved", CALIBRATION, settings)
    report = json.loads((result.output / "compound.json").read_text())["experts"]
    assert report["calibration"] == "routed" and result.experts == report
    assert len(report["rounded_to_nearest"]) == 2 * 4  # every expert of both layers
    assert sum(report["routed_tokens"].values()) == 2 * CALIBRATION.samples * CALIBRATION.seq_len * 2  # top-2
    if method == "gptq":  # AWQ still folds its scales into the experts before rounding them
        same, total = expert_codes_equal_rtn(result.output, starved)
        assert same == total == 2 * 4 * 3

    everyone = make_config(method, bits=4, group_size=32, sym=True, moe_min_tokens=10**6, moe_calibration="all")
    result = quantize(str(source), everyone, tmp_path / "all", CALIBRATION, settings)
    report = json.loads((result.output / "compound.json").read_text())["experts"]
    assert report["calibration"] == "all" and report["rounded_to_nearest"] == []
    if method == "gptq":
        same, total = expert_codes_equal_rtn(result.output, everyone)
        assert same < total / 2  # calibrated: most experts' codes differ from round-to-nearest


def test_routers_stay_float_and_every_format_names_them(moe_dirs, tmp_path):
    source = moe_dirs("qwen2_moe")  # a router and a shared expert's gate per sparse layer; layer 1 is dense
    routers = ["model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate"]
    for fmt, method in [("compressed-tensors", "rtn"), ("gptq", "rtn"), ("awq", "awq")]:
        out = quantize(str(source), make_config(method, bits=4, group_size=32, sym=fmt == "gptq"), tmp_path / fmt,
                       CALIBRATION,
                       QuantizeSettings(format=fmt, dtype="float32")).output
        tensors = load_file(out / "model.safetensors")
        for router in routers:
            assert tensors[f"{router}.weight"].dtype == torch.float32, router
        assert "model.layers.1.mlp.gate_proj.qweight" in tensors or "model.layers.1.mlp.gate_proj.weight_packed" in \
            tensors  # the dense layer's gate_proj is quantized: no router entry catches it
        quant = json.loads((out / "config.json").read_text())["quantization_config"]
        if fmt == "compressed-tensors":
            import re

            for router in routers:
                assert any(re.fullmatch(p.removeprefix("re:"), router) for p in quant["ignore"]), router
            assert not any(re.fullmatch(p.removeprefix("re:"), "model.layers.1.mlp.gate_proj") for p in quant["ignore"])
        elif fmt == "gptq":
            import re

            rules = [p.removeprefix("-:") for p in quant["dynamic"]]
            assert all(any(re.match(r, router) for r in rules) for router in routers)
            assert not any(re.match(r, "model.layers.1.mlp.gate_proj") for r in rules)
        else:  # vLLM matches modules_to_not_convert as substrings
            skipped = quant["modules_to_not_convert"]
            assert all(any(s in router for s in skipped) for router in routers)
            assert not any(s in "model.layers.1.mlp.gate_proj" for s in skipped)


def test_mixtral_is_written_and_read_under_its_hub_block_name(moe_dirs, tmp_path):
    from toolkit.runtime.load import load_quantized

    out = quantize(str(moe_dirs("mixtral")), make_config("rtn", bits=4, group_size=32, sym=True), tmp_path / "q",
                   settings=QuantizeSettings(format="gptq", dtype="float32")).output
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.qweight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)
    model, _ = load_quantized(out, backend="reference")
    assert type(model.model.layers[0].mlp.experts[3].w2).__name__ == "QuantLinear"


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_a_streamed_moe_checkpoint_is_the_in_memory_one(moe_dirs, tmp_path, model_type):
    config = make_config("gptq", bits=4, group_size=32)
    source = str(moe_dirs(model_type))
    in_memory = quantize(source, config, tmp_path / "memory", CALIBRATION).output
    streamed = quantize(source, config, tmp_path / "streamed", CALIBRATION,
                        settings=QuantizeSettings(stream=True)).output
    expected, got = read_tensors(in_memory), read_tensors(streamed)
    assert sorted(expected) == sorted(got)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.mark.parametrize("sym", [True, False])
def test_compressed_tensors_decompressor_reproduces_every_expert_bit_exactly(moe_dirs, tmp_path, sym):
    from test_family_matrix import compressed_tensors_weights

    from toolkit.runtime.load import load_quantized

    out = quantize(str(moe_dirs("qwen2_moe")), make_config("gptq", bits=4, group_size=32, sym=sym), tmp_path / "q",
                   CALIBRATION, QuantizeSettings(format="compressed-tensors", dtype="float16")).output
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    theirs = compressed_tensors_weights(load_file(out / "model.safetensors"), quant)
    ours, _ = load_quantized(out, backend="reference")
    experts = [name for name in theirs if ".experts." in name]
    assert len(experts) == 4 * 3  # layer 0's experts (layer 1 is dense)
    for name, weight in theirs.items():
        assert torch.equal(ours.get_submodule(name).dequantized_weight().float(), weight.float()), name


def test_a_negative_min_tokens_is_refused_naming_the_flag(moe_dirs, runs):
    from typer.testing import CliRunner

    from conftest import refused
    from toolkit.cli import app

    result = CliRunner().invoke(app, ["quantize", "--model", str(moe_dirs("mixtral")), "--moe-min-tokens", "-1",
                                      "--output", str(runs / "q")])
    refused(result, "--moe-min-tokens must be 0 or more, got -1")
    assert list(runs.iterdir()) == []
