"""benchmarks/hf_reference_check.py on CPU in fp32 (k3_tiny, 32 tokens): the export and the
reference agree with our model, the JSON is written, and a cosine under the bar exits non-zero."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import hf_reference_check  # noqa: E402

SMOKE = ["--model", "k3_tiny", "--device", "cpu", "--dtype", "fp32", "--seq", "32"]


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_tiny_fp32_matches_reference(tmp_path, capsys, experts):
    out = tmp_path / "check.json"
    row = hf_reference_check.main(SMOKE + ["--experts", experts, "--json", str(out)])
    assert json.loads(out.read_text()) == row
    assert row["cosine"] > 1 - 1e-9 and row["max_pos_rel_err"] < 1e-4 and row["top1_agree"] == 1.0
    assert "k3_tiny" in capsys.readouterr().out


def test_below_min_cosine_exits_nonzero(tmp_path):
    with pytest.raises(SystemExit, match="min-cosine"):
        hf_reference_check.main(SMOKE + ["--min-cosine", "1.5", "--json", str(tmp_path / "c.json")])
