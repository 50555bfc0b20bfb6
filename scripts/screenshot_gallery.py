"""A headless-browser screenshot of a run's gallery index (``<run dir>/gallery/index.html``), to look at it without a
desktop or to check the page after a change.

    python scripts/screenshot_gallery.py outputs/DATE/TIME                      # -> outputs/DATE/TIME/gallery/index.png
    python scripts/screenshot_gallery.py RUN_DIR --out /tmp/x.png --size 1200,900 --rebuild

``--rebuild`` writes the index again from the gallery files first (``flowgrpo.gallery.write_index``; e.g. for a run
made before the index existed). The browser is the first of ``chromium``, ``chromium-browser``, ``google-chrome`` on
the PATH (``--browser`` to name one; Debian: ``apt-get install chromium``), run as
``--headless --no-sandbox --screenshot=OUT --window-size=W,H file:///.../index.html``. Videos are given a moment
to load (``--virtual-time-budget``) so that they show a frame.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a run directory (or its gallery/ directory)")
    p.add_argument("--out", type=Path, default=None, help="the PNG to write (default: gallery/index.png)")
    p.add_argument("--size", default="1200,900", help="window width,height in pixels")
    p.add_argument("--rebuild", action="store_true", help="write index.html again from the gallery files first")
    p.add_argument("--browser", default=None, help=f"the browser executable (default: the first of {BROWSERS})")
    args = p.parse_args(argv)

    gallery = args.run_dir if args.run_dir.name == "gallery" else args.run_dir / "gallery"
    if args.rebuild:
        from flowgrpo.gallery import write_index

        write_index(gallery)
    index = gallery / "index.html"
    if not index.is_file():
        raise SystemExit(f"{index} does not exist: not a run dir with galleries? (--rebuild writes it from "
                         f"{gallery}/*/step-*.parquet)")
    browser = args.browser or next((b for b in BROWSERS if shutil.which(b)), None)
    if browser is None or not shutil.which(browser):
        raise SystemExit(f"no browser found (tried {args.browser or ', '.join(BROWSERS)}): apt-get install chromium, "
                         "or pass --browser")
    out = (args.out or gallery / "index.png").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--autoplay-policy="
           "no-user-gesture-required", "--virtual-time-budget=3000", f"--screenshot={out}",
           f"--window-size={args.size}", index.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    print(out)
    return out


if __name__ == "__main__":
    main()
