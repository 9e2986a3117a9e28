"""Every citation in the repository's code and documents points at something the repository holds: a path of one of
its folders (``toolkit/runtime/native.py``, ``docs/formats.md``), a file named bare (``native.py``, ``README.md``), a
section of a Markdown file (``docs/formats.md §5.1``) or a module (``toolkit.formats.gguf``). Files of other
projects cited by bare name are listed with their project."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("toolkit", "kernels", "calibration", "tests", "benchmarks", "scripts", "docs", "recipes")
SUFFIXES = (".py", ".md", ".cpp", ".sh", ".toml", ".yaml")
INSTALLED_AS = {"kernels": ROOT / "kernels", "calibration": ROOT / "calibration"}  # toolkit.kernels → kernels/
EXTERNAL = {  # other projects' files the code names without their path: name → project
    "algos.py": "vLLM", "auto_awq.py": "vLLM", "awq_marlin.py": "vLLM", "gptq_marlin.py": "vLLM",
    "llama_eagle.py": "vLLM / SGLang", "llama_eagle3.py": "vLLM / SGLang", "config.py": "vLLM / speculators",
    "core.py": "speculators", "convert_hf_to_gguf.py": "llama.cpp", "qlinear_cuda_old.py": "AutoGPTQ",
    "quant.py": "IST-DASLab/gptq", "medusa_model_legacy.py": "FasterDecoding/Medusa", "lr_scheduler.py": "SpecForge",
    "trainer.py": "SpecForge", "cli.py": "an example of a traceback location", "tool.py": "a shell variable's file",
    "llama.cpp": "the llama.cpp project",
}
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(FOLDERS)})/[\w./-]*\w\.(?:py|md|cpp|sh|toml|yaml|json))\b")
BARE = re.compile(r"(?<![\w/.\\-])(?<!/ \")([A-Za-z_][\w-]*\.(?:py|cpp|md))(?![\w/-])")  # not a path built: dir / "x.py"
SECTIONS = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)((?:[ ,–-]*§\d+(?:\.\d+)*)+)")
MODULE = re.compile(r"(?<![\w.])toolkit(?:\.[A-Za-z_]\w*)+")
HEADING = re.compile(r"^#{1,6} (\d+(?:\.\d+)*)\.? ", re.MULTILINE)


def repository_files() -> list[Path]:
    """The text files whose citations are checked: the root's Markdown and every file of the source folders but this
    one (whose examples cite what does not exist on purpose) and those under hidden folders (benchmarks/.venvs: the
    peers' installs; caches)."""
    files = sorted(ROOT.glob("*.md"))
    for folder in FOLDERS:
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()
                        and "__pycache__" not in p.parts and p != Path(__file__).resolve()
                        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts))
    return files


def held_names() -> set[str]:
    """The names of the repository's files: the root's and those of the source folders."""
    return {p.name for p in ROOT.iterdir() if p.is_file()} | {p.name for p in repository_files()} | {"test_citations.py"}


def broken_citations(text: str, names: set[str]) -> list[str]:
    """The citations in ``text`` of files, sections or modules the repository does not hold (``names``: the bare
    file names it holds)."""
    broken = [path for path in PATH.findall(text) if not (ROOT / path).exists()]
    broken += [name for name in BARE.findall(text) if name not in names and name not in EXTERNAL
               and (not name.endswith(".md") or name[0].isupper())]  # lowercase .md: a file compound writes
    for document, sections in SECTIONS.findall(text):
        path = ROOT / document if "/" in document else next(ROOT.rglob(document), None)
        held = set(HEADING.findall(path.read_text())) if path is not None and path.is_file() else set()
        broken += [f"{document} §{n}" for n in re.findall(r"§(\d+(?:\.\d+)*)", sections) if n not in held]
    broken += [module for module in MODULE.findall(text) if not _module_exists(module.split(".")[1:])]
    return broken


def _module_exists(parts: list[str]) -> bool:
    """Whether ``toolkit.<parts>`` names a module, a package, or a name of a package's ``__init__``: the first part
    must be a module or package, a second one (of a package) a module in it or a name its ``__init__`` defines."""
    parts = [p for p in parts if not p.startswith("__")]
    if not parts:
        return True
    top = INSTALLED_AS.get(parts[0], ROOT / "toolkit" / parts[0])
    if not (top.is_dir() or top.with_suffix(".py").is_file()):
        return False
    if len(parts) == 1 or not top.is_dir():
        return True
    inner = top / parts[1]
    init = top / "__init__.py"
    return (inner.is_dir() or inner.with_suffix(".py").is_file() or inner.with_suffix(".cpp").is_file()
            or init.is_file() and re.search(rf"\b{parts[1]}\b", init.read_text()) is not None)


def test_every_citation_names_something_the_repository_holds():
    files, names = repository_files(), held_names()
    broken = {str(p.relative_to(ROOT)): found for p in files if (found := broken_citations(p.read_text(), names))}
    assert not broken, f"citations of files, sections or modules that do not exist: {broken}"


@pytest.mark.parametrize("text,cited", [
    ("see FORMATS.md §2", "FORMATS.md"),
    ("(docs/formats.md §42)", "docs/formats.md §42"),
    ("docs/formats.md §1.1, §3.7", "docs/formats.md §3.7"),
    ("docs/formats.md §2–§19", "docs/formats.md §19"),
    ("toolkit/runtime/cpu_int4_native.py builds this file", "toolkit/runtime/cpu_int4_native.py"),
    ("// cpu_int4_native.py builds this file", "cpu_int4_native.py"),
    ("docs/no_such_guide.md", "docs/no_such_guide.md"),
    ("``toolkit.formats.no_such_layout``", "toolkit.formats.no_such_layout"),
    ("``toolkit.no_such_module``", "toolkit.no_such_module"),
])
def test_a_citation_of_what_does_not_exist_is_flagged(text, cited):
    names = held_names()
    assert any(cited in found for found in broken_citations(text, names)), text


def test_citations_of_what_exists_pass():
    names = held_names()
    text = ("docs/formats.md §5.1 and §6; toolkit/runtime/native.py; native.py; README.md; ``toolkit.formats.gguf``, "
            "``toolkit.kernels.reference``, ``toolkit.formats.FORMATS``; vLLM ``auto_awq.py``; writes eval.md")
    assert broken_citations(text, names) == []
