"""Issue #26 against the local Hub (tests/hub/local_hub.py): nothing pushed names a local path, the user or the host
(the manifest, a config naming its target and the card's results go up rewritten, the files on disk stay as they
are); a Hub id's recipe fingerprint follows the commit its branch resolves to."""

from __future__ import annotations

import getpass
import hashlib
import json
import re
import socket
import struct
from pathlib import Path

from test_hub_push import USER, hub, pushed, run_client  # noqa: F401  (hub is a fixture)


def _char_tokenizer(directory: Path) -> None:
    """A character-level tokenizer (a vocabulary of single letters, so no word of it can match a user or host
    name by chance), saved into ``directory``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz .,")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tokenizer.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def _artifacts(root: Path) -> tuple[Path, Path]:
    """A GPTQ checkpoint of a tiny model in ``root`` calibrated on a text file in ``root``, and Medusa heads in
    FasterDecoding's layout (whose config.json names the target's directory) trained for it."""
    from conftest import tiny_model

    from toolkit.heads.medusa import MedusaConfig, MedusaHeads
    from toolkit.heads.medusa_export import export_medusa
    from toolkit.quant.configs import make_config
    from toolkit.quantize import CalibrationSpec, QuantizeSettings, quantize

    model = root / "models" / "tiny-llama"
    tiny_model("llama", vocab=32).save_pretrained(model)
    _char_tokenizer(model)
    text = root / "data" / "calibration.txt"
    text.parent.mkdir()
    text.write_text("\n\n".join(f"the quick brown fox jumps over the lazy dog, {'again ' * (i % 5)}."
                                for i in range(200)))  # paragraphs: documents for the calibration split
    checkpoint = quantize(str(model), make_config("gptq", group_size=32), root / "out" / "checkpoint",
                          CalibrationSpec(str(text), samples=2, seq_len=32), QuantizeSettings(kv_cache="int8")).output
    heads = export_medusa(MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=32, num_heads=2)), root / "out" / "heads",
                          layout="medusa", target=str(model), target_sha256="0" * 64,
                          extra_manifest={"training": {"dataset": str(text), "examples": 4}})
    return checkpoint, heads


def _names_in(name: str, data: bytes) -> bytes:
    """The bytes of an uploaded file that could carry a name: all of them, but of a safetensors file its header (its
    tensors are numbers, where a two-letter host name occurs by chance)."""
    if name.endswith(".safetensors"):
        return data[8:8 + struct.unpack("<Q", data[:8])[0]]
    return data


def test_nothing_pushed_names_a_local_path_user_or_host(hub, tmp_path):  # noqa: F811
    checkpoint, heads = _artifacts(tmp_path)
    on_disk = {p: hashlib.sha256(p.read_bytes()).digest() for d in (checkpoint, heads) for p in d.iterdir()}
    assert str(tmp_path) in (checkpoint / "compound.json").read_text()  # what there is to keep off the Hub
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"command": f"compound run {tmp_path / 'recipes' / 'mine.yaml'}",
                                   "gates": [f"validate_required: ok ({checkpoint})"],
                                   "divergence": {"kl": 0.01, "dataset": str(tmp_path / "data" / "calibration.txt"),
                                                  "windows": 2, "seq_len": 32}}))
    for directory, repo in ((checkpoint, f"{USER}/tiny-gptq"), (heads, f"{USER}/tiny-medusa")):
        pushed(run_client(hub, tmp_path, "push", str(directory), repo, "--results", str(results))[0])
    private = [str(tmp_path).encode(), getpass.getuser().encode(), socket.gethostname().encode()]
    for repo in (f"{USER}/tiny-gptq", f"{USER}/tiny-medusa"):
        files = hub.files(repo)
        leaks = [(name, word) for name, data in files.items() for word in private if word in _names_in(name, data)]
        assert leaks == [], leaks
        manifest = json.loads(files["compound.json"])
        assert {name: hashlib.sha256(files[name]).hexdigest() for name in manifest["files"]} == manifest["files"]
    assert json.loads(hub.read(f"{USER}/tiny-gptq", "compound.json"))["model"] == "tiny-llama"
    assert json.loads(hub.read(f"{USER}/tiny-medusa", "config.json"))["base_model_name_or_path"] == "tiny-llama"
    assert "compound run mine.yaml" in hub.read(f"{USER}/tiny-gptq", "README.md").decode()
    assert {p: hashlib.sha256(p.read_bytes()).digest() for p in on_disk} == on_disk  # the disk is untouched


def _planned_fingerprint(hub, tmp_path: Path, recipe: Path) -> str:  # noqa: F811
    report, done = run_client(hub, tmp_path, "cli", "run", str(recipe), "--dry-run")
    assert report["exit_code"] in (0, None), done.stderr
    return re.search(r"quantize.*?\b([0-9a-f]{12})\b", done.stderr, re.DOTALL).group(1)


def test_a_hub_ids_fingerprint_follows_its_revision(hub, tmp_path):  # noqa: F811
    from conftest import tiny_config

    repo = f"{USER}/tiny-target"
    config = tiny_config("llama").to_json_string().encode()
    hub.create(repo, {"config.json": config})
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(f"model: {repo}\noutput: {tmp_path / 'out'}\nquantize: {{method: rtn, group_size: 32}}\n")
    first = _planned_fingerprint(hub, tmp_path, recipe)
    assert _planned_fingerprint(hub, tmp_path, recipe) == first  # the same revision, the same plan
    assert any(r.startswith(f"GET /api/models/{repo}") for r in (f"{q.method} {q.path}" for q in hub.requests))
    hub.create(repo, {"config.json": config, "README.md": b"a new upstream revision\n"})
    assert _planned_fingerprint(hub, tmp_path, recipe) != first
    assert not (tmp_path / "out").exists()
