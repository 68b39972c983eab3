"""The documentation site: built as a user builds it, then looked at in a real browser.

``bash .ci/dev docs`` (Sphinx, warnings are errors) builds ``docs/`` once for this module; the
tests read the HTML it wrote, and open the tutorial and the API page in headless Chromium
(Debian's ``chromium``, which ``.ci/run`` installs; as root with ``--no-sandbox``, every host
unresolvable, so a page that needs the network shows it). Without Chromium the browser test is
skipped and says so; the build and its checks still run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
DEV = ROOT / ".ci" / "dev"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
# What a page may not load from elsewhere: scripts, stylesheets, images, fonts, frames.
REMOTE_LOAD = re.compile(
    r"""<(?:script|img|iframe|source)\b[^>]*\bsrc=["']?(?:https?:)?//"""
    r"""|<link\b[^>]*\bhref=["']?(?:https?:)?//"""
    r"""|url\(\s*["']?(?:https?:)?//"""
    r"""|@import\s+["']?(?:https?:)?//""",
    re.IGNORECASE,
)


def build(source: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``bash .ci/dev docs --no-venv OUT`` with this interpreter, as a user (or CI) runs it."""
    env = {**os.environ, "PYTHON": sys.executable}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = ["bash", str(DEV), "docs", "--no-venv", str(out)]
    if source != ROOT / "docs":
        # the same build on a copy of the pages (.ci/dev builds <checkout>/docs)
        cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q", "-b"]
        cmd += ["html", str(source), str(out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("docs-site") / "html"
    done = build(ROOT / "docs", out)
    assert done.returncode == 0, f"the docs build failed:\n{done.stdout}\n{done.stderr}"
    return out


def test_every_page_is_built_and_reachable(site: Path) -> None:
    pages = sorted(p.relative_to(ROOT / "docs").with_suffix("") for p in (ROOT / "docs").rglob("*.md"))
    pages = [p for p in pages if p.parts[0] not in ("_build", "examples")]
    assert pages, "docs/ has no pages"
    index = (site / "index.html").read_text(encoding="utf-8")
    for page in pages:
        html = (site / page).with_suffix(".html")
        assert html.is_file(), f"{page}.md was not built"
        # Furo paints a red error over a `contents` directive (its sidebar lists the sections)
        assert 'class="contents' not in html.read_text(encoding="utf-8"), f"{page}: a contents directive"
        if page.name != "index":
            assert f'href="{page.as_posix()}.html"' in index, f"{page} is not in the navigation"


def test_nothing_is_fetched_from_elsewhere(site: Path) -> None:
    """No script, stylesheet, font or image from another host: CI and many clusters have no
    internet, and a page must look the same there."""
    offenders = []
    for path in site.rglob("*"):
        if path.suffix in (".html", ".css", ".js") and path.is_file():
            for match in REMOTE_LOAD.finditer(path.read_text(encoding="utf-8", errors="replace")):
                offenders.append(f"{path.relative_to(site)}: {match.group(0)}")
    assert not offenders, "remote loads:\n" + "\n".join(offenders[:20])


def test_a_broken_reference_fails_the_build(tmp_path: Path) -> None:
    """Warnings are errors: a reference to an API name that does not exist stops the build
    (one page with the site's own configuration)."""
    pages = tmp_path / "docs"
    pages.mkdir()
    shutil.copy(ROOT / "docs" / "conf.py", pages)
    shutil.copytree(ROOT / "docs" / "_ext", pages / "_ext")
    (pages / "_static").mkdir()
    (pages / "index.md").write_text("# A page\n\nSee {py:class}`resilient.NoSuchThing`.\n")
    done = build(pages, tmp_path / "html")
    assert done.returncode != 0
    assert "resilient.NoSuchThing" in done.stdout + done.stderr


def chromium() -> str:
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium here (apt-get install chromium; .ci/run installs it)")


def browse(page: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    cmd += ['--host-resolver-rules=MAP * ~NOTFOUND', "--window-size=1280,900", *args]
    return subprocess.run(
        [*cmd, page.as_uri()], capture_output=True, text=True, timeout=120, check=True
    )


@pytest.mark.parametrize("page", ["tutorial", "reference/api"])
def test_the_page_in_a_browser(site: Path, page: str) -> None:
    """The DOM Chromium built holds the navigation and a highlighted code block; the
    screenshot (kept under the build folder) is a rendered page, not one colour."""
    html = site / f"{page}.html"
    dom = browse(html, "--dump-dom").stdout
    assert 'class="sidebar-tree"' in dom, "no navigation in the rendered page"
    for other in {"tutorial", "concepts", "reference/api"} - {page}:
        assert f"{Path(other).name}.html" in dom, f"the navigation has no link to {other}"
    assert re.search(r'<div class="highlight"><pre>.*?<span class="\w+">', dom, re.S), (
        "no highlighted code block"
    )

    shot = site / "_screenshots" / f"{page.replace('/', '-')}.png"
    shot.parent.mkdir(exist_ok=True)
    browse(html, f"--screenshot={shot}")
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[0] >= 800 and pixels.shape[1] >= 1200
    colours = np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0)
    assert len(colours) > 16, f"the screenshot has {len(colours)} colours: a blank page"
