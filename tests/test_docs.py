"""The repository's documents: every document a file cites exists, with the cited section;
docs/ keeps its shape (a short results page, raw records in docs/records/)."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCANNED = (".py", ".md", ".toml", ".yaml", ".yml")
SKIPPED_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".carry", ".whl"}
# A bare document name is looked up beside the citing file, at the root and in docs/.
BASES = ("", "docs")

_DOC_PATH = re.compile(r"(?<![\w$/.-])((?:\.{1,2}/|[\w-]+/)*[\w-]+\.md)\b")
_RECORD_PATH = re.compile(r"(?<![\w$/.-])(docs/[\w./-]+\.(?:json|png|md))\b")
# Names of specification or note documents that are cited without their ".md".
_DOC_NAME = re.compile(r"\b([A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*_(?:SPEC|NOTES))\b")
_SECTION = re.compile(r"([\w./-]+\.md)\s*§\s*(\d+(?:\.\d+)?)")
_QUOTED = re.compile(r"([\w./-]+\.md)\)?,?\s+\"([^\"\n]{3,60})\"")
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def tracked_files(root: Path) -> list[Path]:
    """The repository's text files of the scanned kinds (git's list when there is one)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True,
                             check=True).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
            rel = Path(folder).relative_to(root)
            names.extend(str(rel / f) for f in files)
    return sorted(root / n for n in names if n.endswith(SCANNED) and (root / n).is_file())


def cited_text(path: Path) -> str:
    """The part of a file that can cite documents: all of a text file; a Python file's
    comments and docstrings (its other strings are data, e.g. a test's file names)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return text
    parts = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            parts.append(tok.string)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    return "\n".join(parts)


def _resolve(root: Path, citing: Path, target: str) -> Path | None:
    for base in (citing.parent, *(root / b for b in BASES)):
        candidate = (base / target).resolve()
        if candidate.exists():
            return candidate
    return None


def _headings(doc: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in doc.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.lower())
    return text.replace(" ", "-")


def citation_problems(root: Path, files: list[Path] | None = None) -> list[str]:
    """Every citation in ``files`` (default: the tracked files) whose document, section or
    link target is missing, as ``"<file>: <what>"``."""
    problems: list[str] = []
    names = {p.name for p in tracked_files(root)} if files is None else {p.name for p in files}
    for path in tracked_files(root) if files is None else files:
        rel = path.relative_to(root)
        text = cited_text(path)
        for target in set(_DOC_PATH.findall(text)) | set(_RECORD_PATH.findall(text)):
            if _resolve(root, path, target) is None:
                problems.append(f"{rel}: cites {target}, which is not in the repository")
        for name in set(_DOC_NAME.findall(text)):
            if f"{name}.md" not in names:
                problems.append(f"{rel}: cites {name}, which is not in the repository")
        for target, section in set(_SECTION.findall(text)):
            doc = _resolve(root, path, target)
            if doc is not None and not any(re.match(rf"{re.escape(section)}\b\.?(\s|$)", h)
                                           for h in _headings(doc)):
                problems.append(f"{rel}: cites {target} §{section}, which has no such section")
        for target, title in set(_QUOTED.findall(text)):
            doc = _resolve(root, path, target)
            if doc is not None and title[0].isupper() and not any(
                    title.lower() in h.lower() for h in _headings(doc)):
                problems.append(f"{rel}: cites {target} \"{title}\", which has no such section")
        if path.suffix == ".md":
            for link in set(_LINK.findall(text)):
                if re.match(r"[a-z]+:", link):
                    continue  # http(s), mailto: outside the repository
                target, _, anchor = link.partition("#")
                doc = path if not target else (path.parent / target).resolve()
                if not doc.exists():
                    problems.append(f"{rel}: links to {link}, which does not exist")
                elif anchor and doc.suffix == ".md" and anchor not in {
                        _slug(h) for h in _headings(doc)}:
                    problems.append(f"{rel}: links to {link}, which has no such anchor")
    return sorted(problems)


def test_every_cited_document_exists():
    problems = citation_problems(ROOT)
    assert not problems, "\n".join(problems)


def test_a_bogus_citation_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "real.md").write_text("# Real\n\n## 2. Steps\n\n## Output schema\n")
    (tmp_path / "good.py").write_text(
        '"""See docs/real.md §2 and real.md, "Output schema"."""\n'
        "# links: [x](docs/real.md#2-steps)\n"
        'path = "tmp/notes.md"  # a string literal is data, not a citation\n')
    (tmp_path / "bad.py").write_text(
        '"""Rules of ' + "SAMPLER" + '_SPEC §1; see docs/missing.md."""\n'
        "# and docs/real.md §7, docs/records/gone.json\n")
    (tmp_path / "docs" / "page.md").write_text(
        "[ok](real.md#2-steps) [gone](records/nope.png) [anchor](real.md#9-none) "
        'and docs/real.md, "Missing section"\n')
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    problems = citation_problems(tmp_path, files)
    assert problems == sorted([
        "bad.py: cites " + "SAMPLER" + "_SPEC, which is not in the repository",
        "bad.py: cites docs/missing.md, which is not in the repository",
        "bad.py: cites docs/real.md §7, which has no such section",
        "bad.py: cites docs/records/gone.json, which is not in the repository",
        "docs/page.md: links to records/nope.png, which does not exist",
        "docs/page.md: links to real.md#9-none, which has no such anchor",
        'docs/page.md: cites docs/real.md "Missing section", which has no such section',
    ])


@pytest.mark.parametrize("heading, slug", [("3. Logprobs", "3-logprobs"),
                                           ("Output schema", "output-schema"),
                                           ("2.1 Step 1: raw snapshot", "21-step-1-raw-snapshot")])
def test_anchor_slugs_follow_github(heading, slug):
    assert _slug(heading) == slug


def test_benchmarks_page_is_a_short_results_page():
    lines = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines (at most 400)"


def test_no_json_records_directly_in_docs():
    loose = sorted(p.name for p in (ROOT / "docs").glob("*.json"))
    assert not loose, f"JSON records belong in docs/records/, found in docs/: {loose}"
