"""The repository's own folders never shadow a package that transformers imports: `python benchmarks/<script>.py` puts
`benchmarks/` first on sys.path, and `python -m pytest` the repository root, so a module named `kernels` there would
hide the PyPI package `kernels` that transformers 5.25 imports when it is installed (the root's `kernels/` is
installed as `toolkit.kernels`; tests/conftest.py and validate's child process keep the root off sys.path)."""

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
