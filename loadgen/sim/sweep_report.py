"""The sweep's tables: adaptive against each baseline at its hindsight-best knob, per cell.

Owns: `headline_rows` (one row per cell x SLO: adaptive's goodput, each family's best grid
value and goodput, the best fixed configuration of all, the ratio), `day_hour_rows` (per hour
of a day: adaptive, the best fixed configuration over the whole day, and each hour's own best),
`day_summary_rows` (per day: those summed, the per-hour oracle against the day's best),
`retry_rows`, `prediction_rows`, `ablation_rows` and `report_markdown` (sweep.md). Reads only
the cells' JSON (loadgen/sim/sweep_run.py), so a report can be redrawn from a finished run.

Must not import serve_app, actors, ray or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loadgen.report import markdown_table
from loadgen.sim.sweep_matrix import CAPPED, SLOS
from loadgen.sim.sweep_run import best_of

BASELINES = ("vllm", "sarathi", CAPPED, "tgi", "ray-serve")  # CAPPED (sarathi-seqs): not with --no-seqs
GOAL = 0.98


def _cell_label(res: dict[str, Any]) -> dict[str, Any]:
    c = res["cell"]
    return {"trace": c["trace"], "rate": f"x{c['rate']:g}", "gpu": c["gpu"].split("-")[0]}


def best_fixed(res: dict[str, Any], slo: str) -> tuple[str, dict[str, Any]] | None:
    """The best of every baseline variant (any family, any grid value) under `slo`."""
    found = [b for fam in BASELINES if (b := best_of(res["variants"], fam, slo)) is not None]
    return max(found, key=lambda lv: lv[1]["slo"][slo]["goodput_rps"]) if found else None


def best_fixed_within_tpot(res: dict[str, Any], slo: str) -> tuple[str, dict[str, Any]] | None:
    """The best baseline variant under `slo` whose TPOT p99 meets the SLO's TPOT target: what a
    user who tunes the knob for that target would run (the best overall may break it)."""
    target_ms = SLOS[slo].tpot_s * 1e3 if slo in SLOS else None
    found = [(label, v) for label, v in res["variants"].items()
             if v["family"] in BASELINES and slo in v["slo"] and v["slo"][slo]["goodput_rps"] is not None
             and (target_ms is None or (v["slo"][slo]["tpot_p99_ms"] or 0.0) <= target_ms)]
    return max(found, key=lambda lv: lv[1]["slo"][slo]["goodput_rps"]) if found else None


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def headline_rows(results: Sequence[dict[str, Any]], slo: str) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        ad = res["variants"].get("adaptive")
        if ad is None:
            continue
        a = ad["slo"][slo]
        row = {**_cell_label(res), "adaptive": a["goodput_rps"], "adaptive_tpot_p99_ms": a["tpot_p99_ms"]}
        for fam in BASELINES:
            b = best_of(res["variants"], fam, slo)
            if b is not None:  # a family this sweep did not run has no column
                cap = b[1].get("max_batch_size")
                row[fam] = f"{b[1]['slo'][slo]['goodput_rps']:.3g} @{b[1]['value']}{'' if cap is None else f'/{cap}'}"
        best = best_fixed(res, slo)
        if best is not None:
            g = best[1]["slo"][slo]
            row.update(best=best[0], best_goodput=g["goodput_rps"], best_tpot_p99_ms=g["tpot_p99_ms"],
                       ratio=_ratio(a["goodput_rps"], g["goodput_rps"]))
        rows.append(row)
    return rows


HEADLINE_COLUMNS = ("trace", "rate", "gpu", "adaptive", *BASELINES, "best", "ratio", "adaptive_tpot_p99_ms",
                    "best_tpot_p99_ms")


def headline_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """`HEADLINE_COLUMNS` less the baseline families no row has (those the sweep did not run)."""
    return [c for c in HEADLINE_COLUMNS if c not in BASELINES or any(c in r for r in rows)]


def ratio_pivot(results: Sequence[dict[str, Any]], slo: str, key: str = "ratio") -> list[dict[str, Any]]:
    """One row per trace, one column per GPU x rate: adaptive / hindsight-best (or another headline key)."""
    table: dict[str, dict[str, Any]] = {}
    for row in headline_rows(results, slo):
        table.setdefault(row["trace"], {"trace": row["trace"]})[f"{row['gpu']} {row['rate']}"] = row.get(key)
    return list(table.values())


def pivot_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    cols: list[str] = []
    for row in rows:
        cols += [c for c in row if c not in cols]
    return cols


def _hour_values(res: dict[str, Any], slo: str) -> tuple[str, list[tuple[Any, Any, str, Any]]] | None:
    """A day's hours under `slo`: the day's best fixed configuration's label, and per hour adaptive's
    goodput, that configuration's, and the hour's own best (label, goodput); None if not a day."""
    ad = res["variants"]["adaptive"]["slo"][slo]
    best = best_fixed(res, slo)
    if best is None or "hours" not in ad:
        return None
    baseline = [(label, v) for label, v in res["variants"].items() if v["family"] in BASELINES]
    hours = []
    for h, a in enumerate(ad["hours"]):
        own = max(baseline, key=lambda lv: lv[1]["slo"][slo]["hours"][h] or 0.0)
        hours.append((a, best[1]["slo"][slo]["hours"][h], own[0], own[1]["slo"][slo]["hours"][h]))
    return best[0], hours


def day_hour_rows(res: dict[str, Any], slo: str) -> list[dict[str, Any]]:
    found = _hour_values(res, slo)
    if found is None:
        return []
    label, hours = found
    tpot = res["variants"]["adaptive"]["slo"][slo]["hours_tpot_p99_ms"]
    return [{"hour": h, "adaptive": a, f"{label} (best over the day)": fixed,
             "vs day-best": _ratio(a, fixed) if a is not None and fixed else None,
             "hour's own best": f"{own_g:.3g} ({own})" if own_g is not None else None,
             "vs hour-best": _ratio(a, own_g) if a is not None and own_g else None,
             "adaptive_tpot_p99_ms": tpot[h]} for h, (a, fixed, own, own_g) in enumerate(hours)]


def day_summary_rows(results: Sequence[dict[str, Any]], slo: str) -> list[dict[str, Any]]:
    """One row per day cell: adaptive over the whole day against the day's best fixed configuration,
    the per-hour oracle (each hour's own best, summed: a fixed knob retuned every hour with
    hindsight) against the same, adaptive against the oracle, and the hours below `GOAL`. Hours are
    of equal length, so sums of hourly goodput compare as the day's."""
    rows = []
    for res in results:
        found = _hour_values(res, slo)
        if found is None:
            continue
        label, hours = found
        a = sum(x[0] or 0.0 for x in hours)
        fixed = sum(x[1] or 0.0 for x in hours)
        oracle = sum(x[3] or 0.0 for x in hours)
        per_hour = [r for x in hours if x[0] is not None and x[1] and (r := _ratio(x[0], x[1])) is not None]
        within = best_fixed_within_tpot(res, slo)
        a_day = res["variants"]["adaptive"]["slo"][slo]["goodput_rps"] or 0.0
        rows.append({**_cell_label(res), "day-best": label, "adaptive / day-best": _ratio(a, fixed),
                     "oracle / day-best": _ratio(oracle, fixed), "adaptive / oracle": _ratio(a, oracle),
                     "worst hour vs day-best": min(per_hour, default=None),
                     f"hours below {GOAL}": sum(1 for r in per_hour if r < GOAL),
                     "day-best within the TPOT target": within[0] if within else None,
                     "adaptive / it": _ratio(a_day, within[1]["slo"][slo]["goodput_rps"]) if within else None})
    return rows


