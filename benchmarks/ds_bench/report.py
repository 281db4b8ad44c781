"""Turn measured trials into comparisons against the targets, and render them as Markdown.

Targets for unmanaged mode (b) against managed mode (a), per configuration and N:

* the same collectives and bytes per logical step, op by op and step by step, apart from the one all-reduce of
  at most ``STEP_CHECK_BYTES`` with which unmanaged ``step()`` takes every decision that depends on per-rank
  state (the number of backward passes, the factor's checks) on all ranks together;
* the same peak memory, within 1 %;
* a wall-time ratio b/a, measured pair by pair on neighbouring steps, whose median is at most 1.02.

The toggle workaround (c) is compared with (a) the same way, for reference; it has no targets. The
control (a′, a second managed engine in the timing trial) gives the ratio that noise alone produces.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from ds_bench import configs
from ds_bench.trial import CONTROL

MEMORY_TOLERANCE = 0.01
TIME_RATIO_TARGET = 1.02
#: The modes compute bitwise the same update (the parity tests prove it), so their losses must be equal.
LOSS_TOLERANCE = 0.0
MIB = 2**20
#: Unmanaged step() checks that the ranks agree (backward counts, no_sync(), gradient_divide_factor) in one
#: all-reduce of at most 10 int64 values; managed mode has no such check.
STEP_CHECK_BYTES = 80


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> float | None:
    """(max - min) / median: how much one mode's own measurement moves from round to round."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None
    return (max(values) - min(values)) / statistics.median(values)


def _quartiles(values: list[float]) -> list[float] | None:
    if not values:
        return None
    if len(values) == 1:
        return [values[0]] * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def summarize_mode(entry: dict) -> dict | None:
    """One mode's rounds of mode trials: counts, memory, and the correctness checks."""
    rounds = entry.get("rounds") or []
    if not rounds:
        return None
    first = rounds[0]["counts_per_step"]
    consistent = all(r["counts_per_step"] == first and r["counts_same_every_step"] and r["counts_same_every_rank"]
                     for r in rounds)
    return {
        "rounds": len(rounds),
        "counts_per_step": first,
        "calls_per_step": sum(v["calls"] for v in first.values()),
        "bytes_per_step": sum(v["bytes"] for v in first.values()),
        "counts_consistent": consistent,
        "peak_rss_bytes": _median(r["peak_rss_bytes"] for r in rounds),
        "peak_rss_spread": _spread([r["peak_rss_bytes"] for r in rounds]),
        "engine_peak_rss_bytes": _median(r.get("engine_peak_rss_bytes") for r in rounds),
        "peak_gpu_allocated_bytes": _median(r["peak_gpu_allocated_bytes"] for r in rounds),
        "peak_gpu_spread": _spread([r["peak_gpu_allocated_bytes"] for r in rounds]),
        "isolated_median_step_s": _median(r["median_step_s"] for r in rounds),
        "one_update_per_step": all(r["global_steps"] == r["expected_global_steps"] for r in rounds),
        "global_steps": rounds[0]["global_steps"],
        "expected_global_steps": rounds[0]["expected_global_steps"],
    }


def summarize_timing(timing: dict, mode: str, base: str = configs.MANAGED) -> dict | None:
    """``mode`` against ``base`` in the timing trial: per-step ratios of wall and CPU time."""
    if not timing or timing.get("status") != "ok" or mode not in timing["times_s"]:
        return None
    wall, cpu = timing["times_s"], timing["cpu_times_s"]
    ratios = [x / y for x, y in zip(wall[mode], wall[base])]
    cpu_ratios = [x / y for x, y in zip(cpu[mode], cpu[base]) if y > 0]
    losses, base_losses = timing["losses"][mode], timing["losses"][base]
    return {
        "median_step_s": statistics.median(wall[mode]),
        "median_step_cpu_s": statistics.median(cpu[mode]),
        "ratio": statistics.median(ratios),
        "ratio_quartiles": _quartiles(ratios),
        "cpu_ratio": _median(cpu_ratios),
        "cpu_ratio_quartiles": _quartiles(cpu_ratios),
        "pairs": len(ratios),
        "max_loss_difference": max(abs(x - y) for ra, rb in zip(base_losses, losses) for x, y in zip(ra, rb)),
        "one_update_per_step": timing["global_steps"][mode] == timing["expected_global_steps"],
    }


def count_differences(base: dict[str, dict], other: dict[str, dict]) -> list[str]:
    out = []
    for op in sorted(set(base) | set(other)):
        a = base.get(op, {"calls": 0, "bytes": 0})
        b = other.get(op, {"calls": 0, "bytes": 0})
        if a != b:
            out.append(f"{op}: {_num(b['calls'])} calls / {_bytes(b['bytes'])} vs "
                       f"{_num(a['calls'])} calls / {_bytes(a['bytes'])}")
    return out


