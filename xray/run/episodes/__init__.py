"""Multi-turn rollouts: the episode `runner` (turns batched on the rollout engine), the step's
episode `samples` (an environment's episodes), `agents` (user agent functions driving the model
through the OpenAI-compatible `endpoint`: its wire format `openai_messages` and `sse`, the
`tool_calls` parsers). The runner and the endpoint render new turns in the model's chat format with
`xray/data/chat_delta.py`.
"""
