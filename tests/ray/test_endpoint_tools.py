"""OpenAI function calling through the agent endpoint on the real pretrained model (SmolLM2-135M-Instruct
on a vLLM rollout): agent code written with the `openai` client, here and not in xray, sends
`tools`, reads `message.tool_calls`, runs the tool and answers with `role: tool` messages; once as
plain requests, once streamed (`stream=True`, the client assembling the chunks).

SmolLM2's own ChatML template ignores `tools`, so the run gives `configs/chat_templates/chatml_tools.jinja`
(`data.chat_template`): the schemas in the system turn, calls as `<tool_call>` blocks. Three
examples in the conversation (assistant messages with `tool_calls` and the tools' answers, in
history) make the greedy model call the tool itself. The episodes are played as a run plays an
`env.agent`'s (`AgentSamples.play`: the same samples a run trains on), and each trajectory is
token-exact: the prompt is the template's rendering of the first request (the tool schemas in it),
each model turn the engine's own ids for its history, each tool turn exactly the template's text
after the answer (the newline after `<|im_end|>` included) tokenized alone, out of the loss (mask 0,
log-prob 0); the actor's log-probs of the model tokens (the Hugging Face model) equal the
engine's within the sync tolerance, and one policy-gradient step on the batch moves them.
"""
import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.ray.test_episodes import Recording
from xray.data import columns as C

pytestmark = pytest.mark.ray

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "configs/chat_templates/chatml_tools.jinja"
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = [{"type": "function",
            "function": {"name": "get_weather", "description": "The weather in a city", "parameters": CITY}}]
REAL_FP32_PROBE = 1e-4
"""The actor's fp32 log-probs against the engine's on SmolLM2-135M (30 layers, width 576, vocabulary 49,152):
measured 2.2e-5 here and up to 5.8e-5 in the real-model recipe's runs (its sync probe), where the tiny
model's `FP32_PROBE` is 2e-5; the one policy-gradient step below moves them by more (a model one
step stale fails it)."""
SKIES = {"Rome": "sunny", "Berlin": "rainy", "Madrid": "windy", "Paris": "cloudy", "Tokyo": "snowy"}


def get_weather(city: str) -> str:
    """The agent's tool."""
    return SKIES.get(city, "foggy")


def examples() -> list[dict]:
    """Three solved questions: the user asks, the assistant calls, the tool answers, the assistant says."""
    out = []
    for i, city in enumerate(("Rome", "Berlin", "Madrid")):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        out += [{"role": "user", "content": f"What is the weather in {city}?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": get_weather(city)},
                {"role": "assistant", "content": f"It is {SKIES[city]} in {city}."}]
    return out


