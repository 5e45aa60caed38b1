"""The run length shared by the multi-rank training tests and their one-rank reference, and the
loss comparison they use."""

STEPS = ["train.steps=6", "train.save_every=3", "train.log_every=1"]


def assert_close_losses(got: dict, ref: dict, steps, rel: float) -> None:
    for step in steps:
        assert abs(got[step] - ref[step]) <= rel * abs(ref[step]), (step, got[step], ref[step], rel)
