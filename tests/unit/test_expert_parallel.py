"""Expert parallelism's pure pieces: the layout (`ParallelDims.ep`), which rank holds which expert
(`convert.stage_entries`, the export's sources), the padding of micro-batches to their
expert-parallel peers' shapes (`megatron/experts.py`), the MoE config section and the plan's checks."""
import pytest
import torch

from tests.unit.test_config import DEFAULT, groups
from xray.backends.expert_names import bucketed, moe_block_of
from xray.backends.megatron.convert import stage_entries
from xray.backends.megatron.experts import _padded, shape_of, uneven
from xray.backends.megatron.export import Planned, _source, _sends_for
from xray.config import ConfigError, load_config
from xray.config.moe import MoeConfig, MoeConfigError
from xray.config.parallel import LayoutError, ParallelDims
from xray.config.plan import plan_run
from xray.data import columns as C
from xray.data.batch import Batch
from algorithms.specs import command_spec

pytestmark = pytest.mark.unit


def _spec(experts: int = 4):
    from xray.backends.megatron.spec import ModelSpec

    return ModelSpec(architecture="Qwen3MoeForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=32,
                     num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=1e4,
                     max_position_embeddings=64, tie_word_embeddings=False, qkv_bias=False, qk_norm=True,
                     num_experts=experts, experts_per_token=2, moe_intermediate_size=8)


def test_ep_divides_dp_and_the_experts():
    with pytest.raises(LayoutError, match="ep=3 does not divide dp=4"):
        ParallelDims(dp=4, ep=3)
    with pytest.raises(LayoutError, match="ep=4 does not divide the model's 6 experts"):
        ParallelDims(dp=4, ep=4).check_experts(6)
    with pytest.raises(LayoutError, match="ep=2 on a dense model"):
        ParallelDims(dp=2, ep=2).check_experts(0)
    d = ParallelDims(dp=4, ep=2)
    assert d.world_size == 4  # ep splits the replicas; it adds no ranks
    # replica 3's expert-parallel group is replicas 2 and 3: experts 0-3 on 2, 4-7 on 3
    assert [d.expert_owner(3, e, 8) for e in range(8)] == [2, 2, 2, 2, 3, 3, 3, 3]


