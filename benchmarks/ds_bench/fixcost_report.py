"""The page of ``python -m ds_bench fixcost``, rendered from its :class:`ds_bench.fixcost.Study`.

Per configuration, each build's median step over the pristine build's in the same round (f/a, g/a), beside the same
ratio for the second pristine build (a′/a): what two identical builds differ by on this machine, at that moment. A
cost shows when f/a stands apart from a′/a over the rounds; the fixes' own methods, timed inside the same trials, say
what they take directly.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ds_bench import report
from ds_bench.fixcost import AFTER, CONTROL, FIXES, LETTER, PRISTINE, Cell, Study

RESULTS = Path(__file__).resolve().parents[1] / "results"


def analysis_of(page: Path) -> Path | None:
    """The hand-written reading of a committed page: ``benchmarks-fixcost-<base>.md`` ->
    ``fixcost-analysis-<base>.md`` beside it (None for pages elsewhere)."""
    if page.resolve().parent != RESULTS.resolve():
        return None
    return page.with_name(page.name.replace("benchmarks-fixcost", "fixcost-analysis"))


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.0f}" if seconds >= 0.1 else f"{seconds * 1e3:.2f}"


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return "–"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f})"


def _others(study: Study) -> list[str]:
    """The roles compared with pristine, in the page's order."""
    return [r for r in (FIXES, AFTER, CONTROL) if r in study.roles]


def same_collectives(cell: Cell, role: str) -> bool:
    """Every trial of ``role`` issued the collectives (calls and bytes per op and step) of pristine's."""
    base = cell.of(PRISTINE)
    return bool(base) and all(t.collectives == base[0].collectives for t in cell.of(role))


def same_losses(cell: Cell, role: str) -> bool:
    """Every trial of ``role`` computed pristine's losses, bit for bit, on every rank (NaN equal to NaN)."""
    base = cell.of(PRISTINE)
    same = lambda a, b: a == b or (a != a and b != b)  # noqa: E731
    return bool(base) and all(
        all(same(x, y) for ra, rb in zip(t.losses, base[0].losses) for x, y in zip(ra, rb)) for t in cell.of(role))


def method_median(cell: Cell, role: str, method: str) -> float | None:
    """The median over every measured step of ``role``'s trials of the seconds inside ``method``."""
    values = [s for t in cell.of(role) if method in t.methods_s for s in t.methods_s[method]]
    return statistics.median(values) if values else None


def _cpu(trial) -> float:
    return statistics.median(trial.cpu_s)


def _summary_rows(study: Study) -> list[str]:
    others = _others(study)
    lines = [
        "| Configuration | a: median step (ms) | " + " | ".join(f"{LETTER[r]}/a" for r in others) +
        " | a: CPU per step (ms) | " + " | ".join(f"CPU {LETTER[r]}/a"
                                                  for r in others) + " | peak RSS f − a | collectives, losses |",
        "|---|---:|" + "---:|" * len(others) + "---:|" + "---:|" * len(others) + "---:|---|",
    ]
    for cell in study.cells:
        base = [s for t in cell.of(PRISTINE) for s in t.step_s]
        base_cpu = [s for t in cell.of(PRISTINE) for s in t.cpu_s]
        rss = [t.peak_rss_bytes for t in cell.of(FIXES)], [t.peak_rss_bytes for t in cell.of(PRISTINE)]
        rss_text = f"{(statistics.median(rss[0]) - statistics.median(rss[1])) / 2**20:+.0f} MiB" if all(rss) else "–"
        checks = [r for r in (FIXES, AFTER) if r in study.roles]
        same = all(same_collectives(cell, r) and same_losses(cell, r) for r in checks)
        lines.append(f"| {cell.configuration} | {_ms(statistics.median(base)) if base else '–'} | " +
                     " | ".join(_spread(cell.ratios(r))
                                for r in others) + f" | {_ms(statistics.median(base_cpu)) if base_cpu else '–'} | " +
                     " | ".join(_spread(cell.ratios(r, _cpu)) for r in others) + f" | {rss_text} | " +
                     ("identical" if same else "**differ**") + " |")
    return lines


def _round_rows(study: Study, cell: Cell) -> list[str]:
    roles, others = study.roles, _others(study)
    lines = [
        "| Round | order | load (1 min) | " + " | ".join(f"{LETTER[r]} (ms)" for r in roles) + " | " +
        " | ".join(f"{LETTER[r]}/a"
                   for r in others) + " | " + " | ".join(f"{LETTER[r]} CPU (ms)"
                                                         for r in roles) + " | " + " | ".join(f"CPU {LETTER[r]}/a"
                                                                                              for r in others) + " |",
        "|---:|---|---|" + "---:|" * 2 * (len(roles) + len(others)),
    ]
    for round_index in range(study.rounds):
        trials = {t.role: t for t in cell.trials if t.round == round_index}
        if not trials:
            continue
        order = ", ".join(LETTER[t.role] for t in sorted(trials.values(), key=lambda t: t.place))
        loads = [x for t in trials.values() for x in t.load]
        base = trials.get(PRISTINE)

        def ratio(role: str, of) -> str:
            return f"{of(trials[role]) / of(base):.3f}" if base and role in trials else "–"

        wall = lambda t: t.median_s  # noqa: E731
        lines.append(f"| {round_index + 1} | {order} | {min(loads):.1f}–{max(loads):.1f} | " +
                     " | ".join(_ms(trials[r].median_s) if r in trials else "–"
                                for r in roles) + " | " + " | ".join(ratio(r, wall) for r in others) + " | " +
                     " | ".join(_ms(_cpu(trials[r])) if r in trials else "–"
                                for r in roles) + " | " + " | ".join(ratio(r, _cpu) for r in others) + " |")
    return lines


