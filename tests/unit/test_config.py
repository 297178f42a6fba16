"""Typed config: overrides, unknown keys, wrong types, device groups, layout and batch checks."""
import pytest

from xray.config import ConfigError, load_config
from xray.config.placement import parse_ranks
from xray.config.plan import plan_run
from algorithms.specs import default_config, command_spec

pytestmark = pytest.mark.unit
DEFAULT = default_config("ppo")


def test_default_config_loads_and_plans():
    cfg = load_config(DEFAULT)
    plan = plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert [r.role for r in plan.roles] == ["rollout", "actor", "critic", "reference"]
    assert plan.role("actor").ranks == (0,) and plan.role("rollout").ranks == (1,)
    assert plan.role("rollout").backend == "vllm" and plan.role("critic").backend == "megatron"
    assert plan_run(cfg, "deepspeed-dsinfer", command_spec("ppo")).role("rollout").backend == "dsinfer"


def test_overrides_are_typed():
    cfg = load_config(DEFAULT, ["--ppo.kl_coef=0.25", "--actor.optim.lr", "3e-4", "--sync.verify=false"])
    assert cfg.ppo.kl_coef == 0.25 and cfg.actor.optim.lr == 3e-4 and cfg.sync.verify is False
    assert load_config(DEFAULT, ["--ppo.kl_coef=1"]).ppo.kl_coef == 1.0  # int accepted as float


@pytest.mark.parametrize("override, needle", [
    ("--no_such_section.no_such_key=1", "no_such_section.no_such_key"),
    ("--ppo.kl_cof=1", "did you mean 'kl_coef'"),
    ("--ppo.ppo_epochs=1.5", "ppo.ppo_epochs: expected int"),
    ("--rollout.dtype=float64", "rollout.dtype: must be one of"),
    ("--sync.verify=3", "sync.verify: expected bool"),
])
def test_bad_keys_and_types_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(DEFAULT, [override])


@pytest.mark.parametrize("text, offset, expected", [
    ([2, 3], 0, (2, 3)), (2, 4, (4, 5)), ("list(range(0, 3))", 0, (0, 1, 2)),
    ("range(2)", 0, (0, 1)), ("[1, 3]", 0, (1, 3)),
])
def test_ranks_formats(text, offset, expected):
    assert parse_ranks(text, offset, "g.ranks") == expected


@pytest.mark.parametrize("bad", ["__import__('os').system('true')", "list(range(0, 2)) + [9]", True, [], [0, 0]])
def test_ranks_never_evaluated(bad):
    with pytest.raises(ConfigError, match="g.ranks"):
        parse_ranks(bad, 0, "g.ranks")


def groups(**over):
    base = {"nproc_per_node": 4,
            "train": {"device": "GPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"]},
            "gen": {"device": "GPU", "ranks": [2, 3], "workers": ["rollout"]}}
    base.update(over)
    return [("device_groups", base), ("actor.dp", 2), ("critic.dp", 2), ("reference.dp", 2),
            ("rollout.dp", 2)]


def test_gpu_groups_plan():
    cfg = load_config(DEFAULT, groups())
    plan = plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert plan.role("rollout").ranks == (2, 3) and plan.role("actor").parallel.dp == 2


def test_shared_rank_names_both_groups():
    over = groups(gen={"device": "GPU", "ranks": [1, 2], "workers": ["rollout"]})
    with pytest.raises(ConfigError, match=r"groups 'train' and 'gen' share ranks \[1\]"):
        load_config(DEFAULT, over)


def test_ranks_beyond_nproc_names_the_group():
    over = groups(gen={"device": "GPU", "ranks": "list(range(2, 6))", "workers": ["rollout"]})
    with pytest.raises(ConfigError, match=r"group 'gen' or raise device_groups.nproc_per_node"):
        load_config(DEFAULT, over)


def test_role_in_two_groups_and_in_none():
    over = groups(gen={"device": "GPU", "ranks": [2, 3], "workers": ["rollout", "actor"]})
    with pytest.raises(ConfigError, match="role 'actor' is placed in two groups, 'train' and 'gen'"):
        load_config(DEFAULT, over)
    over = groups(train={"device": "GPU", "ranks": [0, 1], "workers": ["actor", "critic"]})
    with pytest.raises(ConfigError, match="role 'reference' is placed in no group"):
        plan_run(load_config(DEFAULT, over), "megatron-vllm", command_spec("ppo"))


