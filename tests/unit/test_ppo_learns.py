"""PPO's pure parts wired in a plain single-process loop on Hugging Face models (the algorithm the
engine distributes): a PPO step moves log-probs in the advantages' direction (fast), and on
`builtin:arith` a supervised warm start followed by PPO raises held-out accuracy (slow)."""
import copy
import random

import pytest
import torch

from algorithms.core.kl_control import FixedKLController
from algorithms.core.kl_estimators import kl_metrics
from algorithms.core.masked import whiten
from algorithms.core.policy_loss import PolicyLoss
from algorithms.core.rewards import kl_penalized_rewards
from algorithms.ppo.gae import gae
from algorithms.ppo.value_loss import ValueLoss
from xray.builtin.sources import load_prompt_splits
from xray.check.reference import token_logprobs
from xray.config.data import DataConfig
from xray.data import columns as C
from xray.data.prompts import PromptSampler
from xray.data.tokenizer import EOS_ID, PAD_ID, VOCAB_SIZE, build_char_tokenizer
from xray.builtin.tiny_llama import TinySpec, hf_config
from xray.rewards.loader import compute_scores, load_reward_function
from xray.builtin.tasks import get_task
from xray.data.sequences import pack_sequences
from xray.data.supervised import SFTLoss, sft_batch

pytestmark = pytest.mark.unit
SPEC = TinySpec(vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                num_kv_heads=4)


class Critic(torch.nn.Module):
    """A value model: the actor's trunk and a zero-initialised scalar head."""

    def __init__(self, actor):
        super().__init__()
        self.trunk = copy.deepcopy(actor.model)
        self.head = torch.nn.Linear(actor.config.hidden_size, 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, batch):
        h = self.trunk(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK]).last_hidden_state
        return self.head(h).squeeze(-1)[:, :-1]


def actor_model(seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(SPEC))


def logprobs(model, batch):
    out = model(input_ids=batch[C.INPUT_IDS], attention_mask=batch[C.ATTENTION_MASK])
    return token_logprobs(out.logits, batch[C.INPUT_IDS])


@torch.no_grad()
def sample(model, prompt_ids, greedy, max_new=4):
    """Responses (ending at EOS when produced) for prompts of different lengths, left-padded."""
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), PAD_ID)
    attn = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
    out = model.generate(input_ids=ids, attention_mask=attn, do_sample=not greedy, max_new_tokens=max_new,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID, top_k=None, top_p=None,
                         temperature=None if greedy else 1.0)
    responses = []
    for row in out[:, width:].tolist():
        cut = row.index(EOS_ID) + 1 if EOS_ID in row else len(row)
        responses.append(row[:cut] or [EOS_ID])
    return responses


def ppo_update(actor, critic, optims, batch, epochs=2, mini=32):
    metrics = []
    policy_loss, value_loss = PolicyLoss(cliprange=0.2), ValueLoss(cliprange_value=0.2, vf_coef=0.1)
    for _ in range(epochs):
        for mb in batch.chunks(mini):
            for model, fn, opt, key in ((actor, policy_loss, optims[0], C.LOGPROBS),
                                        (critic, value_loss, optims[1], C.VALUES)):
                out = {key: logprobs(model, mb) if key == C.LOGPROBS else model(mb)}
                loss, m = fn(out, mb)
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                metrics.append(m)
    return metrics


def experience(actor, ref, critic, batch, scores, kl_coef):
    """Old log-probs, reference log-probs, values, per-token rewards, advantages, returns."""
    with torch.no_grad():
        batch[C.OLD_LOGPROBS], batch[C.REF_LOGPROBS] = logprobs(actor, batch), logprobs(ref, batch)
        batch[C.OLD_VALUES] = critic(batch)
    mask = batch[C.LOSS_MASK]
    rewards = kl_penalized_rewards(batch[C.OLD_LOGPROBS], batch[C.REF_LOGPROBS], mask, scores, kl_coef)
    adv, batch[C.RETURNS] = gae(rewards, batch[C.OLD_VALUES], mask, gamma=1.0, lam=0.95)
    batch[C.ADVANTAGES] = whiten(adv, mask)
    return batch


