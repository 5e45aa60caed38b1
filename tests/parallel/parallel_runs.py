"""The run length shared by the multi-rank training tests and their one-rank reference."""

STEPS = ["train.steps=6", "train.save_every=3", "train.log_every=1"]
