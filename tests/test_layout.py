"""The repository's own folders never shadow a package that transformers imports: `python benchmarks/<script>.py` puts
`benchmarks/` first on sys.path, and `python -m pytest` the repository root, so a module named `kernels` there would
hide the PyPI package `kernels` that transformers 5.25 imports when it is installed (the root's `kernels/` is
installed as `toolkit.kernels`; tests/conftest.py and validate's child process keep the root off sys.path)."""

import re

import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHADOWED = ("kernels",)  # top-level packages transformers imports by name


def test_no_script_folder_shadows_a_package_transformers_imports():
    folders = [ROOT / name for name in ("benchmarks", "benchmarks/peers", "scripts", "tests", "tests/integration")]
    # a module, or a folder with an __init__.py (a folder without one, like tests/kernels, is a namespace portion,
    # which an installed package of the same name outranks)
    shadowing = [str(path) for folder in folders for name in SHADOWED
                 for path in (folder / f"{name}.py", folder / name / "__init__.py") if path.exists()]
    assert not shadowing, f"rename {shadowing}: they would shadow the PyPI package of that name"


def test_tests_import_this_checkouts_toolkit_and_the_installed_kernels():
    """conftest keeps the repository root on sys.path, after site-packages: `toolkit` is this checkout's, and an
    installed PyPI `kernels` (if any) is not shadowed by the source folder `kernels/`."""
    import importlib.util

    import toolkit

    assert Path(toolkit.__file__).resolve().parent == ROOT / "toolkit"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "").resolve().parent != ROOT / "kernels"


def test_every_torch_load_is_weights_only():
    sources = [p for folder in ("toolkit", "calibration", "kernels", "benchmarks", "scripts", "tests")
               for p in (ROOT / folder).rglob("*.py")
               if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # venvs and caches
    calls = [(p, m.group()) for p in sources for m in re.finditer(r"torch\.load\([^)]*\)", p.read_text())]
    assert calls and [(p, c) for p, c in calls if "weights_only=True" not in c] == []


def _layers() -> dict[str, int]:
    """The README's layer list (Layout): top-level unit of ``toolkit`` → its rank, lowest first."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Layout"):]
    ranks = {}
    for rank, line in enumerate(re.findall(r"^\d+\. (.+)$", section, re.M)):
        for name in re.findall(r"`([a-z_]+)`", line):
            ranks[f"toolkit.{name}"] = rank
    return ranks


def _module_imports() -> dict[str, set[str]]:
    """Every module of the package (``kernels`` and ``calibration`` under ``toolkit``) → the package modules it imports,
    anywhere in its body (a function's import runs upward just as well)."""
    import ast

    files = {}
    for folder in ("toolkit", "kernels", "calibration"):
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            parts = (["toolkit"] if parts[0] != "toolkit" else []) + parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    imports = {}
    for module, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("toolkit"):
                names |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                          for alias in node.names}
            elif isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names if alias.name.startswith("toolkit")}
        imports[module] = {name for name in names if name in files and name != module}
    return imports


def _unit(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_module_imports_from_a_layer_above_its_own():
    ranks, imports = _layers(), _module_imports()
    units = {_unit(m) for m in imports} - {"toolkit"}  # the package root holds the public verbs: the top
    assert units <= set(ranks), f"add {sorted(units - set(ranks))} to the README's layer list"
    upward = sorted(f"{m} imports {d}" for m, deps in imports.items() if m != "toolkit" for d in deps
                    if d != "toolkit" and ranks[_unit(d)] > ranks[_unit(m)])
    assert upward == []


def test_no_two_modules_import_each_other():
    """No import circle between modules; a package's ``__init__`` importing its own submodules (a registry filled as
    they import, re-exports) is not one."""
    imports = _module_imports()
    edges = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in imports.items()}
    circles, state = [], {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(edges[module]):
            if state.get(dep) == "open":
                circles.append(" -> ".join([*path[path.index(dep):], dep]))
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert circles == []


def test_the_layer_checks_catch_an_upward_import_and_a_circle(monkeypatch):
    """The two checks above fail on what they look for: a formats module importing the CLI, two modules importing
    each other."""
    real = _module_imports()
    fake = {m: set(deps) for m, deps in real.items()}
    fake["toolkit.formats.gptq"].add("toolkit.cli.common")
    fake["toolkit.models"].add("toolkit.identity")
    fake["toolkit.identity"].add("toolkit.models")
    monkeypatch.setitem(globals(), "_module_imports", lambda: fake)
    with pytest.raises(AssertionError, match="toolkit.formats.gptq imports toolkit.cli.common"):
        test_no_module_imports_from_a_layer_above_its_own()
    with pytest.raises(AssertionError, match="(toolkit.identity|toolkit.models) -> (toolkit.identity|toolkit.models)"):
        test_no_two_modules_import_each_other()
