"""The docs hold together: every relative link in README.md and docs/**/*.md reaches a file (and
a heading, for ``page.md#anchor``), every config field's docstring is one line of at most 160
characters, and no text tells the history of the repository's making ("session 8", "this
round", "(issue 32)")."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import gspo.config
from gspo.config.base import Section
from gspo.config.reference import field_docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")

# Phrases that date a text to a moment of its making; each is specific enough that a plain
# statement of what is true never matches it. A dated record keeps its date and commit.
HISTORY = [r"\bsessions? \d+", r"\bin (this|that|an earlier|a later) session\b",
           r"\b(this|that|last|previous|next) round\b", r"\bearlier figures\b",
           r"\bissues? #?\d+\b", r"\bmeasured in session\b"]   # an upstream bug: link its URL
HISTORY_RE = re.compile("|".join(HISTORY), re.I)


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (where brackets are code)."""
    return CODE.sub("", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    heads = re.findall(r"^#{1,6}\s+(.+?)\s*#*$", FENCE.sub("", page.read_text()), re.M)
    seen, out = {}, set()
    for head in heads:   # a repeated heading gets -1, -2 ...
        slug = _slug(head)
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def _links():
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text())):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, mailto: ...
                yield page, target


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for source, target in _links():
        if source != page:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slug_matches_github():
    assert _slug("Asynchronous rollouts (`rollout.async`)") == "asynchronous-rollouts-rolloutasync"
    assert _slug("Where the time goes: CPU, 2 cores") == "where-the-time-goes-cpu-2-cores"


def _sections():
    for module in pkgutil.iter_modules(gspo.config.__path__):
        mod = importlib.import_module(f"gspo.config.{module.name}")
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, Section) and cls.__module__ == mod.__name__:
                yield cls


def test_config_docstrings_are_one_short_line():
    long = [f"{cls.__name__}.{name} ({len(info.description or '')} chars)"
            for cls in _sections() for name, info in cls.model_fields.items()
            if len(info.description or "") > 160 or "\n" in (info.description or "")]
    assert not long, "explain in the docs page of the package, keep one line: " + ", ".join(long)


def test_every_leaf_field_has_a_docstring():
    assert [key for key, _, doc in field_docs() if not doc] == []


def _texts():
    for page in PAGES:
        yield page
    for folder in ("src", "benchmarks", "configs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".yaml", ".yml", ".md", ".sh"):
                yield path


def test_no_history_wording():
    hits = []
    for path in _texts():
        for n, line in enumerate(path.read_text().splitlines(), 1):
            match = HISTORY_RE.search(line)
            if match:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {match.group(0)!r}")
    assert not hits, "say what is true, not when it was made:\n" + "\n".join(hits)


@pytest.mark.parametrize("line", ["Measured in session 8, after ...", "Reliability, this round",
                                  "(earlier figures: 40 s)", "a fix (issue 32)", "issue #10's work"])
def test_history_patterns_match(line):
    assert HISTORY_RE.search(line)


@pytest.mark.parametrize("line", ["a Ray session starts", "rounded to int8", "round-trip",
                                  "see the GitHub issue tracker", "the first round of refills"])
def test_history_patterns_spare_plain_text(line):
    assert not HISTORY_RE.search(line)


def test_train_help_lists_config_fields():
    from gspo.cli import config_fields_help
    text = config_fields_help(100)
    assert "\nrollout:" in text and "\n  engine=hf " in text         # grouped by section
    assert not re.search(r"^\s+rollout\.engine=", text, re.M)
    assert max(len(line) for line in text.splitlines()) <= 100
