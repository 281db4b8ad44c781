"""The cost of the bug-fix PRs (``python -m ds_bench fixcost``): comparisons against the targets, and the page.

Per configuration and N, the fix build (f) against the pristine release (a), both in managed mode, with a second pristine
pool (a′) as the control:

* wall time: the median of the ratios f/a of neighbouring steps (the pools step in turn), at most
  ``report.TIME_RATIO_TARGET``, or within the quartiles of a′/a (what two identical builds differ by here);
* peak RSS: within ``report.MEMORY_TOLERANCE``;
* the same collectives and bytes per step, the same losses, one optimizer update per logical step.

The time spent inside the fixes' own methods is read beside it (``ds_bench.method_timer``): milliseconds per step
where the step time's noise is larger than the cost.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import List, Optional, Tuple

from ds_bench import report
from ds_bench.fixcost import BASES, BUILD_OF, FixesOfBase, CONTROL, FIXES, LETTER, PRISTINE, ROLES, short_method

#: The hand-written reading of the committed run, rendered into results/benchmarks-fixcost.md.
ANALYSIS = Path(__file__).resolve().parents[1] / "results" / "fixcost-analysis.md"


def analysis_of(base: str) -> Path:
    """The hand-written reading of ``base``'s committed run (0.19.3's keeps its first name)."""
    return ANALYSIS if base == "0.19.3" else ANALYSIS.with_name(f"fixcost-analysis-{base}.md")
MIB = report.MIB


def base_of(data: dict) -> str:
    """The release measured (records before 0.19.8 was measured have no ``base``: they are of 0.19.3)."""
    return data.get("base", "0.19.3")


def _fixes(data: dict) -> FixesOfBase:
    return BASES[base_of(data)]


def _rounds_of_all(cell: dict) -> List[int]:
    """The rounds in which every pool's trial ran."""
    rounds = [{t["round"] for t in cell["trials"][role]} for role in ROLES]
    return sorted(set.intersection(*rounds)) if rounds else []


def timing_of(cell: dict) -> dict:
    """The cell's steps as the main benchmark's timing record (``report.summarize_timing``): per role, its measured
    steps of every complete round, in round order, so step i of every role comes from the same turn rotation."""
    rounds = _rounds_of_all(cell)
    by_round = {role: {t["round"]: t for t in cell["trials"][role]} for role in ROLES}
    timing = {"status": "ok" if rounds else "missing", "times_s": {}, "cpu_times_s": {}, "losses": {}}
    for role in ROLES:
        trials = [by_round[role][r] for r in rounds]
        timing["times_s"][role] = [x for t in trials for x in t["step_times_s"]]
        timing["cpu_times_s"][role] = [x for t in trials for x in t["step_cpu_s"]]
        ranks = len(trials[0]["losses"]) if trials else 0
        timing["losses"][role] = [[x for t in trials for x in t["losses"][rank]] for rank in range(ranks)]
    timing["global_steps"] = {role: sum(by_round[role][r]["global_steps"] for r in rounds) for role in ROLES}
    timing["expected_global_steps"] = sum(by_round[PRISTINE][r]["expected_global_steps"] for r in rounds)
    return timing


def loss_difference(base: List[List[float]], other: List[List[float]]) -> float:
    """The largest difference of two roles' losses, rank by rank and step by step; inf where only one is finite.

    Two NaNs count as equal: pristine ZeRO-3 on gloo can read parameters before their all-gather completed (the
    bug of fix-zero3-allgather-wait), and a NaN it produces then is not a cost of the fixes.
    """
    worst = 0.0
    for rank_base, rank_other in zip(base, other):
        for x, y in zip(rank_base, rank_other):
            if math.isnan(x) and math.isnan(y):
                continue
            if not (math.isfinite(x) and math.isfinite(y)):
                return math.inf
            worst = max(worst, abs(x - y))
    return worst


