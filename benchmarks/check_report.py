"""Check that a gna_lens HTML report renders in a headless Chromium with no network.

The report written by ``gna-lens scan`` (``GnaReport.to_html``) promises to work offline: inline
SVG heatmaps and circuitsvis pattern widgets whose script is embedded (no CDN). This script opens
a report in headless Chromium with every host name unresolvable, lets the page's JavaScript run,
dumps the resulting DOM and checks that

- the report references no external resource (no ``http(s)`` ``src`` / ``href``),
- the heatmap SVGs are there (``<svg class="heatmap">`` with cells),
- each circuitsvis widget was rendered by its script: its container, empty in the file, holds
  ``<canvas>`` elements and the head names only after the JavaScript ran;
- each plotly figure (``to_html(interactive=True)``), empty in the file, holds its SVG.

Optionally it also takes a screenshot (used for ``docs/assets/report.png``).

Usage::

    python benchmarks/check_report.py                          # toy model report, check only
    python benchmarks/check_report.py --screenshot docs/assets/report.png
    python benchmarks/check_report.py --model zoo-llama --screenshot out.png   # runs gna-lens scan
    python benchmarks/check_report.py --report gna_lens_report/report.html --screenshot out.png

Needs a Chromium (Debian: ``apt-get install -y chromium``); exits 2 when there is none, 1 when the
check fails, 0 when it passes. ``tests/test_report_browser.py`` runs the same check.
"""

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

#: Chromium flags: headless, no sandbox (root in containers), nothing phoning home, and every
#: host name unresolvable so that a page needing the network visibly fails.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--host-resolver-rules=MAP * ~NOTFOUND",
)
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def _stderr_tail(stderr: str, n: int = 1500) -> str:
    """The browser's stderr without the harmless D-Bus noise of a container."""
    lines = [line for line in stderr.splitlines() if "dbus" not in line.lower()]
    return "\n".join(lines)[-n:]


class ReportCheckError(Exception):
    """The report did not render as expected (the message says what was missing)."""


def find_chromium(explicit: str | None = None) -> str | None:
    """A Chromium / Chrome executable: ``explicit``, else the first of BROWSER_NAMES on PATH."""
    if explicit:
        return shutil.which(explicit)
    for name in BROWSER_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


