"""Importing Kog's releases computes exactly what Kog's code computes, and exports are readable by it.

The reference is ``kog_reference``: Kog's two forward passes written from
their description in plain torch, independent of ``models/``. Tiny models
with random weights are saved in the released layout, imported with
``convert from-hf``, and their logits compared in fp32 (max abs diff <= 1e-5).
"""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from models.laneformer import read_native_config
from models.laneformer.attention import DenseMaskFlexAttention
from models.laneformer.convert import main as convert_main
from models.laneformer.hf.checkpoint_io import load_dcp
from models.laneformer.hf.export import export_hf
from models.laneformer.model import Laneformer
from rundir import REPO
from tests.models import kog_reference as kog

TOL = 1e-5
SEQ = 24  # longer than the window below


def tp_config(**keys) -> dict:
    """A small laneformer_tp config.json: 8 lanes, 16/8 heads of 8, 4 layers, delay 2, window 8 on 2 layers."""
    return {
        "model_type": "laneformer_tp", "architectures": ["LaneformerTPForCausalLM"],
        "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 8,
        "intermediate_size": 256, "vocab_size": 256, "max_position_embeddings": 64, "rope_theta": 10000.0,
        "norm_eps": 1e-5, "num_lanes": 8, "broadcast_delay": 2, "use_comm": True, "use_early_comm": True,
        "lm_head_type": "replicate", "pre_norm_lane_agg": False, "replicated_rmsn_scale": True,
        "tie_word_embeddings": False, "sliding_window": 8, "sliding_window_n_layers": 2,
        "multiple_of": 32, "depth_init": True, "eos_token_id": 2, "torch_dtype": "float32",
        **keys,
    }


