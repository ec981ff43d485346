"""mkdocs hook: render the package's Sphinx-style roles as plain code in the API reference.

The docstrings say :class:`LLMException` and :class:`~aiodatadist.errors.LLMParamError`
(readable in ``help()`` and editors); mkdocstrings renders the role's text literally.
This drops the role prefix and shortens ``~a.b.C`` to ``C``, as Sphinx would show it.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|data|mod|exc|obj|const):(?=<code>)")
_TILDE = re.compile(r"<code>~(?:\w+\.)*(\w+)</code>")


def on_page_content(html: str, page: Any, **_: Any) -> str:
    if not page.file.src_uri.startswith("reference/"):
        return html
    return _TILDE.sub(r"<code>\1</code>", _ROLE.sub("", html))
