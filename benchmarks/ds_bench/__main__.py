"""Command line: ``python -m ds_bench run`` measures; ``python -m ds_bench render`` rewrites the table.

    python -m ds_bench run            # the full run: writes benchmarks/results/benchmarks.md and .json
    python -m ds_bench run --quick    # a smoke run on a tiny model (writes under scratch/ by default)
    python -m ds_bench render         # re-render benchmarks/results/benchmarks.md from its JSON
    python -m ds_bench factor         # re-measure only the gradient_divide_factor table into the JSON
    python -m ds_bench list           # the configurations
    python -m ds_bench fixcost        # the bug-fix PRs' cost in managed mode: results/benchmarks-fixcost-<base>.md
    python -m ds_bench fixwork        # the bug-fix PRs' own per-step work, timed directly at 100M parameters
    python -m ds_bench tinker-memory  # the Tinker server's memory per rank (docs/tinker-server/deployment.md)
    python -m ds_bench tinker-sampling  # the Tinker server's sampling throughput (docs/tinker-server/internals.md)
    python -m ds_bench tinker-samplers  # the native and vLLM samplers side by side (docs/tinker-server/sampling.md)
    python -m ds_bench tinker-logits-memory  # one training pass's memory, 151,936 tokens' vocabulary (internals.md)

The pages and their hand-written analyses are committed in ``benchmarks/results/``; a run's JSON (every round and
rank) is written beside its page and not committed, except ``*-summary.json``, what another page shows of it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parents[1] / "results"
DOCS_MD = RESULTS / "benchmarks.md"
DOCS_JSON = RESULTS / "benchmarks.json"
QUICK_MD = ROOT / "scratch" / "benchmarks-quick.md"
QUICK_JSON = ROOT / "scratch" / "benchmarks-quick.json"
#: The 0.19.8 build's page, which results/benchmarks.md summarizes beside its own (``run`` in the 0.19.8 virtualenv),
#: from the committed summary of its JSON.
DOCS_0198_MD = RESULTS / "benchmarks-0.19.8.md"


def fixcost_md(base: str, quick: bool = False) -> Path:
    """``fixcost``'s page for ``base``: results/benchmarks-fixcost-<base>.md (quick: under scratch/)."""
    return (ROOT / "scratch" if quick else RESULTS) / f"benchmarks-fixcost{'-quick' if quick else ''}-{base}.md"


def _log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def _csv(text: str):
    return [item.strip() for item in text.split(",") if item.strip()]


