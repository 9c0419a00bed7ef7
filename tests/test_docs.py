"""The README and docs/layout.md say what is true of the tree: every module of kernels/ and lab/ is
in docs/layout.md, which the README links, and what the README's install makes (.venv) is ignored by
git. Run:
python -m pytest -q tests/test_docs.py"""

from pathlib import Path

import pytest
from conftest import ROOT

MODULES = sorted(f"{p.parent.name}/{p.name}" for folder in ("kernels", "lab")
                 for p in (Path(ROOT) / folder).glob("*.[pc]*") if p.name != "__init__.py")


@pytest.mark.parametrize("page", ["docs/layout.md"])
def test_every_module_of_kernels_and_lab_is_listed(page):
    text = (Path(ROOT) / page).read_text(encoding="utf-8")
    missing = [m for m in MODULES if m not in text]
    assert not missing, f"{page} does not list {', '.join(missing)}"


def test_what_the_readme_install_makes_is_ignored():
    readme = (Path(ROOT) / "README.md").read_text(encoding="utf-8")
    assert "python -m venv .venv" in readme
    ignored = (Path(ROOT) / ".gitignore").read_text(encoding="utf-8").split()
    assert ".venv/" in ignored or ".venv" in ignored


def test_the_readme_links_the_layout():
    readme = (Path(ROOT) / "README.md").read_text(encoding="utf-8")
    assert "(docs/layout.md)" in readme


def test_no_placeholder_is_left_in_the_pages():
    """A figure written in later (RESULT, TODO, TBD) must not land in place of the figure."""
    pages = [Path(ROOT) / "README.md", *sorted((Path(ROOT) / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for word in ("RESULT", "TODO", "TBD", "XXX"):
            assert word not in text, (page.name, word)
