"""`milepost` command line: run a campaign, show its status.

Exit codes: 0 done, 2 bad input (recipe, flag, dataset), 1 runtime failure.
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
    status = sub.add_parser("status", help="show a campaign's blocks, evals and latest checkpoint")
    status.add_argument("campaign", help="campaign store URL or folder")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    from milepost.core.recipe_io import RecipeError, load_recipe
    from milepost.tasks.campaign import prepare_campaign, run_campaign

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        campaign_url = args.campaign or str(Path("runs") / Path(args.recipe).stem)
        prepared = prepare_campaign(recipe, campaign_url)
    except (RecipeError, ValueError) as e:
        print(f"milepost: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    run_campaign(prepared, show_progress=not args.quiet)
    return EXIT_OK


def _cmd_status(args: argparse.Namespace) -> int:
    from milepost.tasks.status import campaign_status, format_status

    try:
        status = campaign_status(args.campaign)
    except ValueError as e:
        print(f"milepost: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per engine call drowns the progress
    args = build_parser().parse_args(argv)
    try:
        return {"run": _cmd_run, "status": _cmd_status}[args.command](args)
    except KeyboardInterrupt:
        return EXIT_RUNTIME
    except Exception as e:  # noqa: BLE001 - a runtime failure: say what broke, exit 1
        logging.getLogger("milepost").exception("campaign failed")
        print(f"milepost: runtime failure: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_RUNTIME


if __name__ == "__main__":
    raise SystemExit(main())
