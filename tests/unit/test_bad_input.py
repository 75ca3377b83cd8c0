"""Every user mistake is a UserError whose message names the problem and the fix, raised
before anything is written. Library-level: the CLI's exit code 2 and no-traceback for these
is tested in tests/integration/test_cli_bad_input.py.

Each case is one mistake a new user makes; `needle` is a regex the message must match
(the field or file, and what to do about it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from milepost.core.config import ModelConfig
from milepost.core.data.source import DataCursor, DatasetError, DatasetNotFoundError, PromptSource, load_rows
from milepost.core.errors import UserError
from milepost.core.model.loading import ModelPathError, check_model_path
from milepost.core.recipe_io import RecipeError, load_recipe, recipe_from_dict
from milepost.core.reward import resolve_reward_fn
from milepost.core.rollout import resolve_rollout_fn

TINY = Path("recipes/tiny-arith.yaml")


def _write(tmp_path: Path, name: str, content: str | bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return path


# --- recipe files ------------------------------------------------------------------------------

@pytest.mark.parametrize("name,content,needle", [
    ("missing.yaml", None, r"recipe file .*missing.yaml does not exist; pass a YAML file such as"),
    ("broken.yaml", "train:\n  lr: [1,\n", r"broken.yaml: not valid YAML"),
    ("list.yaml", "- train\n- rollout\n", r"a recipe is a YAML mapping of sections .* got a list"),
    ("scalar.yaml", "just words\n", r"a recipe is a YAML mapping of sections .* got a str"),
    ("empty.yaml", "", r"empty.yaml: the recipe is empty; start from recipes/tiny-arith.yaml"),
    ("binary.yaml", b"\xff\xfe\x00binary", r"binary.yaml: not a text file \(not UTF-8\)"),
])
def test_a_recipe_file_that_is_not_a_recipe(tmp_path, name, content, needle):
    path = tmp_path / name if content is None else _write(tmp_path, name, content)
    with pytest.raises(RecipeError, match=needle):
        load_recipe(path)


def test_a_folder_given_as_the_recipe(tmp_path):
    with pytest.raises(RecipeError, match=r"is a folder; pass a YAML file"):
        load_recipe(tmp_path)


# --- recipe values: unknown keys, wrong types, out of range, inconsistent ---------------------------

@pytest.mark.parametrize("doc,needle", [
    ({"trian": {"lr": 0.1}}, r"unknown key `trian`: did you mean `train`\?"),
    ({"rollout": {"temprature": 0.5}}, r"unknown key `rollout.temprature`: did you mean `rollout.temperature`\?"),
    ({"rollout": {"zzz": 1}}, r"unknown key `rollout.zzz`: remove it; this section takes: function, num_engines"),
    ({"train": {"lr": "fast"}}, r"`train.lr`: Input should be a valid number.*'fast'"),
    ({"train": 5}, r"`train`: Input should be a valid dictionary"),
    ({"campaign": None}, r"section `campaign` is empty; put its keys under it, or remove the line"),
    ({"campaign": {"num_blocks": True}}, r"`campaign.num_blocks`: expected a number, got true"),
    ({"rollout": {"num_engines": 1.5}}, r"`rollout.num_engines`: .*fractional part.*1.5"),
    ({"campaign": {"steps_per_block": -1}},
     r"`campaign.steps_per_block`: Input should be greater than or equal to 1 \(got -1\)"),
    ({"rollout": {"prompts_per_step": 0}},
     r"`rollout.prompts_per_step`: Input should be greater than or equal to 1 \(got 0\)"),
    ({"rollout": {"top_p": 1.5}}, r"`rollout.top_p`: Input should be less than or equal to 1 \(got 1.5\)"),
    ({"rollout": {"temperature": -0.1}}, r"`rollout.temperature`: Input should be greater than or equal to 0"),
    ({"rollout": {"top_k": 0}}, r"`rollout.top_k`: top_k=0 keeps no token; use -1 to disable top-k"),
    ({"rollout": {"top_k": -5}}, r"`rollout.top_k`: Input should be greater than or equal to -1"),
    ({"train": {"lr": float("nan")}}, r"`train.lr`: Input should be a finite number"),
    ({"rollout": {"request_timeout_s": float("inf")}}, r"`rollout.request_timeout_s`: Input should be a finite number"),
    ({"train": {"betas": [0.9, 1.0]}}, r"`train.betas`: AdamW betas must each be in \[0, 1\)"),
    ({"algo": {"clip_low": 1.0}}, r"`algo.clip_low`: Input should be less than 1"),
    ({"filters": {"min_response_tokens": 9, "max_response_tokens": 4}},
     r"filters.min_response_tokens=9 is above filters.max_response_tokens=4: every sample would be dropped"),
    ({"model": {"tiny": {"hidden_size": 100, "num_heads": 3}}},
     r"model.tiny.hidden_size=100 is not divisible by num_heads=3"),
    ({"model": {"tiny": {"num_heads": 4, "num_kv_heads": 3}}}, r"num_heads=4 is not divisible by num_kv_heads=3"),
    ({"train": {"backend": "megatron", "num_ranks": 3, "megatron": {"tensor_parallel": 2}}},
     r"train.num_ranks=3 is not divisible by .*set num_ranks to a multiple of 2"),
    ({"campaign": {"name": ""}}, r"campaign.name '' has no letter or digit; it names the campaign's Airflow DAG"),
    ({"campaign": {"name": "---"}}, r"campaign.name '---' has no letter or digit"),
    ({"campaign": {"max_eval_drop": 2}}, r"`campaign.max_eval_drop`: Input should be less than or equal to 1"),
])
def test_a_bad_recipe_value_names_the_key_the_value_and_the_fix(doc, needle):
    with pytest.raises(RecipeError, match=needle):
        recipe_from_dict(doc)


# --- --set overrides ---------------------------------------------------------------------------

@pytest.mark.parametrize("override,needle", [
    ("train.lr=[1,", r"--set 'train.lr=\[1,': the value '\[1,' is not valid YAML .*quote a string"),
    ("train.lr={a: ", r"--set 'train.lr=\{a: ': the value .* is not valid YAML"),
    ("train.lr=!!python/object/apply:os.system [ls]", r"is not valid YAML"),  # safe_load refuses, no code runs
    ("train..lr=1", r"empty key segment in 'train..lr'; write the full dotted key"),
    ("=1", r"empty key segment"),
    ("train.lr.peak=1", r"`lr` is a value, not a section"),
    ("train.lr", r"expected dotted.key=value, e.g. --set train.lr=1e-4"),
    ("rollout.temprature=0.5", r"unknown key `rollout.temprature`: did you mean `rollout.temperature`\?"),
    ("train.num_ranks=two", r"`train.num_ranks`: Input should be a valid integer.*'two'"),
])
def test_a_bad_override_names_the_override(override, needle):
    with pytest.raises(RecipeError, match=needle):
        load_recipe(TINY, [override])


# --- model paths (checked before the store is written) ------------------------------------------

def _hf_folder(tmp_path: Path, *, config: str | None = '{"model_type": "qwen2"}', weights: bool = True,
               tokenizer: bool = True) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    if config is not None:
        (folder / "config.json").write_text(config)
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 8)
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    return folder


@pytest.mark.parametrize("make,needle", [
    (lambda tmp: tmp / "no-such-model",
     r"model.path `.*no-such-model` does not exist; pass a folder saved with save_pretrained"),
    (lambda tmp: _hf_folder(tmp, config=None), r"is not an HF checkpoint folder \(no config.json\); pass a folder"),
    (lambda tmp: _hf_folder(tmp, config="{not json"), r"config.json is not valid JSON .*save the checkpoint again"),
    (lambda tmp: _hf_folder(tmp, config='{"hidden_size": 8}'), r"config.json has no `model_type`"),
    (lambda tmp: _hf_folder(tmp, weights=False),
     r"has config.json but no weights \(\*.safetensors or pytorch_model\*.bin\)"),
    (lambda tmp: _hf_folder(tmp, tokenizer=False), r"has no tokenizer .*tokenizer.save_pretrained"),
    (lambda tmp: _write(tmp, "model.bin", b"\0"),
     r"model.path `.*model.bin` is a file; point it at the checkpoint's folder"),
    (lambda tmp: "builtin:gpt5", r"model.path `builtin:gpt5`: unknown builtin model; available: builtin:tiny-arith"),
    (lambda tmp: "nosuchproto://bucket/model", r"model.path `nosuchproto://bucket/model`: cannot open it"),
    (lambda tmp: "memory://milepost-no-such-ckpt", r"memory://milepost-no-such-ckpt` is not an HF checkpoint folder"),
])
def test_a_bad_model_path_is_refused_without_loading_anything(tmp_path, make, needle):
    with pytest.raises(ModelPathError, match=needle):
        check_model_path(ModelConfig(path=str(make(tmp_path))))


def test_a_complete_hf_folder_and_the_builtin_model_pass(tmp_path):
    check_model_path(ModelConfig(path=str(_hf_folder(tmp_path))))
    check_model_path(ModelConfig(path="builtin:tiny-arith"))


# --- datasets ----------------------------------------------------------------------------------

GOOD = '{"prompt": "1+1=", "label": "2"}\n'


@pytest.mark.parametrize("content,needle", [
    (GOOD + "\n" + '{"prompt": "2+2=", "label": "4"\n', r"d.jsonl: line 3 is not valid JSON .*; fix or remove it"),
    (GOOD + '["1+1=", "2"]\n', r"d.jsonl: line 2 must be a JSON object like \{\"prompt\""),
    (GOOD + '{"question": "a", "label": "b"}\n', r"d.jsonl: line 2 has no `prompt` .*set data.prompt_key"),
    (GOOD + '{"prompt": "a", "answer": "b"}\n', r"d.jsonl: line 2 has no `label` .*set data.label_key"),
    ("\n\n  \n", r"data.train_path: dataset `.*d.jsonl` has no rows; point data.train_path at a file"),
    (GOOD + '{"prompt": "  ", "label": "b"}\n',
     r"d.jsonl: line 2: `prompt` is empty; remove the row or give it a prompt"),
    (GOOD + '{"prompt": ["a", "b"], "label": "b"}\n', r"d.jsonl: line 2: `prompt` is a list .*not a string"),
    (GOOD + '{"prompt": "a", "label": null}\n', r"d.jsonl: line 2: `label` is null"),
    (GOOD.encode() + b'{"prompt": "\xff", "label": "b"}\n', r"d.jsonl: line 2 is not UTF-8 text"),
])
def test_a_malformed_dataset_names_the_file_and_the_line(tmp_path, content, needle):
    path = _write(tmp_path, "d.jsonl", content)
    with pytest.raises(DatasetError, match=needle):
        load_rows(str(path))


def test_a_missing_dataset_names_the_setting_and_is_still_a_file_not_found(tmp_path):
    with pytest.raises(DatasetNotFoundError, match=r"data.eval_path: dataset `.*nope.jsonl` does not exist; "
                                                   r"fix the path in the recipe or pass --set data.eval_path="):
        load_rows(str(tmp_path / "nope.jsonl"), setting="data.eval_path")
    with pytest.raises(FileNotFoundError):  # callers that catch FileNotFoundError keep working
        load_rows(str(tmp_path / "nope.jsonl"))


def test_a_folder_or_an_unreadable_parquet_as_dataset(tmp_path):
    with pytest.raises(DatasetError, match=r"is a folder; point it at a JSONL or Parquet file"):
        load_rows(str(tmp_path))
    path = _write(tmp_path, "d.parquet", b"PAR1 not really")
    with pytest.raises(DatasetError, match=r"d.parquet: not a readable Parquet file .*use JSONL"):
        load_rows(str(path))


def test_a_parquet_row_without_the_prompt_column_names_the_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist([{"question": "1+1=", "label": "2"}]), tmp_path / "d.parquet")
    with pytest.raises(DatasetError, match=r"d.parquet: row 0 has no `prompt` .*set data.prompt_key"):
        load_rows(str(tmp_path / "d.parquet"))


def test_an_unknown_builtin_dataset_is_refused_at_validation(tmp_path):
    from milepost.tasks.campaign import validate_resources
    recipe = load_recipe(TINY, ["data.eval_path=builtin:tiny-arith/test"])
    with pytest.raises(UserError, match=r"data.eval_path: unknown builtin dataset `builtin:tiny-arith/test`; "
                                        r"available: builtin:tiny-arith/train, builtin:tiny-arith/eval"):
        validate_resources(recipe)


def test_a_prompt_longer_than_the_run_allows_names_its_line(tmp_path):
    """Tokenized with the policy's real tokenizer (the builtin model's, made without training)."""
    from milepost.tasks.campaign import validate_resources
    rows = [{"prompt": "1+2=", "label": "3"}, {"prompt": "1+2+3+4=", "label": "10"}]
    path = _write(tmp_path, "d.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    recipe = load_recipe(TINY, [f"data.train_path={path}", "rollout.max_prompt_tokens=5"])
    with pytest.raises(DatasetError, match=r"d.jsonl: line 2: the prompt is 8 tokens, longer than "
                                           r"rollout.max_prompt_tokens=5; shorten or drop the row"):
        validate_resources(recipe)
    # The model's context (64 positions for the builtin model) bounds it too, less the response.
    path.write_text(json.dumps({"prompt": "1+" * 40 + "1=", "label": "41"}) + "\n")
    with pytest.raises(DatasetError, match=r"line 1: the prompt is 82 tokens, longer than 58 tokens "
                                           r"\(the model's context of 64 less max_new_tokens=6"):
        validate_resources(load_recipe(TINY, [f"data.train_path={path}"]))


def test_a_dataset_changed_under_a_campaign_is_a_user_error():
    rows = [{"prompt": "1+1=", "label": "2"}]
    with pytest.raises(DatasetError, match=r"the dataset has 1 rows but the checkpoint's cursor was made for 5.*"
                                           r"restore the file the campaign started with"):
        PromptSource(rows, None, DataCursor(0, 0, 0, 5))


# --- reward and rollout functions (checked at start-up) ------------------------------------------

REWARDS = """
import asyncio
THRESHOLD = 0.5
def one_arg(response_text):
    return 1.0
