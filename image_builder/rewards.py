"""verl's reward function where scripts find it: `custom_reward_function.path=` this
file, `name=compute_score` (graders/rewards.py has the code and its documentation).
verl loads the file by its path, outside any package: absolute imports only."""

from image_builder.graders.rewards import INSTANCE_ENV, OPTIONS_ENV, STORE_ENV, compute_score

__all__ = ["INSTANCE_ENV", "OPTIONS_ENV", "STORE_ENV", "compute_score"]