def tokens(vocab, batch=2, seed=1):
    return torch.randint(0, vocab, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def native_logits(folder, x):
    config = read_native_config(folder)
    model = Laneformer(dataclasses.replace(config, inner_attention=DenseMaskFlexAttention.Config())).eval()
    model.load_state_dict(load_dcp(folder, config))
    with torch.no_grad():
        return model(x)


def import_and_compare(tmp_path, cfg, newer=False, seed=0, extra_args=()):
    weights = kog.random_weights(cfg, seed)
    kog.save_release(tmp_path / "release", cfg, weights)
    convert_main(["from-hf", str(tmp_path / "release"), str(tmp_path / "dcp"), *extra_args])
    x = tokens(kog._get(cfg, "vocab_size"))
    with torch.no_grad():
        expected = kog.forward(cfg, weights, x, newer=newer)
    return (native_logits(tmp_path / "dcp", x) - expected).abs().max().item()


TP_VARIANTS = {
    "early_comm_on": {},
    "early_comm_off": {"use_early_comm": False},
    "pre_norm_lane_agg": {"pre_norm_lane_agg": True},
    "delay1": {"broadcast_delay": 1},
    "delay3_7layers": {"broadcast_delay": 3, "num_hidden_layers": 7},
    "3layers_delay2": {"num_hidden_layers": 3},
    "5layers_delay3": {"broadcast_delay": 3, "num_hidden_layers": 5},
    "1layer_delay2": {"num_hidden_layers": 1, "sliding_window_n_layers": 1},
    "use_comm_false": {"use_comm": False},
    "use_comm_false_early_off": {"use_comm": False, "use_early_comm": False},
    "unclamped_layers": {"sliding_window_n_layers": 4, "unclamped_layers": [1, 2]},
    "negative_window_layers": {"sliding_window_n_layers": -2},
    "window_layers_beyond_n": {"sliding_window_n_layers": -9, "unclamped_layers": [0]},
    "no_window": {"sliding_window": None, "sliding_window_n_layers": 0},
    "heads_8_8": {"num_attention_heads": 8, "num_key_value_heads": 8},
    "heads_16_16": {"num_attention_heads": 16, "num_key_value_heads": 16},
    "kv_absent": {"num_key_value_heads": None},
    "tied_embeddings": {"tie_word_embeddings": True},
    "head_dim_key_ignored": {"head_dim": 32},  # laneformer_tp computes hidden_size // heads = 8
}


@pytest.mark.parametrize("keys", TP_VARIANTS.values(), ids=TP_VARIANTS.keys())
def test_laneformer_tp_imports_with_the_same_logits(tmp_path, keys, capsys):
    assert import_and_compare(tmp_path, tp_config(**keys)) <= TOL
    assert "read as: laneformer_tp" in capsys.readouterr().out


def test_laneformer_tp_absent_keys_take_its_own_defaults(tmp_path, capsys):
    """No broadcast_delay, use_comm, use_early_comm, ...: LaneformerTPConfig's defaults (delay 1), not ours (2)."""
    cfg = tp_config()
    for key in ("broadcast_delay", "use_comm", "use_early_comm", "pre_norm_lane_agg", "lm_head_type",
                "replicated_rmsn_scale", "tie_word_embeddings", "sliding_window_n_layers"):
        del cfg[key]
    assert import_and_compare(tmp_path, cfg) <= TOL
    out = capsys.readouterr().out
    assert "delay = 1  <- broadcast_delay absent: default 1" in out
    assert "early_send_forward = True" in out and "keys ignored (no effect on the logits): architectures" in out


def test_the_variants_compute_different_functions():
    """Each key above moves the logits, so matching them is not a coincidence of defaults."""
    base_cfg = tp_config()
    weights = kog.random_weights(base_cfg)
    x = tokens(256)
    base = kog.forward(base_cfg, weights, x)
    for name in ("early_comm_off", "pre_norm_lane_agg", "delay1", "use_comm_false", "unclamped_layers",
                 "negative_window_layers"):
        other = kog.forward(tp_config(**TP_VARIANTS[name]), weights, x)
        assert (other - base).abs().max() > 1e-2, name
    # Sending the early layers forward matters: the newer code's rule gives other logits.
    assert (kog.forward(base_cfg, weights, x, newer=True) - base).abs().max() > 1e-2
    # So does dropping, not flushing, the last layers' sends when there are fewer layers than 2 x delay.
    short = tp_config(num_hidden_layers=3)
    short_w = kog.random_weights(short)
    native = Laneformer(Laneformer.Config(
        dim=128, n_layers=3, n_heads=16, n_kv_heads=8, head_dim=8, ffn_hidden_dim=256, vocab_size=256,
        max_seq_len=64, n_lanes=8, delay=2, early_send_forward=True, late_mode="flush", window_size=8,
        window_layers=[0, 1], inner_attention=DenseMaskFlexAttention.Config())).eval()
    native.load_state_dict({k.removeprefix("model."): v for k, v in short_w.items()})
    with torch.no_grad():
        assert (native(x) - kog.forward(short, short_w, x)).abs().max() > 1e-2


NEWER = {
    "model_type": "laneformer", "hidden_size": 128, "num_hidden_layers": 5, "num_attention_heads": 16,
    "num_key_value_heads": 8, "intermediate_size": 256, "vocab_size": 256, "max_position_embeddings": 64,
    "rope_theta": 10000.0, "norm_eps": 1e-5, "num_lanes": 8, "broadcast_delay": 2, "use_early_comm": True,
    "sliding_window": 8, "swa_layers": [0, 1, 2], "lm_head_type": "replicate", "pre_norm_lane_agg": False,
    "eos_token_id": 2,
}


@pytest.mark.parametrize("keys", [{}, {"use_early_comm": False, "pre_norm_lane_agg": True},
                                  {"use_attention_comm": False, "use_mlp_comm": False}, {"num_hidden_layers": 3}],
                         ids=["default", "scaled_norm_of_sum", "no_comm", "3layers"])
def test_newer_revision_imports_with_the_same_logits(tmp_path, keys, capsys):
    assert import_and_compare(tmp_path, {**NEWER, **keys}, newer=True) <= TOL
    assert "read as: laneformer (Kog's newer code" in capsys.readouterr().out


REFUSED = {
    "lm_head_type": (tp_config(lm_head_type="lane"), ()),
    "replicated_rmsn_scale": (tp_config(replicated_rmsn_scale=False), ()),
    "sliding_window": (tp_config(sliding_window=None), ()),
    "broadcast_delay": (tp_config(broadcast_delay=0), ()),
    "model_type": (tp_config(model_type="llama"), ()),
    "use_mlp_comm": ({**NEWER, "use_mlp_comm": False}, ()),
    "rope_theta": ({k: v for k, v in NEWER.items() if k != "rope_theta"}, ()),
    "rope_scaling": ({**NEWER, "rope_scaling": {"factor": 8.0}}, ()),
    "sliding_window_n_layers": ({**NEWER, "sliding_window_n_layers": 2}, ()),
    "clamp_temp": ({**NEWER, "clamp_temp": True}, ()),
}


@pytest.mark.parametrize("key", REFUSED)
def test_a_config_it_cannot_reproduce_is_refused(tmp_path, key, capsys):
    cfg, _ = REFUSED[key]
    kog.save_release(tmp_path / "release", cfg, kog.random_weights(tp_config()))
    with pytest.raises(SystemExit) as exit_:
        convert_main(["from-hf", str(tmp_path / "release"), str(tmp_path / "dcp")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"config.json: {key}: " in err, err
    assert not (tmp_path / "dcp").exists()


def test_refusal_from_the_command_line_and_ignore_key(tmp_path):
    cfg = {**NEWER, "clamp_temp": False}
    weights = kog.random_weights(cfg)
    kog.save_release(tmp_path / "release", cfg, weights)
    cmd = [sys.executable, "-m", "models.laneformer.convert", "from-hf", str(tmp_path / "release"), str(tmp_path / "dcp")]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2 and "clamp_temp: not known to be read" in run.stderr
    assert not (tmp_path / "dcp").exists()
    convert_main(["from-hf", str(tmp_path / "release"), str(tmp_path / "dcp"), "--ignore-key", "clamp_temp"])
    x = tokens(256)
    assert (native_logits(tmp_path / "dcp", x) - kog.forward(cfg, weights, x, newer=True)).abs().max() <= TOL


def test_set_overrides_an_inferred_field_and_says_so(tmp_path, capsys):
    kog.save_release(tmp_path / "release", tp_config(), kog.random_weights(tp_config()))
    convert_main(["from-hf", str(tmp_path / "release"), str(tmp_path / "dcp"),
                  "--set", "late_mode=flush", "--set", "window_layers=[0, 3]"])
    assert "late_mode = 'flush'  <- --set" in capsys.readouterr().out
    config = read_native_config(tmp_path / "dcp")
    assert config.late_mode == "flush" and config.window_layers == [0, 3]
    with pytest.raises(SystemExit) as exit_:
        convert_main(["from-hf", str(tmp_path / "release"), str(tmp_path / "dcp2"), "--set", "lanes=4"])
    assert exit_.value.code == 2 and "'lanes' is not a Laneformer.Config field" in capsys.readouterr().err


def native_config(**changes) -> Laneformer.Config:
    fields = dict(
        dim=128, n_layers=5, n_heads=16, n_kv_heads=8, head_dim=8, ffn_hidden_dim=256, vocab_size=256,
        max_seq_len=64, n_lanes=8, delay=2, early_send_forward=True, window_size=8, window_layers=[0, 2, 3],
        inner_attention=DenseMaskFlexAttention.Config(),
    )
    return Laneformer.Config(**{**fields, **changes})


EXPRESSIBLE = {
    "send_forward_gapped_windows": {},
    "scaled_norm_of_sum_suffix_windows": {"early_mode": "scaled", "final_agg": "norm_of_sum", "window_layers": [3, 4]},
    "no_delayed_exchange": {"delayed_exchange": False, "early_send_forward": False},
    "fewer_layers_than_2x_delay": {"n_layers": 3, "delay": 2, "window_layers": []},
}


def random_native(config, seed=0):
    model = Laneformer(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 if "tok_embeddings" in name else 0.08
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.mark.parametrize("changes", EXPRESSIBLE.values(), ids=EXPRESSIBLE.keys())
def test_kogs_older_code_reads_an_export_with_the_same_logits(tmp_path, changes):
    config = native_config(**changes)
    model = random_native(config)
    export_hf(model.state_dict(), config, tmp_path / "hf")
    cfg, weights = kog.load_release(tmp_path / "hf")
    assert cfg["laneformer_tp_compatible"] is True
    x = tokens(256)
    with torch.no_grad():
        assert (kog.forward(cfg, weights, x) - model(x)).abs().max().item() <= TOL


@pytest.mark.parametrize("changes, reason", [
    ({"early_send_forward": False}, "early_send_forward=false"),
    ({"late_mode": "flush"}, "late_mode='flush'"),
    ({"delay": 0}, "delay=0"),
])
def test_an_export_kogs_older_code_cannot_compute_says_so(tmp_path, changes, reason):
    config = native_config(**changes)
    export_hf(random_native(config).state_dict(), config, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["laneformer_tp_compatible"].startswith("no: ") and reason in cfg["laneformer_tp_compatible"]
    assert not {"use_early_comm", "pre_norm_lane_agg", "sliding_window_n_layers"} & set(cfg)
    assert reason in (tmp_path / "hf" / "README.md").read_text()


def test_export_import_round_trip_keeps_every_field(tmp_path, capsys):
    config = native_config(late_mode="present", delayed_exchange=True, window_layers=[1])
    model = random_native(config)
    export_hf(model.state_dict(), config, tmp_path / "hf")
    convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "dcp")])
    assert "read as: laneformer (a project export)" in capsys.readouterr().out
    back = read_native_config(tmp_path / "dcp")
    for f in dataclasses.fields(Laneformer.Config):
        if f.name not in ("inner_attention", "init_std"):
            assert getattr(back, f.name) == getattr(config, f.name), f.name
    x = tokens(256)
    with torch.no_grad():
        assert (native_logits(tmp_path / "dcp", x) - model(x)).abs().max().item() <= TOL