def test_layout_must_fill_its_group():
    cfg = load_config(DEFAULT, groups() + [("actor.tp", 2)])
    with pytest.raises(ConfigError, match=r"actor.tp \* actor.pp \* actor.dp = 2\*1\*2 = 4, but its device group has 2"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    cfg = load_config(DEFAULT, groups() + [("actor.tp", 2), ("actor.dp", 1)])
    with pytest.raises(ConfigError, match="deepspeed backend has no tensor"):
        plan_run(cfg, "deepspeed-vllm", command_spec("ppo"))


def test_batch_divisibility():
    cfg = load_config(DEFAULT, [("ppo.mini_batch_size", 12)])
    with pytest.raises(ConfigError, match="mini_batch_size=12 does not divide the 128 samples"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    cfg = load_config(DEFAULT, groups() + [("actor.micro_batch_size", 32)])
    with pytest.raises(ConfigError, match=r"not divisible by actor.dp x actor.micro_batch_size = 2x32"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    cfg = load_config(DEFAULT, groups() + [("ppo.rollout_batch_size", 31), ("ppo.mini_batch_size", 31), ("data.eval_size", 200)])
    with pytest.raises(ConfigError, match="not divisible by the 2 rollout replicas"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))


def test_sampling_and_lengths_the_engines_refuse(tmp_path):
    from xray.run.models import check_layouts

    cfg = load_config(DEFAULT, [("rollout.temperature", 3.0)])
    with pytest.raises(ConfigError, match="temperatures from 0 to 2"):
        plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    plan_run(cfg, "deepspeed-dsinfer", command_spec("ppo"))  # DeepSpeed-Inference samples at any temperature
    cfg = load_config(DEFAULT, [("rollout.max_new_tokens", 200)])
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 128}')
    with pytest.raises(ConfigError, match=r"= \d+ exceeds the model's max_position_embeddings=128"):
        check_layouts(cfg, plan_run(cfg, "deepspeed-dsinfer", command_spec("ppo")), str(tmp_path))


def test_elasticity_block_is_accepted_and_checked():
    block = {"max_train_batch_size": 16, "micro_batch_sizes": [2, 4], "min_gpus": 1, "max_gpus": 4,
             "ignore_non_elastic_batch_info": True}
    cfg = load_config(DEFAULT, [("actor.elasticity", block)])
    assert cfg.actor.elasticity.micro_batch_sizes == (2, 4)
    plan_run(cfg, "deepspeed-dsinfer", command_spec("ppo"))
    # ignore_non_elastic_batch_info false: the run's own batch keys must be the elastic batch (DeepSpeed's
    # 16, valid at 1, 2 and 4 replicas, beats 12's 1, 2 and 3: 4 x 4 x 1 = 16)
    strict = dict(block, ignore_non_elastic_batch_info=False)
    with pytest.raises(ConfigError, match=r"actor.micro_batch_size=4 \(the config has 16\), ppo.mini_batch_size=16 "
                                          r"\(the config has 32\); write those values"):
        plan_run(load_config(DEFAULT, [("actor.elasticity", strict)]), "deepspeed-dsinfer", command_spec("ppo"))
    plan_run(load_config(DEFAULT, [("actor.elasticity", strict), ("actor.micro_batch_size", 4),
                                   ("ppo.mini_batch_size", 16)]), "deepspeed-dsinfer", command_spec("ppo"))
    bad = dict(block, min_gpus=2)  # the actor has 1 device: below min_gpus
    with pytest.raises(ConfigError, match="actor.elasticity"):
        plan_run(load_config(DEFAULT, [("actor.elasticity", bad)]), "deepspeed-dsinfer", command_spec("ppo"))
    with pytest.raises(ConfigError, match="actor.elasticity.max_batch"):
        load_config(DEFAULT, [("actor.elasticity", dict(block, max_batch=3))])
    with pytest.raises(ConfigError, match="actor.elasticity: elasticity.min_gpus=5 exceeds max_gpus=4"):
        load_config(DEFAULT, [("actor.elasticity", dict(block, min_gpus=5))])
