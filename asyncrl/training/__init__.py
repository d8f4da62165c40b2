"""The training core the Trainer role runs: the Learner (one train step over a step's groups), the batch
it builds, PPO's critic and the reference policy. Plain torch, no roles, no Ray."""
