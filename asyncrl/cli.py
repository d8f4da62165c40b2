"""`asyncrl` command line: thin — parse arguments, load the config, call the runtime.

  asyncrl validate CONFIG [--set k=v ...]            check a config; one line per problem
  asyncrl launch CONFIG [--set k=v ...] [--dry-run] [--local] [--address ADDR]
  asyncrl serve CONFIG [--set k=v ...] [--host H] [--port P] [--chat-template FILE] [--ray]
                                                      train on agents calling an OpenAI-compatible endpoint
  asyncrl plot RUN_DIR [RUN_DIR ...] [--metric KEY ...] [--out PNG]
                                                      reward curve from metrics.jsonl; several runs or
                                                      chosen keys overlaid, one line per run
  asyncrl report RUN_DIR [--target-reward R]          plots + one-page report.md of a finished run
  asyncrl sweep CONFIG --set k=v1,v2 ... [--out DIR] [--ray] [--target-reward R]
                                                      one run per grid point, results table + plots
  asyncrl plan RUN_DIR|CONFIG [--local] [--generators 1,2] [--max-staleness 0,1,2,4] [--steps N]
                                                      predict throughput/staleness, recommend a setting
                                                      (a CONFIG gets a short calibration run first)
  asyncrl config schema [--out FILE]                  the config's JSON schema (TOML editors)
  asyncrl config show CONFIG [--set k=v ...]          the resolved config as TOML, every default included
  asyncrl config init [--out FILE] [--force]          a commented starter config
  asyncrl --version
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from importlib import metadata
from pathlib import Path

from asyncrl import heap
from asyncrl.config import Config, ConfigError, config_to_toml, load_config
from asyncrl.telemetry.runlog import FORMAT as LOG_FORMAT

EPILOG = """\
examples:
  asyncrl config init --out my.toml                        a commented starter config
  asyncrl validate examples/first_digit/config.toml        every problem at once, one line each
  asyncrl config show examples/grpo/config.toml --set trainer.lr=1e-4
                                                           the resolved config, defaults included
  asyncrl launch examples/first_digit/config.toml --local  run every role in this process
  asyncrl launch --resume runs/first_digit                 continue from the newest checkpoint
  asyncrl report runs/first_digit                          report.md and plots of a finished run
