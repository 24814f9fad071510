"""What every `pdserve` command's --help ends with: examples to copy, laid out as written."""

from __future__ import annotations

import argparse
from typing import Any

DOCS = "More: docs/ (README.md links every page)."


class ExamplesFormatter(argparse.HelpFormatter):
    """Fills a one-paragraph description to the terminal's width, and keeps text of several lines (the
    examples) as written: argparse would refill them into one paragraph."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def examples(*commands: str) -> dict[str, Any]:
    """`add_parser` / `ArgumentParser` keywords: an epilog of `commands`, one per line, each with an
    optional `  # what it does` comment."""
    lines = "\n".join(f"  {command}" for command in commands)
    return {"epilog": f"examples:\n{lines}\n\n{DOCS}", "formatter_class": ExamplesFormatter}