def is_step_check(base: dict[str, dict], other: dict[str, dict]) -> bool:
    """Whether ``other`` sends what ``base`` sends plus exactly one all-reduce of at most STEP_CHECK_BYTES."""
    zero = {"calls": 0, "bytes": 0}
    a, b = base.get("all_reduce", zero), other.get("all_reduce", zero)
    rest = [op for op in set(base) | set(other) if op != "all_reduce"]
    return (all(base.get(op, zero) == other.get(op, zero) for op in rest) and b["calls"] == a["calls"] + 1
            and 0 < b["bytes"] - a["bytes"] <= STEP_CHECK_BYTES)


def compare(cell: dict, mode: str) -> dict | None:
    """``mode`` against managed for one cell, with the targets' verdicts and the reasons for a miss."""
    base_entry, entry = cell["modes"][configs.MANAGED], cell["modes"][mode]
    base, this = summarize_mode(base_entry), summarize_mode(entry)
    if base is None or this is None:
        return None
    by_round = {r["round"]: r for r in base_entry["rounds"]}
    paired = [(r, by_round[r["round"]]) for r in entry["rounds"] if r["round"] in by_round]

    # Exactly the same collectives (unmanaged mode: plus step()'s check), step by step in every round and rank.
    def same(x: dict[str, dict], y: dict[str, dict]) -> bool:
        return y == x or (mode == configs.UNMANAGED and is_step_check(x, y))

    step_check = mode == configs.UNMANAGED and is_step_check(base["counts_per_step"], this["counts_per_step"])
    differences = [] if step_check else count_differences(base["counts_per_step"], this["counts_per_step"])
    same_steps = bool(paired) and all(
        len(r["counts_by_step"]) == len(b["counts_by_step"]) and all(
            same(managed, step) for step, managed in zip(r["counts_by_step"], b["counts_by_step"]))
        and r["counts_same_every_rank"] and b["counts_same_every_rank"] for r, b in paired)
    loss_diff = max(abs(x - y) for r, b in paired for ra, rb in zip(b["losses"], r["losses"]) for x, y in zip(ra, rb))
    gpu = base["peak_gpu_allocated_bytes"] is not None
    memory_key = "peak_gpu_allocated_bytes" if gpu else "peak_rss_bytes"
    memory_ratio = this[memory_key] / base[memory_key] if base[memory_key] else None
    engine_ratio = None
    if not gpu and base.get("engine_peak_rss_bytes"):
        engine_ratio = this["engine_peak_rss_bytes"] / base["engine_peak_rss_bytes"]
    timing = summarize_timing(cell.get("timing"), mode)
    control = summarize_timing(cell.get("timing"), CONTROL)
    parameters = base_entry["rounds"][0]["parameters"]
    world = len(base_entry["rounds"][0]["losses"])
    result = {
        "same_collectives": not differences and same_steps,
        "step_check": step_check,
        "count_differences": differences,
        "memory_key": memory_key,
        "memory_ratio": memory_ratio,
        "memory_delta_bytes": this[memory_key] - base[memory_key],
        "memory_noise": base["peak_gpu_spread" if gpu else "peak_rss_spread"],
        "engine_memory_ratio": engine_ratio,
        "time_ratio": timing["ratio"] if timing else None,
        "time_ratio_quartiles": timing["ratio_quartiles"] if timing else None,
        "cpu_time_ratio": timing["cpu_ratio"] if timing else None,
        "control_ratio": control["ratio"] if control else None,
        "control_ratio_quartiles": control["ratio_quartiles"] if control else None,
        "control_cpu_ratio": control["cpu_ratio"] if control else None,
        # One rank's share of the gradients in fp32: the size of a gradient-partition buffer.
        "fp32_gradient_partition_bytes": 4 * parameters / world,
        "timing": timing,
        "max_loss_difference": max(loss_diff, timing["max_loss_difference"] if timing else 0.0),
        "one_update_per_step": this["one_update_per_step"] and (timing is None or timing["one_update_per_step"]),
    }
    result["same_losses"] = result["max_loss_difference"] <= LOSS_TOLERANCE
    quartiles = result["control_ratio_quartiles"]
    result["time_within_noise"] = (None if quartiles is None or result["time_ratio"] is None else
                                   quartiles[0] <= result["time_ratio"] <= quartiles[2])
    result["targets"] = {
        "collectives": result["same_collectives"],
        "memory": memory_ratio is not None and abs(memory_ratio - 1) <= MEMORY_TOLERANCE,
        "time": result["time_ratio"] is not None and result["time_ratio"] <= TIME_RATIO_TARGET,
    }
    result["reasons"] = _reasons(result, this)
    return result