class _Dom(HTMLParser):
    """Collects heatmap SVGs, circuitsvis containers (with their canvases and h4 titles) and
    external resource URLs."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.heatmaps: list[int] = []  # coloured cells (<rect fill='rgb(...)'>) per heatmap svg
        self.widgets: dict[str, dict[str, list[str] | int]] = {}
        self.plotly: dict[str, int] = {}  # plotly div id -> <svg class="main-svg"> inside
        self.external: list[str] = []
        # (tag, heatmap index, widget id, plotly div id) of the open elements
        self._stack: list[tuple[str, str | None, str | None, str | None]] = []
        self._in_h4: str | None = None

    def _current(self) -> tuple[str | None, str | None, str | None]:
        svg = widget = plot = None
        for _, s, w, p in self._stack:
            svg, widget, plot = s or svg, w or widget, p or plot
        return svg, widget, plot

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        for key in ("src", "href"):
            url = a.get(key) or ""
            if tag in ("script", "link", "img", "iframe") and re.match(r"(https?:)?//", url):
                self.external.append(url)
        svg, widget, plot = self._current()
        new_svg = new_widget = new_plot = None
        if tag == "svg" and "heatmap" in (a.get("class") or "").split():
            self.heatmaps.append(0)
            new_svg = str(len(self.heatmaps) - 1)
        if tag == "div" and (a.get("id") or "").startswith("circuits-vis-"):
            new_widget = str(a["id"])
            self.widgets[new_widget] = {"canvas": 0, "titles": []}
        if tag == "div" and "plotly-graph-div" in (a.get("class") or "").split():
            new_plot = a.get("id") or f"plotly-{len(self.plotly)}"
            self.plotly[new_plot] = 0
        if tag == "svg" and plot is not None and "main-svg" in (a.get("class") or "").split():
            self.plotly[plot] += 1
        if tag == "rect" and svg is not None and (a.get("fill") or "").startswith("rgb("):
            self.heatmaps[int(svg)] += 1
        if tag == "canvas" and widget is not None:
            self.widgets[widget]["canvas"] += 1  # type: ignore[operator]
        if tag == "h4" and widget is not None:
            self._in_h4 = widget
        if tag not in ("rect", "canvas", "img", "br", "meta", "link", "input", "path"):
            self._stack.append((tag, new_svg, new_widget, new_plot))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if self._stack and self._stack[-1][0] == tag:
            self._stack.pop()

    def handle_endtag(self, tag: str) -> None:
        if tag == "h4":
            self._in_h4 = None
        for i in range(len(self._stack) - 1, -1, -1):
            if self._stack[i][0] == tag:
                del self._stack[i:]
                break

    def handle_data(self, data: str) -> None:
        if self._in_h4 is not None and data.strip():
            self.widgets[self._in_h4]["titles"].append(data.strip())  # type: ignore[union-attr]


@dataclass
class CheckResult:
    """What the rendered report showed."""

    report: Path
    heatmaps: list[int]
    widgets: dict[str, dict[str, list[str] | int]]
    plotly: dict[str, int]
    seconds: float
    screenshot: Path | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [
            f"report: {self.report} ({self.report.stat().st_size / 1e6:.2f} MB)",
            f"heatmap SVGs: {len(self.heatmaps)} (cells: {self.heatmaps})",
        ]
        for wid, w in self.widgets.items():
            lines.append(f"circuitsvis widget {wid}: {w['canvas']} canvases, heads {w['titles']}")
        if self.plotly:
            lines.append(f"plotly figures rendered: {len(self.plotly)}")
        lines.append(f"chromium render: {self.seconds:.1f} s")
        if self.screenshot:
            lines.append(f"screenshot: {self.screenshot}")
        return "\n".join(lines + self.notes)


def parse(html_text: str) -> _Dom:
    dom = _Dom()
    dom.feed(html_text)
    dom.close()
    return dom


def run_chromium(
    chromium: str,
    url: str,
    *,
    extra: list[str],
    budget_ms: int = 5000,
    timeout: float = 120.0,
) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium once on ``url`` with a fresh profile folder."""
    with tempfile.TemporaryDirectory(prefix="gna_lens_chromium_") as profile:
        cmd = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--virtual-time-budget={budget_ms}",
            *extra,
            url,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def check_report(
    report: str | Path,
    *,
    chromium: str | None = None,
    screenshot: str | Path | None = None,
    window: tuple[int, int] = (1200, 1500),
    budget_ms: int = 5000,
) -> CheckResult:
    """Render ``report`` offline in headless Chromium and check heatmaps and widgets.

    Args:
        report: The report HTML file.
        chromium: The browser executable (default: :func:`find_chromium`).
        screenshot: Also write a PNG screenshot of the top ``window`` of the page here.
        window: Window size ``(width, height)`` for the screenshot.
        budget_ms: Virtual time the page's scripts get before the DOM is dumped.

    Returns:
        A :class:`CheckResult`.

    Raises:
        FileNotFoundError: For a missing report or browser.
        ReportCheckError: When the report references the network, lacks heatmaps, or a widget
            did not render.
    """
    report = Path(report).resolve()
    if not report.is_file():
        raise FileNotFoundError(f"check_report: no report at {str(report)!r}.")
    exe = find_chromium(chromium)
    if exe is None:
        raise FileNotFoundError(
            f"check_report: no Chromium found (looked for {chromium or list(BROWSER_NAMES)} on "
            "PATH); install one: apt-get install -y chromium."
        )
    source = parse(report.read_text(encoding="utf-8"))
    if source.external:
        raise ReportCheckError(
            f"{report} loads external resources {source.external[:5]}; the report must be "
            "self-contained."
        )
    empty = [w for w, v in source.widgets.items() if v["canvas"] or v["titles"]]
    empty += [p for p, n in source.plotly.items() if n]
    if empty:  # otherwise the check below would not prove that the JavaScript ran
        raise ReportCheckError(f"widget containers {empty} already have content in the file.")
    t0 = time.perf_counter()
    proc = run_chromium(exe, report.as_uri(), extra=["--dump-dom"], budget_ms=budget_ms)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0 or "<html" not in proc.stdout:
        raise ReportCheckError(
            f"{exe} --dump-dom {report} failed (exit {proc.returncode}): {_stderr_tail(proc.stderr)}"
        )
    dom = parse(proc.stdout)
    problems = []
    if not dom.heatmaps or not all(dom.heatmaps):
        problems.append(f"heatmap SVGs with cells: {dom.heatmaps} (expected >= 1, all non-empty)")
    if not dom.widgets:
        problems.append("no circuitsvis widget container (div id='circuits-vis-...') in the DOM")
    for wid, w in dom.widgets.items():
        if not w["canvas"] or not w["titles"]:
            problems.append(
                f"circuitsvis widget {wid} did not render: {w['canvas']} canvases, titles "
                f"{w['titles']} (its script did not run or failed offline)"
            )
    problems += [
        f"plotly figure {p} did not render (no <svg class='main-svg'>)"
        for p, n in dom.plotly.items()
        if not n
    ]
    if len(dom.plotly) != len(source.plotly):
        problems.append(
            f"plotly figures: {len(source.plotly)} in the file, {len(dom.plotly)} shown"
        )
    if problems:
        raise ReportCheckError(
            f"{report} rendered by {exe}:\n- " + "\n- ".join(problems) + "\nbrowser stderr (tail): "
            f"{_stderr_tail(proc.stderr)}"
        )
    result = CheckResult(report, dom.heatmaps, dom.widgets, dom.plotly, seconds)
    if screenshot is not None:
        shot = Path(screenshot).resolve()
        shot.parent.mkdir(parents=True, exist_ok=True)
        proc = run_chromium(
            exe,
            report.as_uri(),
            extra=[f"--screenshot={shot}", f"--window-size={window[0]},{window[1]}"],
            budget_ms=budget_ms,
        )
        if proc.returncode != 0 or not shot.is_file():
            raise ReportCheckError(
                f"{exe} --screenshot={shot} failed (exit {proc.returncode}): {_stderr_tail(proc.stderr)}"
            )
        result.screenshot = shot
    return result