docs: README.md, docs/config.md (extends, ${env:VAR}, the schema, names in TRL / OpenRLHF / verl)"""


def _version() -> str:
    try:
        return metadata.version("asyncrl")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training runtime",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"asyncrl {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="what to do; `asyncrl COMMAND --help` lists its arguments")
    for name, text in (("validate", "check a config file"), ("launch", "run a config")):
        s = sub.add_parser(name, help=text)
        s.add_argument("config", nargs="?" if name == "launch" else None,
                       help="path to the run's TOML file (launch --resume: default RUN_DIR/config.toml)")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set trainer.lr=1e-4 (repeatable)")
    launch = sub.choices["launch"]
    launch.add_argument("--dry-run", action="store_true", help="print the derived plan; start nothing")
    launch.add_argument("--local", action="store_true", help="run every role in this process, without Ray")
    launch.add_argument("--address", help="join an existing Ray cluster (same as --set cluster.address=...)")
    launch.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR from its newest valid checkpoint (run.save_every, "
                             "run.save_every_s)")
    launch.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="console and RUN_DIR/run.log (default INFO)")
    from asyncrl.cli_serve import add_parser as add_serve

    add_serve(sub)
    plot = sub.add_parser("plot", help="write the reward curve PNG of a run directory, or overlay several runs")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                      help="run directories (their metrics.jsonl); several are overlaid, one colour each")
    plot.add_argument("--metric", dest="metrics", action="append", default=[], metavar="KEY",
                      help="a metrics.jsonl key to draw, e.g. staleness/mean (repeatable; default: the rewards)")
    plot.add_argument("--out", default=None,
                      help="the PNG (default: RUN_DIR/reward_curve.png for one run, ./compare.png for several)")
    report = sub.add_parser("report", help="write report.md and plots into a finished run directory")
    report.add_argument("run_dir", help="a finished run directory (metrics.jsonl, trace.json, config.toml)")
    report.add_argument("--target-reward", type=float, default=None,
                        help="also report the wall time until the 5-step mean reward reached this")
    sweep = sub.add_parser("sweep", help="run a grid of settings and tabulate/plot the results")
    sweep.add_argument("config", help="the TOML file every grid point starts from")
    sweep.add_argument("--set", dest="axes", action="append", default=[], metavar="KEY=V1,V2",
                       help="a grid axis, e.g. --set staleness.max_staleness=0,1,2 (repeatable; one value = fixed)")
    sweep.add_argument("--out", default=None, help="sweep directory (default: <run.output_dir>-sweep)")
    sweep.add_argument("--ray", action="store_true", help="run each point on Ray (default: --local, in-process)")
    sweep.add_argument("--target-reward", type=float, default=None, help="reward for the time-to-target column")
    sweep.add_argument("--timeout", type=float, default=None, help="seconds before a point counts as failed")
    sweep.add_argument("--resume", action="store_true", help="keep points whose run directory has a summary.json")
    planp = sub.add_parser("plan", help="predict throughput and staleness for other settings from a run")
    planp.add_argument("run_dir", help="a finished run directory (trace.json, metrics.jsonl, config.toml), or a "
                       "config TOML: a short calibration run of it is made first (in-process)")
    planp.add_argument("--calibration-steps", type=int, default=10,
                       help="train steps of the calibration run when given a config")
    planp.add_argument("--generators", default="1,2", help="comma-separated generator counts")
    planp.add_argument("--max-staleness", default="0,1,2,4", help="comma-separated staleness bounds")
    planp.add_argument("--steps", type=int, default=None, help="train steps to simulate (default: the run's)")
    planp.add_argument("--cores", type=float, default=None, help="CPU cores the roles share (default: this machine's)")
    planp.add_argument("--local", action="store_true",
                       help="RUN_DIR was run in-process (launch --local, the sweep's default): every role shares one "
                            "interpreter; implied when CONFIG is given (its calibration run is in-process)")
    _config_parser(sub)
    return p


def _config_parser(sub: argparse._SubParsersAction) -> None:
    cfg = sub.add_parser("config", help="the config's JSON schema, a resolved config, a starter config")
    what = cfg.add_subparsers(dest="config_command", required=True, metavar="ACTION",
                              help="`asyncrl config ACTION --help` lists its arguments")
    schema = what.add_parser("schema", help="print (or write) the JSON schema of a config file, for TOML editors")
    schema.add_argument("--out", help="write it to this file instead of stdout, e.g. asyncrl.schema.json")
    show = what.add_parser("show", help="print the resolved config as TOML: extends merged, ${env:VAR} replaced, "
                                        "--set applied, every default included (checked field by field; "
                                        "`asyncrl validate` also checks it against this machine)")
    show.add_argument("config", help="path to the run's TOML file")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config value, e.g. --set trainer.lr=1e-4 (repeatable)")
    init = what.add_parser("init", help="write a commented starter config (every key with its description)")
    init.add_argument("--out", default="config.toml", help="file to write (default: config.toml)")
    init.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def _machine_defaults_comment(cfg: Config) -> str:
    """The `"auto"` values of [cluster] resolved on this machine (asyncrl/deploy/auto.py `machine_defaults`), as TOML
    comments after the config: they are decided when a run starts, from its machine, not written into the file."""
    from asyncrl.deploy.auto import available_cpus, machine_defaults

    rows = machine_defaults(cfg)
    if not rows:
        return ""
    cpus = available_cpus()
    lines = [f"# On this machine ({len(cpus)} CPUs: {', '.join(map(str, cpus))}) `asyncrl launch` resolves the "
             f'"auto" values as (Ray,', "# a local cluster it starts; torch_threads.local: --local):"]
    for key, value in rows:
        if key.startswith("torch_threads.") and isinstance(value, list):
            shown = str(value[-1]) + ("" if len(value) == 1 else f" (its tuner measures {value}, keeps the faster)")
        else:
            shown = json.dumps(value)
        lines.append(f"#   {key} = {shown}")
    return "\n" + "\n".join(lines) + "\n"


def _config_command(args: argparse.Namespace) -> int:
    """asyncrl config schema | show | init."""
    from asyncrl.config.tools import config_schema, starter_config

    if args.config_command == "show":
        try:
            cfg = load_config(args.config, args.overrides, cross_checks=False)
        except ConfigError as err:
            return _config_errors(err)
        sys.stdout.write(config_to_toml(cfg))
        sys.stdout.write(_machine_defaults_comment(cfg))
        return 0
    if args.config_command == "schema":
        text = json.dumps(config_schema(), indent=2) + "\n"
        if args.out is None:
            sys.stdout.write(text)
            return 0
        Path(args.out).write_text(text, encoding="utf-8")
        print(f"wrote {args.out}")
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"config init: {out} exists — pass --force to overwrite it, or --out another file", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(starter_config(), encoding="utf-8")
    print(f"wrote {out}; check it with: asyncrl validate {out}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag} {text}: expected comma-separated integers, e.g. 0,1,2") from None
    if not values or min(values) < 0:
        raise SystemExit(f"{flag} {text}: expected non-negative integers, e.g. 0,1,2")
    return values


def _calibration_run(config: str, steps: int) -> str:
    """A short in-process run of `config` (no evaluation, no checkpoint: not even the default's durable one)
    to calibrate the planner from."""
    from asyncrl.deploy.local import run_local

    # On-policy (max_staleness = 0): the one setting where generation, scoring and training each run alone,
    # so their costs are measured without the others' contention (docs/observability.md, the planner).
    overrides = [f"trainer.total_steps={steps}", "trainer.eval_every=0", "run.save_checkpoint=false",
                 "run.save_every=0", "run.save_every_s=0", "logging.live=false", "staleness.max_staleness=0"]
    out = f"{load_config(config, overrides).run.output_dir}-calibration"
    cfg = load_config(config, [*overrides, f'run.output_dir="{out}"'])
    logging.getLogger("asyncrl").info("calibration run: %d steps of %s into %s", steps, config, out)
    run_local(cfg, config_text=config_to_toml(cfg))
    return out


def _analysis(args: argparse.Namespace) -> int:
    """report / sweep / plan: the commands that read run directories."""
    if args.command == "report":
        from asyncrl.report import write_report

        print(write_report(args.run_dir, target_reward=args.target_reward))
        return 0
    if args.command == "plan":
        from asyncrl.planning.planner import calibrate, format_plan, plan

        generators = _ints(args.generators, "--generators")
        if 0 in generators:
            raise SystemExit("--generators: counts must be >= 1")
        run_dir, in_process = args.run_dir, args.local
        if Path(run_dir).is_file():
            run_dir, in_process = _calibration_run(run_dir, args.calibration_steps), True
        costs = calibrate(run_dir, cores=args.cores, shared_interpreter=in_process)
        steps = args.steps or costs.steps
        print(format_plan(costs, plan(costs, generators, _ints(args.max_staleness, "--max-staleness"), steps)))
        return 0
    from asyncrl.sweep import parse_axes, run_sweep

    try:
        axes = parse_axes(args.axes)
        cfg = load_config(args.config, [f"{k}={v[0]}" for k, v in axes])  # fail fast on a bad key or value
    except ValueError as err:
        print(f"sweep error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:
        return _config_errors(err)
    out = args.out or f"{cfg.run.output_dir}-sweep"
    points = run_sweep(args.config, axes, out, ray=args.ray, target_reward=args.target_reward,
                       timeout_s=args.timeout, skip_existing=args.resume)
    failed = [p.name for p in points if p.status != "ok"]
    print(f"sweep directory: {out} ({len(points) - len(failed)} of {len(points)} points ok)")
    print((Path(out) / "results.md").read_text())
    return 1 if failed and len(failed) == len(points) else 0


def _config_errors(err: ConfigError) -> int:
    """One stderr line per config problem; the exit status of a bad config."""
    for line in err.errors:
        print(f"config error: {line}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """The `asyncrl` command. `argv` None: this process's own command line (the console script, `python -m
    asyncrl.cli`), so a launch may tune the process for its one run (asyncrl/heap.py); a list: a caller's."""
    launched_at = time.time()  # the run's start-up is counted from here (summary.json "startup_s")
    own_process = argv is None
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, datefmt="%H:%M:%S")
    if args.command == "config":
        return _config_command(args)
    if args.command == "plot":
        from asyncrl.telemetry.plot import plot_runs

        try:
            print(plot_runs(args.run_dirs, args.out, args.metrics))
        except (FileNotFoundError, ValueError, ImportError) as err:
            print(f"plot error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command in ("report", "sweep", "plan"):
        try:
            return _analysis(args)
        except (FileNotFoundError, ValueError) as err:
            print(f"{args.command} error: {err}", file=sys.stderr)
            return 2
        except ConfigError as err:
            return _config_errors(err)
    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f'cluster.address="{args.address}"')
    resume = getattr(args, "resume", None)
    if resume:  # the run's own resolved config, into the same directory (--set may change, e.g. total_steps)
        args.config = args.config or str(Path(resume) / "config.toml")
        overrides.append(f"run.output_dir={json.dumps(str(resume))}")
    if args.config is None:
        print("launch: give a CONFIG (or --resume RUN_DIR)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        return _config_errors(err)
    if args.command == "validate":
        from asyncrl.data.prompts import check_prompts

        problems = check_prompts(cfg)  # with the model's tokenizer: prompts render and fit (data.overlong)
        if problems:
            return _config_errors(ConfigError(problems))
        print(f"{args.config}: ok")
        return 0
    if args.command == "serve":
        from asyncrl.cli_serve import serve

        if own_process:  # a long-lived endpoint: as a launch (asyncrl/heap.py)
            heap.settle()
        return serve(cfg, args)
    if args.dry_run:
        from asyncrl.deploy.plan import derived

        print(json.dumps(derived(cfg), indent=2, default=str))
        return 0
    from asyncrl.checkpoints.policy import failure_line
    from asyncrl.control.controller import RunStopped
    from asyncrl.telemetry.runlog import RunLog, cause_chain

    if args.local:  # asyncrl.deploy.launch imports Ray; the in-process path does not (machines without Ray)
        from asyncrl.deploy.local import run_local as runner
    else:
        from asyncrl.deploy.launch import run_with_ray as runner
    logging.getLogger().setLevel(args.log_level)
    run_log = RunLog(cfg.run.output_dir, level=args.log_level)
    if own_process:  # this process drives one run: its imports are never walked by a full collection again
        heap.settle()
    try:
        rows = runner(cfg, config_text=config_to_toml(cfg), resume=bool(resume), launched_at=launched_at)
    except KeyboardInterrupt:  # Ctrl-C before the run's loop took the signal (setup)
        print("interrupted; actors stopped", file=sys.stderr)
        return 130
    except RunStopped as stop:  # SIGTERM or Ctrl-C: a checkpoint was written
        print(str(stop), file=sys.stderr)
        return 130 if "SIGINT" in str(stop) else 143
    except asyncio.CancelledError:  # a second SIGTERM or Ctrl-C
        print("stopped at once (a second signal); actors stopped; resume from the last checkpoint with: "
              f"asyncrl launch --resume {cfg.run.output_dir}", file=sys.stderr)
        return 143
    except Exception as exc:  # a failed run: the root cause first, one line per wrapper; tracebacks in run.log
        run_log.exception(exc)
        root, *wrappers = cause_chain(exc)
        print(f"run failed: {root}", file=sys.stderr)
        for line in wrappers:
            print(f"  raised as: {line}", file=sys.stderr)
        print(f"  (tracebacks: {run_log.path})", file=sys.stderr)
        # a valid checkpoint of this run: what failed, the last good checkpoint, the command that resumes
        if (going_on := failure_line(cfg.run.output_dir, exc, resumed=bool(resume))) is not None:
            print(going_on, file=sys.stderr)
        return 1
    finally:
        run_log.close()
    print(f"run directory: {cfg.run.output_dir} ({len(rows)} metric rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
