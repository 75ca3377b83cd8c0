"""`milepost` command line: run a campaign, show its status.

Exit codes: 0 done, 2 bad input (recipe, flag, model path, dataset, reward function; a campaign
paused or run by another process), 1 runtime failure, 3 the campaign paused (regression gate)
or stopped on request.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

EXIT_OK, EXIT_RUNTIME, EXIT_BAD_INPUT = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 already; keep the message short
        self.print_usage(sys.stderr)
        print(f"milepost: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="milepost", description="RL post-training campaigns, resumable at any point.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser("run", help="run (or resume) a campaign from a recipe")
    run.add_argument("recipe", help="YAML recipe, e.g. recipes/tiny-arith.yaml")
    run.add_argument("--campaign", help="campaign store URL or folder (default: runs/<recipe name>)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value, e.g. --set train.lr=1e-4 (repeatable)")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--resume", action="store_true",
                     help="resume a campaign paused by its regression gate or a stop request")
    run.add_argument("--dry-run", action="store_true",
                     help="print every stage's job and the exact engine and router commands, then exit "
                          "without starting anything or writing the campaign store")
    status = sub.add_parser("status", help="show a campaign's blocks, evals and latest checkpoint")
    status.add_argument("campaign", help="campaign store URL or folder")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--plot", metavar="OUT.png",
                        help="also draw reward, held-out accuracy, KL, entropy, response length, staleness "
                             "and step time against step, with block starts and restarts marked")
    air = sub.add_parser("airflow", help="start or stop a local Airflow (standalone) running the project's DAGs")
    air.add_argument("action", choices=("up", "down", "status"))
    air.add_argument("--work", default="runs/airflow", help="its folder: AIRFLOW_HOME, log, pid (default %(default)s)")
    air.add_argument("--port", type=int, help="API server/UI port on 127.0.0.1 (default: a free one)")
    air.add_argument("--parallelism", type=int, default=4, help="task slots (default %(default)s)")
    plan = sub.add_parser("plan", help="devices per role, parallel layout and memory per GPU of a recipe; "
                                       "exit 2 if it does not divide or fit")
    plan.add_argument("recipe", nargs="?", help="YAML recipe, e.g. recipes/qwen3-8b-gsm8k.yaml")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a recipe value before planning (repeatable)")
    plan.add_argument("--models", action="store_true", help="list the shipped model configs (model.catalog)")
    return parser


def _bad_input(error: BaseException) -> int:
    print(f"milepost: {error}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _cmd_run(args: argparse.Namespace) -> int:
    from milepost.core.recipe_io import load_recipe
    from milepost.run_cmd import run_campaign
    from milepost.tasks.campaign import prepare_campaign

    if args.campaign is not None and not args.campaign.strip():
        return _bad_input("--campaign is empty; pass a folder or store URL, or leave the flag out "
                          "(default: runs/<recipe name>)")
    try:  # every check runs before prepare_campaign writes the store: bad input writes nothing
        recipe = load_recipe(args.recipe, args.overrides)
        campaign_url = args.campaign or str(Path("runs") / Path(args.recipe).stem)
        if args.dry_run:
            from milepost.core.records import check_campaign_url
            from milepost.tasks.dry_run import dry_run_report

            check_campaign_url(campaign_url)
            print(dry_run_report(recipe, args.recipe, campaign_url), end="")
            return EXIT_OK
        prepared = prepare_campaign(recipe, campaign_url)
    except ValueError as e:  # UserError and the ValueErrors of pydantic-free checks
        return _bad_input(e)
    from milepost.tasks.lease import LeaseHeldError
    from milepost.tasks.progression import CampaignPaused

    try:  # blocks run as runs of the campaign's Airflow DAG, in-process (embedded mode)
        return run_campaign(prepared, show_progress=not args.quiet, resume=args.resume)
    except (LeaseHeldError, CampaignPaused) as e:
        print(f"milepost: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _cmd_status(args: argparse.Namespace) -> int:
    from milepost.tasks.status import campaign_status, format_status

    if "://" not in args.campaign and not Path(args.campaign).exists():
        return _bad_input(f"campaign folder {args.campaign} does not exist; pass the folder given to "
                          "`milepost run --campaign` (default: runs/<recipe name>)")
    try:
        status = campaign_status(args.campaign)
    except ValueError as e:
        return _bad_input(e)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    if args.plot:
        from milepost.tasks.status import write_plot

        try:
            write_plot(args.campaign, args.plot)
        except ValueError as e:
            return _bad_input(e)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace) -> int:
    from milepost.core.plan.command import run_plan

    return run_plan(args.recipe, args.overrides, args.models)


def _cmd_airflow(args: argparse.Namespace) -> int:
    from milepost.airflow_cmd import main as airflow_main

    return airflow_main(args)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call drowns the progress
    args = build_parser().parse_args(argv)
    from milepost.core.errors import UserError

    try:
        return {"run": _cmd_run, "status": _cmd_status, "plan": _cmd_plan, "airflow": _cmd_airflow}[args.command](args)
    except KeyboardInterrupt:
        return EXIT_RUNTIME
    except UserError as e:  # raised past a command's own checks: still the user's to fix, no traceback
        return _bad_input(e)
    except Exception as e:  # a runtime failure: say what broke, exit 1
        logging.getLogger("milepost").exception("campaign failed")
        print(f"milepost: runtime failure: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    raise SystemExit(main())
