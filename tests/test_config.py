"""Config: strict YAML loading, overrides, validation, docs, atomic save."""

import dataclasses

import pytest
import yaml

from moe_rl.config import (
    Config,
    ConfigError,
    describe,
    field_docs,
    load_config,
    parse_overrides,
    save_config,
)


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "rl:\n  objective: gspo\n  objective_args: {clip_low: 0.001}\noptimizer:\n  lr: 1e-5\n")
    cfg = load_config(p, ["rl.group_size=4", "run.name=x", "parallel.sequence_parallel=null"])
    assert cfg.rl.objective == "gspo" and cfg.rl.objective_args == {"clip_low": 0.001}
    assert cfg.optimizer.lr == 1e-5 and isinstance(cfg.optimizer.lr, float)  # YAML 1.1 would give "1e-5"
    assert cfg.rl.group_size == 4 and cfg.run.name == "x" and cfg.parallel.sequence_parallel is None
    assert parse_overrides(["a.b.c=3", "a.d=[1, 2]"]) == [(["a", "b", "c"], 3), (["a", "d"], [1, 2])]
    # a mapping-valued field is replaced whole, or changed entry by entry with a dotted key
    assert load_config(p, ["rl.objective_args={}"]).rl.objective_args == {}
    assert load_config(p, ["rl.objective_args.clip_high=0.002"]).rl.objective_args == {
        "clip_low": 0.001, "clip_high": 0.002}


def test_unknown_key_names_the_key_and_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key rl\.objetive in rl; valid keys: objective, objective_args"):
        load_config(write(tmp_path, "rl:\n  objetive: gspo\n"))
    with pytest.raises(ConfigError, match="unknown key modle in top level; valid keys: model, parallel"):
        load_config(None, ["modle.num_layers=2"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.num_layers=two", "model.num_layers: expected an integer, got str 'two'"),
        ("model.num_layers=2.5", "model.num_layers: expected an integer, got float 2.5"),
        ("rl.dynamic_sampling=1", "rl.dynamic_sampling: expected true/false, got int 1"),
        ("rl.replay=R4", r"rl.replay: 'R4' is not one of \['none', 'R2', 'R3'\]"),
        ("rl.objective_args=3", "rl.objective_args: expected a mapping"),
        ("model.num_experts=0", "model.num_experts must be >= 1"),
        ("model.moe_router_topk=9", "exceeds model.num_experts=8"),
        ("model.moe_router_enable_expert_bias=true", "needs model.moe_router_score_function=sigmoid"),
        ("norank", "must look like section.key=value"),
    ],
)
def test_wrong_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_missing_recipe_and_non_mapping(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"))


def test_every_field_has_a_docstring():
    sections = [type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)]
    for cls in [Config, *sections]:
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
    text = describe()
    assert "model.num_experts = 8  (int)" in text and "rl.replay = 'none'" in text


def test_save_then_load_is_identity(tmp_path):
    cfg = load_config(None, ["rl.objective=rspo", "rl.objective_args={gamma_min: 0.2}"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert not list(tmp_path.glob(".c.yaml.*"))  # no temp file left behind
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["rl"]["objective"] == "rspo"


def test_every_shipped_recipe_loads():
    from pathlib import Path

    from moe_rl.trainer import check_objective_args

    recipes = sorted((Path(__file__).resolve().parents[1] / "examples").rglob("*.yaml"))
    assert len(recipes) >= 8
    for path in recipes:
        check_objective_args(load_config(path))
