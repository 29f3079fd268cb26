"""mkdocs hooks (mkdocs.yml, ``hooks:``): the site is built from docs/, README.md (its home
page) and config/README.md (the config reference), each kept in one place.

README.md and config/README.md stay where GitHub and the Snakemake workflow catalog read them
(the catalog shows config/README.md as the workflow's configuration); the site takes them as
``index.md`` and ``config.md``. Every relative link is written for the file that holds it, as
on GitHub: here it is pointed at that file's page in the site, or, for a repository file that
is no page (``config/examples/quiz.yaml``), at a copy of it under ``repo/``. A link to a file
that does not exist is left as written, so ``mkdocs build --strict`` fails on it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[1]
# repository path -> the page's path in the site, for the pages that live outside docs/
PAGES_OUTSIDE_DOCS = {"README.md": "index.md", "config/README.md": "config.md"}
COPIES = "repo"  # repository files a page links to that are no page: their copies in the site
LINK = re.compile(r"\]\(([^)\s]+)\)")  # as tests/test_docs.py reads links


def _repo_path(site_path: str) -> str:
    """Where a page of the site lives in the repository."""
    for repo_path, page in PAGES_OUTSIDE_DOCS.items():
        if page == site_path:
            return repo_path
    return f"docs/{site_path}"


def _site_target(repo_path: str) -> str | None:
    """The site path a link to ``repo_path`` goes to; None when nothing exists there."""
    if repo_path in PAGES_OUTSIDE_DOCS:
        return PAGES_OUTSIDE_DOCS[repo_path]
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    if (REPO / repo_path).is_file():
        return f"{COPIES}/{repo_path}"
    return None


def _links(markdown: str, page_repo_path: str):
    """(link as written, target's repository path, #fragment) of every relative link."""
    here = posixpath.dirname(page_repo_path)
    for target in LINK.findall(markdown):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the same page
        path, _, fragment = target.partition("#")
        yield target, posixpath.normpath(posixpath.join(here, path)), fragment


def on_files(files, config):
    for repo_path, page in PAGES_OUTSIDE_DOCS.items():
        files.append(File.generated(config, page, abs_src_path=str(REPO / repo_path)))
    copied = set()
    for file in list(files.documentation_pages()):
        markdown = Path(file.abs_src_path).read_text(encoding="utf-8")
        for _, repo_path, _ in _links(markdown, _repo_path(file.src_uri)):
            site = _site_target(repo_path)
            if site and site.startswith(f"{COPIES}/") and site not in copied:
                copied.add(site)
                files.append(File.generated(config, site, abs_src_path=str(REPO / repo_path)))
    return files


def on_page_markdown(markdown, page, config, files):
    here = posixpath.dirname(page.file.src_uri)
    for written, repo_path, fragment in set(_links(markdown, _repo_path(page.file.src_uri))):
        site = _site_target(repo_path)
        if site is None:
            continue  # broken: mkdocs --strict names it
        relative = posixpath.relpath(site, here or ".")
        markdown = markdown.replace(f"]({written})", f"]({relative}{'#' + fragment if fragment else ''})")
    return markdown