def three_args(response_text, label, extra):
    return 1.0
def kw_only(response_text, *, label):
    return 1.0
async def later(response_text, label):
    return 1.0
def several(response_text, label):
    yield 1.0
def good(response_text, label):
    return 1.0
"""


@pytest.mark.parametrize("spec,needle", [
    ("{d}/missing.py:score", r"reward.function `.*missing.py:score`: file .*missing.py does not exist"),
    ("{d}/r.py:scroe", r"`.*r.py` has no attribute `scroe`; its functions: .*good"),
    ("{d}/r.py:one_arg",
     r"must accept \(response_text, label\): .*change its signature to fn\(response_text: str, label: str\)"),
    ("{d}/r.py:three_args", r"r.py:three_args` must accept \(response_text, label\)"),
    ("{d}/r.py:kw_only", r"r.py:kw_only` must accept \(response_text, label\)"),
    ("{d}/r.py:THRESHOLD", r"r.py:THRESHOLD` is a float, not callable; name a function"),
    ("{d}/r.py:later", r"r.py:later` is an async or generator function.*make it a plain `def"),
    ("{d}/r.py:several", r"r.py:several` is an async or generator function"),
    ("{d}/broken.py:score", r"importing .*broken.py failed: SyntaxError: .*fix the file"),
    ("{d}/exits.py:score", r"importing .*exits.py failed: SystemExit"),
    ("exact-match",
     r"reward.function `exact-match` is not a registered name \(arith-value, gsm8k, math-final-answer, tiny-arith\)"),
    ("no_such_module_xyz:score", r"cannot import `no_such_module_xyz`: ModuleNotFoundError.*install the package"),
    ("{d}/r.py:", r"both sides of `:` are needed"),
])
def test_a_bad_reward_function_is_refused_at_start_up(tmp_path, spec, needle):
    _write(tmp_path, "r.py", REWARDS)
    _write(tmp_path, "broken.py", "def score(response_text, label)\n    return 1\n")
    _write(tmp_path, "exits.py", "import sys\nsys.exit(3)\n")
    with pytest.raises(UserError, match=needle):
        resolve_reward_fn(spec.format(d=tmp_path))


def test_a_good_reward_file_resolves(tmp_path):
    _write(tmp_path, "r.py", REWARDS)
    assert resolve_reward_fn(f"{tmp_path}/r.py:good")("x", "y") == 1.0


@pytest.mark.parametrize("attr,needle", [
    ("one", r"rollout.function `.*:one` must accept \(request, router\)"),
    ("VALUE", r"rollout.function `.*:VALUE` is a int, not callable"),
])
def test_a_bad_rollout_function_is_refused_at_start_up(tmp_path, attr, needle):
    _write(tmp_path, "ro.py", "VALUE = 3\ndef one(request):\n    return []\n")
    with pytest.raises(UserError, match=needle):
        resolve_rollout_fn(f"{tmp_path}/ro.py:{attr}")


# --- validation comes before any write ----------------------------------------------------------

@pytest.mark.parametrize("override", [
    "model.path=/no/such/model",
    "reward.function=./nope.py:score",
    "data.train_path=/no/such/train.jsonl",
    "rollout.function=no_such_module_xyz:rollout",
])
def test_prepare_campaign_writes_nothing_when_validation_fails(tmp_path, override):
    from milepost.tasks.campaign import prepare_campaign
    campaign = tmp_path / "campaign"
    with pytest.raises(UserError):
        prepare_campaign(load_recipe(TINY, [override]), str(campaign))
    assert not campaign.exists()


def test_an_unknown_advantage_name_is_refused_at_validation_with_the_known_names():
    # algo.advantage takes plugins too, so names are checked against the registry at start-up
    from milepost.tasks.campaign import validate_resources
    with pytest.raises(UserError, match=r"algo.advantage `ppo2` is not a registered name "
                                        r"\(dr_grpo, grpo, reinforce_pp, rloo\) nor an import path"):
        validate_resources(load_recipe(TINY, ["algo.advantage=ppo2"]))


def test_an_unknown_model_catalog_name_is_refused_at_validation():
    from milepost.tasks.campaign import validate_resources
    with pytest.raises(UserError, match=r"model.catalog `Qwen3-9B` is not a shipped config; known: .*Qwen3-8B"):
        validate_resources(load_recipe(TINY, ["model.catalog=Qwen3-9B"]))


def test_a_campaign_url_that_is_a_file_is_refused(tmp_path):
    from milepost.tasks.campaign import prepare_campaign
    path = _write(tmp_path, "notes.txt", "mine")
    with pytest.raises(UserError, match=r"--campaign .*notes.txt is a file; a campaign is a folder"):
        prepare_campaign(load_recipe(TINY), str(path))
    assert path.read_text() == "mine"


def test_every_user_error_type_is_a_user_error():
    """The stage runner classifies by UserError: these must all be one."""
    from milepost.core.plugins import PluginError
    from milepost.core.reward import RewardFailedError
    for kind in (RecipeError, DatasetError, DatasetNotFoundError, ModelPathError, PluginError, RewardFailedError):
        assert issubclass(kind, UserError), kind
