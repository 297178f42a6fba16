"""`python -m xray.train`: dry run prints the plan; user errors are one line, no traceback."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def run(*args, timeout=60):
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "xray.train", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=timeout)
    return p, time.perf_counter() - t0


def test_dry_run_prints_config_and_plan():
    p, seconds = run("ppo", "--dry-run")
    assert p.returncode == 0, p.stderr
    assert seconds < 20
    assert "placement plan (backend megatron-vllm" in p.stdout
    assert "actor     megatron  group=train_group" in p.stdout
    assert "workhorses=1 tp=1 pp=1 dp=1" in p.stdout
    assert yaml.safe_load(p.stdout.split("placement plan")[0])["ppo"]["kl_coef"] == 0.01


def test_unknown_override_fails_fast_naming_the_key():
    p, seconds = run("ppo", "--dry-run", "--no_such_section.no_such_key=1")
    assert p.returncode != 0 and seconds < 10
    assert "no_such_section.no_such_key" in p.stderr
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout


def write(tmp_path, name, groups):
    cfg = yaml.safe_load((ROOT / "configs/ppo_tiny_cpu.yaml").read_text())
    cfg["device_groups"] = groups
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.parametrize("name, groups, needle", [
    ("shared.yaml", {"nproc_per_node": 2,
                     "train_group": {"device": "CPU", "ranks": [0, 1], "workers": ["actor", "critic", "reference"]},
                     "rollout_group": {"device": "CPU", "ranks": [1], "workers": ["rollout"]}},
     "groups 'train_group' and 'rollout_group' share ranks [1]"),
    ("beyond.yaml", {"nproc_per_node": 2,
                     "train_group": {"device": "CPU", "ranks": [0], "workers": ["actor", "critic", "reference"]},
                     "rollout_group": {"device": "CPU", "ranks": "list(range(1, 4))", "workers": ["rollout"]}},
     "ranks [2, 3] are beyond the 2 devices"),
])
def test_bad_device_groups_fail_naming_the_groups(tmp_path, name, groups, needle):
    p, _ = run("ppo", "--dry-run", "--config", str(write(tmp_path, name, groups)))
    assert p.returncode == 2
    assert needle in p.stderr and "rollout_group" in p.stderr
    assert "Traceback" not in p.stderr


def test_bad_backend_and_missing_config():
    p, _ = run("ppo", "--dry-run", "--backend", "megatron-foo")
    assert p.returncode == 2 and "choose one of megatron-vllm" in p.stderr
    p, _ = run("ppo", "--dry-run", "--config", "nope.yaml")
    assert p.returncode == 2 and "'nope.yaml' does not exist" in p.stderr


def test_bad_layout_fails_before_any_workhorse(tmp_path):
    import sys as _sys

    from xray.builtin.tiny_llama import TinySpec, build_tiny_model

    model = build_tiny_model(tmp_path / "m", TinySpec(num_heads=4, num_kv_heads=2))
    groups = {"nproc_per_node": 4,
              "train_group": {"device": "CPU", "ranks": [0, 1, 2], "workers": ["actor", "critic", "reference"]},
              "rollout_group": {"device": "CPU", "ranks": [3], "workers": ["rollout"]}}
    p, seconds = run("ppo", f"--model.path={model}", f"--device_groups={groups}", "--actor.tp=3", "--critic.tp=3",
                     "--reference.tp=3", "--ppo.mini_batch_size=48", "--ppo.rollout_batch_size=48",
                     "--data.eval_size=48", "--actor.micro_batch_size=16", "--critic.micro_batch_size=16",
                     "--reference.micro_batch_size=16")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "actor: tp=3 does not divide the model's 4 attention heads" in p.stderr
    assert "Traceback" not in p.stderr and "ray" not in p.stderr.lower().split("error:")[0]
    assert seconds < 30


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves_and_plans(path):
    from xray.train import resolve

    if path.name.startswith("sample"):  # ms-swift's groups: sampler on two devices, orm on the other two
        _, cfg, plan, _, _ = resolve(["sample", "--config", str(path)])
        assert [(r.role, r.backend, r.ranks) for r in plan.roles] == [("sampler", "vllm", (0, 1)),
                                                                     ("orm", "fn-reward", (2, 3))]
        return
    if path.name.startswith("opd"):  # the student and its teacher share a device; the rollout has the other
        _, cfg, plan, _, _ = resolve(["opd", "--config", str(path)])
        assert [(r.role, r.backend, r.ranks) for r in plan.roles] == [
            ("rollout", "vllm", (1,)), ("actor", "megatron", (0,)), ("teacher", "megatron", (0,))]
        return
    algos = ("grpo", "rloo", "reinforce_pp") if path.name.startswith(("critic_free", "grpo")) else ("ppo",)
    for algo in algos:
        _, cfg, plan, _, _ = resolve([algo, "--config", str(path)])
        assert plan.roles and cfg.trainer.steps > 0
        assert ("critic" in {r.role for r in plan.roles}) == (algo == "ppo")


def test_critic_free_config_mistakes_say_the_fix():
    from xray.config import ConfigError
    from xray.train import resolve

    with pytest.raises(ConfigError, match="has no critic; remove 'critic'"):
        resolve(["grpo", "--config", str(ROOT / "configs/ppo_tiny_cpu.yaml")])
    with pytest.raises(ConfigError, match="n_samples to 2 or more"):
        resolve(["rloo", "--rollout.n_samples=1"])
    _, _, plan, _, _ = resolve(["reinforce_pp", "--rollout.n_samples=1", "--ppo.rollout_batch_size=128"])
    assert [r.role for r in plan.roles] == ["rollout", "actor", "reference"]
    _, cfg, plan, _, _ = resolve(["opd", "--trainer.mode=async"])  # detached: makers and a trainer, no critic
    assert cfg.trainer.mode == "async" and [r.role for r in plan.roles] == ["rollout", "actor", "teacher"]
    with pytest.raises(ConfigError, match="set trainer.mode=sync, or dynamic_sampling=false"):
        resolve(["grpo", "--trainer.mode=async", "--critic_free.dynamic_sampling=true"])


def test_sample_and_distill_mistakes_say_the_fix(tmp_path):
    from xray.config import ConfigError
    from xray.train import resolve

    with pytest.raises(ConfigError, match="'prm' is placed but sample.prm_model is not set"):
        resolve(["sample", "--device_groups.rm_group.workers=[prm, orm]"])
    _, _, plan, _, _ = resolve(["sample", "--device_groups.rm_group.workers=[prm, orm]", "--sample.prm_model=/x",
                                "--backend", "deepspeed-dsinfer"])
    assert [(r.role, r.backend) for r in plan.roles] == [("sampler", "dsinfer"), ("prm", "hf-reward"),
                                                         ("orm", "fn-reward")]
    _, _, plan, _, _ = resolve(["sample", "--reward.function=null", "--reward.model=/rm"])
    assert plan.role("orm").backend == "hf-reward"
    with pytest.raises(ConfigError, match="'orm' is placed but the reward has neither"):
        resolve(["sample", "--reward.function=null"])
    with pytest.raises(ConfigError, match="batch_prompts=33 is not divisible by the 2 sampler replicas"):
        resolve(["sample", "--sample.batch_prompts=33"])
    with pytest.raises(ConfigError, match="role 'sampler' is placed in no group"):
        resolve(["sample", "--config", str(ROOT / "configs/critic_free_tiny_cpu.yaml")])
    p, _ = run("distill", "--output-dir", str(tmp_path / "d"))
    assert p.returncode == 2 and "distill.dataset is not set; pass --distill.dataset=FILE" in p.stderr
    p, _ = run("distill", "--output-dir", str(tmp_path / "d"), f"--distill.dataset={tmp_path / 'none.jsonl'}")
    assert p.returncode == 2 and "does not exist; run `python -m xray.train sample` first" in p.stderr


def test_gpu_rollout_memory_share_is_passed_and_checked(tmp_path):
    from xray.backends.vllm import VllmEngineConfig
    from xray.config import ConfigError
    from xray.run.models import role_init_kwargs
    from xray.train import resolve

    on_gpu = VllmEngineConfig(model_dir="m", device="cuda", gpu_memory_utilization=0.4).llm_kwargs()
    assert on_gpu["gpu_memory_utilization"] == 0.4
    assert "gpu_memory_utilization" not in VllmEngineConfig(model_dir="m").llm_kwargs()  # CPU: the KV cache size
    gpu8 = ROOT / "configs/ppo_gpu_8x.yaml"
    _, cfg, plan, _, _ = resolve(["ppo", "--config", str(gpu8)])
    assert plan.role("rollout").parallel.tp == 2 and plan.role("rollout").parallel.dp == 2
    assert role_init_kwargs(cfg, "rollout", "vllm", "m")["gpu_memory_utilization"] == 0.85
    data = yaml.safe_load(gpu8.read_text())  # the rollout on the training GPUs: 0.85 would starve them
    data["device_groups"] = {"nproc_per_node": 4, "all": {"device": "GPU", "ranks": 4,
                                                          "workers": ["actor", "critic", "reference", "rollout"]}}
    colocated = tmp_path / "colocated.yaml"
    colocated.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="shares with the rollout|set it to 0.5 or less"):
        resolve(["ppo", "--config", str(colocated)])
    _, _, plan, _, _ = resolve(["ppo", "--config", str(colocated), "--rollout.gpu_memory_utilization=0.3"])
    assert plan.role("rollout").group == plan.role("actor").group


def test_gpu_1x_and_2nodes_configs_pass_dry_run_with_their_layouts():
    from xray.train import resolve

    p, _ = run("ppo", "--dry-run", "--config", "configs/ppo_gpu_1x.yaml")
    assert p.returncode == 0, p.stderr
    assert "gpu_group      1 GPU in 1 pack of 1: each replica of rollout, actor, critic, reference" in p.stdout
    assert "rollout sleep: on" in p.stdout and "ranks count devices, they do not choose them" in p.stdout
    printed = yaml.safe_load(p.stdout.split("placement plan")[0])
    assert printed["model"]["dtype"] == "bfloat16" and printed["rollout"]["gpu_memory_utilization"] <= 0.5
    _, cfg, plan, _, _ = resolve(["ppo", "--config", str(ROOT / "configs/ppo_gpu_1x.yaml")])
    assert {r.group for r in plan.roles} == {"gpu_group"} and plan.role("rollout").device == "GPU"

    p, _ = run("ppo", "--dry-run", "--config", "configs/ppo_gpu_2nodes.yaml")
    assert p.returncode == 0, p.stderr
    assert "placement plan (backend megatron-vllm; 2 node(s) x 8 devices)" in p.stdout
    assert "rollout_group  8 GPU in 4 packs of 2: each replica of rollout inside one pack" in p.stdout
    assert "train_group    8 GPU in 4 packs of 2: each replica of actor, critic, reference inside one pack" in p.stdout
    assert "rollout sleep: off" in p.stdout
    _, cfg, plan, _, _ = resolve(["ppo", "--config", str(ROOT / "configs/ppo_gpu_2nodes.yaml")])
    for role in ("actor", "critic", "reference", "rollout"):
        placed = plan.role(role)
        assert (placed.parallel.tp, placed.parallel.dp, placed.num_workhorses) == (2, 4, 8)
        assert placed.packs == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert set(plan.role("actor").nodes) == {0} and set(plan.role("rollout").nodes) == {1}
    assert plan.role("actor").resources == (("xray_train_node", 1.0),)
    assert plan.role("rollout").resources == (("xray_rollout_node", 1.0),)


def test_a_1024_gpu_plan_reads_in_a_dozen_lines_and_an_elastic_one_shows_its_batch_rule(tmp_path):
    """configs/ppo_gpu_128nodes.yaml (1,024 GPUs: the trained roles tp8 pp4 dp16 on 512, the rollout
    tp8 dp64 on 512): ranks and nodes print as ranges, the config's ranks as `list(range(a, b))`
    (read back to the same plan), and the plan stays under 40 lines; made elastic, each size the
    group may take prints with its batch (DeepSpeed's rule: dp x micro x accumulation = global)."""
    from xray.train import resolve

    p, _ = run("ppo", "--dry-run", "--config", "configs/ppo_gpu_128nodes.yaml")
    assert p.returncode == 0, p.stderr
    config, plan = p.stdout.split("placement plan")
    assert len(("placement plan" + plan).strip().splitlines()) < 40, plan
    assert "actor     megatron  group=train_group    GPU ranks=0-511 nodes=0-63 workhorses=512 tp=8 pp=4 dp=16" in plan
    assert "rollout   vllm      group=rollout_group  GPU ranks=512-1023 nodes=64-127 workhorses=512 tp=8 pp=1 dp=64" \
        in plan
    assert "train_group    512 GPU in 64 packs of 8" in plan
    printed = yaml.safe_load(config)
    assert printed["device_groups"]["train_group"]["ranks"] == "list(range(0, 512))"
    again = tmp_path / "printed.yaml"
    again.write_text(config.split("\n", 1)[1])
    _, _, replan, _, _ = resolve(["ppo", "--config", str(again)])
    _, _, plan_of, _, _ = resolve(["ppo", "--config", str(ROOT / "configs/ppo_gpu_128nodes.yaml")])
    assert replan == plan_of

    printed["trainer"]["mode"] = "sync"
    printed["ppo"].update(rollout_batch_size=192, mini_batch_size=48)
    block = {"ignore_non_elastic_batch_info": True, "enabled": True, "max_train_batch_size": 48,
             "micro_batch_sizes": [4], "min_gpus": 128, "max_gpus": 512}
    for role in ("actor", "critic", "reference"):
        printed[role].update(tp=8, pp=16, dp=4, micro_batch_size=4)
    for role in ("actor", "critic"):
        printed[role]["elasticity"] = block
    elastic = tmp_path / "elastic.yaml"
    elastic.write_text(yaml.safe_dump(printed, sort_keys=False))
    p, _ = run("ppo", "--dry-run", "--config", str(elastic))
    assert p.returncode == 0, p.stderr
    plan = p.stdout.split("placement plan")[1]
    assert len(plan.strip().splitlines()) < 40, plan
    assert "elastic train_group (actor, critic, reference): 4 sizes in 128-512 devices" in plan, plan
    assert "128: 1 x 4 x 12 = 48 | 256: 2 x 4 x 6 = 48 | 384: 3 x 4 x 4 = 48 | 512: 4 x 4 x 3 = 48" in plan, plan


MS_SWIFT_GROUPS = ('{"nproc_per_node": 4, "sample_group": {"device": "CPU", "ranks": [0, 1], "workers": ["sampler"]}, '
                   '"rm_group": {"device": "CPU", "ranks": [2, 3], "workers": ["prm", "orm"]}}')


def test_device_groups_as_one_json_argument():
    """ms-swift's form: `--device_groups '<json>'` (a separate argument), as the README shows."""
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["sample", "--device_groups", MS_SWIFT_GROUPS, "--sample.prm_model=/x"])
    assert [(r.role, r.group, r.ranks) for r in plan.roles] == [
        ("sampler", "sample_group", (0, 1)), ("prm", "rm_group", (2, 3)), ("orm", "rm_group", (2, 3))]


