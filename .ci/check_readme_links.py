"""Check that every link from README.md into docs/ lands on a built page and heading.

    python .ci/check_readme_links.py SITE_DIR     # after `mkdocs build --site-dir SITE_DIR`

`mkdocs build --strict` checks the links between the docs pages; README.md is not one of
them, so its links (`docs/budgets.md#budget-forms`) are checked here against the built
site: the page must exist and carry the anchor as a heading id. Exits 1 naming each broken
link.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

LINK = re.compile(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)")


def page_of(site: Path, target: str) -> Path:
    """docs/a/b.md -> SITE/a/b/index.html; docs/a/index.md -> SITE/a/index.html."""
    rel = Path(target).relative_to("docs")
    if rel.suffix != ".md":
        return site / rel  # an image or other file, copied as is
    if rel.stem == "index":
        return site / rel.parent / "index.html"
    return site / rel.with_suffix("") / "index.html"


def main(site: Path, readme: Path) -> int:
    broken = []
    for target, anchor in LINK.findall(readme.read_text(encoding="utf-8")):
        page = page_of(site, target)
        if not page.is_file():
            broken.append(f"{target}: no such page in the built site ({page})")
        elif anchor and f'id="{anchor}"' not in page.read_text(encoding="utf-8"):
            broken.append(f"{target}#{anchor}: the page has no heading with that anchor")
    for line in broken:
        print(f"README.md: broken link {line}", file=sys.stderr)
    print(f"README.md links into docs/: {'%d broken' % len(broken) if broken else 'all found'}")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(__file__).resolve().parent.parent / "README.md"))
