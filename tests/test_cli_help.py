"""The command line teaches itself: every command's --help explains each option and ends with examples
of that command, and `pdserve --version` prints the installed version. No Ray: the parsers only."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version

import pytest

from pdserve.cluster.cli import build_parser


Command = tuple[tuple[str, ...], argparse.ArgumentParser]


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[Command]:
    """Every parser of the command line with the words that reach it: ("bench", "serve"), ..."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, (*path, name))
    return found


COMMANDS = _commands(build_parser())


def test_the_command_line_has_the_commands_the_docs_name() -> None:
    names = {" ".join(path) for path, _ in COMMANDS}
    assert {"up", "generate", "demo", "make-model", "bench", "bench serve", "bench report", "soak"} <= names


@pytest.mark.parametrize("path,parser", COMMANDS, ids=[" ".join(p) or "pdserve" for p, _ in COMMANDS])
def test_every_command_shows_examples_of_itself(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    text = parser.format_help()
    examples = text.split("examples:\n", 1)
    assert len(examples) == 2, f"pdserve {' '.join(path)} --help has no examples:\n{text}"
    lines = [line.strip() for line in examples[1].splitlines() if line.startswith("  ")]
    assert lines and all(line.startswith(" ".join(("pdserve", *path))) for line in lines), examples[1]


@pytest.mark.parametrize("path,parser", COMMANDS, ids=[" ".join(p) or "pdserve" for p, _ in COMMANDS])
def test_every_option_and_argument_says_what_it_is(path: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
    silent = [action.dest for action in parser._actions
              if not isinstance(action, argparse._SubParsersAction) and not (action.help or "").strip()]
    assert not silent, f"pdserve {' '.join(path)}: options without help text: {silent}"


def test_help_runs_from_the_installed_command() -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "up", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "examples:\n  pdserve up" in result.stdout


def test_version_prints_the_package_version() -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve.cluster.cli", "--version"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pdserve {version('pdserve')}"
