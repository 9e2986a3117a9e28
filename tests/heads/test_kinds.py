"""The head registry: it lists every kind, each implements everything a kind declares, ``load_head`` recognises the
directory each kind's real exporter writes (every layout) and refuses anything else by name, no module outside the
registry branches on a kind's name, and heads/ imports nothing above it and no module of it imports itself back."""

import ast
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_model
from rich.console import Console

from toolkit.heads import eagle_config
from toolkit.heads.kinds import KINDS, HeadKind, kind_named, register
from toolkit.heads.load import detect_head, load_head
from toolkit.heads.options import EagleOptions, MedusaOptions
from toolkit.heads.speculators_export import SUBDIR
from toolkit.options import choices_of, option_fields
from toolkit.train_heads import HEADS, HeadsJob

TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"
# Options small enough for the tiny target (vocabulary 512, 8 layers), per options class a kind reads.
OPTIONS = {MedusaOptions: MedusaOptions(num_heads=2), EagleOptions: EagleOptions(draft_vocab=100, depth=3)}


@pytest.fixture(scope="module")
def target(one_thread):
    return tiny_model("llama", layers=8, vocab=512)


def test_the_registry_lists_every_kind():
    assert set(KINDS) == {"medusa", "eagle", "eagle3"}
    assert set(eagle_config.VARIANTS) <= set(KINDS)  # every EAGLE variant the model builds is a registered kind
    head_field = next(f for f in option_fields(HeadsJob) if f.name == "head")
    assert HEADS == tuple(KINDS) == choices_of(head_field) and head_field.default == HEADS[0]
    assert {kind.options for kind in KINDS.values()} <= set(HeadsJob.parts().values())
    abstract = [name for name, member in vars(HeadKind).items()
                if callable(member) and "raise NotImplementedError" in inspect.getsource(member)]
    assert abstract, "HeadKind declares what a kind must implement"
    for kind in KINDS.values():
        missing = [name for name in abstract if getattr(type(kind), name) is getattr(HeadKind, name)]
        assert not missing, f"{kind.name} does not implement {missing}"
        assert kind.name and kind.title and kind.signature


def test_a_kind_is_registered_once_and_looked_up_by_name():
    with pytest.raises(ValueError, match="'eagle3' is already registered"):
        register(KINDS["eagle3"])
    with pytest.raises(ValueError, match=r"--head 'hydra' is not supported; choose one of medusa, eagle, eagle3"):
        kind_named("hydra")


def _examples(count: int = 3) -> list:
    """Conversations as the kinds' ``build`` reads them: token ids and a mask of the trained labels."""
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 512, (40,), generator=g) for _ in range(count)]
    return [SimpleNamespace(input_ids=i, loss_mask=torch.arange(40) >= 10) for i in ids]


def _export(kind: HeadKind, opts, target, out: Path):
    torch.manual_seed(0)
    head = kind.build(opts, target, _examples(), Console(quiet=True)).head
    with torch.no_grad():
        for p in head.parameters():
            p.normal_()  # every tensor random: a swapped one cannot hide
    kind.export(head, out, opts, target="tiny-llama", target_sha256="ab" * 32,
                target_architectures=["LlamaForCausalLM"], overwrite=False, extra_manifest={},
                console=Console(quiet=True))
    return head


# (kind, options replaced, directory below the export): every layout an exporter writes
LAYOUTS = [(name, {}, ".") for name in KINDS] + [("medusa", {"layout": "medusa"}, "."), ("eagle3", {}, SUBDIR)]


LAYOUT_IDS = [f"{name}-{changes.get('layout') or subdir.replace('.', 'main')}" for name, changes, subdir in LAYOUTS]


