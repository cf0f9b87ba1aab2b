"""Opens the built course site from disk in headless Chromium with the network cut off, and
fails when a page asks for anything outside the site folder, when a page or the search does
not work, or when the browser is missing:

    python tests/docs/offline_site.py site

Every request of every page is intercepted: a ``file://`` URL inside the site folder goes
through (reported when the file is missing), any other one (Google Fonts, a CDN, http, a file
outside the site) is refused and reported, and the host resolver maps every name to nowhere
so that nothing a route misses can leave the machine either. On the English and the Japanese
home page the search is used as a reader would (type a word) and must list results; the maths
must be typeset by the bundled KaTeX.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from playwright.sync_api import sync_playwright

# Waits on a page: hang guards, far above their time on a busy 2-core machine.
HANG_MS = 120_000
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-proxy-server",
        "--host-resolver-rules=MAP * ~NOTFOUND"]
SEARCHES = {"index.html": "softmax", "ja/index.html": "アテンション"}
MATHS_PAGE = "tutorials/01-attention.html"


class OfflineError(Exception):
    """The site asked for something outside its folder, or a page or the search failed."""


def chromium() -> str:
    """The Chromium binary on PATH; an ``OfflineError`` (not a skip) when there is none."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise OfflineError("no chromium on PATH: the offline check of the site needs it "
                           "(Debian: apt-get install chromium)")
    return found


def check_site(site: Path, pages: list[str] | None = None,
               searches: dict[str, str] = SEARCHES) -> list[str]:
    """Open ``pages`` (paths relative to ``site``; every ``.html`` file but the server's
    ``404.html`` by default), search on the pages named in ``searches`` for their word, and
    return one line per problem: a request that would leave the site, a script error, a search
    that lists nothing. An empty list means the site works with no network."""
    site = site.resolve()
    if not (site / "index.html").is_file():
        raise OfflineError(f"site={str(site)!r} has no index.html: build it first (make docs)")
    # 404.html is served by a web server for any missing path, so its links are absolute.
    names = pages or sorted(str(p.relative_to(site)) for p in site.rglob("*.html")
                            if p.name != "404.html")
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=ARGS, headless=True)
        context = browser.new_context(service_workers="block")
        context.set_default_timeout(HANG_MS)

        def route(request_route):
            url = request_route.request.url
            if not _inside(url, site):
                problems.append(f"{current[0]}: asks for {url}")
                request_route.abort()
                return
            # Material's language switch probes a sitemap.xml beside each language's version
            # of the page (one exists only at each language's root); without it the switch
            # follows its plain link, which the i18n plugin already points at the same page.
            missing = url.startswith("file://") and not _path(url).exists()
            if missing and _path(url).name != "sitemap.xml":
                problems.append(f"{current[0]}: asks for a file the site lacks, {url}")
            request_route.continue_()

        current = [""]
        context.route("**/*", route)
        for name in names:
            current[0] = name
            page = context.new_page()
            page.on("pageerror", lambda e, name=name: problems.append(f"{name}: error {e}"))
            page.goto((site / name).as_uri(), wait_until="load")
            if name in searches:
                problems.extend(_search(page, name, searches[name]))
            if name == MATHS_PAGE and page.locator(".katex").count() == 0:
                problems.append(f"{name}: no maths typeset (KaTeX did not load)")
            page.close()
        browser.close()
    return problems


def _inside(url: str, site: Path) -> bool:
    if url.startswith(("data:", "blob:", "about:")):
        return True  # made by the page itself, nothing is fetched
    if not url.startswith("file://"):
        return False
    path = _path(url)
    return path == site or site in path.parents


def _path(url: str) -> Path:
    return Path(unquote(urlparse(url).path)).resolve()


def _search(page, name: str, word: str) -> list[str]:
    """Type ``word`` into the search as a reader would; a problem when nothing is listed (on
    file:// the search runs in a Web Worker, which without the iframe-worker shim never starts:
    the search box then stays disabled)."""
    try:
        page.locator("input[data-md-component=search-query]").fill(word, timeout=HANG_MS)
        page.locator(".md-search-result__item").first.wait_for(state="attached",
                                                              timeout=HANG_MS)
    except PlaywrightTimeoutError:
        return [f"{name}: the search for {word!r} lists nothing"]
    return []


def main(argv: list[str]) -> int:
    site = Path(argv[0] if argv else "site")
    try:
        problems = check_site(site)
    except OfflineError as error:
        print(f"offline check: {error}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"offline check: {line}", file=sys.stderr)
    pages = len(list(site.rglob("*.html"))) - 1
    print(f"offline check: {pages} pages opened from disk, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
