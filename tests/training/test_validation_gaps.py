"""Issue 14 item 8: settings that used to pass start-up validation and fail later (or do nothing)."""

from __future__ import annotations

import pytest

from k3train.config.load import load_config
from k3train.config.validate import ConfigError, validate, validate_keys
from test_training_helpers import train


@pytest.mark.parametrize("overrides,needles", [
    (["train.exit_after_steps=-1"], ["train.exit_after_steps=-1", ">= 0"]),
    (["train.eval_iters=0"], ["train.eval_iters=0", "train.eval_every=0"]),
    (["optim.weight_decay=-0.1"], ["optim.weight_decay=-0.1", ">= 0"]),
    (["optim.qk_clip_tau=-1"], ["optim.qk_clip_tau=-1", ">= 0"]),
    (["data.split='100,0,0'", "train.eval_every=5"], ["data.split", "train.eval_every=0"]),
    (["train.max_consecutive_skips=-1"], ["train.max_consecutive_skips"]),
    (["train.loss_spike_factor=0.5"], ["train.loss_spike_factor"]),
    (["train.loss_spike_action=ignore"], ["train.loss_spike_action"]),
    (["train.collective_timeout_s=0"], ["train.collective_timeout_s=0", "positive"]),
    (["train.steps=10", "train.profile_steps=[3]"], ["train.profile_steps=[3]", "[first, last]"]),
    (["train.steps=10", "train.profile_steps=[5,3]"], ["train.profile_steps=[5, 3]"]),
    (["train.steps=10", "train.profile_steps=[9,11]"], ["train.profile_steps=[9, 11]", "train.steps=10"]),
    (["precision.expert_gemm=tiles:9"], ["precision.expert_gemm='tiles:9'", "tiles:<t>"]),
    (["precision.expert_gemm=cutlass:0", "train.device=cpu"], ["precision.expert_gemm=cutlass:0 on cpu", "CUDA only"]),
    (["precision.expert_gemm=tiles:1:3", "train.device=cpu"], ["precision.expert_gemm=tiles:1:3 on cpu"]),
])
def test_invalid_settings_are_refused_at_start_up(overrides, needles):
    cfg = load_config(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    msg = str(err.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, msg


def test_cutlass_expert_gemms_are_refused_under_expert_parallelism():
    with pytest.raises(ConfigError, match=r"precision.expert_gemm=tiles:1 with parallel.expert=2.*expert_gemm=torch"):
        validate(load_config(["precision.expert_gemm=tiles:1", "parallel.expert=2"]), world_size=2)


def test_valid_settings_pass():
    validate(load_config(["train.eval_iters=0", "train.eval_every=0", "data.split='100,0,0'",
                          "optim.weight_decay=0", "train.steps=10", "train.profile_steps=[10,10]",
                          "precision.expert_gemm=tiles:1", "train.device=cpu"]))


def test_unknown_key_is_refused_with_a_suggestion():
    from hydra import compose, initialize_config_dir

    from k3train.config.load import CONF_DIR, register_schema

    register_schema()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        raw = compose(config_name="config", overrides=["+train.save_evry=1"])
    with pytest.raises(ConfigError, match=r"train\.save_evry.*train\.save_every"):
        validate_keys(raw)


def test_typo_key_is_a_one_line_error_from_the_cli(tmp_path):
    proc = train(tmp_path, "train.steps=1", "+train.save_evry=1", check=False)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("k3train: config error:") and "train.save_evry" in last and "save_every" in last, last
    assert not (tmp_path / "metrics.jsonl").exists()
