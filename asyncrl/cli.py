"""`asyncrl` command line: thin — parse arguments, load the config, call the runtime.

  asyncrl validate CONFIG [--set k=v ...]            check a config; one line per problem
  asyncrl launch CONFIG [--set k=v ...] [--dry-run] [--local] [--address ADDR]
  asyncrl plot RUN_DIR [--out PNG]                    reward curve from metrics.jsonl
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from asyncrl.config import ConfigError, config_to_toml, derived, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl", description="Asynchronous RL post-training runtime")
    sub = p.add_subparsers(dest="command", required=True)
    for name, text in (("validate", "check a config file"), ("launch", "run a config")):
        s = sub.add_parser(name, help=text)
        s.add_argument("config", help="path to the run's TOML file")
        s.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config value, e.g. --set trainer.lr=1e-4 (repeatable)")
    launch = sub.choices["launch"]
    launch.add_argument("--dry-run", action="store_true", help="print the derived plan; start nothing")
    launch.add_argument("--local", action="store_true", help="run every role in this process, without Ray")
    launch.add_argument("--address", help="join an existing Ray cluster (same as --set cluster.address=...)")
    plot = sub.add_parser("plot", help="write the reward curve PNG of a run directory")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if args.command == "plot":
        from asyncrl.telemetry.plot import plot_run

        print(plot_run(args.run_dir, args.out))
        return 0
    overrides = list(args.overrides)
    if getattr(args, "address", None):
        overrides.append(f'cluster.address="{args.address}"')
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as err:
        for line in err.errors:
            print(f"config error: {line}", file=sys.stderr)
        return 2
    if args.command == "validate":
        print(f"{args.config}: ok")
        return 0
    if args.dry_run:
        print(json.dumps(derived(cfg), indent=2, default=str))
        return 0
    from asyncrl.launch import run_local, run_with_ray

    runner = run_local if args.local else run_with_ray
    try:
        rows = runner(cfg, config_text=config_to_toml(cfg))
    except KeyboardInterrupt:
        print("interrupted; actors stopped", file=sys.stderr)
        return 130
    except Exception as exc:  # a failed run ends with one line, the traceback goes to the log
        logging.getLogger("asyncrl").debug("run failed", exc_info=True)
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        print(f"run failed: {type(exc).__name__}: {first}", file=sys.stderr)
        return 1
    print(f"run directory: {cfg.run.output_dir} ({len(rows)} metric rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
