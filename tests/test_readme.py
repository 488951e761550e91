"""Every Python example in the README and the docs site (docs/*.md) runs; their links resolve; the
API reference lists every public name."""

import re
from pathlib import Path

import pytest
import torch

import offloadopt

ROOT = Path(__file__).parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
RESULTS = [
    ROOT / "benchmarks" / "RESULTS.md",
    *sorted((ROOT / "benchmarks").glob("results/*/*.md")),
]
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
# A block that names a CUDA device needs a GPU: it is skipped without one, as the CUDA tests are.
NEEDS_CUDA = re.compile(r"""["']cuda|\.cuda\(|torch\.cuda\.(?!is_available)""")
BLOCKS = [(page, code) for page in PAGES for code in FENCE.findall(page.read_text())]
IDS = [f"{page.stem}-block{i}" for i, (page, _) in enumerate(BLOCKS)]
# [text](target) and ![alt](target): the target up to a space or the closing parenthesis.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ANY_FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)


def test_the_docs_have_examples():
    pages = {page.name for page, _ in BLOCKS}
    assert {"getting-started.md", "distributed.md", "audit.md"} <= pages, pages


@pytest.mark.parametrize("page,code", BLOCKS, ids=IDS)
def test_example_runs(page, code, capsys):
    if NEEDS_CUDA.search(code) and not torch.cuda.is_available():
        pytest.skip("the example needs a CUDA device")
    exec(compile(code, str(page), "exec"), {"__name__": "docs_example"})
    assert capsys.readouterr().out  # each example prints what it shows


@pytest.mark.parametrize(
    "page", PAGES + RESULTS, ids=[str(p.relative_to(ROOT)) for p in PAGES + RESULTS]
)
def test_relative_links_resolve(page):
    """mkdocs build --strict checks the site's links; this checks the README's and the
    benchmark results' too, and runs where the docs extra is not installed. Links out of docs/
    would not build, so docs pages link only to docs pages."""
    text = ANY_FENCE.sub("", page.read_text())
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path = target.split("#")[0]
        if not path:
            continue
        resolved = (page.parent / path).resolve()
        assert resolved.exists(), f"{page.name}: link to {target!r}, which does not exist"
        if page.parent.name == "docs":
            assert resolved.parent == page.parent, f"{page.name}: {target!r} leaves docs/"


def test_every_docs_page_is_in_the_nav_and_every_public_name_in_the_api_reference():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in DOCS:
        assert f": {page.name}\n" in nav, f"{page.name} is missing from mkdocs.yml's nav"
    api = (ROOT / "docs" / "api.md").read_text()
    # offloadopt.audit, the function, is reached as offloadopt.audit.audit (the module's name)
    documented = {
        m.rsplit(".", 1)[1] for m in re.findall(r"^::: (offloadopt[.\w]*)$", api, flags=re.M)
    }
    public = set(offloadopt.__all__) - {"__version__"}
    assert documented == public, (public - documented, documented - public)


def test_the_readme_links_every_docs_page():
    text = README.read_text()
    for page in DOCS:
        assert f"docs/{page.name}" in text, f"README.md does not link docs/{page.name}"