def retry_rows(results: Sequence[dict[str, Any]], slo: str, families: Sequence[str] = ("adaptive",)
               ) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        for label, v in res["variants"].items():
            if v["family"] not in families:
                continue
            judged = v["slo"][slo]
            r = v["runs"][judged["run"]]["retries"]
            if r is None:
                continue
            rows.append({**_cell_label(res), "policy": label, "goodput": judged["goodput_rps"],
                         "client_goodput": judged.get("client_goodput_rps"), "amplification": r["amplification"],
                         "retries_sent": r["retries_sent"], "retry_admit_rate": r["retry_admit_rate"],
                         "retry_after_admit_rate": r["retry_after_admit_rate"], "gave_up": r["gave_up"]})
    return rows


RETRY_COLUMNS = ("trace", "rate", "gpu", "policy", "goodput", "client_goodput", "amplification", "retries_sent",
                 "retry_admit_rate", "retry_after_admit_rate", "gave_up")


def prediction_rows(results: Sequence[dict[str, Any]], slo: str) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        ad = res["variants"].get("adaptive")
        if ad is None:
            continue
        judged = ad["slo"][slo]
        p = ad["runs"][judged["run"]]["prediction"]
        good = round(judged["goodput_rps"] * res["duration_s"])
        missed = (judged["completed"] - good) / judged["completed"] if judged["completed"] else None
        rows.append({**_cell_label(res), "n": p["n"], "p10": p["p10"], "p50": p["p50"], "p90": p["p90"],
                     "admitted_missed_slo": None if missed is None else round(missed, 3)})
    return rows


