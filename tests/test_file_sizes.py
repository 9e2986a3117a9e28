"""Small modules with one job: no source file of the repository runs over 500 lines (split it by concept)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("toolkit", "kernels", "calibration", "benchmarks", "scripts", "tests")
SUFFIXES = (".py", ".cpp", ".sh")
MAX_LINES = 500


def source_files() -> list[Path]:
    """Every .py/.cpp/.sh under the repository's source folders, venvs, caches and symlinked folders left out."""
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*")
                  if p.suffix in SUFFIXES and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
                  and p.resolve().is_relative_to(ROOT / folder))


def test_the_walk_finds_every_kind_of_source():
    found = {p.suffix for p in source_files()}
    assert found == set(SUFFIXES) and ROOT / "toolkit" / "hub.py" in source_files()


def test_no_source_file_runs_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in source_files()
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}, f"split these by concept (one job per module), at most {MAX_LINES} lines each: {long}"