def compare(cell: dict, role: str, timing: dict) -> Optional[dict]:
    """``role`` (f, or the control a′) against pristine (a) in one cell."""
    base, this = cell["summary"][PRISTINE], cell["summary"][role]
    time = report.summarize_timing(timing, role, PRISTINE)
    if base is None or this is None or time is None:
        return None
    memory_ratio = this["peak_rss_bytes"] / base["peak_rss_bytes"] if base["peak_rss_bytes"] else None
    differences = report.count_differences(base["counts_per_step"], this["counts_per_step"])
    losses = loss_difference(timing["losses"][PRISTINE], timing["losses"][role])
    return {
        "median_step_s":
        time["median_step_s"],
        "time_ratio":
        time["ratio"],
        "time_ratio_quartiles":
        time["ratio_quartiles"],
        "cpu_time_ratio":
        time["cpu_ratio"],
        "cpu_time_ratio_quartiles":
        time["cpu_ratio_quartiles"],
        "pairs":
        time["pairs"],
        "memory_ratio":
        memory_ratio,
        "memory_delta_bytes":
        this["peak_rss_bytes"] - base["peak_rss_bytes"],
        "engine_memory_ratio":
        (this["engine_peak_rss_bytes"] / base["engine_peak_rss_bytes"] if base.get("engine_peak_rss_bytes") else None),
        "same_collectives":
        not differences and this["counts_consistent"] and base["counts_consistent"],
        "count_differences":
        differences,
        "max_loss_difference":
        losses,
        "same_losses":
        losses <= report.LOSS_TOLERANCE,
        "one_update_per_step":
        time["one_update_per_step"],
    }


def _verdicts(fixes: dict, control: Optional[dict]) -> dict:
    """The targets for f: time at most the target ratio (else whether a′/a's quartiles hold it), memory, the rest."""
    within = None
    if control is not None:
        low, _, high = control["time_ratio_quartiles"]
        within = low <= fixes["time_ratio"] <= high
    return {
        "time": fixes["time_ratio"] <= report.TIME_RATIO_TARGET,
        "time_within_noise": within,
        "memory": fixes["memory_ratio"] is not None and abs(fixes["memory_ratio"] - 1) <= report.MEMORY_TOLERANCE,
        "collectives": fixes["same_collectives"],
        "same_update": fixes["same_losses"] and fixes["one_update_per_step"],
    }


def method_times(cell: dict, fix_only: Tuple[str, ...]) -> List[dict]:
    """Per timed method that ran: calls and median seconds per measured step for each role, and its share of f's
    median step time."""
    rows = {}
    for role in ROLES:
        for trial in cell["trials"][role]:
            for step in trial.get("method_times_by_step") or []:
                for name, entry in step.items():
                    rows.setdefault(name, {r: {"calls": [], "seconds": []} for r in ROLES})
                    rows[name][role]["calls"].append(entry["calls"])
                    rows[name][role]["seconds"].append(entry["seconds"])
    fixes_step = (cell.get("comparisons") or {}).get(FIXES) or {}
    out = []
    for name, by_role in rows.items():
        entry = {"method": name, "fix_only": name in fix_only}
        for role in ROLES:
            values = by_role[role]
            entry[role] = ({
                "calls_per_step": statistics.median(values["calls"]),
                "median_s": statistics.median(values["seconds"]),
                "max_s": max(values["seconds"]),
            } if values["seconds"] else None)
        step = fixes_step.get("median_step_s")
        entry["share_of_fixes_step"] = entry[FIXES]["median_s"] / step if entry[FIXES] and step else None
        out.append(entry)
    return sorted(out, key=lambda e: (not e["fix_only"], e["method"]))


def builds_as_expected(cell: dict, fix_only: Tuple[str, ...]) -> bool:
    """Whether every pristine trial lacked the fixes' new methods and every fix trial had them."""
    for role in ROLES:
        for trial in cell["trials"][role]:
            absent = set(trial.get("methods_absent", fix_only)) & set(fix_only)
            if absent != (set() if role == FIXES else set(fix_only)):
                return False
    return True


