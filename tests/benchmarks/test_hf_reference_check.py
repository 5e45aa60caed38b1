"""benchmarks/hf_reference_check.py on CPU (k3_tiny, 16 tokens): the export and the reference agree
with our model in fp32, the bf16 runs really round, the JSON and the table are written, and the
gates decide as the docstring says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import hf_reference_check  # noqa: E402

SMOKE = ["--model", "k3_tiny", "--device", "cpu", "--seq", "16"]


def test_tiny_spread_mxfp4(tmp_path, capsys):
    out = tmp_path / "check.json"
    (row,) = hf_reference_check.main(SMOKE + ["--weights", "spread", "--experts", "mxfp4", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == [row]
    p = row["pairs"]
    assert p["ours32~ref32"]["cosine"] > 1 - 1e-9 and p["ours32~ref32"]["max_pos_rel_err"] < 1e-4
    assert p["ours32~ref32"]["top1_agree"] == 1.0
    for name in ("ours16~ref16", "ref16~ref32", "ours16~ref32"):  # bf16 rounds, but stays close
        assert 0.99 < p[name]["cosine"] < 1 - 1e-7 and p[name]["rel_err"] > 1e-4
    floor = 1 - p["ref16~ref32"]["cosine"]
    assert row["floor_ratio"] == pytest.approx((1 - p["ours16~ref32"]["cosine"]) / floor)
    assert row["passed"]
    printed = capsys.readouterr().out
    assert "spread" in printed and "ours16~ref16" in printed and "floor" in printed


def pairs(ours16_ref16: float, ref16_ref32: float, ours16_ref32: float) -> dict:
    return {"ours32~ref32": {"cosine": 1.0}, "ours16~ref16": {"cosine": ours16_ref16},
            "ref16~ref32": {"cosine": ref16_ref32}, "ours16~ref32": {"cosine": ours16_ref32}}


def test_gates():
    # The floor allows the bar: it applies, and so does the ratio.
    g = hf_reference_check.gates(pairs(0.99995, 0.99998, 0.99996), 0.9999, 4.0)
    assert g["floor_allows_bar"] and g["bar_ok"] and g["floor_ratio"] == pytest.approx(2.0) and g["passed"]
    assert not hf_reference_check.gates(pairs(0.99985, 0.99998, 0.99996), 0.9999, 4.0)["passed"]  # bar missed
    assert not hf_reference_check.gates(pairs(0.99995, 0.99998, 0.99990), 0.9999, 4.0)["passed"]  # ratio 5
    # The floor is below the bar: the bar is not applied, the ratio decides.
    g = hf_reference_check.gates(pairs(0.999, 0.9995, 0.999), 0.9999, 4.0)
    assert g["bar_ok"] is None and g["passed"]
    assert not hf_reference_check.gates(pairs(0.999, 0.9995, 0.99), 0.9999, 4.0)["passed"]


def test_failed_gate_exits_nonzero(tmp_path, monkeypatch):
    monkeypatch.setattr(hf_reference_check, "check", lambda weights, args, device: {
        "weights": weights, "pairs": {}, "floor_ratio": 9.0, "floor_ratio_ok": False, "bar_ok": None,
        "passed": False})
    monkeypatch.setattr(hf_reference_check, "print_table", lambda *a: None)
    with pytest.raises(SystemExit, match="gate failed for weights init"):
        hf_reference_check.main(SMOKE + ["--weights", "init", "--json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["rows"][0]["floor_ratio"] == 9.0


def test_corpus_batch_is_corpus_text_with_document_positions():
    eod = 0  # the default corpus's end-of-document id
    for seed in range(30):  # documents average ~8K tokens: find a window that crosses a document end
        tokens, pos = hf_reference_check.corpus_batch(2, 4096, 163840, seed=seed)
        after_eod = tokens[:, :-1] == eod
        if bool(after_eod.any()):
            break
    else:
        pytest.fail("no 8,192-token window of 30 crossed a document end")
    assert tokens.shape == pos.shape == (2, 4096) and 0 <= int(tokens.min()) and int(tokens.max()) < 512
    assert len(set(tokens.flatten().tolist())) > 100  # text, not one repeated id
    assert torch.equal(pos[:, 1:], torch.where(after_eod, 0, pos[:, :-1] + 1)) and bool((pos[:, 0] == 0).all())
