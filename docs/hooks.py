"""mkdocs hook: the docstrings use Sphinx roles (:class:`~offloadopt.HybridAdamW`), which
Markdown renders as ":class:" before the code span; keep the code span, shortened after a "~"."""

import re

ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html, **kwargs):
    return ROLE.sub(lambda m: f"<code>{m[2].rsplit('.', 1)[-1] if m[1] else m[2]}</code>", html)
