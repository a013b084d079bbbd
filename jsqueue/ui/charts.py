"""Small inline SVG charts for the dashboard, drawn on the server (no JavaScript, no
chart library): a line chart of several series over time and a stacked bar chart per
minute. Pure: strings in, SVG markup out; every label is escaped."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

#: Series colours, in order (colour-blind safe palette, Okabe and Ito).
PALETTE = (
    "#0072b2",
    "#e69f00",
    "#009e73",
    "#d55e00",
    "#cc79a7",
    "#56b4e9",
    "#f0e442",
    "#000000",
    "#999999",
    "#882255",
)

_W, _H, _PAD_L, _PAD_B, _PAD_T = 640, 180, 48, 22, 8


def colour(index: int) -> str:
    """The colour of series ``index``."""
    return PALETTE[index % len(PALETTE)]


def _axis(top: float, x_labels: tuple[str, str]) -> list[str]:
    plot_h = _H - _PAD_B - _PAD_T
    out = [
        f'<line x1="{_PAD_L}" y1="{_PAD_T}" x2="{_PAD_L}" y2="{_H - _PAD_B}" class="axis"/>',
        f'<line x1="{_PAD_L}" y1="{_H - _PAD_B}" x2="{_W}" y2="{_H - _PAD_B}" class="axis"/>',
        f'<text x="{_PAD_L - 4}" y="{_PAD_T + 8}" text-anchor="end">{_num(top)}</text>',
        f'<text x="{_PAD_L - 4}" y="{_PAD_T + plot_h}" text-anchor="end">0</text>',
        f'<text x="{_PAD_L}" y="{_H - 6}">{escape(x_labels[0])}</text>',
        f'<text x="{_W}" y="{_H - 6}" text-anchor="end">{escape(x_labels[1])}</text>',
    ]
    return out


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 10 or value == int(value) else f"{value:.1f}"


def line_chart(series: Mapping[str, Sequence[float]], x_labels: tuple[str, str], title: str) -> str:
    """An SVG line chart: one polyline per series (all of the same length, oldest value
    first), y from 0 to the largest value, ``x_labels`` under the two ends.

    A series of one value is drawn as a dot. Returns ``<svg>`` markup (escaped labels).
    """
    values = [v for vs in series.values() for v in vs]
    top = max(values, default=0.0) or 1.0
    n = max((len(vs) for vs in series.values()), default=0)
    plot_w, plot_h = _W - _PAD_L - 4, _H - _PAD_B - _PAD_T
    parts = [
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        *_axis(top, x_labels),
    ]
    for i, (name, vs) in enumerate(series.items()):
        if not vs:
            continue
        step = plot_w / (n - 1) if n > 1 else 0.0
        points = [
            (_PAD_L + 2 + step * (n - len(vs) + j), _PAD_T + plot_h * (1 - v / top))
            for j, v in enumerate(vs)
        ]
        label = escape(f"{name}: {_num(vs[-1])}")
        if len(points) == 1:
            x, y = points[0]
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour(i)}">'
                f"<title>{label}</title></circle>"
            )
        else:
            pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
            parts.append(
                f'<polyline points="{pts}" fill="none" stroke="{colour(i)}" '
                f'stroke-width="2"><title>{label}</title></polyline>'
            )
    parts.append("</svg>")
    return "".join(parts)


def bar_chart(
    bars: Sequence[Mapping[str, int]], keys: Sequence[str], x_labels: tuple[str, str], title: str
) -> str:
    """An SVG stacked bar chart: one bar per element of ``bars`` (oldest first), stacked by
    ``keys`` in order. Returns ``<svg>`` markup (escaped labels)."""
    top = float(max((sum(b.get(k, 0) for k in keys) for b in bars), default=0) or 1)
    plot_w, plot_h = _W - _PAD_L - 4, _H - _PAD_B - _PAD_T
    width = plot_w / max(1, len(bars))
    parts = [
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        *_axis(top, x_labels),
    ]
    for j, bar in enumerate(bars):
        y = float(_H - _PAD_B)
        for i, key in enumerate(keys):
            n = bar.get(key, 0)
            if not n:
                continue
            h = plot_h * n / top
            y -= h
            parts.append(
                f'<rect x="{_PAD_L + 2 + j * width:.1f}" y="{y:.1f}" '
                f'width="{max(1.0, width - 1):.1f}" height="{h:.1f}" fill="{colour(i)}">'
                f"<title>{escape(f'{key}: {n}')}</title></rect>"
            )
    parts.append("</svg>")
    return "".join(parts)