def _reasons(result: dict, this: dict) -> list[str]:
    reasons = []
    if not result["targets"]["collectives"]:
        if result["count_differences"]:
            reasons.append("collectives per step differ: " + "; ".join(result["count_differences"]))
        else:
            reasons.append("the same collectives per step on average, but not step by step or rank by rank "
                           "(see counts_by_step in the JSON)")
    if not result["targets"]["memory"] and result["memory_ratio"] is not None:
        percent = (result["memory_ratio"] - 1) * 100
        text = f"peak memory {_signed_mib(result['memory_delta_bytes'])} ({percent:+.1f} %)"
        own = result["memory_noise"]
        if own is not None:
            noise = "within" if abs(result["memory_ratio"] - 1) <= own else "outside"
            text += f"; managed's own peak moves {own * 100:.1f} % between rounds, so this is {noise} that noise"
        if result["engine_memory_ratio"] is not None:
            text += f"; counted from the RSS before the model existed the ratio is {result['engine_memory_ratio']:.3f}"
        partition = result["fp32_gradient_partition_bytes"]
        if partition and abs(abs(result["memory_delta_bytes"]) / partition - 1) <= 0.15:
            text += (
                f"; the difference is the size of one rank's fp32 gradient partition ({partition / MIB:.1f} MiB): "
                "a gradient buffer held by one mode and not the other")
        reasons.append(text)
    if not result["targets"]["time"] and result["time_ratio"] is not None:
        q1, _, q3 = result["time_ratio_quartiles"]
        text = f"median time ratio {result['time_ratio']:.3f} (quartiles {q1:.2f}–{q3:.2f})"
        if result["control_ratio"] is not None:
            c1, _, c3 = result["control_ratio_quartiles"]
            noise = "within" if result["time_within_noise"] else "outside"
            text += (f"; two identical managed engines differ by {result['control_ratio']:.3f} "
                     f"(quartiles {c1:.2f}–{c3:.2f}), so this is {noise} the noise")
        if result["cpu_time_ratio"] is not None:
            text += f"; CPU-time ratio {result['cpu_time_ratio']:.3f}"
            if result["control_cpu_ratio"] is not None:
                text += f" (control {result['control_cpu_ratio']:.3f})"
            if result["cpu_time_ratio"] <= TIME_RATIO_TARGET:
                text += " (the ranks computed no more: the extra wall time was spent waiting)"
        reasons.append(text)
    if result["targets"]["time"] is False and result["time_ratio"] is None:
        reasons.append("no timing (the timing trial did not run; see the JSON)")
    if not result["same_losses"]:
        reasons.append(f"losses differ from managed by up to {result['max_loss_difference']:.2e}")
    if not result["one_update_per_step"]:
        reasons.append(f"{this['global_steps']} optimizer updates for {this['expected_global_steps']} logical steps")
    return reasons


def analyze(data: dict) -> dict:
    """Add ``summary`` to each mode and ``comparisons`` to each cell (in place); return ``data``."""
    for section in data["devices"]:
        for cell in section["results"]:
            for mode, entry in cell["modes"].items():
                entry["summary"] = summarize_mode(entry)
                timing = summarize_timing(cell.get("timing"), mode)
                if entry["summary"] and timing:
                    entry["summary"]["median_step_s"] = timing["median_step_s"]
                    entry["summary"]["median_step_cpu_s"] = timing["median_step_cpu_s"]
            cell["comparisons"] = {mode: compare(cell, mode) for mode in (configs.UNMANAGED, configs.TOGGLE)}
        for cell in section.get("factor", []):
            timing = cell.get("timing")
            cell["comparison"] = {
                "factor": summarize_timing(timing, configs.FACTOR, configs.UNMANAGED),
                "control": summarize_timing(timing, CONTROL, configs.UNMANAGED),
            }
    return data


# -- Markdown -------------------------------------------------------------------------------------------------
def _num(value) -> str:
    if value is None:
        return "–"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.2f}"


def _bytes(value) -> str:
    if value is None:
        return "–"
    if value < 1024:
        return f"{_num(value)} B"
    if value < MIB:
        return f"{value / 1024:.1f} KiB"
    return f"{value / MIB:.2f} MiB"


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _signed_mib(value) -> str:
    return f"{value / MIB:+.1f} MiB"


def _plain_ratio(comparison: dict | None, entry: dict, key: str) -> str:
    if _mode_state(entry) or comparison is None or comparison.get(key) is None:
        return "–"
    return f"{comparison[key]:.3f}"


def _mode_state(entry: dict) -> str | None:
    status = entry["status"]
    if status == "ok":
        return None
    if status == "unsupported":
        return "not supported by the installed stack"
    if status == "unavailable":
        return "unavailable here"
    if status == "error":
        return "error"
    return status


def _check(flag: bool) -> str:
    return "✅" if flag else "❌"


def _verdict(comparison: dict | None, entry: dict) -> str:
    state = _mode_state(entry)
    if state:
        return state
    if comparison is None:
        return "–"
    t = comparison["targets"]
    text = f"{_check(t['collectives'])} comm {_check(t['memory'])} mem {_check(t['time'])} time"
    if not (comparison["same_losses"] and comparison["one_update_per_step"]):
        text += " ❌ not the same update"
    return text


def _ratio(comparison: dict | None, entry: dict | None, key: str) -> str:
    if (entry is not None and _mode_state(entry)) or comparison is None or comparison[key] is None:
        return "–"
    low, _, high = comparison[f"{key}_quartiles"]
    return f"{comparison[key]:.3f} ({low:.2f}–{high:.2f})"


