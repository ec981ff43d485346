"""mkdocs hook: the status-code table of troubleshooting.md, generated from the code.

The table (code, value, exception class, builtin it also is, whether this library
produces it) is built from ``aiodatadist.errors.LLMStatusCode`` at build time, so it
is always complete; "produced here" is read from the hand-written sections (a section
that starts with ``*Not produced`` marks its code as kept for compatibility only).
The explanations under it are written by hand; the hook checks that every code
has its own ``### LLM_...`` section and emits a warning (an error under
``mkdocs build --strict``) for one that is missing or stale.
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger("mkdocs.hooks.status_codes")

PAGE = "troubleshooting.md"
MARKER = "<!-- status-code-table -->"
_HEADING = re.compile(r"^### (LLM_[A-Z_]+)\s*$", re.MULTILINE)


def _sections(markdown: str) -> dict[str, str]:
    """``{code name: the text of its ### section}``."""
    found = list(_HEADING.finditer(markdown))
    ends = [m.start() for m in found[1:]] + [len(markdown)]
    return {m.group(1): markdown[m.end() : end].strip() for m, end in zip(found, ends, strict=True)}


def _table(sections: dict[str, str]) -> tuple[str, list[str]]:
    from aiodatadist.errors import LLMException, LLMStatusCode

    rows = [
        "| status code | value | raised as | also a | produced here |",
        "| --- | --- | --- | --- | --- |",
    ]
    names = []
    for code in LLMStatusCode:
        names.append(code.name)
        # Upstream writes the GE codes in hex and the ACL ones (507053) in decimal.
        value = f"`0x{int(code):X}`" if int(code) >= 0x10000000 else f"`{int(code)}`"
        if code == LLMStatusCode.LLM_SUCCESS:
            cls, builtin = "(no exception)", ""
        else:
            exc_type = type(LLMException("", status_code=code))
            cls = f"`{exc_type.__name__}`"
            extra = [
                b.__name__
                for b in exc_type.__mro__[1:]
                if not issubclass(b, LLMException) and b.__module__ == "builtins"
            ]
            # Every LLMException is a RuntimeError; name the more specific builtin.
            builtin = ", ".join(
                f"`{n}`"
                for n in extra
                if n not in ("Exception", "BaseException", "object", "OSError")
            )
        produced = "no" if sections.get(code.name, "").startswith("*Not produced") else "yes"
        anchor = code.name.lower()
        rows.append(f"| [`{code.name}`](#{anchor}) | {value} | {cls} | {builtin} | {produced} |")
    return "\n".join(rows), names


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        log.warning("%s: the marker %s is missing", PAGE, MARKER)
        return markdown
    sections = _sections(markdown)
    table, names = _table(sections)
    written = list(sections)
    for name in names:
        if name not in written:
            log.warning("%s: no '### %s' section for LLMStatusCode.%s", PAGE, name, name)
    for name in written:
        if name not in names:
            log.warning("%s: section '### %s' names no LLMStatusCode member", PAGE, name)
    return markdown.replace(MARKER, table)
