"""Elastic device groups (xray.config.batches): the sizes a group may take, the batches at each,
and the plan's checks over all of them, against hand-computed values."""
import pytest

from tests.unit.test_deepspeed_elastic_rule import SEED_BLOCK
from xray.config.elasticity import ElasticityConfig, ElasticityError, device_batch
from xray.config import ConfigError, load_config
from xray.config.batches import elastic_ranges, train_batches
from xray.config.plan import plan_run
from algorithms.specs import default_config, command_spec

pytestmark = pytest.mark.unit
GROUPS = {"nproc_per_node": 3,
          "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"],
                          "resources": {"trainer_node": 1}},
          "rollout_group": {"device": "CPU", "ranks": [2], "workers": ["rollout"]}}
BLOCK = {"max_train_batch_size": 32, "micro_batch_sizes": [16], "min_gpus": 1, "max_gpus": 2}


def elastic_cfg(block=BLOCK, groups=GROUPS, extra=()):
    return load_config(default_config("ppo"), [("device_groups", groups), ("actor.dp", 2), ("critic.dp", 2),
                                                ("reference.dp", 2), ("actor.elasticity", block),
                                                ("critic.elasticity", block), *extra])


def test_device_batch_counts_whole_replicas():
    cfg = ElasticityConfig(max_train_batch_size=12, micro_batch_sizes=(2, 4), min_gpus=2, max_gpus=8, version=0.1)
    # DeepSpeed's batch: 12 (valid at dp 2, 3, 6) beats 8 (dp 2, 4); dp 2 takes 6 each: micro 2 x 3
    b = device_batch(cfg, 4, model_parallel=2)
    assert (b.world_size, b.micro_batch_size, b.gradient_accumulation_steps, b.train_batch_size) == (2, 2, 3, 12)
    with pytest.raises(ElasticityError, match="use a multiple of 2"):
        device_batch(cfg, 3, model_parallel=2)
    with pytest.raises(ElasticityError, match=r"world size 1 .* valid sizes \[2, 3, 6\]"):
        device_batch(cfg, 1)


def test_the_actor_block_sets_the_mini_batch_at_each_size():
    cfg = elastic_cfg(block=dict(BLOCK, max_train_batch_size=48), extra=[("ppo.rollout_batch_size", 192)])
    assert plan_run(cfg, "megatron-vllm", command_spec("ppo")).role("actor").resources == (("trainer_node", 1.0),)
    # DeepSpeed's one batch for the block: 16 x 2 = 32 (48 // 16 = 3, the largest highly composite
    # number <= 3 is 2), valid at dp 1 and 2: 16 x 2 x 1 and 16 x 1 x 2; the reference keeps its own
    two = train_batches(cfg, {"actor": 2, "critic": 2, "reference": 2})
    one = train_batches(cfg, {"actor": 1, "critic": 1, "reference": 1})
    assert (two.mini_batch_size, two.micro_of("actor"), two.micro_of("reference")) == (32, 16, 32)
    assert (one.mini_batch_size, one.micro_of("critic")) == (32, 16)
    [er] = elastic_ranges(cfg, cfg.device_groups)
    assert (er.group, er.roles, er.sizes, er.fit(5), er.fit(0)) == ("train_group", ("actor", "critic", "reference"),
                                                                   (1, 2), 2, None)


