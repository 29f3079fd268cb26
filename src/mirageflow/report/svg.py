"""The plots of report.html as SVG, drawn here: bars (stacked, outlined), step and plain lines,
a heatmap, a marker line, axes with round ticks, grid, titles and a legend.

Why not matplotlib: importing it and rendering the report's plots through Agg took ~2 CPU-s
of every run's aggregate job (the largest fixed cost of a small run after Snakemake's own
start, scripts/bench/small_run.py); these few chart kinds need only this much. Plain SVG
text, no scripts or external references: report.html stays self-contained.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ["#3b6fb6", "#e8833a", "#3a9d5d", "#c23b3b", "#8a63b8", "#8c564b", "#d46fb0", "#7f7f7f", "#b5b52f", "#2bb3c4"]
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'
# viridis at 0, 25, 50, 75, 100 % (the heatmap's colour scale, interpolated between)
_VIRIDIS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2, 2.5 or 5 x 10^k)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    if integer:
        step = max(1, math.ceil(step))
    first = math.ceil(lo / step - 1e-9) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 10))
        t += step
    return ticks


def tick_label(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if v == int(v):
        return str(int(v))
    return f"{v:g}"


def viridis(value: float) -> str:
    """A colour for ``value`` in [0, 100]."""
    x = min(1.0, max(0.0, value / 100)) * (len(_VIRIDIS) - 1)
    i = min(int(x), len(_VIRIDIS) - 2)
    f = x - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(_VIRIDIS[i], _VIRIDIS[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


class Panel:
    """One plot: marks in data coordinates, rendered into a box of the figure."""

    def __init__(self, title: str = "", xlabel: str = "", ylabel: str = ""):
        self.title, self.xlabel, self.ylabel = title, xlabel, ylabel
        self.marks: list[tuple] = []
        self.legend: list[tuple[str, str, str]] = []  # (label, colour, "bar" | "line" | "dash")
        self.xlim: tuple[float, float] | None = None
        self.ylim: tuple[float, float] | None = None
        self.xticks: list[tuple[float, str]] | None = None  # explicit (value, label)
        self.yticks: list[tuple[float, str]] | None = None
        self.integer_x = self.integer_y = False
        self.ygrid_only = False

    def bars(self, lefts, heights, width, bottoms=None, color=PALETTE[0], edges=None, label=None) -> None:
        bottoms = bottoms or [0.0] * len(lefts)
        edges = edges or [None] * len(lefts)
        for x, h, b, e in zip(lefts, heights, bottoms, edges):
            self.marks.append(("rect", x, b, x + width, b + h, color, e))
        if label:
            self.legend.append((label, color, "bar"))

    def line(self, xs, ys, color, width: float = 1.3, opacity: float = 1.0, label=None) -> None:
        """A polyline; None or NaN in ``ys`` breaks it."""
        self.marks.append(("line", list(xs), list(ys), color, width, opacity))
        if label:
            self.legend.append((label, color, "line"))

    def step(self, xs, ys, color, width: float = 1.3, opacity: float = 1.0, label=None) -> None:
        """A step line holding each value until the next x (matplotlib's ``where="post"``)."""
        xs, ys = list(xs), list(ys)
        px, py = [], []
        for i, (x, y) in enumerate(zip(xs, ys)):
            px.append(x)
            py.append(y)
            if i + 1 < len(xs):
                px.append(xs[i + 1])
                py.append(y)
        self.line(px, py, color, width, opacity, label)

    def vline(self, x: float, color: str, text: str = "") -> None:
        self.marks.append(("vline", x, color, text))

    def cell(self, x0, y0, x1, y1, color) -> None:
        self.marks.append(("cell", x0, y0, x1, y1, color))

    def _extent(self):
        xs, ys = [], []
        for m in self.marks:
            if m[0] in ("rect", "cell"):
                xs += [m[1], m[3]]
                ys += [m[2], m[4]]
            elif m[0] == "line":
                xs += [x for x, y in zip(m[1], m[2]) if _ok(y)]
                ys += [y for y in m[2] if _ok(y)]
            elif m[0] == "vline":
                xs.append(m[1])
        has_bars = any(m[0] == "rect" for m in self.marks)
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if has_bars:
            y0 = min(0.0, y0)
        if y1 <= y0:
            y1 = y0 + 1
        if x1 <= x0:
            x0, x1 = x0 - 0.5, x1 + 0.5
        return self.xlim or (x0, x1), self.ylim or (y0, y1)

    def render(self, left: float, top: float, width: float, height: float) -> list[str]:
        (x0, x1), (y0, y1) = self._extent()
        yt = self.yticks or [(v, tick_label(v)) for v in nice_ticks(y0, y1, 5, self.integer_y)]
        if not self.ylim and yt:
            y0, y1 = min(y0, yt[0][0]), max(y1, yt[-1][0])
        xt = self.xticks or [(v, tick_label(v)) for v in nice_ticks(x0, x1, 6, self.integer_x) if x0 - 1e-9 <= v <= x1 + 1e-9]

        def px(x):
            return left + (x - x0) / (x1 - x0) * width

        def py(y):
            return top + height - (y - y0) / (y1 - y0) * height

        out = [
            f'<rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height:.1f}" fill="white" stroke="#9aa5b8" stroke-width="0.8"/>'
        ]
        for v, label in yt:
            y = py(v)
            if top - 0.5 <= y <= top + height + 0.5:
                out.append(f'<line x1="{left:.1f}" x2="{left + width:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="#dde2ea" stroke-width="0.7"/>')
                out.append(f'<text x="{left - 4:.1f}" y="{y + 3.5:.1f}" font-size="10" text-anchor="end" {FONT}>{escape(label)}</text>')
        for v, label in xt:
            x = px(v)
            if left - 0.5 <= x <= left + width + 0.5:
                if not self.ygrid_only:
                    out.append(
                        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{top + height:.1f}" stroke="#eef2f7" stroke-width="0.7"/>'
                    )
                out.append(
                    f'<text x="{x:.1f}" y="{top + height + 13:.1f}" font-size="10" text-anchor="middle" {FONT}>{escape(label)}</text>'
                )
        clip = f"clip{id(self)}"
        out.append(f'<clipPath id="{clip}"><rect x="{left:.1f}" y="{top:.1f}" width="{width:.1f}" height="{height:.1f}"/></clipPath>')
        out.append(f'<g clip-path="url(#{clip})">')
        for m in self.marks:
            if m[0] in ("rect", "cell"):
                a, b = px(m[1]), px(m[3])
                c, d = py(m[4]), py(m[2])
                fill = m[5]
                edge = m[6] if m[0] == "rect" else None
                stroke = (
                    f' stroke="{edge}" stroke-width="1.5"' if edge else (' stroke="white" stroke-width="0.4"' if m[0] == "rect" else "")
                )
                out.append(
                    f'<rect x="{min(a, b):.2f}" y="{min(c, d):.2f}" width="{abs(b - a):.2f}" height="{abs(d - c):.2f}" fill="{fill}"{stroke}/>'
                )
            elif m[0] == "line":
                for run in _runs(m[1], m[2]):
                    if len(run) < 2:  # a lone sample between gaps draws no line (as matplotlib)
                        continue
                    points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in run)
                    out.append(f'<polyline points="{points}" fill="none" stroke="{m[3]}" stroke-width="{m[4]}" stroke-opacity="{m[5]}"/>')
            elif m[0] == "vline":
                x = px(m[1])
                out.append(
                    f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top:.1f}" y2="{top + height:.1f}" stroke="{m[2]}" stroke-width="1.2" stroke-dasharray="5,3"/>'
                )
                if m[3]:
                    anchor, dx = ("end", -3) if x > left + 0.7 * width else ("start", 3)
                    out.append(
                        f'<text x="{x + dx:.1f}" y="{top + 11:.1f}" font-size="10" fill="{m[2]}" text-anchor="{anchor}" {FONT}>{escape(m[3])}</text>'
                    )
        out.append("</g>")
        if self.title:
            out.append(
                f'<text x="{left + width / 2:.1f}" y="{top - 8:.1f}" font-size="12" text-anchor="middle" {FONT}>{escape(self.title)}</text>'
            )
        if self.xlabel:
            out.append(
                f'<text x="{left + width / 2:.1f}" y="{top + height + 28:.1f}" font-size="10.5" text-anchor="middle" {FONT}>{escape(self.xlabel)}</text>'
            )
        if self.ylabel:
            cx, cy = left - 40, top + height / 2
            out.append(
                f'<text x="{cx:.1f}" y="{cy:.1f}" font-size="10.5" text-anchor="middle" transform="rotate(-90 {cx:.1f} {cy:.1f})" {FONT}>{escape(self.ylabel)}</text>'
            )
        return out