def analyze(data: dict) -> dict:
    """Add ``summary``, ``comparisons``, ``verdicts`` and ``methods`` to every cell (in place); return ``data``."""
    fix_only = _fixes(data).fix_only
    for cell in data.get("cells", []):
        cell["summary"] = {role: report.summarize_mode({"rounds": cell["trials"][role]}) for role in ROLES}
        timing = timing_of(cell)
        cell["comparisons"] = {role: compare(cell, role, timing) for role in (FIXES, CONTROL)}
        fixes = cell["comparisons"][FIXES]
        cell["verdicts"] = _verdicts(fixes, cell["comparisons"][CONTROL]) if fixes else None
        cell["methods"] = method_times(cell, fix_only)
        cell["builds_as_expected"] = builds_as_expected(cell, fix_only)
    return data


# -- Markdown -------------------------------------------------------------------------------------------------
def _ratio(comparison: Optional[dict], key: str = "time_ratio") -> str:
    if comparison is None or comparison.get(key) is None:
        return "–"
    low, _, high = comparison[f"{key}_quartiles"]
    return f"{comparison[key]:.3f} ({low:.2f}–{high:.2f})"


def _memory(comparison: Optional[dict]) -> str:
    if comparison is None or comparison["memory_ratio"] is None:
        return "–"
    return f"{(comparison['memory_ratio'] - 1) * 100:+.2f} % ({comparison['memory_delta_bytes'] / MIB:+.1f} MiB)"


def _ms(seconds: Optional[float]) -> str:
    if seconds is None:
        return "–"
    return f"{seconds * 1e3:.2f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def _verdict(cell: dict) -> str:
    v = cell.get("verdicts")
    if v is None:
        return "not measured"
    if v["time"]:
        time = "✅ time"
    elif v["time_within_noise"]:
        time = "≈ time (within a′/a)"
    else:
        time = "❌ time"
    text = f"{time} {report._check(v['memory'])} mem {report._check(v['collectives'])} comm"
    if not v["same_update"]:
        text += " ❌ not the same update"
    return text


def _loads(data: dict) -> List[float]:
    return [
        x for cell in data.get("cells", []) for trials in cell["trials"].values() for t in trials
        for x in t.get("load_1min", [])
    ]


def _builds(data: dict) -> List[str]:
    lines = []
    for role in ROLES:
        if role == CONTROL:
            continue
        build = data["builds"][BUILD_OF[role]]
        letters = " and ".join(f"({LETTER[r]})" for r in ROLES if BUILD_OF[r] == BUILD_OF[role])
        imported = (data.get("imported") or {}).get(role) or {}
        prs = ", ".join(f"`{name}`" for name in build["prs"]) or "no PR (pristine)"
        lines.append(f"- {letters} DeepSpeed {str(imported.get('version', '?')).strip()} sdist + {prs}: the tree "
                     f"`{build['tree']}`, imported by PYTHONPATH (nothing installed)")
    ops = {b["installed_ops"] is not None for b in data["builds"].values()}
    lines.append("- JIT ops (CPU Adam, shared-memory comm): " +
                 ("the installed DeepSpeed's, loaded from `TORCH_EXTENSIONS_DIR` (the trees' op sources are the same)"
                  if ops == {True} else "built for each tree beside it (its op sources differ from the installed)"))
    return lines