def _devices(choice: str):
    if choice != "auto":
        return [choice]
    import torch
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def cmd_run(args) -> int:
    os.environ.setdefault("DS_BUILD_OPS", "0")
    import torch

    from ds_bench import configs, machine, report
    from ds_bench.model import FULL, TINY
    from ds_bench.run import Plan, measure_device

    names = _csv(args.configs) if args.configs else [c.name for c in configs.CONFIGURATIONS]
    unknown = [n for n in names if n not in configs.BY_NAME]
    if unknown:
        print(f"unknown configuration(s): {', '.join(unknown)}; see `python -m ds_bench list`", file=sys.stderr)
        return 2
    base = machine.deepspeed_series()["version"].partition("+")[0]
    out_md = Path(args.out) if args.out else (QUICK_MD if args.quick else page_of(base))
    out_json = Path(args.json) if args.json else out_md.with_suffix(".json")
    info = machine.describe()
    print(f"torch {torch.__version__}; {report._series_line(info['deepspeed'])}", flush=True)

    command = "python -m ds_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    data = {
        "schema": 1,
        "command": command.strip(),
        "quick": args.quick,
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": info,
        "devices": [],
    }
    for device in _devices(args.device):
        world = args.world_size
        if device == "cuda":
            world = min(world, torch.cuda.device_count())
        plan = Plan(device=device,
                    world_size=world,
                    configurations=[configs.BY_NAME[n] for n in names],
                    micro_counts=[int(n) for n in _csv(args.micro)],
                    rounds=args.rounds or (2 if args.quick else 3),
                    size=TINY if args.quick else FULL,
                    dtype=args.dtype or ("bf16" if device == "cuda" else "fp32"),
                    threads=args.threads,
                    scratch=ROOT / "scratch" / "benchmarks",
                    force=bool(args.configs))
        if args.quick:
            plan.warmup_steps = 1
            plan.measure_steps = {n: 2 for n in plan.micro_counts}
            plan.timing_steps = {n: 4 for n in plan.micro_counts}
        for item in _csv(args.timing_steps):
            n_micro, steps = item.split(":")
            plan.timing_steps[int(n_micro)] = int(steps)
        # The factor's timing at the default N (1 and 4) where this run measures them, else at its first N.
        plan.factor_micro_counts = [n for n in plan.factor_micro_counts if n in plan.micro_counts
                                    ] or plan.micro_counts[:1]
        data["devices"].append(measure_device(plan, log=_log))
        data["finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        _write(data, out_md, out_json)  # after each device, so a later failure keeps what was measured
    _log(f"wrote {out_md} and {out_json}")
    failed = _failed_trials(data)
    for line in failed:
        print(f"error: {line}", file=sys.stderr)
    return 1 if failed else 0


def _failed_trials(data: dict) -> list:
    """One line per trial that ended in an error (a refusal by the installed stack is not one)."""
    failed = []
    for section in data["devices"]:
        for cell in section["results"]:
            where = f"{section['device']} {cell['configuration']} N={cell['n_micro']}"
            failed += [
                f"{where} {mode}: {e.get('error')}" for mode, e in cell["modes"].items() if e["status"] == "error"
            ]
            if cell.get("timing", {}).get("status") == "error":
                failed.append(f"{where} timing: {cell['timing'].get('error')}")
        for cell in section.get("factor", []):
            if cell["timing"]["status"] == "error":
                failed.append(f"{section['device']} {cell['configuration']} N={cell['n_micro']} factor timing: "
                              f"{cell['timing'].get('error')}")
    return failed


def page_of(base: str) -> Path:
    """The committed page of the build on ``base``: results/benchmarks.md for 0.19.3, results/benchmarks-0.19.8.md."""
    return DOCS_MD if base == "0.19.3" else DOCS_MD.with_name(f"benchmarks-{base}.md")


def _render_page(data: dict, out_md: Path) -> str:
    """``out_md``'s text: a committed page gets its hand-written analysis, and results/benchmarks.md also the summary
    of the 0.19.8 build's run beside its own (from that run's committed summary)."""
    from ds_bench import report
    report.analyze(data)
    if out_md.resolve() == DOCS_MD.resolve():
        beside = summary_path(DOCS_0198_MD.with_suffix(".json"))
        other = json.loads(beside.read_text()) if beside.is_file() else None
        return report.render(data, report.ANALYSIS, beside=other, beside_page=DOCS_0198_MD.name)
    if out_md.resolve() == DOCS_0198_MD.resolve():
        return report.render(data, report.ANALYSIS.with_name("analysis-0.19.8.md"))
    return report.render(data)


def summary_path(out_json: Path) -> Path:
    """Where the small, committed summary of the run in ``out_json`` goes: ``<name>-summary.json`` beside it."""
    return out_json.with_name(f"{out_json.stem}-summary.json")


def _write(data: dict, out_md: Path, out_json: Path) -> None:
    from ds_bench import report
    text = _render_page(data, out_md)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    summary_path(out_json).write_text(json.dumps(report.summary(data), indent=1) + "\n")
    out_md.write_text(text)


def cmd_render(args) -> int:
    from ds_bench import report
    source = Path(args.json)
    out = Path(args.out) if args.out else source.with_suffix(".md")
    data = json.loads(source.read_text())
    out.write_text(_render_page(data, out))
    summary_path(source).write_text(json.dumps(report.summary(data), indent=1) + "\n")
    print(f"wrote {out} and {summary_path(source).name}")
    return 0


def cmd_factor(args) -> int:
    """Re-measure the gradient_divide_factor trials of an existing run and re-render its page."""
    os.environ.setdefault("DS_BUILD_OPS", "0")
    from ds_bench import configs
    from ds_bench.model import ModelSize
    from ds_bench.run import Plan, measure_factor

    source = Path(args.json)
    data = json.loads(source.read_text())
    for section in data["devices"]:
        s = section["settings"]
        names = list(dict.fromkeys(c["configuration"] for c in section["results"]))
        plan = Plan(device=section["device"],
                    world_size=s["world_size"],
                    configurations=[configs.BY_NAME[n] for n in names],
                    size=ModelSize(**s["model"]),
                    dtype=s["dtype"],
                    threads=s["threads_per_rank"],
                    factor_micro_counts=[int(n) for n in _csv(args.micro)],
                    scratch=ROOT / "scratch" / "benchmarks")
        section["factor"] = measure_factor(plan, log=_log)
        s["factor_micro_counts"] = plan.factor_micro_counts
        data.setdefault("factor_command", "python -m ds_bench factor")
        data["factor_finished"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        _write(data, Path(args.out), source)
    print(f"wrote {args.out} and {source}")
    return 0


def cmd_fixcost(args) -> int:
    """Pristine DeepSpeed against the same release + the series' bug-fix PRs (and, with ``--after``, another version of
    those PRs), managed mode: rounds of interleaved processes, with a second pristine build as the control."""
    from ds_bench import fixcost, fixcost_report
    base = args.base or fixcost.installed_base()
    if base not in fixcost.TIMED_METHODS:
        print(f"fixcost measures {', '.join(fixcost.TIMED_METHODS)}, not {base}", file=sys.stderr)
        return 2
    out_md = Path(args.out) if args.out else fixcost_md(base, args.quick)
    out_json = Path(args.json) if args.json else out_md.with_suffix(".json")
    if args.render:
        study = fixcost.Study.from_json(json.loads(out_json.read_text()))
        out_md.write_text(fixcost_report.render(study, fixcost_report.analysis_of(out_md)))
        print(f"wrote {out_md}")
        return 0
    os.environ.setdefault("DS_BUILD_OPS", "0")
    from ds_bench import configs, machine

    names = _csv(args.configs) if args.configs else list(fixcost.CONFIGURATIONS)
    unknown = [n for n in names if n not in configs.BY_NAME]
    if unknown:
        print(f"unknown configuration(s): {', '.join(unknown)}; see `python -m ds_bench list`", file=sys.stderr)
        return 2
    size_name = "quick" if args.quick else args.size
    size = fixcost.SIZES[size_name]
    info = machine.describe()
    del info["deepspeed"]  # the installed one; the builds measured are the study's builds
    builds = fixcost.prepare_builds(base,
                                    Path(args.after) if args.after else None,
                                    _log,
                                    fixes=Path(args.fixes) if args.fixes else None)
    roles = [fixcost.PRISTINE, fixcost.FIXES] + ([fixcost.AFTER] if args.after else []) + [fixcost.CONTROL]
    parameters, tensors = fixcost.model_shape(size)
    plan = fixcost.make_plan(size, args.warmup, args.steps, args.micro)
    study = fixcost.Study(command=("python -m ds_bench " + " ".join(shlex.quote(a) for a in sys.argv[1:])).strip(),
                          started=_now(),
                          base=base,
                          size_name=size_name,
                          size=size,
                          parameters=parameters,
                          parameter_tensors=tensors,
                          world_size=plan.world_size,
                          threads_per_rank=plan.threads,
                          warmup_steps=args.warmup,
                          measure_steps=args.steps,
                          rounds=args.rounds,
                          nice=os.nice(0),
                          machine=info,
                          builds=builds,
                          roles=roles,
                          timed_methods=list(fixcost.TIMED_METHODS[base]),
                          quick=args.quick)
    _log(f"DeepSpeed {base}: {', '.join(roles)}; {parameters / 1e6:.1f} M parameters; nice {study.nice}")

    def save(study) -> None:
        study.finished = _now()
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps(study.to_json(), indent=1) + "\n")

    fixcost.measure(study, plan, names, log=_log, save=save)
    save(study)
    out_md.write_text(fixcost_report.render(study, fixcost_report.analysis_of(out_md)))
    _log(f"wrote {out_md} and {out_json}")
    for cell in study.cells:
        for e in cell.errors:
            print(f"error: {cell.configuration} round {e['round'] + 1} {e['role']}: {e['error']}", file=sys.stderr)
    return 1 if any(cell.errors for cell in study.cells) else 0


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def cmd_list(args) -> int:
    from ds_bench import configs
    for c in configs.CONFIGURATIONS:
        skipped = f"  (not run by default on: {', '.join(sorted(c.skip_on))})" if c.skip_on else ""
        print(f"{c.name:20} ZeRO {c.stage}  offload: {c.offload}{skipped}")
    return 0


#: Measurements with their own arguments: ``python -m ds_bench <name> ...``.
OWN_OPTIONS_TOOLS = {
    "fixwork": "the bug-fix PRs' own per-step work, timed directly",
    "tinker-memory": "the Tinker server's peak memory per rank",
    "tinker-sampling": "the Tinker server's sampling throughput",
    "tinker-samplers": "the Tinker server's native and vLLM samplers side by side",
    "tinker-logits-memory": "the Tinker server's peak memory of one training pass, before and after issue 44",
}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_OPTIONS_TOOLS:
        import importlib
        importlib.import_module(f"ds_bench.{argv[0].replace('-', '_')}").main(argv[1:])
        return 0
    parser = argparse.ArgumentParser(prog="python -m ds_bench", description="The cost of owning the boundary.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="measure (a) managed, (b) unmanaged, (c) toggle for every configuration")
    run.add_argument("--quick", action="store_true", help="tiny model, 2 rounds: a smoke run (writes under scratch/)")
    run.add_argument("--configs", default="", help="comma-separated configurations (default: all; see `list`)")
    run.add_argument("--micro", default="1,4,16", help="micro-batches per logical step (default: 1,4,16)")
    run.add_argument("--rounds",
                     type=int,
                     default=0,
                     help="mode trials per mode, configuration and N (default: 3; quick: 2)")
    run.add_argument("--timing-steps",
                     default="",
                     help="measured steps per engine of the timing trial, as N:steps,... (default 1:32,4:16,16:8)")
    run.add_argument("--device",
                     choices=["auto", "cpu", "cuda"],
                     default="auto",
                     help="auto: CPU ranks, and GPU ranks too when CUDA is present")
    run.add_argument("--world-size", type=int, default=2, help="ranks (default 2; on GPUs at most the GPU count)")
    run.add_argument("--dtype",
                     choices=["fp32", "bf16", "fp16"],
                     default=None,
                     help="default: fp32 on CPU, bf16 on GPU")
    run.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    run.add_argument("--out",
                     default=None,
                     help="Markdown output (default benchmarks/results/benchmarks.md, on 0.19.8 benchmarks-0.19.8.md; "
                     "quick: scratch/)")
    run.add_argument("--json", default=None, help="JSON output (default: beside the Markdown)")
    run.set_defaults(func=cmd_run)

    render = sub.add_parser("render", help="rewrite the Markdown table (and the run's summary) from the JSON")
    render.add_argument("--json", default=str(DOCS_JSON), help="default benchmarks/results/benchmarks.json "
                        "(0.19.8's: benchmarks-0.19.8.json)")
    render.add_argument("--out", default=None, help="default: the JSON's name with .md")
    render.set_defaults(func=cmd_render)

    factor = sub.add_parser("factor", help="re-measure only the gradient_divide_factor timing (d against b)")
    factor.add_argument("--json", default=str(DOCS_JSON))
    factor.add_argument("--out", default=str(DOCS_MD))
    factor.add_argument("--micro", default="1,4", help="micro-batches per logical step (default: 1,4)")
    factor.set_defaults(func=cmd_factor)

    fixcost = sub.add_parser("fixcost",
                             help="pristine DeepSpeed against it + the bug-fix PRs in managed mode (the default): "
                             "rounds of interleaved processes")
    fixcost.add_argument("--base", default=None, help="the release (default: the installed DeepSpeed's)")
    fixcost.add_argument("--fixes",
                         default=None,
                         help="the patches/deepspeed-<base>/ folder whose fix PRs are (f) (default: this checkout's)")
    fixcost.add_argument("--after",
                         default=None,
                         help="another patches/deepspeed-<base>/ folder: its fix PRs are measured too, as (g)")
    fixcost.add_argument("--size", choices=["100m", "2.9m"], default="100m", help="the model (default 100m)")
    fixcost.add_argument("--quick", action="store_true", help="a tiny model: a smoke run (under scratch/)")
    fixcost.add_argument("--configs",
                         default="",
                         help="comma-separated configurations (default: z2-opt-cpu,z3-opt-cpu)")
    fixcost.add_argument("--micro", type=int, default=1, help="micro-batches per logical step (default 1)")
    fixcost.add_argument("--rounds", type=int, default=6, help="rounds: one trial per build each (default 6)")
    fixcost.add_argument("--warmup", type=int, default=2, help="warm-up steps per trial (default 2)")
    fixcost.add_argument("--steps", type=int, default=6, help="measured steps per trial (default 6)")
    fixcost.add_argument("--out",
                         default=None,
                         help="Markdown (default benchmarks/results/benchmarks-fixcost-<base>.md; quick: scratch/)")
    fixcost.add_argument("--json", default=None, help="JSON (default: beside the Markdown, not committed)")
    fixcost.add_argument("--render", action="store_true", help="only rewrite the Markdown from the JSON")
    fixcost.set_defaults(func=cmd_fixcost)

    listing = sub.add_parser("list", help="list the configurations")
    listing.set_defaults(func=cmd_list)

    for name in OWN_OPTIONS_TOOLS:  # listed in --help; main() hands them their arguments
        sub.add_parser(name, help=f"{OWN_OPTIONS_TOOLS[name]} (its own options: {name} --help)")

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