def _step_ms(summary: dict | None) -> str:
    if not summary:
        return "–"
    if "median_step_s" in summary:
        return f"{summary['median_step_s'] * 1e3:.1f} ms"
    return f"({summary['isolated_median_step_s'] * 1e3:.1f} ms)"


def _memory_vs(comparison: dict | None, entry: dict) -> str:
    if _mode_state(entry) or comparison is None or comparison["memory_ratio"] is None:
        return "–"
    return f"{(comparison['memory_ratio'] - 1) * 100:+.2f} % ({_signed_mib(comparison['memory_delta_bytes'])})"


def _short_names(base: str) -> dict[str, str]:
    """Each PR's title -> its short name, from ``patches/deepspeed-<base>/series``: PRs are named, not numbered
    (a position goes stale when PRs are put before it)."""
    series = Path(__file__).resolve().parent.parent / "patches" / f"deepspeed-{base}" / "series"
    if not series.is_file():
        return {}
    pairs = [line.split(" ", 1) for line in series.read_text().splitlines() if line and not line.startswith("#")]
    return {title: name for name, title in pairs}


def _series_line(ds: dict) -> str:
    commits = ds.get("commits")
    base = ds["version"].partition("+")[0]
    if commits is None:
        text = f"DeepSpeed {ds['version']}"
    elif not commits:
        text = f"DeepSpeed {ds['version']}: pristine {base}, no PR of the series committed"
    else:
        names = _short_names(base)
        prs = ", ".join(f"`{names[title]}`" if title in names else title for title in commits)
        text = f"DeepSpeed {ds['version']}: {base} + {prs}"
    if ds.get("uncommitted_changes"):
        text += " (the DeepSpeed tree had uncommitted changes)"
    return text


def machine_lines(machine: dict) -> list[str]:
    """The machine and the Python and torch versions (``ds_bench.machine.describe()``), as list items."""
    return [
        f"- Machine: {machine['cpu']}, {machine['cpu_count']} cores, {machine['memory_gib']} GiB; {machine['os']}" +
        (f"; GPUs: {', '.join(machine['cuda_devices'])}" if machine.get("cuda_devices") else "; no GPU"),
        f"- Python {machine['python']}, torch {machine['torch']}",
    ]


def base_of(data: dict) -> str:
    """The release the measured DeepSpeed is built on."""
    return data["machine"]["deepspeed"]["version"].partition("+")[0]


def render(data: dict,
           analysis_path: Path | None = None,
           beside: dict | None = None,
           beside_page: str | None = None) -> str:
    """The Markdown page; ``analysis_path`` (default: none) adds the hand-written analysis, ``beside`` (an analyzed
    run on another base, whose page is ``beside_page``) a section with its summary and its ratios next to these."""
    machine = data["machine"]
    base = base_of(data)
    json_name = "benchmarks.json" if base == "0.19.3" else f"benchmarks-{base}.json"
    fixcost_page = "benchmarks-fixcost.md" if base == "0.19.3" else f"benchmarks-fixcost-{base}.md"
    lines = [
        "# Benchmarks: the cost of owning the boundary",
        "",
        "What does `\"managed_gradient_accumulation\": false` cost? The same model and data are trained three "
        "ways for N micro-batches per logical step:",
        "",
        "- **(a) managed**: `gradient_accumulation_steps = N`; forward, backward and `step()` on every micro-batch.",
        "- **(b) unmanaged**: the same config with `\"managed_gradient_accumulation\": false`; N backwards, then "
        "one `step()`.",
        "- **(c) toggle**: managed, driven by `set_gradient_accumulation_boundary(i == N - 1)` before each "
        "micro-batch and `step()` after each backward (today's workaround).",
        "",
        "All three call `backward(loss / N, scale_wrt_gas=False)`. Targets for (b) against (a): the same "
        "collectives and bytes per logical step (apart from one all-reduce of at most "
        f"{STEP_CHECK_BYTES} bytes with which `step()` checks that the ranks agree), the same peak memory "
        f"(within 1 %), and a median time ratio b/a of at most {TIME_RATIO_TARGET}.",
        "",
        f"Generated by `{data['command']}` ({data['finished']}) with DeepSpeed {base} and its series; regenerate the "
        f"text from the run's JSON, `benchmarks/results/{json_name}` (written beside this page, not committed), with "
        f"`python -m ds_bench render --json benchmarks/results/{json_name}`. Do not edit by hand." +
        (f" The `gradient_divide_factor` tables were re-measured by `python -m ds_bench factor` "
         f"({data['factor_finished']})." if data.get("factor_finished") else ""),
        "",
        f"What the series' bug-fix PRs cost in managed mode, pristine {base} against {base} with them, has a page of "
        f"its own: [{fixcost_page}]({fixcost_page}) (`python -m ds_bench fixcost`).",
        "",
        "## Machine and software",
        "",
    ] + machine_lines(machine) + [f"- {_series_line(machine['deepspeed'])}"]
    if data.get("quick"):
        lines.append("- **Quick mode** (`--quick`): a tiny model and few rounds; a smoke test, not a measurement.")
    lines += ["", "## Summary", ""]
    for section in data["devices"]:
        lines += _summary(section)
    lines.append("")
    lines += _analysis(data, analysis_path)
    if beside is not None:
        lines += _render_beside(data, beside, beside_page)
    for section in data["devices"]:
        lines += _render_section(section, data)
        lines += _render_factor(section)
    return "\n".join(lines).rstrip() + "\n"