def test_lora_plan_starts_no_reference_and_says_so():
    from xray.config import ConfigError
    from xray.train import resolve

    _, cfg, plan, _, _ = resolve(["ppo", "--actor.lora.rank=8"])  # the default groups still name the reference
    assert [r.role for r in plan.roles] == ["rollout", "actor", "critic"] and plan.lora_sync == "adapters"
    assert "no reference model starts" in plan.describe() and "the adapters alone" in plan.describe()
    _, _, plan, _, _ = resolve(["grpo", "--actor.lora.rank=8", "--backend", "deepspeed-dsinfer"])
    assert [r.role for r in plan.roles] == ["rollout", "actor"] and plan.lora_sync == "merged"
    _, _, plan, _, _ = resolve(["sft", "--actor.lora.rank=8"])
    assert plan.lora_sync is None and [r.role for r in plan.roles] == ["actor"]
    with pytest.raises(ConfigError, match="set trainer.mode=sync"):
        resolve(["ppo", "--actor.lora.rank=8", "--config", str(ROOT / "configs/ppo_async_2makers_1trainer.yaml")])
    with pytest.raises(ConfigError, match="remove reference.lora"):
        resolve(["ppo", "--reference.lora.rank=8"])


CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def command_of(config: Path) -> str:
    """The command a config is for, as its opening comment names it (`python -m xray.train grpo ...`)."""
    header = "".join(line for line in config.read_text().splitlines(keepends=True) if line.startswith("#"))
    found = re.search(r"xray\.train (\w+)", header)
    assert found, f"{config.name}: its opening comment names no `python -m xray.train <command>`"
    return found.group(1)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_config_passes_its_dry_run(config, capsys, monkeypatch):
    """Every file under configs/ passes `python -m xray.train <its command> --config FILE --dry-run`
    as it is (in-process: the command's own `main`), a model.path that is a placeholder included:
    the resolved config prints back with that path, then the plan of every role."""
    import xray.train

    monkeypatch.setattr(xray.train, "setup_console", lambda level: None)  # the suite's logging stays
    assert xray.train.main([command_of(config), "--config", str(config), "--dry-run"]) == 0, capsys.readouterr().err
    printed, plan = capsys.readouterr().out.split("placement plan")
    resolved = yaml.safe_load(printed)
    assert resolved["model"]["path"] == yaml.safe_load(config.read_text())["model"]["path"]
    assert "actor" in plan or "sampler" in plan, plan


def test_the_real_size_configs_train_real_lengths_at_a_real_learning_rate():
    """configs/grpo_gpu_1x.yaml, grpo_gpu_8x.yaml and ppo_gpu_8x.yaml: a model.path placeholder to
    replace, bf16, 512-token prompts and 1024-token responses, lr 1e-6, KL 0.001 (veRL's GSM8K)."""
    from xray.train import resolve

    assert len(CONFIGS) >= 13
    for name, command in (("grpo_gpu_1x", "grpo"), ("grpo_gpu_8x", "grpo"), ("ppo_gpu_8x", "ppo")):
        path = ROOT / f"configs/{name}.yaml"
        assert command_of(path) == command and "placeholder" in path.read_text()
        _, cfg, plan, _, _ = resolve([command, "--config", str(path)])
        assert cfg.model.path.startswith("/models/") and cfg.model.dtype == "bfloat16"
        assert (cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens) == (512, 1024)
        assert cfg.actor.optim.lr == 1e-6 and cfg.ppo.kl_coef == 0.001 and cfg.trainer.keep_last == 3
        assert cfg.ppo.rollout_batch_size * cfg.rollout.n_samples >= 512
        assert all(r.device == "GPU" for r in plan.roles)