PREDICTION_COLUMNS = ("trace", "rate", "gpu", "n", "p10", "p50", "p90", "admitted_missed_slo")


def ablation_rows(results: Sequence[dict[str, Any]], slo: str) -> list[dict[str, Any]]:
    rows = []
    for res in results:
        variants = res["variants"]
        names = [k for k, v in variants.items() if v["family"].startswith(("adaptive-", "continuous-"))]
        if not names or "adaptive" not in variants:
            continue
        a = variants["adaptive"]["slo"][slo]["goodput_rps"]
        row = {**_cell_label(res), "adaptive": a}
        for name in names:
            row[name] = _ratio(variants[name]["slo"][slo]["goodput_rps"], a)
        rows.append(row)
    return rows


def _summary_line(rows: list[dict[str, Any]]) -> str:
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    if not ratios:
        return "No cell has a ratio.\n"
    below = [f"{r['trace']} {r['rate']} {r['gpu']} ({r['ratio']:.3f})" for r in rows
             if r.get("ratio") is not None and r["ratio"] < GOAL]
    return (f"{len(ratios)} cells; adaptive / hindsight-best fixed: min {min(ratios):.3f}, median "
            f"{sorted(ratios)[len(ratios) // 2]:.3f}, max {max(ratios):.3f}; {len(ratios) - len(below)} of "
            f"{len(ratios)} at >= {GOAL}. Below: {', '.join(below) or 'none'}.\n")


def report_markdown(results: Sequence[dict[str, Any]], slos: dict[str, Any], header: str) -> str:
    parts = [header]
    for name, slo in slos.items():
        rows = headline_rows(results, name)
        parts.append(f"## SLO {name}: TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s * 1000:g} ms\n\n"
                     "Goodput (req/s of original requests served within the SLO). A baseline's cell is its best "
                     "grid value with hindsight (goodput @ knob); `best` is the best fixed configuration of all; "
                     f"`ratio` = adaptive / best.\n\n{_summary_line(rows)}\n"
                     f"{markdown_table(rows, headline_columns(rows))}")
        pivot = ratio_pivot(results, name)
        parts.append(f"Adaptive / hindsight-best fixed, by trace and GPU x rate (SLO {name}):\n\n"
                     f"{markdown_table(pivot, pivot_columns(pivot))}")
        days = day_summary_rows(results, name)
        if days:
            parts.append(f"### Days, SLO {name}: adaptive, the day's best fixed configuration and the per-hour "
                         "oracle (each hour's own best fixed configuration, chosen with hindsight)\n\n"
                         + markdown_table(days, list(days[0])))
        for res in results:
            hours = day_hour_rows(res, name)
            if hours:
                parts.append(f"### Per hour: {res['trace']} on {res['cell']['gpu']}, SLO {name}\n\n"
                             f"{markdown_table(hours, list(hours[0]))}")
        retries = retry_rows(results, name, ("adaptive", "tgi", "ray-serve"))
        parts.append(f"### Retrying clients, SLO {name}\n\nEvery policy's variant (tgi/ray-serve: every cap). "
                     "`client_goodput` times TTFT from the first send; `amplification` = attempts / original "
                     "requests; `retry_after_admit_rate` = retries sent at the server's Retry-After that got in.\n\n"
                     + markdown_table([r for r in retries if r["policy"] == "adaptive"], RETRY_COLUMNS))
        parts.append(f"### TTFT prediction error (adaptive: predicted / measured TTFT of completed requests), "
                     f"SLO {name}\n\n" + markdown_table(prediction_rows(results, name), PREDICTION_COLUMNS))
        abl = ablation_rows(results, name)
        if abl:
            parts.append(f"### Ablations (goodput / adaptive's), SLO {name}\n\n{markdown_table(abl, list(abl[0]))}")
    return "\n\n".join(parts) + "\n"
