"""docs/cli.md documents every command, every subcommand and every long option.

The parsers are the commands' own: each command's function is called with a patched
``ArgumentParser.parse_args`` that hands back the parser instead of parsing, so what
is checked is exactly what ``splitinfer COMMAND --help`` shows (hidden options aside).
"""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from splitinfer.cli import COMMANDS

CLI_MD = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
_HEADING = re.compile(r"^(#{2,3}) splitinfer (.*)$")
_WORD = re.compile(r"[a-z][a-z0-9-]*$")
# `bench` dispatches to a benchmark module; its parsers are those of the benchmarks it lists.
_BENCH_ARGV = {"e2e": ["e2e"], "wild": ["wild"]}


class _Captured(BaseException):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def _capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
    raise _Captured(self)


def _parser_of(monkeypatch: pytest.MonkeyPatch, command: str, argv: list[str]) -> argparse.ArgumentParser:
    module, func, _ = COMMANDS[command]
    fn = getattr(importlib.import_module(module), func)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", _capture)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", _capture)
    try:
        fn(argv)
    except _Captured as c:
        return c.parser
    finally:
        monkeypatch.undo()
    raise AssertionError(f"splitinfer {command} returned without parsing its arguments")


def _parsers(monkeypatch: pytest.MonkeyPatch, command: str) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every parser of ``command``, keyed by its words: ('edge',), ('edge', 'run'), ..."""
    if command == "bench":
        return {("bench", name): _parser_of(monkeypatch, command, argv) for name, argv in _BENCH_ARGV.items()}
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(words: tuple[str, ...], parser: argparse.ArgumentParser) -> None:
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                seen: set[int] = set()
                for name, sub in action.choices.items():
                    if id(sub) not in seen:
                        seen.add(id(sub))
                        walk((*words, name), sub)

    walk((command,), _parser_of(monkeypatch, command, []))
    return found


def _long_options(parser: argparse.ArgumentParser) -> list[str]:
    return [opt for action in parser._actions if action.help != argparse.SUPPRESS
            for opt in action.option_strings if opt.startswith("--") and opt != "--help"]


def _sections(text: str | None = None) -> dict[tuple[str, ...], str]:
    """docs/cli.md's `## splitinfer WORDS ...` and `### splitinfer WORDS ...` sections.

    A section runs to the next heading of its level or above; its words are the lower-case
    words after `splitinfer` up to the first argument (MODEL, [--json], ...).
    """
    lines = (CLI_MD.read_text(encoding="utf-8") if text is None else text).splitlines()
    heads = [(i, len(m.group(1)), m.group(2)) for i, line in enumerate(lines) if (m := _HEADING.match(line))]
    levels = [(i, len(line) - len(line.lstrip("#"))) for i, line in enumerate(lines) if line.startswith("#")]
    sections: dict[tuple[str, ...], str] = {}
    for i, level, rest in heads:
        words = []
        for token in rest.replace("`", "").split():
            if not _WORD.match(token):
                break
            words.append(token)
        end = next((j for j, lv in levels if j > i and lv <= level), len(lines))
        key = tuple(words)
        sections[key] = sections.get(key, "") + "\n".join(lines[i:end]) + "\n"
    return sections


def _text_of(sections: dict[tuple[str, ...], str], words: tuple[str, ...]) -> str:
    return "".join(text for key, text in sections.items() if key[:len(words)] == words)


def _mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_cli_md_has_a_section_for_no_command_that_does_not_exist():
    stale = sorted({key[0] for key in _sections() if key} - set(COMMANDS))
    assert not stale, f"docs/cli.md documents commands that splitinfer does not have: {stale}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cli_md_documents_every_command_subcommand_and_long_option(command, monkeypatch):
    sections = _sections()
    assert any(key[:1] == (command,) for key in sections), (
        f"docs/cli.md has no '## splitinfer {command} ...' section")
    gives_exit_codes = re.search(r"\bexit", _text_of(sections, (command,)), re.IGNORECASE) is not None
    assert gives_exit_codes, (
        f"docs/cli.md's section for {command} does not give its exit codes")
    # Options a command's subcommands share may be given once, before its first subsection.
    intro = sections.get((command,), "").split("\n### ")[0]
    for words, parser in _parsers(monkeypatch, command).items():
        if len(words) > 1:
            assert words in sections, f"docs/cli.md has no '### splitinfer {' '.join(words)} ...' section"
        text = _text_of(sections, words) + (intro if len(words) > 1 else "")
        missing = [opt for opt in _long_options(parser) if not _mentions(text, opt)]
        assert not missing, f"docs/cli.md's section for 'splitinfer {' '.join(words)}' does not mention {missing}"


def _prose(text: str) -> str:
    """The text outside fenced code blocks (examples may show other commands' options)."""
    return "".join(part for i, part in enumerate(text.split("```")) if i % 2 == 0)


def _stale(command: str, sections: dict[tuple[str, ...], str],
           parsers: dict[tuple[str, ...], argparse.ArgumentParser]) -> list[str]:
    defined = {opt for parser in parsers.values() for opt in _long_options(parser)}
    mentioned = {opt for words, text in sections.items() if words[:1] == (command,)
                 for opt in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", _prose(text))}
    return sorted(mentioned - defined - {"--help"})


@pytest.mark.parametrize("command", list(COMMANDS))
def test_cli_md_mentions_no_option_the_command_does_not_have(command, monkeypatch):
    """A renamed or removed option does not linger in the page."""
    stale = _stale(command, _sections(), _parsers(monkeypatch, command))
    assert not stale, f"docs/cli.md's section for {command} mentions options it does not have: {stale}"


def test_the_checks_find_a_missing_and_a_stale_option(monkeypatch):
    """The checks can fail: an option left out of a section, or one a command lacks, is caught."""
    parsers = _parsers(monkeypatch, "netem")
    assert "--trace" in _long_options(parsers[("netem",)])
    text = re.sub(r"(?<![\w-])--trace(?![\w-])", "--tr", _text_of(_sections(), ("netem",)))
    assert not _mentions(text, "--trace") and _mentions(text, "--loop")
    assert _stale("netem", _sections(text), parsers) == ["--tr"]
