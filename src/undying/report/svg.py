"""A minimal SVG writer: elements collected as text, numbers rounded, the standalone document around them.

Knows nothing of runs; ``undying.report.timeline`` draws with it. Runs in the CLI process
(``undying report``, ``undying demo``), never in the job.
"""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr


class SvgDrawing:
    """Collects SVG elements in drawing order; every number is rounded so the file stays small.

    Attribute names are written Python-style: ``font_size`` becomes ``font-size`` and a
    trailing underscore is dropped (``class_``); attributes set to ``None`` are left out.
    """

    def __init__(self) -> None:
        self.parts: list[str] = []

    def add(self, tag: str, text: str | None = None, **attributes: object) -> None:
        rendered = " ".join(
            f"{name.rstrip('_').replace('_', '-')}={quoteattr(fmt(value))}"
            for name, value in attributes.items()
            if value is not None
        )
        if text is None:
            self.parts.append(f"<{tag} {rendered}/>")
        else:
            self.parts.append(f"<{tag} {rendered}>{escape(text)}</{tag}>")

    def text(self, x: float, y: float, content: str, size: int = 12, **attributes: object) -> None:
        self.add("text", content, x=x, y=y, font_size=size, **attributes)

    def document(self, width: int, height: int, font: str) -> str:
        """The standalone ``<svg>`` file holding every element added so far."""
        body = "\n".join(self.parts)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="{font}">\n{body}\n</svg>\n'
        )


def fmt(value: object) -> str:
    """A float with at most one decimal and no trailing zeros; anything else as ``str``."""
    if isinstance(value, float):
        return f"{value:.1f}".rstrip("0").rstrip(".")
    return str(value)
