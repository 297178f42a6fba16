"""Multi-turn rollouts: the episode `runner` (turns batched on the rollout engine), the step's
episode `samples` (an environment's episodes), `agents` (user agent functions driving the model
through the OpenAI-compatible `endpoint`).
"""
