"""The package's docstrings are plain text with Markdown's inline code (`x`), `-` lists and
indented blocks; this turns them into the reStructuredText autodoc expects.

- `x` becomes an inline literal; `|`, a lone `*` and a trailing `_` are escaped outside it
  (`|x|` is a norm, `2*pi` a product, `clip_` a name, not RST substitutions, emphasis or
  link targets);
- an indented block after a line ending in ':', or indented by four more after a blank
  line (Markdown's code block), becomes a literal block (commands, formulas, tables laid
  out by hand); any other indented block, and a list, is set off by blank
  lines, except a list item's continuation lines.
"""

from __future__ import annotations

import re
from typing import List

_CODE = re.compile(r"(?<![`:\w])`([^`\n]+)`(?!`)")
_LIST = re.compile(r"^(\s*)([-*+]|\d+[.)])\s+")


def _inline(text: str) -> str:
    out, last = [], 0
    for m in _CODE.finditer(text):
        out.append(_escape(text[last:m.start()]))
        out.append(f"``{m.group(1)}``")
        last = m.end()
    out.append(_escape(text[last:]))
    return "".join(out)


def _escape(text: str) -> str:
    if "``" in text:  # already RST inline literals: leave their content alone
        parts = text.split("``")
        return "``".join(p if i % 2 else _escape(p) for i, p in enumerate(parts))
    text = text.replace("\\", "\\\\").replace("|", "\\|")
    text = re.sub(r"\*\*(?=\w)(?![^*]*\*\*)", r"\\*\\*", text)  # **kwargs, unclosed
    text = re.sub(r"(?<![*\\])\*(?!\*)", r"\\*", text)
    return re.sub(r"(?<=\w)_(?=\W|$)", r"\\_", text)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def convert(lines: List[str]) -> List[str]:
    out: List[str] = []
    literal_at = None  # indentation of the paragraph a literal block belongs to
    item_at = None     # text column of the list item being continued
    for line in lines:
        if not line.strip():
            out.append(line)
            continue
        ind = _indent(line)
        if literal_at is not None:
            if ind > literal_at:
                out.append(line)
                continue
            literal_at = None
            if out and out[-1].strip():
                out.append("")
        prev = next((p for p in reversed(out) if p.strip()), None)
        prev_blank = bool(out) and not out[-1].strip()
        m = _LIST.match(line)
        if (prev is not None and prev_blank and item_at is None and ind >= _indent(prev) + 4
                and not prev.rstrip().endswith("::")):
            # As in Markdown: a block indented by 4 more after a blank line is code.
            at = max(i for i, p in enumerate(out) if p.strip())
            if prev.rstrip().endswith(":"):
                out[at] = out[at].rstrip() + ":"
            else:
                out.insert(at + 1, "")
                out.insert(at + 2, " " * _indent(prev) + "::")
            literal_at = _indent(prev)
            out.append(line)
            continue
        if prev is not None and not prev_blank:
            pind = _indent(prev)
            if ind > pind and not (item_at is not None and ind == item_at):
                if prev.rstrip().endswith(":") and not prev.rstrip().endswith("::"):
                    out[-1] = out[-1].rstrip() + ":"
                    literal_at = pind
                    out.append("")
                    out.append(line)
                    continue
                out.append("")
            elif ind < pind and not (item_at is not None and pind == item_at):
                out.append("")
            elif m is not None and item_at is None and m.group(2) in "-*+1.1)":
                # a list right after a paragraph (as in Markdown, only a bullet or "1."
                # interrupts one: "100) scoring" continues the sentence)
                out.append("")
            elif m is None and item_at is not None and ind < item_at:  # the list ended
                out.append("")
        item_at = len(m.group(0)) if m else (item_at if item_at is not None and ind >= item_at
                                             else None)
        out.append(_inline(line))
    return out


def _process(app, what, name, obj, options, lines: List[str]) -> None:
    lines[:] = convert(lines)


def setup(app):
    app.connect("autodoc-process-docstring", _process, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