class Figure:
    """Panels side by side (``columns``) or stacked, each with room for a legend on its right."""

    def __init__(self, width: int, height: int, panels: list[Panel], legend_width: int = 0, margin_left: int = 58):
        self.width, self.height, self.panels, self.legend_width = width, height, panels, legend_width
        self.margin_left = margin_left  # room for the y tick labels (wider for category names)

    def svg(self) -> str:
        margin_left, margin_right, margin_top, margin_bottom = self.margin_left, 12, 26, 40
        n = len(self.panels)
        cell = self.width / n
        out = [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{self.height}" viewBox="0 0 {self.width} {self.height}">'
        ]
        for i, panel in enumerate(self.panels):
            legend = self.legend_width if panel.legend else 0
            left = i * cell + margin_left
            width = cell - margin_left - margin_right - legend
            height = self.height - margin_top - margin_bottom
            out += panel.render(left, margin_top, width, height)
            for k, (label, color, kind) in enumerate(panel.legend):
                x, y = left + width + 8, margin_top + 6 + 14 * k
                if kind == "bar":
                    out.append(f'<rect x="{x:.1f}" y="{y - 4:.1f}" width="10" height="8" fill="{color}"/>')
                else:
                    out.append(f'<line x1="{x:.1f}" x2="{x + 12:.1f}" y1="{y:.1f}" y2="{y:.1f}" stroke="{color}" stroke-width="2"/>')
                out.append(f'<text x="{x + 16:.1f}" y="{y + 3.5:.1f}" font-size="9.5" {FONT}>{escape(label)}</text>')
        out.append("</svg>")
        return "".join(out)


def _ok(y) -> bool:
    return y is not None and not (isinstance(y, float) and math.isnan(y))


def _runs(xs, ys):
    """The unbroken stretches of a polyline (None/NaN values break it)."""
    run = []
    for x, y in zip(xs, ys):
        if _ok(y):
            run.append((x, y))
        elif run:
            yield run
            run = []
    if run:
        yield run
