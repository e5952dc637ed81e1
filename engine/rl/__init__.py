"""The RL half: data, models, rollout, rewards, buffer, algorithms, DeepSpeed workers, the trainer."""