def _summary(data: dict) -> List[str]:
    cells = [c for c in data.get("cells", []) if c.get("verdicts")]
    if not cells:
        return ["- Nothing measured."]
    fixes = [c["comparisons"][FIXES] for c in cells]
    controls = [c["comparisons"][CONTROL] for c in cells if c["comparisons"][CONTROL]]
    ratios = [x["time_ratio"] for x in fixes]
    cpu = [x["cpu_time_ratio"] for x in fixes if x["cpu_time_ratio"] is not None]
    misses = [c for c in cells if not c["verdicts"]["time"]]
    within = sum(bool(c["verdicts"]["time_within_noise"]) for c in misses)
    memory = [x["memory_ratio"] for x in fixes if x["memory_ratio"] is not None]
    worst = max(memory, key=lambda r: abs(r - 1)) if memory else None
    shares = [(m["share_of_fixes_step"], c) for c in cells for m in c["methods"]
              if m["fix_only"] and m["share_of_fixes_step"] is not None]
    lines = [
        f"- Median time ratio f/a at most {report.TIME_RATIO_TARGET}: {len(cells) - len(misses)} of {len(cells)} "
        f"cells; f/a over all cells: median {statistics.median(ratios):.3f}, from {min(ratios):.3f} to "
        f"{max(ratios):.3f}" +
        (f"; two identical pristine builds (a′/a): from {min(x['time_ratio'] for x in controls):.3f} to "
         f"{max(x['time_ratio'] for x in controls):.3f}" if controls else "") +
        (f"; {within} of the {len(misses)} misses lie within a′/a's quartiles" if misses else "") + ".",
        f"  CPU-time ratio f/a (the busiest rank's CPU time, insensitive to waiting for a core): median "
        f"{statistics.median(cpu):.3f}, from {min(cpu):.3f} to {max(cpu):.3f}." if cpu else "",
        f"- Peak RSS within {report.MEMORY_TOLERANCE * 100:.0f} % of pristine: "
        f"{sum(c['verdicts']['memory'] for c in cells)} of {len(cells)}" +
        (f" (largest difference {(worst - 1) * 100:+.2f} %)." if worst is not None else "."),
        f"- The same collectives and bytes per step as pristine: {sum(c['verdicts']['collectives'] for c in cells)} "
        f"of {len(cells)}; the same losses and one optimizer update per logical step: "
        f"{sum(c['verdicts']['same_update'] for c in cells)} of {len(cells)}.",
        f"- The builds are what they claim (the fixes' new methods absent from every pristine trial, present in every "
        f"fix trial): {sum(c['builds_as_expected'] for c in cells)} of {len(cells)}.",
    ]
    if shares:
        share, cell = max(shares, key=lambda item: item[0])
        lines.append(f"- Time inside the fixes' new methods: at most {share * 100:.2f} % of a step "
                     f"({cell['configuration']}, N = {cell['n_micro']}; table below).")
    loads = _loads(data)
    if loads:
        lines.append(f"- Machine load (1-minute load average, sampled at each round's start, lockstep start and end): "
                     f"median {statistics.median(loads):.1f}, from {min(loads):.1f} to {max(loads):.1f}, on "
                     f"{data['machine']['cpu_count']} cores.")
    return [line for line in lines if line]