def test_ppo_step_moves_logprobs_along_advantages():
    torch.manual_seed(0)
    actor = actor_model()
    ref, critic = copy.deepcopy(actor), Critic(actor)
    prompts = [[1, 4 + i % 10, 41, 4 + (i * 7) % 10, 45] for i in range(32)]
    responses = sample(actor, prompts, greedy=False)
    batch = pack_sequences(prompts, responses)
    scores = torch.tensor([1.0 if r[0] % 2 == 0 else 0.0 for r in responses])  # reward even first tokens
    assert 0 < scores.sum() < len(scores)
    batch = experience(actor, ref, critic, batch, scores, kl_coef=0.0)
    optims = (torch.optim.AdamW(actor.parameters(), lr=1e-3), torch.optim.AdamW(critic.parameters(), lr=1e-3))
    metrics = ppo_update(actor, critic, optims, batch, epochs=1, mini=16)
    assert metrics[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and metrics[0]["policy_clipfrac"] == 0.0
    with torch.no_grad():
        moved = (logprobs(actor, batch) - batch[C.OLD_LOGPROBS]) * batch[C.LOSS_MASK]
        first = moved[torch.arange(32), [len(p) - 1 for p in prompts]]   # the scored first response token
    assert first[scores == 1].mean() > 0.05 and first[scores == 0].mean() < -0.05
    assert critic(batch)[batch[C.LOSS_MASK] > 0].mean() > 0   # values move towards the positive returns


def accuracy(actor, prompts, reward_fn, tok):
    responses = sample(actor, prompts.prompt_ids, greedy=True)
    texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
    return float(compute_scores(reward_fn, prompts.prompts, texts, prompts.extras).scores.mean())


@pytest.mark.slow
def test_sft_then_ppo_raises_heldout_arith_accuracy(tmp_path):
    torch.manual_seed(0)
    tok, task = build_char_tokenizer(), get_task("builtin:arith")
    train, held = load_prompt_splits(DataConfig(path="builtin:arith"), tok, tmp_path)
    reward_fn = load_reward_function(task.reward_function)
    actor = actor_model()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-3, betas=(0.9, 0.95))
    rng = random.Random(0)
    for _ in range(170):                              # a partial warm start
        rows = train.select(rng.sample(range(len(train)), 64))
        mb = sft_batch(rows.prompt_ids, rows.extras[task.answer_field], tok)
        loss, _ = SFTLoss()({C.LOGPROBS: logprobs(actor, mb)}, mb)
        opt.zero_grad()
        loss.backward()
        opt.step()
    before = accuracy(actor, held, reward_fn, tok)
    ref, critic = copy.deepcopy(actor).eval(), Critic(actor)
    optims = (torch.optim.AdamW(actor.parameters(), lr=1e-4, betas=(0.9, 0.95)),
              torch.optim.AdamW(critic.parameters(), lr=1e-4, betas=(0.9, 0.95)))
    sampler, kl_ctl, rewards_seen = PromptSampler(len(train), 128, seed=0), FixedKLController(0.01), []
    for _ in range(40):
        rows = train.select(sampler.next_indices())
        responses = sample(actor, rows.prompt_ids, greedy=False)
        texts = [tok.decode(r, skip_special_tokens=True) for r in responses]
        scores = compute_scores(reward_fn, rows.prompts, texts, rows.extras, completion_ids=responses).scores
        batch = experience(actor, ref, critic, pack_sequences(rows.prompt_ids, responses), scores, kl_ctl.value)
        kl_ctl.update(kl_metrics(batch[C.OLD_LOGPROBS], batch[C.REF_LOGPROBS], batch[C.LOSS_MASK])["kl_sequence"],
                      len(rows))
        ppo_update(actor, critic, optims, batch)
        rewards_seen.append(float(scores.mean()))
    after = accuracy(actor, held, reward_fn, tok)
    print(f"eval_before={before:.3f} eval_after={after:.3f} reward {rewards_seen[0]:.3f} -> {rewards_seen[-1]:.3f}")
    assert 0.2 < before < 0.8
    assert after - before >= 0.15
