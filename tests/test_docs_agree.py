"""What the docs state about the repository itself agrees with it: the layout in
docs/internals.md names every module and benchmark script, and the README's headline figures are
the ones docs/benchmarks.md measured. (The docs' examples run as tests of their own:
tests/doc_examples.py.)"""

from __future__ import annotations

import re

from helpers import REPO

PACKAGE = REPO / "ckptavg"


def _layout() -> list[str]:
    """The lines of the layout block of docs/internals.md (the fenced block that starts ``ckptavg/``)."""
    text = (REPO / "docs" / "internals.md").read_text()
    block = re.search(r"```\n(ckptavg/\n.*?)```", text, re.DOTALL)
    assert block, "docs/internals.md has no layout block starting 'ckptavg/'"
    return block.group(1).splitlines()


def _listed_paths(lines: list[str]) -> set[str]:
    """Every file and folder the layout lists, as paths (``formats/writers/base.py``): a line's
    names are its text up to the first run of two spaces; ``native.py/.c`` names two files."""
    folders: list[tuple[int, str]] = []
    listed: set[str] = set()
    for line in lines:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        names = re.split(r"\s{2,}", line.strip())[0]
        while folders and folders[-1][0] >= indent:
            folders.pop()
        parent = "/".join(name for _, name in folders)
        for name in names.split(", "):
            if name.endswith("/"):
                folders.append((indent, name.rstrip("/")))
                listed.add(f"{parent}/{name.rstrip('/')}".lstrip("/"))
            elif "/." in name:  # native.py/.c
                stem = name.split(".", 1)[0]
                listed.update(f"{parent}/{stem}{suffix}".lstrip("/") for suffix in re.findall(r"\.\w+", name))
            else:
                listed.add(f"{parent}/{name}".lstrip("/"))
    return listed


def test_the_layout_names_every_module_of_the_package():
    listed = _listed_paths(_layout())
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = "ckptavg/" + path.relative_to(PACKAGE).as_posix()
        folder = relative.rsplit("/", 1)[0]
        if path.name == "__init__.py" and folder != "ckptavg":
            continue  # a subpackage is listed by its folder
        files_listed_in_folder = any(p.startswith(folder + "/") and p.endswith(".py") for p in listed)
        if relative not in listed and (files_listed_in_folder or folder not in listed):
            missing.append(relative)
    assert not missing, f"docs/internals.md's layout misses {missing}"


def test_the_layout_names_every_make_target_script():
    """Every script a make target runs (benchmarks/bench_*.py, gpu_check.py) is in the layout."""
    layout = "\n".join(_layout())
    targets = re.findall(r"\$\(PY\) (benchmarks/\w+\.py)", (REPO / "Makefile").read_text())
    assert len(targets) >= 8
    missing = [t for t in targets if t.split("/")[1] not in layout]
    assert not missing, f"docs/internals.md's layout misses {missing}"


def _bench_row(table: str, label: str) -> tuple[float, float]:
    """(seconds, MB) of the row of docs/benchmarks.md's first table that starts with ``label``."""
    row = next(line for line in table.splitlines() if line.startswith(f"| {label}"))
    wall, rss = row.split("|")[2:4]
    return float(re.search(r"[\d.]+(?= s)", wall).group()), float(re.search(r"[\d.]+(?= MB)", rss).group())


def test_the_readme_headline_figures_are_the_benchmark_pages():
    readme = (REPO / "README.md").read_text()
    claimed = re.search(r"runs in ([\d.]+) × the time and ([\d.]+) × the memory of a load-everything average", readme)
    assert claimed, "README.md no longer states the merge's time and memory against a naive average"
    table = (REPO / "docs" / "benchmarks.md").read_text()
    ours, naive = _bench_row(table, "`ckptavg merge`, 4 inputs"), _bench_row(table, "naive: `load_file` everything")
    assert claimed.group(1) == f"{ours[0] / naive[0]:.2f}", (ours, naive)
    assert claimed.group(2) == f"{ours[1] / naive[1]:.2f}", (ours, naive)


def test_comments_name_modules_that_exist():
    """``ckptavg.x.y`` named in pyproject.toml's comments is a module of the package."""
    for name in re.findall(r"#.*?\b(ckptavg(?:\.\w+)+)", (REPO / "pyproject.toml").read_text()):
        path = REPO / name.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), f"pyproject.toml names {name}, which does not exist"