#: What ``_render_beside`` and ``_summary`` read of a cell's comparison.
_BESIDE_KEYS = ("targets", "time_ratio", "control_ratio", "memory_ratio", "time_within_noise", "same_losses",
                "one_update_per_step", "same_collectives")


def summary(data: dict) -> dict:
    """What another base's page shows of an analyzed run (``_render_beside``), without its rounds and ranks: the
    small file committed in place of the run's JSON."""
    return {
        "schema": data.get("schema"),
        "command": data.get("command"),
        "finished": data.get("finished"),
        "machine": data["machine"],
        "devices": [{
            "device": section["device"],
            "settings": section["settings"],
            "results": [{
                "configuration": cell["configuration"],
                "n_micro": cell["n_micro"],
                "modes": {mode: {"status": entry["status"]} for mode, entry in cell["modes"].items()},
                "comparisons": {
                    mode: comparison and {key: comparison.get(key) for key in _BESIDE_KEYS}
                    for mode, comparison in (cell.get("comparisons") or {}).items()
                },
            } for cell in section["results"]],
        } for section in data["devices"]],
    }


def _render_beside(data: dict, other: dict, page: str | None) -> list[str]:
    """The other base's run next to this one: its summary, and per cell both runs' b/a and a′/a and targets met."""
    base, other_base = base_of(data), base_of(other)
    lines = [
        f"## Beside it: DeepSpeed {other_base}",
        "",
        f"The same benchmark on DeepSpeed {other_base} with its follow-up series (upstream's own "
        f"`managed_gradient_accumulation` and this project's PRs on top), run on the same kind of machine "
        f"({other['finished']}; the whole page: [{page}]({page})).",
        "",
        f"- {_series_line(other['machine']['deepspeed'])}",
        "",
    ]
    for section in other["devices"]:
        lines += _summary(section)
    lines += [
        "",
        "Per cell, b/a and a′/a of both runs (medians of neighbouring-step ratios) and the targets (b) met "
        "(collectives, memory, time):",
        "",
        f"| Configuration | N | b/a {base} | a′/a {base} | Targets {base} | b/a {other_base} | a′/a {other_base} "
        f"| Targets {other_base} |",
        "|---|--:|--:|--:|---|--:|--:|---|",
    ]
    mine = {(c["configuration"], c["n_micro"]): c
            for s in data["devices"] if s["device"] == "cpu" for c in s["results"]}
    theirs = {(c["configuration"], c["n_micro"]): c
              for s in other["devices"] if s["device"] == "cpu" for c in s["results"]}

    def columns(cell: dict | None) -> list[str]:
        comparison = ((cell or {}).get("comparisons") or {}).get(configs.UNMANAGED)
        if comparison is None:
            return ["–", "–", "not run"]
        targets = comparison["targets"]
        met = ", ".join(name for name in ("collectives", "memory", "time") if targets[name])
        return [_fmt_ratio(comparison["time_ratio"]), _fmt_ratio(comparison["control_ratio"]), met or "none"]

    for key in list(mine) + [k for k in theirs if k not in mine]:
        if key not in theirs and not ((mine[key].get("comparisons") or {}).get(configs.UNMANAGED)):
            continue
        lines.append(f"| {key[0]} | {key[1]} | "
                     + " | ".join(columns(mine.get(key)) + columns(theirs.get(key))) + " |")
    return lines + [""]


def _ratio_cell(summary: dict | None) -> str:
    if summary is None:
        return "–"
    q1, _, q3 = summary["ratio_quartiles"]
    return f"{summary['ratio']:.3f} ({q1:.2f}–{q3:.2f})"