def write_toy_report(folder: str | Path, interactive: bool = False) -> Path:
    """Score the hand-built toy G&A model and write its report (a few seconds)."""
    from gna_lens import score_heads
    from gna_lens.testing import toy_gna_model, toy_gna_task

    model = toy_gna_model()
    report = score_heads(model, toy_gna_task(model, n_samples=8), progress=False)
    report = dataclasses.replace(report, model_name="toy G&A model (gna_lens.testing)")
    return report.to_html(Path(folder) / "report.html", k=4, interactive=interactive)


def write_scan_report(model: str, folder: str | Path, n_samples: int = 48) -> Path:
    """Run ``gna-lens scan MODEL --out FOLDER`` and return its report.html."""
    from gna_lens.cli import main

    rc = main(["scan", model, "--out", str(folder), "--n-samples", str(n_samples)])
    if rc != 0:
        raise ReportCheckError(f"gna-lens scan {model} failed with exit code {rc}.")
    return Path(folder) / "report.html"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--report", help="an existing report.html to check")
    src.add_argument("--model", help="run `gna-lens scan MODEL` first (zoo name, dir, .gguf)")
    parser.add_argument("--n-samples", type=int, default=48, help="prompts for --model's scan")
    parser.add_argument("--out", help="folder for the generated report (default: a temp dir)")
    parser.add_argument("--screenshot", help="also write a PNG screenshot here")
    parser.add_argument("--window", default="1200x1500", help="screenshot size WIDTHxHEIGHT")
    parser.add_argument(
        "--interactive", action="store_true", help="toy report with the plotly heatmaps too"
    )
    parser.add_argument("--chromium", help="browser executable (default: chromium on PATH)")
    args = parser.parse_args(argv)
    if find_chromium(args.chromium) is None:
        print(
            f"check_report: no Chromium ({args.chromium or list(BROWSER_NAMES)}) on PATH; "
            "install one: apt-get install -y chromium",
            file=sys.stderr,
        )
        return 2
    width, height = (int(v) for v in args.window.lower().split("x"))
    with tempfile.TemporaryDirectory(prefix="gna_lens_report_") as tmp:
        out = Path(args.out or tmp)
        if args.report:
            path = Path(args.report)
        elif args.model:
            path = write_scan_report(args.model, out, args.n_samples)
        else:
            path = write_toy_report(out, interactive=args.interactive)
        try:
            result = check_report(
                path, chromium=args.chromium, screenshot=args.screenshot, window=(width, height)
            )
        except (ReportCheckError, FileNotFoundError) as err:
            print(f"FAIL: {err}", file=sys.stderr)
            return 1
        print(result.summary())
    print("OK: the report renders offline (heatmaps and circuitsvis widgets).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