def _method_rows(study: Study, cell: Cell) -> list[str]:
    roles = study.roles
    names = sorted({m for t in cell.trials for m in t.methods_s}, key=lambda m: (not m.endswith(".step"), m))
    lines = [
        "| Method | calls a step | " + " | ".join(f"{LETTER[r]} (ms)" for r in roles) + " |",
        "|---|---:|" + "---:|" * len(roles),
    ]
    for name in names:
        calls = next((t.method_calls[name] for t in cell.trials if t.method_calls.get(name)), 0)
        if not calls:
            continue
        lines.append(f"| `{name}` | {calls} | " + " | ".join(_ms(method_median(cell, r, name)) for r in roles) + " |")
    return lines


def _rounds_text(study: Study) -> str:
    done = len({t.round for cell in study.cells for t in cell.trials})
    return report._plural(done, "round") + (f" (of {study.rounds} planned)" if done < study.rounds else "")


def render(study: Study, analysis_path: Path | None = None) -> str:
    """The page; ``analysis_path`` adds the hand-written analysis."""
    size, b = study.size, study.builds
    built = [
        f"- ({LETTER[r]}) {r}: " +
        (f"the pristine tree again, `{b[PRISTINE].tree}`" if r == CONTROL else f"`{b[r].tree}`, " +
         (f"{len(b[r].prs)} PRs from `{b[r].patches}`: " +
          ", ".join(f"`{p}`" for p in b[r].prs) if b[r].prs else f"DeepSpeed {study.base} as released"))
        for r in study.roles
    ]
    lines = [
        f"# Benchmarks: the cost of the {study.base} bug-fix PRs in managed mode, "
        f"{study.parameters / 1e6:.0f} M parameters",
        "",
        f"Pristine DeepSpeed {study.base} **(a)** against {study.base} with the series' bug-fix PRs **(f)**" +
        (" and with a later version of those PRs **(g)**" if AFTER in study.roles else "") +
        ", both in managed mode (the default, what every user runs), with a second pristine build **(a′)** beside "
        "them: "
        "a′/a is what two identical builds differ by on this machine during the run.",
        "",
        f"Generated by `{study.command}` ({study.finished}); `--render` rewrites this text from the run's JSON "
        "(written beside the page, not committed). Do not edit by hand.",
        "",
        "## Machine and software",
        "",
    ] + report.machine_lines(study.machine) + built + [
        f"- The timed processes ran at nice {study.nice}; the machine is shared (other work at nice 10 and 0), "
        "so the load average is recorded around every trial.",
    ]
    if study.quick:
        lines.append("- **Quick mode** (`--quick`): a tiny model and few steps; a smoke test, not a measurement.")
    lines += [
        "",
        "## How",
        "",
        f"- Model: a GPT of {size.n_layers} layers (d_model {size.d_model}, d_ff {size.d_ff}, {size.n_heads} heads, "
        f"vocabulary {size.vocab}): {report._num(study.parameters)} parameters in {study.parameter_tensors} tensors, "
        f"fp32; micro-batch {size.micro_batch} × {size.seq_len} tokens, 1 micro-batch a step; CPU Adam (optimizer "
        f"offloaded to CPU); the main benchmark's ZeRO configurations; {study.world_size} ranks, gloo, "
        f"{report._plural(study.threads_per_rank, 'torch thread')} per rank.",
        f"- {_rounds_text(study)}; in each, for each configuration, one trial per build, one after "
        "another, in an order rotated every round. A trial is a fresh forked process per rank that builds its engine "
        f"from the same weights and data and takes {report._plural(study.warmup_steps, 'warm-up step')} and "
        f"{study.measure_steps} measured steps; its time is the median of the slowest rank's step times.",
        "- *x/a*: per round, build x's median step over pristine's in the same round; the median over the rounds, "
        "with the smallest and largest. *CPU f/a*: the same for the CPU time of the busiest rank. "
        "*Collectives, losses*: calls and bytes per op and step, and every loss on every rank, against a.",
        "",
        "## Summary",
        "",
    ] + _summary_rows(study) + [""]
    lines += report._analysis({"finished": study.finished}, analysis_path)
    for cell in study.cells:
        lines += [f"## {cell.configuration}, by round", ""] + _round_rows(study, cell) + [""]
        lines += [
            f"Time inside the methods the fixes add or change ({cell.configuration}): median per measured step, "
            "slowest rank; – where a build lacks the method.",
            "",
        ] + _method_rows(study, cell) + [""]
        for error in cell.errors:
            lines.append(f"- Failed: round {error['round'] + 1}, ({LETTER[error['role']]}): {error['error']}")
    return "\n".join(lines).rstrip() + "\n"