def _render_factor(section: dict) -> list[str]:
    """The cost of step(gradient_divide_factor=...): (d) against (b), with the noise b′/b beside it."""
    cells = section.get("factor") or []
    if not cells:
        return []
    steps = {c["n_micro"]: c.get("measured_steps") for c in cells}
    lines = [
        f"### {section['device'].upper()}: the cost of `step(gradient_divide_factor=...)` (`gradient-divide-factor`)",
        "",
        "(d) is unmanaged mode with raw losses and `step(gradient_divide_factor=N * world_size)`, the same "
        "update as (b), whose losses are divided by N before `backward()`. One timing trial per configuration "
        "and N holds (b), (d) and a second (b) engine b′ (the control), stepped in rotating order; " +
        ", ".join(f"{v} for N = {n}"
                  for n, v in steps.items()) + " measured steps per engine. *d/b* and *b′/b* are medians of "
        f"the ratios of neighbouring steps, with their quartiles. Target: d/b at most {TIME_RATIO_TARGET}, or "
        "within the noise that b′/b shows.",
        "",
        "| Configuration | Offload | N | Time b | d/b | b′/b | CPU d/b | Loss d vs b | Target |",
        "|---|---|--:|--:|---|---|--:|--:|---|",
    ]
    notes = []
    for cell in cells:
        timing = cell.get("timing") or {}
        head = f"| {cell['configuration']} | {cell['offload']} | {cell['n_micro']} |"
        if timing.get("status") != "ok":
            reason = timing.get("reason") or timing.get("error") or timing.get("status")
            lines.append(head + f" – | – | – | – | – | not measured: {reason} |")
            continue
        factor, control = cell["comparison"]["factor"], cell["comparison"]["control"]
        within = factor["ratio"] <= TIME_RATIO_TARGET
        noise = control is not None and factor["ratio_quartiles"][0] <= control["ratio_quartiles"][2]
        verdict = "✅" if within else ("≈ (within noise)" if noise else "❌")
        if factor["max_loss_difference"] > LOSS_TOLERANCE or not factor["one_update_per_step"]:
            verdict = "❌ not the same update as (b)"
        if not within:
            notes.append(f"- {cell['configuration']}, N = {cell['n_micro']}: d/b {factor['ratio']:.3f}; the "
                         f"control b′/b is {control['ratio']:.3f} (quartiles {control['ratio_quartiles'][0]:.2f}–"
                         f"{control['ratio_quartiles'][2]:.2f}), so this is {'within' if noise else 'beyond'} the "
                         f"noise; CPU d/b {_fmt_ratio(factor['cpu_ratio'])}.")
        lines.append(head + f" {statistics.median(timing['times_s'][configs.UNMANAGED]) * 1e3:.1f} ms |"
                     f" {_ratio_cell(factor)} | {_ratio_cell(control)} | {_fmt_ratio(factor['cpu_ratio'])} |"
                     f" {factor['max_loss_difference']:.1e} | {verdict} |")
    lines.append("")
    if notes:
        lines += ["Above the target:", ""] + notes + [""]
    return lines


def _fmt_ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


#: A hand-written reading of the committed run (why a target was missed), kept beside the code.
ANALYSIS = Path(__file__).resolve().parents[1] / "results" / "analysis.md"
_RUN_MARKER = re.compile(r"<!--\s*run:\s*(\S+)\s*-->")


def _analysis(data: dict, path: Path | None) -> list[str]:
    """The analysis file's text, under a heading; flagged if it was written for another run."""
    if path is None or not path.is_file():
        return []
    text = path.read_text().strip()
    match = _RUN_MARKER.search(text)
    text = _RUN_MARKER.sub("", text).strip()
    lines = ["## Analysis", ""]
    if not match or match.group(1) != data.get("finished"):
        written_for = match.group(1) if match else "an unnamed run"
        lines += [
            f"> Written for the run of {written_for}, not for the one below ({data.get('finished')}): check "
            "that it still applies.", ""
        ]
    return lines + text.splitlines() + [""]


def _summary(section: dict) -> list[str]:
    cells = section["results"]
    ran = [c for c in cells if (c.get("comparisons") or {}).get(configs.UNMANAGED)]
    refused = sum(c["modes"][configs.UNMANAGED]["status"] == "unsupported" for c in cells)
    not_run = sum(c["modes"][configs.MANAGED]["status"] == "unavailable" for c in cells)
    failed = sum(c["modes"][configs.UNMANAGED]["status"] == "error" for c in cells)
    s = section["settings"]
    head = (f"- **{section['device'].upper()}, {s['world_size']} ranks**: unmanaged mode (b) ran in {len(ran)} of "
            f"{len(cells)} cells (configuration × N)")
    others = [
        f"{n} {what}" for n, what in ((refused, "not supported by the installed stack"),
                                      (not_run, "not run on this machine"), (failed, "failed")) if n
    ]
    lines = [head + (f"; {', '.join(others)}." if others else ".")]
    if not ran:
        return lines
    comps = [c["comparisons"][configs.UNMANAGED] for c in ran]
    n = len(comps)
    memory = [x["memory_ratio"] for x in comps if x["memory_ratio"] is not None]
    worst = max(memory, key=lambda r: abs(r - 1)) if memory else None
    ratios = [x["time_ratio"] for x in comps if x["time_ratio"] is not None]
    controls = [x["control_ratio"] for x in comps if x["control_ratio"] is not None]
    time_misses = [x for x in comps if not x["targets"]["time"]]
    noisy = sum(bool(x["time_within_noise"]) for x in time_misses)
    lines += [
        f"  - Collectives and bytes per logical step as managed (a), but for `step()`'s check: "
        f"{sum(x['targets']['collectives'] for x in comps)} of {n}.",
        f"  - Peak memory within 1 % of managed: {sum(x['targets']['memory'] for x in comps)} of {n}" +
        (f" (largest difference {(worst - 1) * 100:+.2f} %)." if worst is not None else "."),
        f"  - Median time ratio b/a at most {TIME_RATIO_TARGET}: {sum(x['targets']['time'] for x in comps)} of {n}" +
        (f"; b/a over all cells: median {statistics.median(ratios):.3f}, from {min(ratios):.3f} to {max(ratios):.3f}"
         if ratios else "") +
        (f"; two identical managed engines (a′/a) ranged from {min(controls):.3f} to {max(controls):.3f}"
         if controls else "") +
        (f"; {noisy} of the {len(time_misses)} misses lie within that noise" if time_misses and controls else "") +
        ".",
        f"  - Same losses as managed and exactly one optimizer update per logical step: "
        f"{sum(x['same_losses'] and x['one_update_per_step'] for x in comps)} of {n}.",
    ]
    toggles = [c["comparisons"].get(configs.TOGGLE) for c in cells if (c.get("comparisons") or {}).get(configs.TOGGLE)]
    if toggles:
        toggle_ratios = [x["time_ratio"] for x in toggles if x["time_ratio"] is not None]
        lines.append(f"  - The toggle workaround (c) sent the same collectives as managed in "
                     f"{sum(x['same_collectives'] for x in toggles)} of {len(toggles)} cells" +
                     (f"; c/a median {statistics.median(toggle_ratios):.3f}." if toggle_ratios else "."))
    return lines


