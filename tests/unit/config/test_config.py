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
from moe_rl_testing import ROOT


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


def test_yaml_and_overrides(tmp_path):
    p = write(tmp_path, "rl:\n  objective: gspo\n  objective_args:\n    gspo: {clip_low: 0.001}\noptimizer:\n  lr: 1e-5\n")
    cfg = load_config(p, ["rl.group_size=4", "run.name=x", "parallel.sequence_parallel=null"])
    assert cfg.rl.objective == "gspo" and cfg.rl.hparams.clip_low == 0.001 and cfg.rl.hparams.clip_high == 4e-4
    assert cfg.optimizer.lr == 1e-5 and isinstance(cfg.optimizer.lr, float)  # YAML 1.1 would give "1e-5"
    assert cfg.rl.group_size == 4 and cfg.run.name == "x" and cfg.parallel.sequence_parallel is None
    assert parse_overrides(["a.b.c=3", "a.d=[1, 2]"]) == [(["a", "b", "c"], 3), (["a", "d"], [1, 2])]
    # a block is replaced whole, or changed entry by entry with a dotted key
    assert load_config(p, ["rl.objective_args.gspo={}"]).rl.hparams.clip_low == 3e-4
    hp = load_config(p, ["rl.objective_args.gspo.clip_high=0.002"]).rl.hparams
    assert (hp.clip_low, hp.clip_high) == (0.001, 0.002)


def test_objective_hparams_are_typed_at_load_and_survive_a_switch(tmp_path):
    """Each objective keeps its own block: switching rl.objective on a recipe written for
    rspo needs no clearing, and the switched-to objective's settings are its own."""
    cfg = load_config("examples/tiny_rspo.yaml", ["rl.objective=gspo"])
    assert cfg.rl.objective == "gspo" and type(cfg.rl.hparams).__name__ == "GSPOHParams"
    assert cfg.rl.objective_args["rspo"].gamma_min == 0.1  # rspo's block is kept, unused
    assert load_config("examples/tiny_rspo.yaml", ["rl.objective_args.rspo.gamma_min=0.3"]).rl.hparams.gamma_min == 0.3
    assert cfg.rl.rollout_correction_args.tis_cap == 2.0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # a key of another objective in rspo's block: named with rspo's valid keys
        ("rl.objective_args.rspo.clip_low=0.1",
         r"unknown key rl\.objective_args\.rspo\.clip_low for objective rspo; did you mean "
         r"rl\.objective_args\.rspo\.log_clip_low\?$"),
        ("rl.objective_args.rspo.temperature=0.1",
         r"unknown key rl\.objective_args\.rspo\.temperature for objective rspo; valid keys: log_clip_low, "
         r"log_clip_high, gamma_min, gamma_placement"),
        ("rl.objective_args.gspo.gamma_min=0.1", r"unknown key rl\.objective_args\.gspo\.gamma_min for objective gspo"),
        # the old flat form points at the right place
        ("rl.objective_args={gamma_min: 0.1}",
         r"rl\.objective_args\.gamma_min: not an objective; hyperparameters go under their objective's name, "
         r"e\.g\. rl\.objective_args\.rspo\.gamma_min"),
        ("rl.objective_args.nope={}", r"rl\.objective_args\.nope: not an objective; valid: grpo, dr_grpo"),
        # values are typed and range-checked by the objective's own dataclass
        ("rl.objective_args.rspo.gamma_min=high", r"rl\.objective_args\.rspo\.gamma_min: expected a number"),
        ("rl.objective_args.rspo.gamma_min=0", r"rl\.objective_args\.rspo: gamma_min must be in \(0, 1\]"),
        ("rl.objective_args.rspo.gamma_placement=middle", r"rl\.objective_args\.rspo\.gamma_placement: 'middle'"),
        ("rl.rollout_correction_args.tis_c=3", r"unknown key rl\.rollout_correction_args\.tis_c; did you mean "
                                               r"rl\.rollout_correction_args\.tis_cap\?$"),
        ("rl.rollout_correction_args.weight=3", r"unknown key rl\.rollout_correction_args\.weight in "
                                             r"rl\.rollout_correction_args; valid keys: tis_cap, mis_low, mis_high"),
        ("rl.rollout_correction_args.mis_low=3", r"rl\.rollout_correction_args: need 0 <= mis_low < mis_high"),
        ("rl.objective=ppo", r"rl\.objective='ppo' is unknown; valid: grpo, dr_grpo"),
        ("rl.capture_routing=false", r"rl\.objective=rspo needs rl\.capture_routing=true"),
    ],
)
def test_objective_args_errors_name_the_objective_and_its_keys(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("examples/tiny_rspo.yaml", [override])


def test_help_config_lists_every_objectives_keys_with_docstrings():
    from moe_rl.objectives import OBJECTIVES

    text = describe()
    for name, spec in OBJECTIVES.items():
        assert f"[rl.objective_args.{name}]  {spec.fixes}" in text
        for f in dataclasses.fields(spec.hparams):
            line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"rl.objective_args.{name}.{f.name} ="))
            assert len(line.split(")  ", 1)[1]) > 10, line  # the docstring follows the type
    assert "rl.rollout_correction_args.tis_cap = 2.0  (float)  TIS truncation" in text


