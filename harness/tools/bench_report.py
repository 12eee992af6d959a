"""`harness bench`'s report (harness/tools/bench.py runs the rounds): the contenders' medians over rounds, the headline
ratios against the baseline and their lines, the table.
"""

from __future__ import annotations

import statistics
from typing import Optional

TRAINERS = ("trainer", "trainer_grouped")  # the Hugging Face Trainer contenders


def summarise(rounds: list[list[dict]], names: list[str], baseline: Optional[str]) -> dict:
    """Medians over rounds per run name, and ratios against `baseline` (raw, or the first profile)."""
    out = {}
    for name in names:
        rs = [r for rnd in rounds for r in rnd if r["name"] == name]
        tps = [r["tokens_per_s"] for r in rs]
        st = [r["step_time_s"] for r in rs]
        out[name] = {"tokens_per_s_median": statistics.median(tps), "step_time_s_median": statistics.median(st),
                     "step_time_s_best": min(st),
                     "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
                     "tokens_per_s_rounds": tps, "step_time_s_rounds": st,
                     "tokens_median": statistics.median(r["tokens"] for r in rs),
                     "peak_mem_gb_max": max((r["peak_mem_gb"] for r in rs if r.get("peak_mem_gb") is not None),
                                            default=None),
                     "final_loss": [r.get("final_loss") for r in rs]}
    if baseline in out:
        b = out[baseline]
        for s in out.values():
            s[f"tokens_per_s_vs_{baseline}"] = s["tokens_per_s_median"] / b["tokens_per_s_median"]
            s[f"step_time_vs_{baseline}"] = s["step_time_s_median"] / b["step_time_s_median"]
    return out


def _median_loss(s: dict) -> Optional[float]:
    losses = [x for x in s["final_loss"] if x is not None]
    return statistics.median(losses) if losses else None


def headline_ratios(summary: dict) -> dict:
    """The numbers the benchmark exists for (when both sides ran): the harness against raw (step time) and against
    each Trainer (tokens/s, median and best rounds; peak memory; final loss)."""
    r, h = {}, summary.get("harness")
    if h is None:
        return r
    if "raw" in summary:
        raw = summary["raw"]
        r["harness_step_time_over_raw"] = h["step_time_s_median"] / raw["step_time_s_median"]
        r["harness_tokens_per_s_over_raw"] = h["tokens_per_s_median"] / raw["tokens_per_s_median"]
        r["harness_step_time_over_raw_best"] = h["step_time_s_best"] / raw["step_time_s_best"]  # less load-sensitive
    for t in TRAINERS:
        if t not in summary:
            continue
        s = summary[t]
        r[f"harness_tokens_per_s_over_{t}"] = h["tokens_per_s_median"] / s["tokens_per_s_median"]
        r[f"harness_tokens_per_s_over_{t}_best"] = h["tokens_per_s_max"] / s["tokens_per_s_max"]
        r[f"harness_step_time_over_{t}"] = h["step_time_s_median"] / s["step_time_s_median"]
        if h.get("peak_mem_gb_max") and s.get("peak_mem_gb_max"):
            r[f"harness_peak_mem_over_{t}"] = h["peak_mem_gb_max"] / s["peak_mem_gb_max"]
        lh, lt = _median_loss(h), _median_loss(s)
        if lh is not None and lt is not None:
            r[f"harness_loss_rel_diff_{t}"] = abs(lh - lt) / max(abs(lt), 1e-12)
    return r


def ratio_lines(ratios: dict, rounds: int) -> list[str]:
    """The ratios as the lines printed under the table."""
    out = []
    if "harness_step_time_over_raw" in ratios:
        out.append(f"harness step time / raw step time = {ratios['harness_step_time_over_raw']:.3f}")
    for t in TRAINERS:
        if f"harness_tokens_per_s_over_{t}" not in ratios:
            continue
        line = f"harness tokens/s / {t} tokens/s = {ratios[f'harness_tokens_per_s_over_{t}']:.3f}"
        if rounds > 1:
            line += f" (best rounds {ratios[f'harness_tokens_per_s_over_{t}_best']:.3f})"
        if f"harness_peak_mem_over_{t}" in ratios:
            line += f"; peak memory harness / {t} = {ratios[f'harness_peak_mem_over_{t}']:.3f}"
        if f"harness_loss_rel_diff_{t}" in ratios:
            line += f"; final loss relative difference {ratios[f'harness_loss_rel_diff_{t}']:.1e}"
        out.append(line)
    if rounds > 1 and "harness_step_time_over_raw_best" in ratios:
        out.append(f"best rounds: harness step time / raw step time = {ratios['harness_step_time_over_raw_best']:.3f}")
    return out


def format_table(summary: dict, baseline: Optional[str], label: str) -> str:
    head = [label, "tokens/s (median)", "step time", "min..max tokens/s", "peak mem", "final loss"]
    if baseline in summary:
        head += [f"tokens/s vs {baseline}", f"step time vs {baseline}"]
    rows = [head]
    for name, s in summary.items():
        row = [name, f"{s['tokens_per_s_median']:,.0f}", f"{s['step_time_s_median'] * 1e3:.1f} ms",
               f"{s['tokens_per_s_min']:,.0f}..{s['tokens_per_s_max']:,.0f}",
               "?" if s.get("peak_mem_gb_max") is None else f"{s['peak_mem_gb_max']:.2f} GiB",
               "?" if _median_loss(s) is None else f"{_median_loss(s):.4f}"]
        if baseline in summary:
            row += [f"{s[f'tokens_per_s_vs_{baseline}']:.3f}x", f"{s[f'step_time_vs_{baseline}']:.3f}x"]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(rows[0]), "  ".join("-" * w for w in widths), *map(fmt, rows[1:])])
