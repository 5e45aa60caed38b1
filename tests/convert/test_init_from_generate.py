"""train.init_from (weights only, step 0, fresh optimizer) from an HF folder, and generation."""

from __future__ import annotations

import torch

from convert_helpers import random_tiny, save_model
from k3train.convert.convert import export_hf, load_weights
from k3train.convert.dist_checkpoint import DistCheckpoint, write_model_checkpoint
from k3train.generate import generate, top_p_sample
from test_training_helpers import blocked_rows, drop_row_layout_marker, train


def test_init_from_hf_folder_loads_weights_at_step_zero(tmp_path):
    model = random_tiny(21)
    save_model(model, tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "hf", "bf16", progress=False)
    # lr = 1e-30: the one step leaves the fp32 weights bit-identical (the QB router bias still moves)
    proc = train(tmp_path / "run", "train.steps=1", "train.save_every=1", "optim.lr=1e-30", "logging.console=true",
                 f"train.init_from={tmp_path / 'hf'}")
    assert "initialised the model weights from" in proc.stdout
    saved = DistCheckpoint(tmp_path / "run")
    assert saved.path.name == "step_00000001" and saved.common["step"] == 1  # started at step 0
    assert saved.common["scheduler"]["last_epoch"] == 1
    sd = model.state_dict()
    names = [n for n in sd if not n.endswith("e_score_correction_bias")]
    got = saved.read_many([(n, tuple(sd[n].shape)) for n in names])
    for n in names:
        assert torch.equal(got[n], sd[n]), n
    # an existing checkpoint in out_dir wins over init_from (train.resume keeps its meaning)
    proc = train(tmp_path / "run", "train.steps=2", "train.save_every=0", "logging.console=true",
                 f"train.init_from={tmp_path / 'hf'}")
    assert "resumed from" in proc.stdout and "initialised" not in proc.stdout


def test_old_weights_only_checkpoint_reads_interleaved(tmp_path, capfd):
    """A weights-only checkpoint from before the experts' rows were interleaved (w13 stored [E, 2, I, ℓ]: gate
    rows, then up rows; no layout entry): the converters' reader and train.init_from interleave it, with a line
    saying so; today's format reads without one."""
    model = random_tiny(23)
    sd = model.state_dict()
    w13 = "layers.1.mlp.experts.w13"
    old = {n: blocked_rows(t) if n.endswith(".experts.w13") else t for n, t in sd.items()}
    write_model_checkpoint(tmp_path / "old", model.cfg, {n: (tuple(t.shape), t.dtype, lambda t=t: t)
                                                         for n, t in old.items()})
    drop_row_layout_marker(tmp_path / "old")
    assert DistCheckpoint(tmp_path / "old").stored[w13][0] == old[w13].shape
    save_model(model, tmp_path / "today")
    capfd.readouterr()
    for name in ("old", "today"):
        _, state = load_weights(tmp_path / name)
        assert state.keys() == sd.keys() and all(torch.equal(state[n], t) for n, t in sd.items()), name
        assert ("predates interleaved expert rows" in capfd.readouterr().err) == (name == "old")
    # lr = 1e-30: the one step leaves the fp32 weights bit-identical (the QB router bias still moves)
    proc = train(tmp_path / "run", "train.steps=1", "train.save_every=1", "optim.lr=1e-30",
                 f"train.init_from={tmp_path / 'old'}")
    assert "converting 8 blocked tensor(s)" in proc.stderr
    saved = DistCheckpoint(tmp_path / "run")
    assert not saved.blocked_rows and saved.stored[w13][0] == sd[w13].shape
    names = [n for n in sd if not n.endswith("e_score_correction_bias")]
    got = saved.read_many([(n, tuple(sd[n].shape)) for n in names])
    for n in names:
        assert torch.equal(got[n], sd[n]), n


def test_generate_greedy_and_top_p(tmp_path):
    model = random_tiny(22)
    save_model(model, tmp_path / "ours")
    cfg, state = load_weights(tmp_path / "ours")
    assert all(torch.equal(state[n], t) for n, t in model.state_dict().items())
    prompt = torch.randint(0, 512, (5,), generator=torch.Generator().manual_seed(0)).tolist()
    ids = generate(model, prompt, 6, greedy=True)
    assert ids[:5] == prompt and len(ids) == 11
    with torch.no_grad():  # greedy = argmax of the model's next-token logits, step by step
        for t in range(5, 11):
            assert ids[t] == int(model(torch.tensor([ids[:t]]))[0, -1].argmax())
    a = generate(model, prompt, 6, greedy=False, top_p=0.9, seed=1)
    assert a == generate(model, prompt, 6, greedy=False, top_p=0.9, seed=1)
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    g = torch.Generator().manual_seed(0)
    draws = {top_p_sample(logits, 0.5, 1.0, g) for _ in range(50)}
    assert draws == {1}  # token 1 alone holds >= 50% of the mass
    draws = {top_p_sample(logits, 0.99, 1.0, g) for _ in range(200)}
    assert draws == {1, 2}


def test_tiktoken_tokenizer_travels_and_generates(tmp_path, capsys):
    """A tiktoken.model + tokenizer_config.json in our checkpoint go out with to-hf and back with
    from-hf, and generate decodes with them (256 byte tokens + 256 specials = k3_tiny's 512 ids)."""
    import base64
    import json

    from k3train.convert.convert import import_hf
    from k3train.generate import find_tokenizer, main

    model = random_tiny(23)
    ours = save_model(model, tmp_path / "ours")
    order = torch.randperm(256, generator=torch.Generator().manual_seed(3)).tolist()
    (ours / "tiktoken.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {r}\n"
                                                 for r, b in enumerate(order)))
    (ours / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"257": {"content": "[EOS]"}}}))
    export_hf(ours, tmp_path / "hf", "bf16", progress=False)
    import_hf(tmp_path / "hf", tmp_path / "back", progress=False)
    for name in ("tiktoken.model", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (ours / name).read_bytes()
        assert (tmp_path / "back" / name).read_bytes() == (ours / name).read_bytes()
    tok = find_tokenizer(tmp_path / "back", None, 512)
    assert tok.path == str(tmp_path / "back" / "tiktoken.model") and (tok.vocab_size, tok.eod) == (512, 257)
    assert tok.encode("hé") == [order.index(b) for b in "hé".encode()]  # bytes only: one id per byte
    main(["--checkpoint", str(tmp_path / "back"), "--prompt", "hé", "--max-new-tokens", "3", "--greedy",
          "--device", "cpu"])
    prompt = tok.encode("hé")
    want = generate(model, prompt, 3, greedy=True, eod=tok.eod)
    assert capsys.readouterr().out == tok.decode(want) + "\n"
