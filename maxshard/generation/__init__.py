"""Sampling: the KV-cached prefill/decode engine (decode), fewer rows than prompts with finished rows refilled
(refill), token sampling (sampling), finding and restoring a run's parameters for inference (inference), and
GRPO's rollouts (rollouts), their multi-turn episodes with a user's environment (environments) and reward models as
rewards (reward_model). The CLI is `maxshard.generate`."""