def test_each_rank_holds_its_share_of_the_experts_under_local_names():
    spec = _spec()
    experts = [e for e in stage_entries(spec, 0, 1, ep=2, ep_rank=1) if e.expert is not None]
    assert sorted({e.expert for e in experts}) == [2, 3]
    names = {e.megatron_name.split("local_experts.")[1].split(".")[0] for e in experts}
    assert names == {"0", "1"}  # local indices
    assert {e.hf_names[0] for e in experts if e.megatron_name.endswith("linear_fc2.weight")} == \
        {f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" for layer in (0, 1) for e in (2, 3)}
    everything = stage_entries(spec, 0, 1, ep=2)  # the export's plan: all experts
    assert len([e for e in everything if e.expert is not None]) == 2 * 4 * 2
    assert len(stage_entries(spec, 0, 1)) == len(everything)


def test_the_export_gathers_experts_from_the_replicas_peers():
    spec, d = _spec(), ParallelDims(dp=4, ep=2)
    entries = stage_entries(spec, 0, 1, ep=2)
    router = next(e for e in entries if e.megatron_name.endswith("router.weight"))
    expert3 = next(e for e in entries if e.expert == 3)
    assert _source(Planned(0, router), spec, d, replica=2) == (0, 2)
    assert _source(Planned(0, expert3), spec, d, replica=2) == (0, 3)
    assert _source(Planned(0, expert3), spec, d, replica=0) == (0, 1)
    assert [_sends_for(d.coords(r), d, replica=2) for r in range(4)] == [False, False, True, True]


def test_micro_batches_pad_to_their_peers_shapes_and_cut_back():
    mb = Batch({C.INPUT_IDS: torch.arange(6).reshape(2, 3) + 1, C.ATTENTION_MASK: torch.ones(2, 3, dtype=torch.long),
                C.LOSS_MASK: torch.ones(2, 2), "advantages": torch.ones(2)})
    out = _padded(mb, 4, 5)
    assert shape_of(out) == (4, 5) and out[C.LOSS_MASK].shape == (4, 4) and out["advantages"].shape == (4,)
    assert out[C.ATTENTION_MASK].sum() == 6 and out[C.LOSS_MASK].sum() == 4  # nothing new is attended or scored
    assert torch.equal(out[C.INPUT_IDS][:2, :3], mb[C.INPUT_IDS])
    stored = [{C.LOGPROBS: torch.randn(4, 4)}]
    assert uneven(stored, [(2, 3)])[0][C.LOGPROBS].shape == (2, 2)


def test_moe_options_and_expert_parallelism_in_the_plan():
    with pytest.raises(MoeConfigError, match="needs a positive weight"):
        MoeConfig("aux_loss", 0.0)
    with pytest.raises(MoeConfigError, match="choose one of"):
        MoeConfig("sinkhorn", 0.1)
    base = groups() + [("actor.ep", 2)]
    plan = plan_run(load_config(DEFAULT, base), "megatron-vllm", command_spec("ppo"))
    assert plan.role("actor").parallel.ep == 2 and "dp=2 ep=2" in plan.describe()
    with pytest.raises(ConfigError, match="expert parallelism runs on Megatron"):
        plan_run(load_config(DEFAULT, base), "deepspeed-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="actor.ep=2 with actor.packing"):
        plan_run(load_config(DEFAULT, base + [("actor.packing", True)]), "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="Model Runner V2"):
        plan_run(load_config(DEFAULT, groups() + [("actor.moe.routing_replay", True)]), "megatron-vllm", command_spec("ppo"))
    with pytest.raises(ConfigError, match="seq_aux_loss is Megatron's"):
        plan_run(load_config(DEFAULT, groups() + [("actor.moe", {"load_balancing": "seq_aux_loss",
                                                                   "aux_loss_coef": 0.01})]), "deepspeed-vllm", command_spec("ppo"))



def test_exports_keep_each_moe_block_in_one_bucket():
    from xray.backends.megatron.export import plan_buckets

    spec = _spec()
    for parallel in (ParallelDims(), ParallelDims(dp=2, ep=2), ParallelDims(pp=2)):
        buckets = plan_buckets(spec, parallel, critic=False, bucket_bytes=1000)  # smaller than one expert
        blocks = [{moe_block_of(p.entry.hf_names[0]) for p in b} - {None} for b in buckets]
        for layer in range(spec.num_layers):
            block = f"model.layers.{layer}.mlp"
            assert sum(block in b for b in blocks) == 1, (parallel, layer)  # its router and 4 experts: one bucket
        assert sum(len(b) for b in buckets) == len([e for s in range(parallel.pp)
                                                    for e in stage_entries(spec, s, parallel.pp, ep=parallel.ep)])
    names = ["model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj",
             "model.layers.0.mlp.experts.down_proj", "model.layers.0.input_layernorm.weight",
             "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.gate_up_proj"]
    cut = bucketed(names, str, lambda n: 100, bucket_bytes=250)
    assert cut == [names[:1], names[1:4], names[4:5], names[5:]]  # blocks whole, larger than a bucket or not


def test_routing_replay_where_the_rollout_reports_routing():
    train = {"device": "GPU", "ranks": [0, 1], "workers": ["actor", "reference"]}
    base = groups(train=train) + [("actor.moe.routing_replay", True), ("rollout.n_samples", 4)]
    plan_run(load_config(DEFAULT, base), "megatron-dsinfer", command_spec("grpo"))
    for backend, algo, extra, match in [("megatron-vllm", "grpo", [], "Model Runner V2"),
                                        ("megatron-dsinfer", "ppo", [("device_groups.train.workers",
                                                                      ["actor", "critic", "reference"])],
                                         "critic-free commands only"),
                                        ("megatron-dsinfer", "grpo", [("trainer.mode", "async")], "trainer.mode async"),
                                        ("megatron-dsinfer", "grpo", [("critic.moe.routing_replay", True)],
                                         "set it on actor.moe only")]:
        with pytest.raises(ConfigError, match=match):
            plan_run(load_config(DEFAULT, base + extra), backend, command_spec(algo))


def test_the_routing_column_lies_with_the_model_inputs():
    from xray.data.sequences import pack_sequences

    rows = [torch.full((4, 2, 2), 3, dtype=torch.int16), torch.full((2, 2, 2), 5, dtype=torch.int16)]
    packed = pack_sequences([[1, 2], [1]], [[7, 8, 9], [4, 2]], routed_experts=rows)
    routing = packed[C.ROUTED_EXPERTS]
    assert routing.shape == (2, 5, 2, 2) and routing.dtype == torch.int16
    assert (routing[0, :4] == 3).all() and (routing[1, :2] == 5).all()
    assert routing[0, 4].tolist() == [[0, 1], [0, 1]] and routing[1, 2:].flatten().tolist() == [0, 1] * 6
