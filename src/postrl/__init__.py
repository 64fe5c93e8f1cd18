"""postrl: reinforcement-learning post-training (GRPO, DAPO) of language and vision-language models."""

__version__ = "0.1.0"
