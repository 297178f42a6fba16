"""Column names of the Batch that flows between the algorithm and the WholeModels, with shapes.

`B` is the number of sequences, `T` the padded sequence length (prompt + response), `R` the padded
response length. Token positions are left-aligned: padding sits at the right end of each row.
"""

INPUT_IDS = "input_ids"            # [B, T] long: prompt followed by response tokens
ATTENTION_MASK = "attention_mask"  # [B, T] long: 1 on real tokens, 0 on padding
LOSS_MASK = "loss_mask"            # [B, T-1] float: 1 where token t+1 is a response token to train on
LOGPROBS = "logprobs"              # [B, T-1] float: log p(token t+1 | tokens <= t) under the actor
REF_LOGPROBS = "ref_logprobs"      # [B, T-1] float: the same under the reference model
TEACHER_LOGPROBS = "teacher_logprobs"  # [B, T-1] float: the same under on-policy distillation's teacher
OLD_LOGPROBS = "old_logprobs"      # [B, T-1] float: the actor's log-probs when the rollout was scored
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # [B, T-1] float: the rollout engine's log-probs of its samples
BEHAVIOUR_VERSIONS = "behaviour_versions"  # [B, T-1] int32: the weight version that sampled token t+1
VALUES = "values"                  # [B, T-1] float: critic value at position t (predicting token t+1)
OLD_VALUES = "old_values"          # [B, T-1] float: critic values when the rollout was scored
ADVANTAGES = "advantages"          # [B, T-1] float
RETURNS = "returns"                # [B, T-1] float
ENTROPY = "entropy"                # [B, T-1] float: entropy of the actor's next-token distribution
PROMPT_IDS = "prompt_ids"          # list of B lists of int
RESPONSE_IDS = "response_ids"      # list of B lists of int
SCORES = "scores"                  # [B] float: the reward model's or function's score per sequence
ROUTED_EXPERTS = "routed_experts"  # [B, T, L, K] int16: the K experts the rollout engine routed token t to
                                   # in each of the L MoE layers (routing replay; the last token: any)

MODEL_INPUTS = (INPUT_IDS, ATTENTION_MASK)  # what a forward reads
