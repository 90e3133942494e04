"""Screenshots of the main pages in headless Chromium, and a check that nothing is cut off on the right.

Run before a release (Chromium is not a dependency; on Debian: ``apt-get install chromium``)::

    python docs/screenshots.py                 # builds the site, writes site-screenshots/*.png, prints findings
    python docs/screenshots.py --width 1024    # a narrower window

For each page it saves a screenshot and measures, in the page as Chromium lays it out, every table, code block and
figure of the text column: one whose box reaches past the column's right edge is reported as cut off (a table
that scrolls sideways inside the column is not).  Exit status 1 when something is cut off.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import threading

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("", "concepts/", "tutorial/", "methods/", "running/", "async/", "api/fedpartial/",
         "reproductions/fedldf/", "reproductions/fedspu/", "benchmarks/")
# Loaded beside the site: opens a page in a same-origin iframe and writes what overflows into its own body.
PROBE = """<!doctype html><html><body><iframe id="f" style="width:%(width)dpx;height:3000px;border:0"></iframe>
<pre id="out">pending</pre><script>
const f = document.getElementById('f');
f.onload = () => {
  const d = f.contentDocument, col = d.querySelector('.md-content__inner') || d.body;
  const right = col.getBoundingClientRect().right + 1;
  const found = [];
  for (const el of d.querySelectorAll('.md-typeset table, .md-typeset pre, .md-typeset img')) {
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > right) found.push(el.tagName + ' ' + Math.round(r.right - right) + 'px: ' +
                                                  (el.textContent || el.getAttribute('src') || '').trim().slice(0, 60));
  }
  const scrolling = [...d.querySelectorAll('.md-typeset table')].filter(t => t.scrollWidth > t.clientWidth + 1).length;
  document.getElementById('out').textContent = JSON.stringify({cut: found, scrolling_tables: scrolling});
};
f.src = location.hash.slice(1);
</script></body></html>"""


def build(site: pathlib.Path) -> None:
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                   check=True, capture_output=True)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    sys.exit("no Chromium found: install it (Debian: apt-get install chromium) to take screenshots")


def serve(site: pathlib.Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def headless(browser: str, *args: str) -> str:
    # without the network switches a machine with no network refuses Chromium's background connections
    with tempfile.TemporaryDirectory() as profile:
        run = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                              "--disable-background-networking", "--disable-component-update", "--disable-sync",
                              f"--user-data-dir={profile}", "--hide-scrollbars", "--virtual-time-budget=8000", *args],
                             capture_output=True, text=True, timeout=120)
    return run.stdout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "site-screenshots"), help="folder for the PNGs")
    p.add_argument("--width", type=int, default=1280, help="window width in pixels")
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    browser = chromium()
    with tempfile.TemporaryDirectory() as tmp:
        site = pathlib.Path(tmp) / "site"
        build(site)
        (site / "_probe.html").write_text(PROBE % {"width": args.width})
        server, port = serve(site)
        bad = 0
        for page in PAGES:
            url = f"http://127.0.0.1:{port}/{page}"
            name = (page.strip("/").replace("/", "-") or "home") + ".png"
            headless(browser, f"--window-size={args.width},2400", f"--screenshot={out / name}", url)
            dom = headless(browser, "--dump-dom", f"http://127.0.0.1:{port}/_probe.html#/{page}")
            match = re.search(r'<pre id="out">(.*?)</pre>', dom, re.S)
            found = json.loads(match.group(1).replace("&quot;", '"')) if match and match.group(1) != "pending" \
                else {"cut": ["the page did not load in time"], "scrolling_tables": 0}
            bad += bool(found["cut"])
            print(f"{page or '(home)'}: {len(found['cut'])} cut off, {found['scrolling_tables']} tables scroll "
                  f"sideways; {out / name}")
            for item in found["cut"][:10]:
                print(f"    cut off: {item}")
        server.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
