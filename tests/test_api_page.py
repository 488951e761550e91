"""The docs site as built (``mkdocs build --strict``, as CI builds it), read back: the API page
shows each documented parameter with its type and default (no parameter with a default shown as
required, every option of ``offloadopt.options`` with the type and default declared there), the
getting-started table of options is the one generated from ``Options``, no bullet is swallowed
into a paragraph, and the site's links work opened from disk (files, not folders)."""

from __future__ import annotations

import html
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offloadopt.options import describe

pytest.importorskip("mkdocstrings", reason="the docs extra builds the site")

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {name: (kind, default) for name, kind, default, _ in describe()}
HEADING = re.compile(r'<h[2-6] id="(offloadopt\.[\w.]+)"')
TABLE = re.compile(r"<p><span class=\"doc-section-title\">Parameters:</span></p>\s*<table>(.*?)</table>",
                   re.S)  # fmt: skip
ROW = re.compile(r"<tr class=\"doc-section-item\">(.*?)</tr>", re.S)
CELL = re.compile(r"<td>(.*?)</td>", re.S)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(out)], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _text(cell: str) -> str:
    return html.unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", cell))).strip()


def parameter_tables(page: str) -> dict[str, list[tuple[str, str, str]]]:
    """object id -> its Parameters table's rows (name, type, default), each table under the
    heading before it."""
    headings = [(m.start(), m[1]) for m in HEADING.finditer(page)]
    out: dict[str, list[tuple[str, str, str]]] = {}
    for m in TABLE.finditer(page):
        owner = [name for pos, name in headings if pos < m.start()][-1]
        rows = []
        for row in ROW.findall(m[1]):
            cells = [_text(c) for c in CELL.findall(row)]
            rows.append((cells[0], cells[1], cells[-1]))
        out[owner] = rows
    return out


def resolve(dotted: str):
    """The object of a heading id: the longest module prefix imported, then attributes
    (``offloadopt.audit.audit`` is the function in the module ``offloadopt.audit``)."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for part in parts[k:]:
            obj = getattr(obj, part)
        return obj
    raise LookupError(dotted)


def signature_defaults(obj) -> dict[str, str | None]:
    """name -> the default's source text (None: required) of ``obj``'s signature, a class's
    ``**options`` as the options themselves."""
    out: dict[str, str | None] = {}
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_KEYWORD and "OffloadOptions" in str(p.annotation):
            out |= {name: default for name, (_, default) in OPTIONS.items()}
        elif p.kind is p.VAR_KEYWORD:
            out[f"**{p.name}"] = None
        elif p.kind is p.VAR_POSITIONAL:
            out[f"*{p.name}"] = None
        else:
            out[p.name] = None if p.default is p.empty else repr(p.default)
    return out


@pytest.mark.slow
def test_each_documented_parameter_shows_its_default(site):
    tables = parameter_tables((site / "api.html").read_text())
    assert {"offloadopt.HybridAdamW", "offloadopt.HybridAdam", "offloadopt.HybridSGD",
            "offloadopt.HybridDeviceOptimizer"} <= set(tables), sorted(tables)  # fmt: skip
    bad = []
    for owner, rows in tables.items():
        defaults = signature_defaults(resolve(owner))
        for name, _, shown in rows:
            if name not in defaults:
                bad.append(f"{owner}: {name!r} is no parameter (one row per parameter)")
            elif defaults[name] is not None and shown == "required":
                bad.append(f"{owner}: {name} has the default {defaults[name]} but shows required")
            elif defaults[name] is None and shown != "required" and not name.startswith("*"):
                bad.append(f"{owner}: {name} is required but shows {shown!r}")
    assert not bad, bad


@pytest.mark.slow
def test_every_option_shows_its_type_and_default(site):
    page = (site / "api.html").read_text()
    rows = {
        name: (kind, shown)
        for name, kind, shown in parameter_tables(page)["offloadopt.HybridAdamW"]
    }
    for name, (kind, default) in OPTIONS.items():
        assert name in rows, f"HybridAdamW's table lacks {name}"
        assert rows[name] == (kind, default), (name, rows[name], (kind, default))
    # the signatures list them too, for the classes that take **options
    for cls in ("HybridAdamW", "HybridAdam", "HybridSGD"):
        start = page.index(f'id="offloadopt.{cls}"')
        end = page.index("</code></pre></div>", start)
        signature = re.sub(r"\s", "", _text(page[start:end]))
        for name, (kind, default) in OPTIONS.items():
            assert re.sub(r"\s", "", f"{name}: {kind} = {default}") in signature, (cls, name)


def test_the_getting_started_table_is_generated_from_the_options():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "options_table.py"), "--check"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 0, r.stderr
    text = (ROOT / "docs" / "getting-started.md").read_text()
    for name in OPTIONS:
        assert f"| `{name}` |" in text, name


@pytest.mark.slow
def test_no_bullet_is_swallowed_into_a_paragraph(site):
    bad = []
    for page in site.glob("*.html"):
        for para in re.findall(r"<p>(.*?)</p>", page.read_text(), re.S):
            if re.search(r"\n\s*- \S", para):
                bad.append(f"{page.name}: {_text(para)[:80]}")
    assert not bad, bad


@pytest.mark.slow
def test_the_site_links_files_so_it_works_opened_from_disk(site):
    pages = sorted(site.glob("*.html"))
    assert {"index.html", "api.html", "getting-started.html"} <= {p.name for p in pages}
    for page in pages:
        if page.name == "404.html":  # served by a web server only: its links are absolute
            continue
        for href in re.findall(r'href="([^"#:?]+)(?:#[^"]*)?"', page.read_text()):
            target = (page.parent / href).resolve()
            assert target.is_file(), f"{page.name}: {href} is not a file ({target})"
