"""Run a recipe's blocks without Airflow (where Airflow is not installed, as on the lent GPU
machine): each block's stages run as local stage jobs through tasks.block_driver.BlockDriver, the
same stage code the Airflow DAG runs, on a real local Ray cluster.

    python bench/gpu_loop.py RECIPE --campaign DIR [--set KEY=VALUE ...] [--out FILE.json]

Prints and writes (--out) each block's held-out accuracy, the base policy's, and the wall
time of every stage (from the store's records).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from milepost.core.recipe_io import load_recipe
from milepost.core.records import TIMINGS_DOC, block_path
from milepost.tasks.block_driver import BlockDriver
from milepost.tasks.campaign import prepare_campaign


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--campaign", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    recipe = load_recipe(args.recipe, args.overrides)
    store = prepare_campaign(recipe, args.campaign).store
    driver = BlockDriver(store, recipe, driver_pid=os.getpid())  # its stage jobs die with this process
    result: dict = {"recipe": args.recipe, "overrides": args.overrides, "blocks": []}
    start = time.monotonic()
    for block in range(recipe.campaign.num_blocks):
        began = time.monotonic()
        driver.run_block(block)
        result["blocks"].append({"block": block, "eval": store.block_eval(block), "wall_s": time.monotonic() - began,
                                 "timings": store.read_json(block_path(block, TIMINGS_DOC))})
    result["base_eval"] = store.read_json("base_eval.json") if store.exists("base_eval.json") else None
    result["wall_s"] = time.monotonic() - start
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