def _table(data: dict) -> List[str]:
    lines = [
        "| Configuration | Offload | N | Time a | f/a | a′/a | CPU f/a | CPU a′/a | Peak RSS a | f vs a | a′ vs a "
        "| Collectives | Losses f vs a | Targets (f) |",
        "|---|---|--:|--:|---|---|---|---|--:|--:|--:|---|--:|---|",
    ]
    notes, errors = [], []
    for cell in data.get("cells", []):
        label = f"{cell['configuration']}, N = {cell['n_micro']}"
        errors += [
            f"- {label}, round {e['round'] + 1}" + (f", ({LETTER[e['role']]}) {e['role']}" if e.get("role") else "") +
            f": {e['error']}" for e in cell["errors"]
        ]
        fixes, control = cell["comparisons"][FIXES], cell["comparisons"][CONTROL]
        head = f"| {cell['configuration']} | {cell['offload']} | {cell['n_micro']} |"
        if fixes is None:
            lines.append(head + " – | – | – | – | – | – | – | – | – | – | not measured (see Errors) |")
            continue
        base = cell["summary"][PRISTINE]
        collectives = "same" if fixes["same_collectives"] else "differ"
        lines.append(head + " " + " | ".join([
            _ms(statistics.median(timing_of(cell)["times_s"][PRISTINE])),
            _ratio(fixes),
            _ratio(control),
            _ratio(fixes, "cpu_time_ratio"),
            _ratio(control, "cpu_time_ratio"),
            f"{base['peak_rss_bytes'] / MIB:.1f} MiB",
            _memory(fixes),
            _memory(control),
            collectives,
            "equal" if fixes["max_loss_difference"] == 0 else f"{fixes['max_loss_difference']:.1e}",
            _verdict(cell),
        ]) + " |")
        v = cell["verdicts"]
        if not v["time"]:
            low, _, high = control["time_ratio_quartiles"] if control else (None, None, None)
            notes.append(
                f"- {label}: f/a {fixes['time_ratio']:.3f} over {fixes['pairs']} step pairs; two identical "
                f"pristine builds differ by a′/a {control['time_ratio']:.3f} (quartiles {low:.2f}–{high:.2f}), "
                f"so this is {'within' if v['time_within_noise'] else 'outside'} the noise; CPU f/a "
                f"{report._fmt_ratio(fixes['cpu_time_ratio'])}."
                if control else f"- {label}: f/a {fixes['time_ratio']:.3f}; no control.")
        if not v["memory"] and fixes["memory_ratio"] is not None:
            notes.append(f"- {label}: peak RSS {_memory(fixes)} (a′ vs a: {_memory(control)}).")
        if not v["collectives"]:
            notes.append(f"- {label}: collectives differ: " +
                         ("; ".join(fixes["count_differences"]) or "not the same in every step and rank"))
        if not v["same_update"]:
            notes.append(f"- {label}: losses differ from pristine by up to {fixes['max_loss_difference']:.2e}, or "
                         "the optimizer updates are not one per logical step.")
    lines.append("")
    lines += ["### Missed targets and why", ""] + (notes or ["- None."]) + [""]
    if errors:
        lines += ["### Errors", ""] + errors + [""]
    return lines


def _method_table(data: dict) -> List[str]:
    lines = [
        "| Configuration | N | Method | Calls per step | f | a | a′ | Share of f's step |",
        "|---|--:|---|--:|--:|--:|--:|--:|",
    ]
    for cell in data.get("cells", []):
        for m in cell.get("methods") or []:
            calls = next((m[r]["calls_per_step"] for r in (FIXES, PRISTINE) if m[r]), 0)
            share = m["share_of_fixes_step"]
            name = short_method(m["method"]) + (" (new)" if m["fix_only"] else "")
            lines.append(f"| {cell['configuration']} | {cell['n_micro']} | `{name}` | {report._num(calls)} | " +
                         " | ".join(_ms(m[r]["median_s"]) if m[r] else "–" for r in (FIXES, PRISTINE, CONTROL)) +
                         f" | {'–' if share is None else f'{share * 100:.2f} %'} |")
    return lines + [""]