@pytest.mark.parametrize(("yaml_text", "override", "message"), [
    ("run:\n  save_evry: 3\n", "run.save_evry=3", "unknown key run.save_evry; did you mean run.save_every?"),
    ("rl:\n  objetive: gspo\n", "rl.objetive=gspo", "unknown key rl.objetive; did you mean rl.objective?"),
    ("modle:\n  num_layers: 2\n", "modle.num_layers=2", "unknown key modle; did you mean model?"),
    ("rl:\n  objective_args:\n    rspo: {gama_min: 0.2}\n", "rl.objective_args.rspo.gama_min=0.2",
     "unknown key rl.objective_args.rspo.gama_min for objective rspo; did you mean rl.objective_args.rspo.gamma_min?"),
    ("rl:\n  objective_args:\n    rpso: {}\n", "rl.objective_args.rpso={}",
     "rl.objective_args.rpso: not an objective; did you mean rspo? valid: grpo, dr_grpo, dapo,"),
    ("rl:\n  objective: gpso\n", "rl.objective=gpso", "rl.objective='gpso' is unknown; did you mean gspo? valid: grpo,"),
    # nothing near: the valid keys instead
    ("run:\n  colour: red\n", "run.colour=red", "unknown key run.colour in run; valid keys: name, output_dir, seed,"),
])
def test_unknown_keys_suggest_the_nearest_valid_one(tmp_path, yaml_text, override, message):
    """The same one-line suggestion for a typo in a YAML recipe and in an override."""
    for path, overrides in ((write(tmp_path, yaml_text), []), (None, [override])):
        with pytest.raises(ConfigError) as e:
            load_config(path, overrides)
        assert str(e.value).startswith(message), str(e.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.num_layers=two", "model.num_layers: expected an integer, got str 'two'"),
        ("model.num_layers=2.5", "model.num_layers: expected an integer, got float 2.5"),
        ("rl.dynamic_sampling=1", "rl.dynamic_sampling: expected true/false, got int 1"),
        ("rl.replay=R4", r"rl.replay: 'R4' is not one of \['none', 'R2', 'R3'\]"),
        ("rl.objective_args=3", "rl.objective_args: expected a mapping of objective name"),
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
    cfg = load_config(None, ["rl.objective=rspo", "rl.objective_args.rspo={gamma_min: 0.2}"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
    assert not list(tmp_path.glob(".c.yaml.*"))  # no temp file left behind
    assert yaml.safe_load((tmp_path / "c.yaml").read_text())["rl"]["objective"] == "rspo"


def test_every_shipped_recipe_loads():

    recipes = sorted((ROOT / "examples").rglob("*.yaml"))
    assert len(recipes) >= 8
    for path in recipes:
        load_config(path)  # objective hyperparameters included


def test_every_section_validates_itself():
    """Each section of `Config` carries its own `validate` (its own rules, beside its fields);
    the rules that span sections are `moe_rl.config.cross_section`'s alone."""
    import dataclasses

    from moe_rl.config import Config

    for f in dataclasses.fields(Config):
        assert callable(getattr(f.default_factory(), "validate", None)), f"{f.name} has no validate()"
    with pytest.raises(ConfigError, match=r"^rl\.group_size must be >= 1, got 0$"):
        Config().rl.__class__(group_size=0).validate()
    with pytest.raises(ConfigError, match=r"critic\.optimizer\.lr must be > 0"):
        load_config(None, ["critic.optimizer.lr=0"])
