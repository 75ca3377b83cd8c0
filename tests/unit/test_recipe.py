import pytest
import yaml

from milepost.core.recipe_io import RecipeError, dump_recipe, load_recipe, recipe_diff, same_recipe
from milepost.core.store import CampaignStore


def _write(tmp_path, text):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_the_shipped_tiny_arith_recipe_is_valid():
    recipe = load_recipe("recipes/tiny-arith.yaml")
    assert recipe.loop.max_staleness == 0
    assert recipe.rollout.num_samples_per_prompt >= 2


def test_typo_key_names_the_key(tmp_path):
    with pytest.raises(RecipeError, match="unknown key `train.lrr`"):
        load_recipe(_write(tmp_path, "train:\n  lrr: 0.1\n"))


def test_wrong_type_names_the_key_and_value(tmp_path):
    with pytest.raises(RecipeError, match=r"`campaign.num_blocks`.*'many'"):
        load_recipe(_write(tmp_path, "campaign:\n  num_blocks: many\n"))


def test_overrides_are_typed(tmp_path):
    recipe = load_recipe(_write(tmp_path, "seed: 3\n"),
                         ["train.lr=1e-4", "campaign.num_blocks=2", "filters.drop_zero_variance_groups=false"])
    assert recipe.train.lr == pytest.approx(1e-4)
    assert recipe.campaign.num_blocks == 2
    assert recipe.filters.drop_zero_variance_groups is False


def test_override_without_equals_sign_says_how(tmp_path):
    with pytest.raises(RecipeError, match="expected dotted.key=value"):
        load_recipe(_write(tmp_path, "seed: 3\n"), ["train.lr"])


def test_grpo_with_one_sample_per_prompt_is_refused(tmp_path):
    with pytest.raises(RecipeError, match="num_samples_per_prompt must be >= 2"):
        load_recipe(_write(tmp_path, "rollout:\n  num_samples_per_prompt: 1\n"))


def test_recipe_diff_shows_the_changed_value(tmp_path):
    a = dump_recipe(load_recipe(_write(tmp_path, "seed: 1\n")))
    b = dump_recipe(load_recipe(_write(tmp_path, "seed: 2\n")))
    diff = recipe_diff(a, b)
    assert "-seed: 1" in diff and "+seed: 2" in diff


def test_a_campaign_stored_before_a_new_setting_existed_still_matches(tmp_path):
    recipe = load_recipe(_write(tmp_path, "seed: 1\n"))
    stored = yaml.safe_load(dump_recipe(recipe))
    del stored["rollout"]["partial_rollout"]  # written by a version without this setting
    older = yaml.safe_dump(stored, sort_keys=True)
    assert same_recipe(older, recipe)
    assert not same_recipe(older, load_recipe(_write(tmp_path, "rollout: {partial_rollout: false}\n")))
    assert not same_recipe(dump_recipe(recipe), load_recipe(_write(tmp_path, "seed: 2\n")))
    assert not same_recipe("rollout: {no_such_setting: 1}\n", recipe)


def test_store_writes_json_atomically_and_reads_it_back(tmp_path):
    store = CampaignStore(str(tmp_path / "c"))
    store.write_stage_record(0, "run_steps", {"state": "done"})
    assert store.read_json("blocks/000000/run_steps.json") == {"state": "done"}
    assert store.block_indices() == [0]
    assert not list((tmp_path / "c").rglob("*.tmp-*"))


def test_async_with_colocated_engines_is_refused_with_the_fix(tmp_path):
    with pytest.raises(RecipeError, match="cluster.placement=disaggregated"):
        load_recipe(_write(tmp_path, "loop: {max_staleness: 1}\n"))
    recipe = load_recipe(_write(tmp_path, "loop: {max_staleness: 1}\ncluster: {placement: disaggregated}\n"))
    assert recipe.loop.max_staleness == 1
    with pytest.raises(RecipeError, match="cluster.placement=shared"):  # the one-device way is named too
        load_recipe(_write(tmp_path, "loop: {max_staleness: 1}\n"))
    recipe = load_recipe(_write(tmp_path, "loop: {max_staleness: 1}\ncluster: {placement: shared}\n"))
    assert recipe.cluster.placement == "shared"