def render(data: dict, analysis_path: Optional[Path] = None) -> str:
    """The page; ``analysis_path`` (default: none) adds the hand-written analysis."""
    machine, s = data["machine"], data["settings"]
    model = s["model"]
    fix_prs = data["builds"][FIXES]["prs"]
    base, fixes = base_of(data), _fixes(data)
    json_name = "benchmarks-fixcost.json" if base == "0.19.3" else f"benchmarks-fixcost-{base}.json"
    lines = [
        "# Benchmarks: the cost of the bug-fix PRs in managed mode",
        "",
        f"The {base} series starts with {len(fix_prs)} bug-fix PRs ({', '.join(f'`{name}`' for name in fix_prs)}). "
        f"What they change in managed mode, the default, every user runs: {fixes.work} This page "
        f"measures what that costs: pristine DeepSpeed {base} **(a)** against {base} with the fix PRs **(f)**, both in "
        "managed mode, and a second pristine build **(a′)** as the control.",
        "",
        f"Targets for (f): a median time ratio f/a of at most {report.TIME_RATIO_TARGET} (or within the quartiles of "
        f"a′/a, what two identical builds differ by on this machine), peak RSS within "
        f"{report.MEMORY_TOLERANCE * 100:.0f} %, the same collectives and the same losses.",
        "",
        f"Generated by `{data['command']}` ({data.get('finished')}); regenerate the text from the run's JSON, "
        f"`benchmarks/results/{json_name}` (written beside this page, not committed), with "
        f"`python -m ds_bench fixcost --render` (in the {base} build's virtualenv). Do not edit by hand. The "
        "cost of unmanaged mode itself is on [benchmarks.md](benchmarks.md).",
        "",
        "## Machine and software",
        "",
    ] + report.machine_lines(machine) + _builds(data)
    if data.get("quick"):
        lines.append("- **Quick mode** (`--quick`): a tiny model and few steps; a smoke test, not a measurement.")
    lines += [
        "",
        "## How",
        "",
        f"- Model: a {model['n_layers']}-layer GPT (d_model {model['d_model']}, {model['n_heads']} heads, vocabulary "
        f"{model['vocab']}), {report._num(s['parameter_tensors'])} parameter tensors, {report._num(s['parameters'])} "
        f"parameters, {s['dtype']}; micro-batch {model['micro_batch']} × {model['seq_len']} tokens; Adam (CPU Adam "
        f"where the optimizer is offloaded); `gradient_clipping` 1.0; ZeRO bucket sizes "
        f"{report._num(s['bucket_elements'])} elements, ZeRO-3 persistence threshold 10,000 elements (the main "
        f"benchmark's configurations); {s['world_size']} ranks, {s['backend']}, "
        f"{report._plural(s['threads_per_rank'], 'torch thread')} per rank.",
        "- Three pools of rank hosts, one per build: (a) and (a′) import the pristine tree, (f) the fix tree. Per "
        f"configuration and N, {report._plural(s['rounds'], 'round')} of one trial per pool at once (a fresh forked "
        "process per rank, building its engine from the same weights and data), whose steps are taken in turn, one "
        "pool at a time, in rotating order (a, f, a′; f, a′, a; a′, a, f; ...): " +
        report._plural(s['warmup_steps'], 'warm-up step') + " then " +
        ", ".join(f"{v} for N = {k}" for k, v in s["measure_steps"].items()) + " measured logical steps per trial.",
        "- *Time a* is pristine's median step time (the slowest rank). *f/a* and *a′/a* are medians of the ratios of "
        "neighbouring steps, with their quartiles; *CPU* is the same for the CPU time of the busiest rank. *Peak RSS* "
        "is the largest over ranks during the measured steps (glibc's mmap threshold fixed, as in the main "
        "benchmark's mode trials); f and a′ are shown against a. *Collectives*: calls and bytes per op and step, "
        "counted as in the main benchmark. *Losses*: every step's loss on every rank, f against a.",
        "",
        "## Summary",
        "",
    ]
    lines += _summary(data)
    lines.append("")
    lines += report._analysis(data, analysis_path)
    lines += ["## Results", ""] + _table(data)
    lines += [
        "## Time inside the methods the fixes add or change",
        "",
        "Median wall time per measured step inside each method (the slowest rank), in the same trials; *(new)* marks "
        f"the fixes' own methods, which pristine {base} does not have. `step` is the ZeRO optimizer's `step()`, which "
        "runs everything the fixes add but the per-backward bookkeeping of ZeRO-1/2 offload (one set insertion per "
        f"parameter and backward); {fixes.methods_note}",
        "",
    ]
    lines += _method_table(data)
    return "\n".join(lines).rstrip() + "\n"
