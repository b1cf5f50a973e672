"""Every relative link and every repository path in code font in the README, docs/ and the benchmark
pages names a file that exists, so a moved result or module breaks the test, not the reader."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("benchmarks/*.md"),
                *ROOT.glob("benchmarks/results/*/LATEST.md")])  # fmt: skip
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE_PATH = re.compile(r"`((?:src|benchmarks|docs|tests)/[^`\s*{}<>]+)`")


def _targets(page: Path) -> list[tuple[str, Path]]:
    text = page.read_text()
    found = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        found.append((target, (page.parent / target).resolve()))
    for target in CODE_PATH.findall(text):
        found.append((target, ROOT / target.split(":")[0].rstrip(".,;")))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_named_file_exists(page: Path):
    missing = [target for target, path in _targets(page) if not path.exists()]
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"