def weather_agent(row: dict, base_url: str) -> float:
    """Agent code as its author writes it with the `openai` client: ask with tools; while the model
    calls them, run each and answer with a `role: tool` message; the reward is 1 when it called
    `get_weather` for the asked city."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = examples() + [{"role": "user", "content": f"What is the weather in {row['city']}?"}]
    reward = 0.0
    for _ in range(2):
        if row["stream"]:
            with client.chat.completions.stream(model="policy", messages=messages, tools=WEATHER, max_tokens=40) as s:
                msg = s.get_final_completion().choices[0].message
        else:
            msg = client.chat.completions.create(model="policy", messages=messages, tools=WEATHER,
                                                 max_tokens=40).choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            arguments = json.loads(call.function.arguments)
            reward = float(call.function.name == "get_weather" and arguments.get("city") == row["city"])
            answer = get_weather(arguments.get("city", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    client.close()
    return reward


@pytest.fixture(scope="module")
def smollm2_engines(smollm2, local_ray):
    from transformers import AutoTokenizer

    from xray.wholemodel import WholeModel

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    rollout = WholeModel.from_pretrained(str(smollm2), backend="vllm", max_model_len=1024, kv_cache_gib=1)
    actor = WholeModel.from_pretrained(str(smollm2), backend="hf")
    try:
        yield tokenizer, rollout, actor
    finally:
        rollout.shutdown()
        actor.shutdown()


def test_an_openai_function_calling_agent_on_smollm2_is_token_exact(smollm2_engines):
    from xray.config.data import DataConfig
    from xray.config.env import EnvConfig
    from xray.data.trajectory import pack_trajectories
    from xray.run.episodes.agents import AgentSamples
    from xray.run.episodes.tool_calls import tool_parser

    tokenizer, rollout, actor = smollm2_engines
    recording = Recording(rollout)
    eos = tokenizer.eos_token_id
    cfg = SimpleNamespace(env=EnvConfig(agent="tests.ray.test_endpoint_tools:weather_agent", max_turns=2,
                                        max_turn_tokens=40, max_tokens=160, timeout_s=300),
                          trainer=SimpleNamespace(agent_endpoint="127.0.0.1:0"),
                          data=DataConfig(chat_template=str(TEMPLATE)))
    samples = AgentSamples(cfg, recording, tokenizer, pad_id=eos)
    rows = [{"city": city, "stream": stream} for city in ("Paris", "Tokyo") for stream in (False, True)]

    async def play():
        try:
            return await samples.play(rows, dict(temperature=0.0, seed=3, stop_token_ids=[eos]))
        finally:
            await samples.close()

    batch = asyncio.run(play())
    trajectories = samples.last
    assert samples.keep is None, [t.detail for t in trajectories]  # every episode ran and asked

    question = lambda city: examples() + [{"role": "user", "content": f"What is the weather in {city}?"}]  # noqa: E731
    engine: dict = {}
    for _, _, prompts, answers, logprobs in recording.calls:
        for p, r, lp in zip(prompts, answers, logprobs):
            engine.setdefault(tuple(p), []).append((r, lp))
    parser, called = tool_parser("hermes"), 0
    for row, t in zip(rows, trajectories):
        prompt = tokenizer.apply_chat_template(question(row["city"]), tools=WEATHER, chat_template=TEMPLATE.read_text(),
                                               tokenize=False, add_generation_prompt=True)
        assert t.prompt_ids == tokenizer(prompt, add_special_tokens=False).input_ids
        assert "<tools>\n" + json.dumps(WEATHER[0]) in tokenizer.decode(t.prompt_ids)  # the schema reached the model
        assert t.end == "done" and len(t.logprobs) == len(t.mask) == len(t.tokens)
        for k, (s, e) in enumerate(t.turns):
            turn = (t.tokens[s:e], t.logprobs[s:e])
            assert turn in [(r[:e - s], lp[:e - s]) for r, lp in engine[tuple(t.prompt_ids + t.tokens[:s])]]
            assert set(t.mask[s:e]) == {1}
            after = t.turns[k + 1][0] if k + 1 < len(t.turns) else len(t.tokens)
            if after == e:
                continue
            calls = parser.parse(tokenizer.decode(t.tokens[s:e], skip_special_tokens=True)).calls
            assert calls, tokenizer.decode(t.tokens[s:e])  # only a tool call is answered
            responses = "".join(f"\n<tool_response>\n{get_weather(json.loads(c.arguments)['city'])}\n</tool_response>"
                                for c in calls)
            closing = "" if t.tokens[e - 1] == eos else "<|im_end|>"  # the turn's end: the engine's, or the template's
            expected = f"{closing}\n<|im_start|>user{responses}<|im_end|>\n<|im_start|>assistant\n"
            assert t.tokens[e:after] == tokenizer(expected, add_special_tokens=False).input_ids
            assert set(t.mask[e:after]) == {0} and set(t.logprobs[e:after]) == {0.0}
            called += 1
    assert called >= 2, [tokenizer.decode(t.tokens) for t in trajectories]  # the greedy model called the tool
    assert [t.score for t in trajectories] == [1.0 if len(t.turns) > 1 else 0.0 for t in trajectories]
    for plain, streamed in (trajectories[:2], trajectories[2:]):  # greedy, same prompts: the same episode
        assert plain.tokens == streamed.tokens and plain.mask == streamed.mask

    # the samples a run trains on: the loss mask is the model's tokens, the actor agrees with the engine
    assert batch[C.LOSS_MASK].sum().item() == sum(sum(t.mask) for t in trajectories)
    packed = pack_trajectories(trajectories, pad_id=eos)
    assert packed[C.LOSS_MASK].tolist() == batch[C.LOSS_MASK].tolist()
    logprobs = actor.forward(batch).get()[C.LOGPROBS]
    mask = batch[C.LOSS_MASK]
    gap = ((logprobs - batch[C.BEHAVIOUR_LOGPROBS]).abs() * mask).max().item()
    assert gap <= REAL_FP32_PROBE, gap
    # and trained on: one policy-gradient update (each episode's reward against a 0.5 baseline) moves
    # the model's log-probs of its own tokens (the plain episodes: the streamed ones are the same)
    part, mask = batch.index([0, 2]), mask[[0, 2]]
    advantages = (part[C.SCORES] - 0.5)[:, None] * mask
    metrics = actor.train_step({C.INPUT_IDS: part[C.INPUT_IDS], C.ATTENTION_MASK: part[C.ATTENTION_MASK],
                                C.LOSS_MASK: mask, C.ADVANTAGES: advantages}, policy_gradient).get()
    assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0, metrics
    moved = actor.forward(part).get()[C.LOGPROBS]
    assert ((moved - logprobs[[0, 2]]).abs() * mask).max().item() > REAL_FP32_PROBE


def policy_gradient(outputs, batch):
    """REINFORCE's loss on the model's tokens (the loss mask), as a run's algorithm would give it."""
    mask = batch[C.LOSS_MASK]
    return -(outputs[C.LOGPROBS] * batch[C.ADVANTAGES] * mask).sum() / mask.sum()