def _render_section(section: dict, data: dict) -> list[str]:
    s = section["settings"]
    model = s["model"]
    params = next((r["modes"][configs.MANAGED]["rounds"][0]["parameters"]
                   for r in section["results"] if r["modes"][configs.MANAGED].get("rounds")), None)
    gpu = section["device"] == "cuda"
    memory_key = "peak_gpu_allocated_bytes" if gpu else "peak_rss_bytes"
    memory_label = "peak allocated GPU memory" if gpu else "peak RSS"
    lines = [
        f"## {section['device'].upper()}: {s['world_size']} ranks, {s['backend']}",
        "",
        f"- Model: a {model['n_layers']}-layer GPT (d_model {model['d_model']}, {model['n_heads']} heads, "
        f"vocabulary {model['vocab']}), {_num(params)} parameters, {s['dtype']}; micro-batch "
        f"{model['micro_batch']} × {model['seq_len']} tokens; Adam (CPU Adam where the optimizer is offloaded); "
        f"`gradient_clipping` 1.0; ZeRO bucket sizes {_num(s['bucket_elements'])} elements.",
        f"- Counts and memory: {_plural(s['rounds'], 'round')} of one trial per mode (a fresh process per rank "
        "and trial; a, b, c, then c, b, a), each " + _plural(s['warmup_steps'], 'warm-up step') + " then " +
        ", ".join(f"{v} for N = {k}" for k, v in s["measure_steps"].items()) + " measured logical steps. "
        "Time: one trial per configuration and N holding an engine per mode plus a second managed engine a′ "
        "(the control), stepped in rotating order; " + ", ".join(f"{v} for N = {k}"
                                                                 for k, v in s["timing_steps"].items()) +
        " measured steps per engine. " + f"{_plural(s['threads_per_rank'], 'torch thread')} per rank.",
        "- *Collectives* and *bytes* are per logical step (bytes: the full buffer of each collective on one rank; "
        "`=`: exactly as (a)). *Time a* is the median step time of the slowest rank. *b/a*, *c/a* and *a′/a* are "
        "medians of the ratios of neighbouring steps, with their quartiles; a′/a is what noise alone produces "
        "on this machine. *CPU b/a* is the same ratio for the CPU time the busiest rank used (insensitive to "
        f"waiting for a core). *Memory* is the {memory_label} during the measured steps, the largest over ranks, "
        "median over rounds; b and c are shown against a.",
        "",
        "| Configuration | Offload | N | Collectives a · b · c | Bytes a · b · c | Time a | b/a | c/a | a′/a "
        "| CPU b/a | Memory a | b vs a | c vs a | Targets (b) |",
        "|---|---|--:|---|---|--:|---|---|---|--:|--:|--:|--:|---|",
    ]
    misses, notes, errors, details, not_run = [], [], [], [], {}
    checked = any(
        ((c.get("comparisons") or {}).get(configs.UNMANAGED) or {}).get("step_check") for c in section["results"])
    varying = False
    for cell in section["results"]:
        modes = cell["modes"]
        summaries = {m: modes[m].get("summary") for m in configs.MODES}
        comps = cell.get("comparisons") or {}
        a = summaries[configs.MANAGED]
        label = f"{cell['configuration']}, N = {cell['n_micro']}"
        if modes[configs.MANAGED]["status"] == "unavailable":
            not_run[cell["configuration"]] = modes[configs.MANAGED].get("reason")
            continue

        def per_mode(key, fmt):
            nonlocal varying
            values = []
            for m in configs.MODES:
                summary = summaries[m]
                if _mode_state(modes[m]) or summary is None:
                    values.append("–")
                    continue
                mark = ""
                if not summary["counts_consistent"]:
                    mark, varying = "†", True
                if m != configs.MANAGED and a is not None and summary[key] == a[key]:
                    values.append("=" + mark)
                else:
                    values.append(fmt(summary[key]) + mark)
            return " · ".join(values)

        managed_state = _mode_state(modes[configs.MANAGED])
        row = [
            cell["configuration"],
            cell["offload"],
            str(cell["n_micro"]),
            per_mode("calls_per_step", _num),
            per_mode("bytes_per_step", _bytes),
            managed_state or _step_ms(a),
            _ratio(comps.get(configs.UNMANAGED), modes[configs.UNMANAGED], "time_ratio"),
            _ratio(comps.get(configs.TOGGLE), modes[configs.TOGGLE], "time_ratio"),
            _ratio(comps.get(configs.UNMANAGED) or comps.get(configs.TOGGLE), None, "control_ratio"),
            _plain_ratio(comps.get(configs.UNMANAGED), modes[configs.UNMANAGED], "cpu_time_ratio"),
            f"{a[memory_key] / MIB:.1f} MiB" if a and a[memory_key] else "–",
            _memory_vs(comps.get(configs.UNMANAGED), modes[configs.UNMANAGED]),
            _memory_vs(comps.get(configs.TOGGLE), modes[configs.TOGGLE]),
            _verdict(comps.get(configs.UNMANAGED), modes[configs.UNMANAGED]),
        ]
        lines.append("| " + " | ".join(row) + " |")
        for mode in configs.MODES:
            if modes[mode]["status"] == "error":
                errors.append(f"- {label}, ({configs.MODE_LETTER[mode]}) {mode}: {modes[mode].get('error')}")
        unmanaged = comps.get(configs.UNMANAGED)
        if unmanaged and unmanaged["reasons"]:
            misses.append(f"- {label}: " + "; ".join(unmanaged["reasons"]))
        toggle = comps.get(configs.TOGGLE)
        if toggle and not (toggle["same_losses"] and toggle["one_update_per_step"] and toggle["same_collectives"]):
            notes.append(f"- {label}, (c) toggle: " +
                         "; ".join(r for r in toggle["reasons"] if not r.startswith(("median time", "peak memory"))))
        if a:
            details += _detail_rows(cell, summaries)
    lines.append("")
    if varying:
        lines += [
            "† The counts changed between measured steps, rounds or ranks; the figure is the mean per step "
            "(each step's counts are in the JSON).", ""
        ]
    unsupported = sorted({(cell["configuration"], cell["modes"][configs.UNMANAGED].get("reason"))
                          for cell in section["results"]
                          if cell["modes"][configs.UNMANAGED]["status"] == "unsupported"})
    if unsupported:
        lines += ["### Not supported by the installed stack", ""]
        lines += [f"- {name}: {reason}" for name, reason in unsupported]
        lines.append("")
    if not_run:
        lines += ["### Not run on this machine", ""]
        lines += [f"- {name}: {reason}" for name, reason in not_run.items()]
        lines.append("")
    lines += ["### Missed targets and why", ""]
    lines += misses or ["- None: every configuration that ran in unmanaged mode met every target."]
    lines.append("")
    if notes:
        lines += ["### The toggle workaround (c) differs from managed mode", ""] + notes + [""]
    if errors:
        lines += ["### Errors", ""] + errors + [""]
    lines += [
        "### Collectives by type, per logical step",
        "",
        "Calls · bytes of (a); for (b) and (c), `=` means exactly the same calls and bytes as (a)." +
        (f" In (b), one `all_reduce` of at most {STEP_CHECK_BYTES} bytes per logical step is `step()`'s check that "
         "the ranks agree." if checked else ""),
        "",
        "| Configuration | N | Collective | Calls (a) | Bytes (a) | (b) | (c) |",
        "|---|--:|---|--:|--:|---|---|",
    ]
    lines += details
    lines.append("")
    return lines


def _detail_rows(cell: dict, summaries: dict) -> list[str]:
    base = summaries[configs.MANAGED]["counts_per_step"]
    ops = list(base)
    for mode in (configs.UNMANAGED, configs.TOGGLE):
        if summaries[mode]:
            ops += [op for op in summaries[mode]["counts_per_step"] if op not in ops]
    rows = []
    zero = {"calls": 0, "bytes": 0}
    for op in ops:
        entry = base.get(op, zero)
        cells = []
        for mode in (configs.UNMANAGED, configs.TOGGLE):
            summary = summaries[mode]
            if summary is None:
                cells.append("–")
                continue
            other = summary["counts_per_step"].get(op, zero)
            cells.append("=" if other == entry else f"{_num(other['calls'])} · {_bytes(other['bytes'])}")
        rows.append(f"| {cell['configuration']} | {cell['n_micro']} | `{op}` | {_num(entry['calls'])} | "
                    f"{_bytes(entry['bytes'])} | {cells[0]} | {cells[1]} |")
    return rows