def test_the_plan_checks_every_size_and_placement():
    # 24 x 2 = 48 divides the 128 samples of a step? no: the plan fails, naming the elastic mini-batch
    with pytest.raises(ConfigError, match=r"mini_batch_size=48 \(the elastic mini-batch on \d actor devices\)"):
        plan_run(elastic_cfg(block=dict(BLOCK, max_train_batch_size=48, micro_batch_sizes=[24]),
                             extra=[("actor.micro_batch_size", 24), ("critic.micro_batch_size", 24)]),
                 "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="give actor and critic the same elasticity block"):
        plan_run(elastic_cfg(extra=[("critic.elasticity", dict(BLOCK, max_train_batch_size=16, micro_batch_sizes=[8]))]), "megatron-vllm", command_spec("ppo"))
    mixed = dict(GROUPS, train_group=dict(GROUPS["train_group"], workers=["actor", "critic", "reference", "rollout"]),
                 rollout_group=None)
    mixed = {k: v for k, v in mixed.items() if v is not None}
    with pytest.raises(ConfigError, match=r"an elastic group .* \['rollout'\] cannot follow"):
        plan_run(elastic_cfg(groups=mixed, extra=[("rollout.dp", 2)]), "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="elastic resizing runs with trainer.mode=sync"):
        plan_run(elastic_cfg(extra=[("trainer.mode", "async")]), "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="has 2 ranks, not a size its elasticity allows"):
        plan_run(elastic_cfg(block=dict(BLOCK, max_gpus=1)), "megatron-vllm", command_spec("ppo"))
    bad = dict(GROUPS, train_group=dict(GROUPS["train_group"], resources={"CPU": 1}))
    with pytest.raises(ConfigError, match="custom resource names"):
        elastic_cfg(groups=bad)


THREE = dict(GROUPS, nproc_per_node=4, train_group=dict(GROUPS["train_group"], ranks=[0, 1, 2]),
             rollout_group=dict(GROUPS["rollout_group"], ranks=[3]))
"""A train group of three devices."""


def test_the_seeds_elasticity_block_runs_as_written_and_each_key_means_something():
    import types

    from xray.run.recovery.elastic import Elastic

    cfg = elastic_cfg(SEED_BLOCK)
    assert cfg.actor.elasticity.min_time == 20 and cfg.actor.elasticity.version == 0.1
    er, = elastic_ranges(cfg, cfg.device_groups)
    assert er.sizes == (1, 2) and er.min_time == 20
    plan = plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert "1: 1 x 4 x 2 = 8" in plan.describe() and "2: 2 x 4 x 1 = 8" in plan.describe()  # one batch: 8
    # DeepSpeed refuses 3 replicas for this block (valid: 1, 2, 4): so does the plan, with the list
    with pytest.raises(ConfigError, match=r"has 3 ranks.*the sizes it allows here are \[1, 2\]"):
        plan_run(elastic_cfg(SEED_BLOCK, groups=THREE, extra=[("actor.dp", 3), ("critic.dp", 3), ("reference.dp", 3)]),
                 "megatron-vllm", command_spec("ppo"))
    # enabled: false keeps the roles fixed, as if the block were absent
    off = elastic_cfg(dict(SEED_BLOCK, enabled=False))
    assert off.actor.elasticity is None and elastic_ranges(off, off.device_groups) == []
    # prefer_larger_batch: between candidates valid at as many sizes (72: 2, 3, 4, 6, 8; 60: 2, 3, 4,
    # 5, 6), the larger or the smaller
    block = dict(max_train_batch_size=100, micro_batch_sizes=(3, 5), min_gpus=2, max_gpus=8, version=0.1)
    larger, smaller = ElasticityConfig(**block), ElasticityConfig(**block, prefer_larger_batch=False)
    assert device_batch(larger, 2).train_batch_size == 72 and device_batch(smaller, 2).train_batch_size == 60
    with pytest.raises(ConfigError, match="elasticity.version=0.3"):
        elastic_cfg(dict(SEED_BLOCK, version=0.3))
    # min_time: a group grows only once it has kept its size that long (a lost device shrinks it at once)
    warm = [False]  # the processes for the grow on the joined node (`Models.warm_joined`)
    trainer = types.SimpleNamespace(cfg=cfg, models=types.SimpleNamespace(standby=0, plan=types.SimpleNamespace(roles=[
        types.SimpleNamespace(role="actor", group="train_group", num_workhorses=1)]), warm_joined=lambda g: warm[0]))
    elastic = Elastic(trainer)
    elastic._free = lambda group: 1  # a node joined: one more device
    assert elastic.growth() == {}  # kept its size for less than 20 minutes
    elastic.sized_at["train_group"] -= 20 * 60
    assert elastic.growth() == {}  # its processes on the joined node still import: the run goes on at its size
    warm[0] = True
    assert elastic.growth() == {"train_group": 2}


def test_lr_scaling_follows_the_global_batch():
    """`elasticity.lr_scaling`: `optim.lr` is written for the batch at the group's full size. With
    DeepSpeed's v0.2 rule over three devices the block's batch is 16 x 2 = 32, valid at 1 and 2
    replicas; 3 replicas, outside that list, get a batch of their own, 16 x 3 = 48 (the full size's):
    at 1 and 2 devices linear gives x 32/48, sqrt its square root."""
    from xray.config.batches import role_lr

    block = {"max_train_batch_size": 48, "micro_batch_sizes": [16], "min_gpus": 1, "max_gpus": 3, "version": 0.2,
             "ignore_non_elastic_batch_info": True}
    three = [("ppo.rollout_batch_size", 192), ("actor.optim.lr", 1e-4), ("actor.dp", 3), ("critic.dp", 3),
             ("reference.dp", 3)]

    def lr_at(scaling: str, devices: int) -> float:
        return role_lr(elastic_cfg(dict(block, lr_scaling=scaling), groups=THREE, extra=three), "actor", devices)

    assert lr_at("none", 1) == lr_at("linear", 3) == lr_at("sqrt", 3) == 1e-4
    assert lr_at("linear", 1) == lr_at("linear", 2) == pytest.approx(1e-4 * 32 / 48, rel=1e-12)
    assert lr_at("sqrt", 1) == pytest.approx(1e-4 * (32 / 48) ** 0.5, rel=1e-12)
    cfg = elastic_cfg(dict(block, lr_scaling="linear"), groups=THREE, extra=three)
    text = "\n".join(plan_run(cfg, "megatron-vllm", command_spec("ppo")).describe().splitlines())
    assert "1: 1 x 16 x 2 = 32, lr 6.67e-05 | 2: 2 x 16 x 1 = 32, lr 6.67e-05 | 3: 3 x 16 x 1 = 48, lr 0.0001" \
        in text, text
    with pytest.raises(ConfigError, match="lr_scaling='cubic'; choose one of none, linear, sqrt"):
        elastic_cfg(dict(block, lr_scaling="cubic"))


def nodes_cfg(train_ranks, rollout_ranks, block=BLOCK, nnodes="1:2"):
    groups = {"nproc_per_node": 2, "nnodes": nnodes,
              "rollout_group": {"device": "CPU", "ranks": rollout_ranks, "workers": ["rollout"]},
              "train_group": {"device": "CPU", "ranks": train_ranks, "workers": ["actor", "critic", "reference"]}}
    return elastic_cfg(block=block, groups=groups)


def test_nnodes_min_max_as_torchrun_writes_it(tmp_path):
    from xray.config import read_yaml
    from xray.config.overrides import parse_overrides

    # YAML 1.1 reads 1:2 as the base-60 integer 62; xray's loader keeps it as written
    (tmp_path / "c.yaml").write_text("device_groups:\n  nnodes: 1:2\n  nproc_per_node: 2\n")
    assert read_yaml(tmp_path / "c.yaml")["device_groups"]["nnodes"] == "1:2"
    assert parse_overrides(["--device_groups.nnodes=1:4", "--x.y=1.5"]) == [("device_groups.nnodes", "1:4"), ("x.y", 1.5)]
    # the elastic train group: rank 1 on the first node (its smallest size, 1), rank 2 on the second
    cfg = nodes_cfg([1, 2], [0])
    g = cfg.device_groups
    assert (g.min_nnodes, g.nnodes, g.fewest_nodes, g.on_fewest_nodes(g.groups[1])) == (1, 2, 1, 1)
    assert g.to_plain()["nnodes"] == "1:2"
    plan = plan_run(cfg, "megatron-vllm", command_spec("ppo"))
    assert plan.describe().startswith("placement plan (backend megatron-vllm; 1:2 node(s) x 2 devices)")
    assert nodes_cfg([1, 2], [0], nnodes=2).device_groups.min_nnodes is None  # an int: no range
    assert nodes_cfg([1, 2], [0], nnodes="2:2").device_groups.min_nnodes is None


@pytest.mark.parametrize("value", ["2:1", "0:2", "1:x", "1:2:3", 0])
def test_nnodes_ranges_that_cannot_be(value):
    with pytest.raises(ConfigError, match=r"device_groups\.nnodes"):
        nodes_cfg([1, 2], [0], nnodes=value)


def test_nnodes_min_must_hold_what_cannot_shrink():
    # the rollout is not elastic: on the second node it could not start on one node
    with pytest.raises(ConfigError, match=r"rollout_group: 1 of its ranks lie beyond the first 1 node\(s\)"):
        plan_run(nodes_cfg([0, 1], [2]), "megatron-vllm", command_spec("ppo"))
    # the elastic group's smallest size (2) does not fit the one device it has on the first node
    with pytest.raises(ConfigError, match=r"train_group: on the first 1 node\(s\) .* has 1 device\(s\), below the "
                                          r"smallest size its elasticity allows \(2"):
        plan_run(nodes_cfg([1, 2], [0], block=dict(BLOCK, min_gpus=2)), "megatron-vllm", command_spec("ppo"))
    plan_run(nodes_cfg([0, 1], [2], nnodes="2:2"), "megatron-vllm", command_spec("ppo"))  # no range: no such check


SFT_GROUPS = {"nproc_per_node": 4, "train_group": {"device": "CPU", "ranks": [0, 1, 2, 3], "workers": ["actor"]}}


def sft_cfg(block=SEED_BLOCK, ranks=(0, 1, 2, 3), extra=()):
    groups = dict(SFT_GROUPS, train_group=dict(SFT_GROUPS["train_group"], ranks=list(ranks)))
    return load_config(default_config("sft"), [("device_groups", groups), ("actor.dp", len(ranks)),
                                                ("actor.elasticity", block), *extra])


def test_elastic_sft_takes_deepspeeds_batch_from_the_seeds_block_verbatim():
    """`python -m xray.train sft` with the seed's block: DeepSpeed's one global batch of 8 at 1, 2 and
    4 devices (micro 4 x 2, 4 x 1, 2 x 1), 3 refused at plan time with the valid sizes; the block's
    batch replaces sft.batch_size (ignore_non_elastic_batch_info) or, when not ignored, must equal it."""
    from xray.config.batches import supervised_batches

    plan = plan_run(sft_cfg(), "deepspeed-dsinfer", command_spec("sft"))
    [elastic] = plan.elastic
    assert [(n, micro, mini) for n, _, micro, _, mini in elastic.sizes] == [(1, 4, 8), (2, 4, 8), (4, 2, 8)]
    cfg = sft_cfg()
    assert [(supervised_batches(cfg, {"actor": n}).mini_batch_size, supervised_batches(cfg, {"actor": n}).micro_of(
        "actor")) for n in (1, 2, 4)] == [(8, 4), (8, 4), (8, 2)]
    assert supervised_batches(load_config(default_config("sft"), []), {"actor": 1}).mini_batch_size == 64  # sft.batch_size
    with pytest.raises(ConfigError, match=r"has 3 ranks, not a size its elasticity allows .* \[1, 2\]"):
        plan_run(sft_cfg(ranks=(0, 1, 2)), "megatron-vllm", command_spec("sft"))
    strict = dict(SEED_BLOCK, ignore_non_elastic_batch_info=False)
    with pytest.raises(ConfigError, match=r"sft.batch_size=8 \(the config has 64\)"):
        plan_run(sft_cfg(block=strict, extra=[("actor.micro_batch_size", 2)]), "megatron-vllm", command_spec("sft"))
    plan_run(sft_cfg(block=strict, extra=[("actor.micro_batch_size", 2), ("sft.batch_size", 8)]), "megatron-vllm",
             command_spec("sft"))


def test_an_elastic_rl_runs_warm_start_plans_at_the_groups_size():
    """The built-in model's warm start is an SFT job on the RL config: the run's elasticity blocks
    size the run's batches, not the warm start's sft.batch_size (64, where the block's batch is 32),
    so its config drops them (`warm_start_config`); kept, the plan would refuse the warm start."""
    from algorithms.warm_start import warm_start_config

    cfg = elastic_cfg()
    with pytest.raises(ConfigError, match=r"sft.batch_size=32 \(the config has 64\)"):
        plan_run(cfg, "megatron-vllm", command_spec("sft"))
    plan = plan_run(warm_start_config(cfg), "megatron-vllm", command_spec("sft"))
    assert plan.role("actor").parallel.dp == 2 and not plan.elastic


def test_an_elastic_group_waits_a_moment_for_devices_released_just_now():
    """Ray shows devices freed a moment ago as free only later: the group waits (up to its settle
    time) for its full size before starting smaller, and starts at once when they are there."""
    import time

    from xray.run.models import settled_free

    answers = iter([0, 0, 1, 2, 2])
    t0 = time.monotonic()
    assert settled_free(lambda: next(answers), 2, settle_s=5.0) == 2  # the third look after the first
    assert time.monotonic() - t0 < 2.0
    t0 = time.monotonic()
    assert settled_free(lambda: 1, 2, settle_s=0.5) == 1  # never more: what is there, after the wait
    assert 0.5 <= time.monotonic() - t0 < 3.0
    assert settled_free(lambda: 3, 2, settle_s=5.0) == 3
