"""Inline SVG charts for the ledger's web page: pure functions from numbers to markup.

Nothing is fetched: the page carries its charts, so it reads the same with
scripts off, offline, or in a headless browser.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

W, H = 560, 240
PAD_L, PAD_R, PAD_T, PAD_B = 56, 16, 28, 40


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    out, v = [], start
    while v <= hi + step * 1e-9:
        out.append(round(v, 10))
        v += step
    if out[-1] < hi:  # the top tick must cover the largest value
        out.append(round(v, 10))
    return out


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _frame(title: str, ylabel: str, xlabel: str, ys: list[float], y_lo: float, y_hi: float,
           body: list[str], css_class: str, x_labels: list[tuple[float, str]]) -> str:
    def y_at(v: float) -> float:
        return PAD_T + (H - PAD_T - PAD_B) * (1 - (v - y_lo) / (y_hi - y_lo))

    parts = [f'<svg class="chart {css_class}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
             f'role="img" aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
             f"<title>{escape(title)}</title>",
             f'<text class="chart-title" x="{PAD_L}" y="18">{escape(title)}</text>']
    for v in ys:
        y = y_at(v)
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" '
                     f'y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{PAD_L - 6}" y="{y + 4:.1f}" '
                     f'text-anchor="end">{_fmt(v)}</text>')
    for x, label in x_labels:
        parts.append(f'<text class="tick" x="{x:.1f}" y="{H - PAD_B + 16}" '
                     f'text-anchor="middle">{escape(label)}</text>')
    parts.append(f'<line class="axis" x1="{PAD_L}" x2="{W - PAD_R}" y1="{H - PAD_B}" '
                 f'y2="{H - PAD_B}"/>')
    parts.append(f'<text class="axis-label" x="{(PAD_L + W - PAD_R) / 2}" y="{H - 6}" '
                 f'text-anchor="middle">{escape(xlabel)}</text>')
    parts.append(f'<text class="axis-label" transform="rotate(-90)" x="{-(H / 2)}" y="14" '
                 f'text-anchor="middle">{escape(ylabel)}</text>')
    parts.extend(body)
    parts.append("</svg>")
    return "".join(parts)


def _x_labels(rounds: Sequence[int], x_at: dict[int, float]) -> list[tuple[float, str]]:
    every = max(1, math.ceil(len(rounds) / 12))
    return [(x_at[r], str(r)) for k, r in enumerate(rounds) if k % every == 0]


def loss_chart(points: Sequence[tuple[int, float]]) -> str:
    """Eval loss of the certified model after each round (one point per finalized round)."""
    title = "Eval loss per round"
    if not points:
        return (f'<svg class="chart loss-chart empty" viewBox="0 0 {W} 60" width="{W}" '
                f'height="60" xmlns="http://www.w3.org/2000/svg"><text x="10" y="30">'
                f"{title}: no finalized round yet</text></svg>")
    losses = [v for _, v in points]
    ys = _ticks(min(losses), max(losses))
    lo, hi = ys[0], ys[-1] if ys[-1] > ys[0] else ys[0] + 1
    rounds = [r for r, _ in points]
    span = max(1, len(rounds) - 1)
    x_at = {r: PAD_L + 12 + (W - PAD_L - PAD_R - 24) * k / span for k, r in enumerate(rounds)}

    def y_at(v: float) -> float:
        return PAD_T + (H - PAD_T - PAD_B) * (1 - (v - lo) / (hi - lo))

    path = " ".join(f"{'M' if k == 0 else 'L'}{x_at[r]:.1f},{y_at(v):.1f}"
                    for k, (r, v) in enumerate(points))
    body = [f'<path class="loss-line" d="{path}"/>']
    body += [f'<circle class="loss-point" data-round="{r}" data-loss="{v:.6g}" '
             f'cx="{x_at[r]:.1f}" cy="{y_at(v):.1f}" r="4"><title>round {r}: {v:.4f}'
             f"</title></circle>" for r, v in points]
    return _frame(title, "loss", "round", ys, lo, hi, body, "loss-chart",
                  _x_labels(rounds, x_at))


def verdict_chart(rows: Sequence[tuple[int, ...]]) -> str:
    """Accepted (green), rejected (red) and excluded (amber: a statistical filter left the
    update out, still paid) submissions per round, stacked: rows of (round, accepted,
    rejected) or (round, accepted, rejected, excluded)."""
    title = "Submissions per round"
    if not rows:
        return (f'<svg class="chart verdict-chart empty" viewBox="0 0 {W} 60" width="{W}" '
                f'height="60" xmlns="http://www.w3.org/2000/svg"><text x="10" y="30">'
                f"{title}: no verdicts yet</text></svg>")
    rows = [(r[0], r[1], r[2], r[3] if len(r) > 3 else 0) for r in rows]
    top = max(1, max(a + b + e for _, a, b, e in rows))
    ys = _ticks(0, top)
    hi = ys[-1]
    n = len(rows)
    slot = (W - PAD_L - PAD_R) / n
    bar = max(2.0, min(40.0, slot * 0.7))
    x_at = {r: PAD_L + slot * (k + 0.5) for k, (r, _, _, _) in enumerate(rows)}
    plot_h = H - PAD_T - PAD_B
    body = []
    for r, acc, rej, exc in rows:
        x = x_at[r] - bar / 2
        h_acc, h_rej = plot_h * acc / hi, plot_h * rej / hi
        base = H - PAD_B
        body.append(f'<rect class="bar-accepted" data-round="{r}" data-count="{acc}" '
                    f'x="{x:.1f}" y="{base - h_acc:.1f}" width="{bar:.1f}" height="{h_acc:.1f}">'
                    f"<title>round {r}: {acc} accepted</title></rect>")
        body.append(f'<rect class="bar-rejected" data-round="{r}" data-count="{rej}" '
                    f'x="{x:.1f}" y="{base - h_acc - h_rej:.1f}" width="{bar:.1f}" '
                    f'height="{h_rej:.1f}"><title>round {r}: {rej} rejected</title></rect>')
        if exc:
            h_exc = plot_h * exc / hi
            body.append(f'<rect class="bar-excluded" data-round="{r}" data-count="{exc}" '
                        f'x="{x:.1f}" y="{base - h_acc - h_rej - h_exc:.1f}" '
                        f'width="{bar:.1f}" height="{h_exc:.1f}"><title>round {r}: {exc} '
                        "excluded (paid)</title></rect>")
    legend_x = W - PAD_R - (250 if any(e for *_, e in rows) else 170)
    body.append(f'<rect class="bar-accepted" x="{legend_x}" y="8" width="10" height="10"/>'
                f'<text class="tick" x="{legend_x + 14}" y="17">accepted</text>'
                f'<rect class="bar-rejected" x="{legend_x + 80}" y="8" width="10" height="10"/>'
                f'<text class="tick" x="{legend_x + 94}" y="17">rejected</text>')
    if any(e for *_, e in rows):
        body.append(f'<rect class="bar-excluded" x="{legend_x + 160}" y="8" width="10" '
                    f'height="10"/><text class="tick" x="{legend_x + 174}" y="17">excluded'
                    "</text>")
    return _frame(title, "submissions", "round", ys, 0, hi, body, "verdict-chart",
                  _x_labels([r for r, *_ in rows], x_at))
