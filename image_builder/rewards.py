"""verl's reward functions where scripts find them: `custom_reward_function.path=` this file,
`name=compute_score` (any manager), `compute_score_batch` (the batch manager) or `compute_score_async`
(the reward loop); graders/rewards.py has the code and its documentation. verl loads the file by its
path, outside any package: absolute imports only, and the functions stay graders.rewards' (verl's prime
manager pickles them by that name into its worker processes)."""

from image_builder.graders.rewards import (INSTANCE_ENV, OPTIONS_ENV, STORE_ENV, Reward, compute_score,
                                           compute_score_async, compute_score_batch)

__all__ = ["INSTANCE_ENV", "OPTIONS_ENV", "STORE_ENV", "Reward", "compute_score", "compute_score_async",
           "compute_score_batch"]
