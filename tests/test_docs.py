"""The README and the guide (docs/guide/*.md, issue 36): every relative link and image of README.md and docs/**/*.md
resolves to a file of the repository, a ``#anchor`` into a markdown file to one of its headings (GitHub's slugs), and
the README stays a newcomer's page of at most 250 lines. ``make docs-check`` runs this file alone."""

import re
import sys
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (an image inside a link)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(][^)]*)?\)")
_REFDEF = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:[ \t]*(<[^>]*>|\S+)", re.M)
_HTML = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _doc_files():
    return [REPO / "README.md"] + sorted((REPO / "docs").rglob("*.md"))


def _prose_lines(text, blank_code=True):
    """(line number, line) outside fenced code blocks, inline code spans blanked (kept for headings)."""
    fenced = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fenced is None:
                fenced = m.group(1)
            elif m.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield n, _CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line) if blank_code else line


def links(text):
    """(line number, target) of every link and image of a markdown text, code excluded; a link's text may run over
    lines."""
    lines = [""] * len(text.splitlines())
    for n, line in _prose_lines(text):
        lines[n - 1] = line
    prose = "\n".join(lines)
    found = []
    for rx in (_INLINE, _REFDEF, _HTML):
        for m in rx.finditer(prose):
            found.append((prose.count("\n", 0, m.start(1)) + 1, m.group(1).strip("<>")))
    return sorted(found)


def slug(heading):
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link or image: its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return text.replace(" ", "-")


def anchors(path):
    """The anchors GitHub gives a markdown file's headings (a repeated slug gets -1, -2, ...)."""
    seen, out = {}, set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8"), blank_code=False):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        if s in seen:
            seen[s] += 1
            s = f"{s}-{seen[s]}"
        else:
            seen[s] = 0
        out.add(s)
    return out


def dead_links(path):
    """'file:line: target (why)' for every relative link of ``path`` that does not resolve."""
    dead, cache = [], {}
    for n, target in links(path.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target) or target.startswith("//"):
            continue
        rel, _, anchor = target.partition("#")
        rel = unquote(rel.split("?")[0])
        dest = path if not rel else (REPO / rel.lstrip("/") if rel.startswith("/") else path.parent / rel).resolve()
        where = f"{path.relative_to(REPO)}:{n}: {target}"
        if not dest.exists():
            dead.append(f"{where} (no such file)")
        elif REPO not in dest.parents and dest != REPO:
            dead.append(f"{where} (outside the repository)")
        elif anchor and dest.suffix == ".md":
            if dest not in cache:
                cache[dest] = anchors(dest)
            if unquote(anchor).lower() not in cache[dest]:
                dead.append(f"{where} (no heading with that anchor)")
    return dead


def test_every_link_and_image_of_the_readme_and_docs_resolves():
    files = _doc_files()
    assert (REPO / "docs" / "guide" / "index.md") in files
    dead = [d for f in files for d in dead_links(f)]
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_readme_is_a_newcomers_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: " \
                                           "move reference into a docs/guide page"
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text and "docs/guide/index.md" in text


def test_every_guide_page_is_listed_in_the_index():
    index = (REPO / "docs" / "guide" / "index.md").read_text(encoding="utf-8")
    listed = {t.split("#")[0] for _, t in links(index)}
    missing = [p.name for p in sorted((REPO / "docs" / "guide").glob("*.md"))
               if p.name != "index.md" and p.name not in listed]
    assert not missing, f"docs/guide/index.md does not list {missing}"


@pytest.mark.parametrize("heading,expected", [
    ("The training device: memory, several GPUs, speed", "the-training-device-memory-several-gpus-speed"),
    ("On a GPU: `make gpu-check`", "on-a-gpu-make-gpu-check"),
    ("The paper's own protocol", "the-papers-own-protocol"),
    ("Is BCD as good as full training? (the validity suite)", "is-bcd-as-good-as-full-training-the-validity-suite"),
    ("Spend, stop rules, and comparing runs", "spend-stop-rules-and-comparing-runs"),
    ("a_b -- c", "a_b----c"),
])
def test_slugs_are_githubs(heading, expected):
    assert slug(heading) == expected


def test_a_dead_link_a_missing_image_and_a_wrong_anchor_are_found(tmp_path, monkeypatch):
    """The check itself: each kind of dead link is reported with its file and line; code is not read as links."""
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words\n\n## Two words\n\n## On a GPU: `make gpu-check`\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#two-words-1) [ok](docs/a.md#on-a-gpu-make-gpu-check) [ok](#here) ![ok](docs/a.md) [web](https://x.invalid/nope)\n"
                    "# Here\n"
                    "[gone](docs/b.md)\n"
                    "![gone](docs/ui/none.png)\n"
                    "[bad anchor](docs/a.md#three-words)\n"
                    "`[code](not/a/link.md)`\n"
                    "```\n[fenced](not/a/link.md)\n```\n"
                    "[up](../outside.md)\n"
                    "[over two\nlines](docs/c.md)\n")
    (tmp_path.parent / "outside.md").write_text("x")
    assert dead_links(page) == ["README.md:3: docs/b.md (no such file)",
                                "README.md:4: docs/ui/none.png (no such file)",
                                "README.md:5: docs/a.md#three-words (no heading with that anchor)",
                                "README.md:10: ../outside.md (outside the repository)",
                                "README.md:12: docs/c.md (no such file)"]


def test_the_planning_guides_tables_are_what_the_planner_prints_today(capsys):
    """docs/guide/planning-a-run.md's three scales (commands and table) are generated by benchmarks/plan_tables.py;
    a planner change that moves a figure fails here until the guide is regenerated (``--write``)."""
    from benchmarks import plan_tables

    assert plan_tables.main(["--check"]) == 0, capsys.readouterr().err
