import pytest

from verlj.engine.config import (
    BOOKKEEPING,
    Config,
    ConfigError,
    diff_configs,
    keys_with_policy,
    make_config,
    parse_override,
    to_yaml,
)


def test_default_validates_and_round_trips_through_yaml(tmp_path):
    cfg = make_config()
    f = tmp_path / "c.yaml"
    f.write_text(to_yaml(cfg))
    assert make_config(f).to_dict() == cfg.to_dict()
    assert make_config(f).hash() == cfg.hash()


def test_file_then_overrides(tmp_path):
    f = tmp_path / "ppo_config.yaml"
    f.write_text("trainer:\n  save_interval: 50\n  save_total_limit: 3\n  resume_from: null\nalgorithm:\n  name: ppo\n")
    cfg = make_config(f, ["trainer.total_steps=40", "model.actor.optim.lr=3e-3", "logging.progress=off"])
    assert (cfg.algorithm.name, cfg.trainer.save_interval, cfg.trainer.total_steps) == ("ppo", 50, 40)
    assert cfg.model.actor.optim.lr == 0.003 and cfg.logging.progress == "off"


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.totl_steps=5", "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?"),
        ("algorithm.name=sac", "algorithm.name must be one of grpo, rloo, reinforce_plus_plus, ppo; got 'sac'"),
        ("algorithm.loss_agg_mode=sum", "algorithm.loss_agg_mode must be one of token-mean, seq-mean-token-sum, "
                                        "seq-mean-token-mean, seq-mean-token-sum-norm; got 'sum'"),
        ("model.actor.loss_mode=gpo", "model.actor.loss_mode must be one of vanilla, gspo; got 'gpo'"),
        ("model.actor.clip_ratio_low=1.5", "model.actor.clip_ratio_low must be between 0.0 and 1.0, got 1.5"),
        ("model.actor.clip_ratio_high=-0.1", "model.actor.clip_ratio_high must be at least 0.0, got -0.1"),
        ("trainer.total_steps=abc", "trainer.total_steps must be an integer, got 'abc'"),
        ("trainer.total_steps=0", "trainer.total_steps must be positive, got 0"),
        ("distributed.zero_stage=4", "distributed.zero_stage must be between 0 and 3, got 4"),
        ("rollout.n=1", "rollout.n must be at least 2 for grpo"),
        ("trainer", "override 'trainer' must look like key.path=value"),
        ("model.actor=3", "model.actor must be a section"),
        ("bogus.key=1", "unknown config key 'bogus'"),
        ("rollout.temperature=0", "rollout.temperature must be positive, got 0.0"),
        ("rollout.top_p=0", "rollout.top_p must be between"),
        ("rollout.reward_fn=nope", "rollout.reward_fn must be auto, reasoning_gym, builtin:NAME or module:function"),
        ("data.train_dataset=d.jsonl", "rollout.reward_fn: a dataset file has no scorer of its own"),
        ("rollout.reward_fn=reasoning_gym", "it needs data.train_dataset=reasoning_gym:TASK"),
        ("trainer.eval_interval=5", "trainer.eval_interval needs held-out prompts: set data.eval_size"),
        ("model.tiny.vocab=utf8", "model.tiny.vocab must be one of auto, digits, ascii"),
        ("rollout.answer_format=json", "rollout.answer_format must be one of text, answer_tag"),
        ("rollout.max_turns=0", "rollout.max_turns must be positive, got 0"),
        ("rollout.max_turns=3", "rollout.max_turns > 1 needs rollout.env (without an environment a sample is one response)"),
        ("rollout.env_timeout_s=0", "rollout.env_timeout_s must be positive, got 0.0"),
        ("rollout.env=calculator", "rollout.env must be null, builtin:NAME, module:Class or trl:module:Class, got 'calculator'"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        make_config(None, [override])
    assert message in str(e.value)


def test_rloo_needs_groups_and_the_new_keys_default_to_todays_behaviour():
    with pytest.raises(ConfigError) as e:
        make_config(None, ["algorithm.name=rloo", "rollout.n=1"])
    assert str(e.value) == "rollout.n must be at least 2 for rloo (advantages are relative within a group)"
    make_config(None, ["algorithm.name=reinforce_plus_plus", "rollout.n=1"])  # no groups needed
    cfg = make_config(None, [])
    assert (cfg.algorithm.loss_agg_mode, cfg.model.actor.loss_mode) == ("token-mean", "vanilla")
    assert cfg.model.actor.clip_ratio_low is None and cfg.model.actor.clip_ratio_high is None
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.fleet=k8s"], "rollout.fleet must be one of none, ray"),
        (["rollout.fleet=ray"], "rollout.fleet=ray applies to rollout.mode=async only"),
        (["rollout.fleet=ray", "rollout.mode=async", "rollout.fleet_size=0"], "rollout.fleet_size must be positive, got 0"),
        (["rollout.fleet=ray", "rollout.mode=async", "rollout.fleet_resources={num_gpus: -1}"],
         "rollout.fleet_resources must map resource names to amounts >= 0"),
    ],
)
def test_bad_fleet_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        make_config(None, overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        make_config(tmp_path / "nope.yaml")
    f = tmp_path / "bad.yaml"
    f.write_text("trainer: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        make_config(f)
    f.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        make_config(f)


def test_a_command_written_after_a_colon_and_a_space_is_told_to_quote_it(tmp_path):
    """`rollout.agent=cmd: python agent.py`: YAML reads the value as a mapping (in a file, as a syntax error); each says
    to quote it, and quoted it is the command."""
    with pytest.raises(ConfigError) as e:
        make_config(None, ["rollout.agent=cmd: python agent.py"])
    assert str(e.value) == ("rollout.agent must be a string, got the mapping {'cmd': 'python agent.py'}: YAML reads a colon followed "
                            "by a space as a mapping; quote the value (agent: \"cmd: python agent.py\" in a file, "
                            "'rollout.agent=\"cmd: python agent.py\"' on the command line), or write it without the space")
    assert make_config(None, ['rollout.agent="cmd: python -c pass"']).rollout.agent == "cmd: python -c pass"
    f = tmp_path / "agent.yaml"
    f.write_text("rollout:\n  agent: cmd: python agent.py\n")
    with pytest.raises(ConfigError, match=r"at line 2: mapping values are not allowed here \(a value holding a colon and a space "
                                          r"needs quotes: agent: \"cmd: python agent.py\"\)"):
        make_config(f)


def test_hash_ignores_bookkeeping_only():
    base = make_config()
    assert make_config(None, ["trainer.total_steps=999", "logging.jsonl=false"]).hash() == base.hash()
    assert make_config(None, ["model.actor.optim.lr=0.5"]).hash() != base.hash()
    assert "trainer.total_steps" in keys_with_policy(BOOKKEEPING)


def test_diff_and_parse_override():
    assert parse_override("a.b=[1, 2]") == {"a": {"b": [1, 2]}}
    a, b = Config().to_dict(), make_config(None, ["algorithm.kl_coef=0.1"]).to_dict()
    assert diff_configs(a, b) == ["algorithm.kl_coef"]


def test_a_number_where_a_name_is_due_gets_the_fields_own_sentence():
    with pytest.raises(ConfigError) as e:
        make_config(None, ["journal.retain_samples=1.5"])
    assert str(e.value) == "journal.retain_samples must be all, since_oldest_snapshot or a whole number of steps >= 0, got '1.5'"


def test_resume_from_is_a_choice_of_one_command_never_the_runs_config():
    from verlj.engine.config import check_change, stored_config

    cfg = make_config(None, ["trainer.resume_from=15"])
    assert cfg.trainer.resume_from == "15" and cfg.to_stored()["trainer"]["resume_from"] is None
    assert "resume_from: null" in to_yaml(cfg, stored=True)
    assert check_change(make_config().to_dict(), cfg, allow_live=False, how="resume") == []  # not a change to record
    old = make_config().to_dict()
    old["trainer"]["resume_from"] = "15"  # as runs stored it before this rule
    assert stored_config(old)["trainer"]["resume_from"] is None


def test_keys_added_since_a_run_began_keep_its_behaviour_and_mapping_keys_take_their_fields_policy():
    """A stored config from before model.tiny.vocab is a digits run; a change inside a mapping field
    (a reasoning-gym task's config) has that field's policy: fixed, so a resume refuses it."""
    from verlj.engine.config import check_change, policy_of, stored_config

    old = make_config(None, ["data.train_dataset=reasoning_gym:spell_backward", "data.reasoning_gym.config={min_word_len: 3}"])
    data = old.to_stored()
    del data["model"]["tiny"]["vocab"]
    assert stored_config(data)["model"]["tiny"]["vocab"] == "digits"
    assert policy_of("data.reasoning_gym.config.min_word_len") == "fixed"
    assert policy_of("trainer.checkpoint_policy_kwargs.every") == "bookkeeping"
    new = make_config(None, ["data.reasoning_gym.config.min_word_len=4"], base=old.to_stored())
    with pytest.raises(ConfigError, match="data.reasoning_gym.config.min_word_len cannot change within a run"):
        check_change(old.to_stored(), new, allow_live=True, how="resume")
    kwargs = make_config(None, ["trainer.checkpoint_policy_kwargs={every: 3}"])
    assert check_change(old.to_stored(), make_config(None, ["trainer.checkpoint_policy_kwargs={every: 3}"], base=old.to_stored()),
                        allow_live=False, how="resume") == ["trainer.checkpoint_policy_kwargs.every"]
    assert kwargs.trainer.checkpoint_policy_kwargs == {"every": 3}


@pytest.mark.parametrize("run, changed, said", [
    (["rollout.mode=async", "rollout.async_order=completion", "rollout.partial=true", "rollout.max_token_staleness=2"],
     ["rollout.partial=false"], "rollout.partial cannot change within a run (resume): it shapes"),  # not max_token_staleness
    (["rollout.mode=async", "rollout.async_order=step"], ["rollout.mode=sync"], "rollout.mode cannot change"),  # not async_order
    (["rollout.mode=async"], ["rollout.mode=sync", "rollout.n=2"], "rollout.mode, rollout.n cannot change within a run (resume): they"),
])
def test_a_resume_that_changes_a_fixed_key_names_that_key_not_what_the_changed_config_would_say(run, changed, said):
    """The keys the command typed and the run fixes are said first, never a key of the run's own the user never typed."""
    from verlj.engine.config import changed_config

    old = make_config(None, run).to_stored()
    with pytest.raises(ConfigError) as e:
        changed_config(old, None, changed, allow_live=True, how="resume")
    assert said in str(e.value), str(e.value)
    if "rollout.partial=true" in run:  # a change of no fixed key: what the changed config says of itself, as before
        with pytest.raises(ConfigError, match="rollout.max_token_staleness must be an integer of at least rollout.max_staleness"):
            changed_config(old, None, ["rollout.max_token_staleness=0"], allow_live=True, how="resume")


def test_a_whatif_may_change_the_estimator_among_those_without_a_critic():
    from verlj.engine.config import check_whatif

    old = make_config(None, []).to_dict()
    changed = check_whatif(old, make_config(None, ["algorithm.name=rloo", "model.actor.loss_mode=gspo", "model.actor.clip_ratio_high=0.3",
                                                   "algorithm.loss_agg_mode=seq-mean-token-mean"]))
    assert sorted(changed) == ["algorithm.loss_agg_mode", "algorithm.name", "model.actor.clip_ratio_high", "model.actor.loss_mode"]
    for a, b in (("grpo", "ppo"), ("ppo", "reinforce_plus_plus")):
        with pytest.raises(ConfigError) as e:
            check_whatif(make_config(None, [f"algorithm.name={a}"]).to_dict(), make_config(None, [f"algorithm.name={b}"]))
        assert str(e.value).startswith(f"algorithm.name cannot change from {a} to {b} in a what-if: ppo trains a critic")


def test_a_whatif_keeps_the_lora_adapters_shape():
    """A what-if re-trains the run's adapters: their rank, scaling and placement make another trained state."""
    from verlj.engine.config import check_whatif

    old = make_config(None, ["model.actor.lora_rank=4"]).to_dict()
    assert check_whatif(old, make_config(None, ["model.actor.optim.lr=0.003"], base=old)) == ["model.actor.optim.lr"]
    for key in ("model.actor.lora_rank=8", "model.actor.lora_alpha=4", "model.actor.lora_rank=0", "model.actor.target_modules=[q_proj]"):
        with pytest.raises(ConfigError) as e:
            check_whatif(old, make_config(None, [key], base=old))
        assert str(e.value).startswith(f"{key.split('=')[0]} cannot change in a what-if") and "\n" not in str(e.value)


def test_trls_loss_type_names_are_read_as_the_modes_they_compute():
    from verlj.engine.config import check_whatif

    want = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dapo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
    for trl, mode in want.items():
        cfg = make_config(None, [f"algorithm.loss_agg_mode={trl}"])
        assert cfg.algorithm.loss_agg_mode == mode and cfg.to_dict()["algorithm"]["loss_agg_mode"] == mode  # stored as verl's name
        assert cfg.hash() == make_config(None, [f"algorithm.loss_agg_mode={mode}"]).hash()
    old = make_config(None, ["algorithm.loss_agg_mode=seq-mean-token-sum-norm"]).to_dict()
    assert check_whatif(old, make_config(None, ["algorithm.loss_agg_mode=dr_grpo"], base=old)) == []
    with pytest.raises(ConfigError, match="algorithm.loss_agg_mode must be one of token-mean, seq-mean-token-sum"):
        make_config(None, ["algorithm.loss_agg_mode=dr-grpo"])