@pytest.mark.parametrize("name, changes, subdir", LAYOUTS, ids=LAYOUT_IDS)
def test_load_head_tells_each_exported_layout_apart(target, tmp_path, name, changes, subdir):
    from dataclasses import replace

    kind = KINDS[name]
    opts = replace(OPTIONS[kind.options], **changes)
    head = _export(kind, opts, target, tmp_path / "head")
    directory = tmp_path / "head" / subdir
    assert detect_head(directory) is kind
    loaded = load_head(directory)
    assert loaded.kind is kind and type(loaded.module) is type(head)
    state = loaded.module.state_dict()
    for key, tensor in head.state_dict().items():  # exported in bfloat16
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(state[key], expected), key


def test_load_head_refuses_a_directory_no_kind_reads(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json in .*empty: not a head directory"):
        load_head(tmp_path / "empty")
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    assert detect_head(checkpoint) is None and detect_head(tmp_path / "empty") is None
    with pytest.raises(ValueError) as err:
        load_head(checkpoint)
    message = str(err.value)
    assert message.startswith(f"{checkpoint / 'config.json'} is not a draft head compound reads (looked for ")
    assert all(kind.signature in message for kind in KINDS.values())
    assert "model_type 'medusa'" in message and "LlamaForCausalLMEagle3" in message and "speculators_config" in message


def _literals(node: ast.AST) -> set[str]:
    """The string constants ``node`` is, or holds as a tuple, list or set display."""
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def kind_branches(source: str, names) -> list[int]:
    """Lines of ``source`` that compare a value with one of ``names`` (``==``, ``!=``, ``in``, a ``match`` case)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(_literals(op) & set(names)
                                                 for op in (node.left, *node.comparators)):
            lines.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and _literals(node.value) & set(names):
            lines.append(node.value.lineno)
    return lines


def test_the_scan_finds_every_shape_of_branch():
    branches = ["if head == 'eagle3':\n    pass", "x = 1 if kind != 'medusa' else 2", "ok = head in ('eagle', 'x')",
                "match head:\n    case 'eagle':\n        pass", "if 'medusa' == head:\n    pass"]
    assert all(kind_branches(source, KINDS) for source in branches)
    fine = ["if head == kind.name:\n    pass", "f(head='eagle3')", "x = {'format': 'eagle'}",
            "if x == 'vllm':\n    pass"]
    assert not any(kind_branches(source, KINDS) for source in fine)


def test_no_module_outside_the_registry_branches_on_a_kind_name():
    registry = TOOLKIT / "heads" / "kinds"
    found = [f"{path.relative_to(TOOLKIT.parent)}:{line}" for path in sorted(TOOLKIT.rglob("*.py"))
             if registry not in path.parents
             for line in kind_branches(path.read_text(), KINDS)]
    assert not found, f"branches on a head kind's name outside toolkit/heads/kinds: {found}"


ABOVE_HEADS = ("toolkit.evaluate", "toolkit.hub", "toolkit.train_heads", "toolkit.recipes", "toolkit.cli",
               "toolkit.validate", "toolkit.quantize", "toolkit.convert")


def _module(path: Path) -> str:
    parts = path.relative_to(TOOLKIT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The toolkit modules ``path`` imports anywhere in it (function bodies too): ``from a import b`` counts as
    ``a.b`` when that is a module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {name for name in found if name.startswith("toolkit.")}


def test_heads_import_nothing_above_them_and_no_module_imports_itself_back():
    modules = {_module(path): _imports(path) for path in TOOLKIT.joinpath("heads").rglob("*.py")}
    upward = {m: sorted(i for i in imports if i.startswith(ABOVE_HEADS)) for m, imports in modules.items()}
    assert not any(upward.values()), {m: i for m, i in upward.items() if i}

    def node(name: str) -> str:  # the registry registers its kind modules like methods/: one node
        return "toolkit.heads.kinds" if name.startswith("toolkit.heads.kinds") else name

    graph: dict[str, set[str]] = {}
    for m, imports in modules.items():
        graph.setdefault(node(m), set()).update(node(i) for i in imports if node(i) in map(node, modules)
                                                and node(i) != node(m))

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and not seen.add(n) and reaches(n, goal, seen))
                   for n in graph.get(start, ()))

    circles = sorted(m for m in graph if reaches(m, m, set()))
    assert not circles, f"import circles through {circles}"
