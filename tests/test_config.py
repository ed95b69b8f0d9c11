"""Run config: every bad input is a ConfigError that names its key; ``--set`` parsing; YAML precedence
(core/config.py, docs/DESIGN.md §8).

Run: python -m pytest -q tests/test_config.py   (no I/O beyond tmp_path, a second or two)
"""
from __future__ import annotations

import pytest

from bcdflow.core.context import model_config
from bcdflow.models.errors import ConfigError
from bcdflow.core.config import RunConfig, load_config, parse_config


@pytest.mark.parametrize("sets,key", [
    (["model.name=nope"], "model.name"),
    (["bcd.order=zigzag"], "bcd.order"),
    (["bcd.blocks=0"], "bcd.blocks"),
    (["bcd.blocks=7"], "bcd.blocks"),  # tiny has 6 layers
    (["model.n_layer=4", "bcd.blocks=5"], "bcd.blocks"),  # checked against the resolved model
    (["bcd.sample_rate=0"], "bcd.sample_rate"),
    (["bcd.sample_rate=1.5"], "bcd.sample_rate"),
    (["bcd.sample_rate=-0.1"], "bcd.sample_rate"),
    (["data.seq_len=512"], "data.seq_len"),  # tiny's n_ctx is 256
    (["model.name=G-1.6B", "data.seq_len=2048"], "data.seq_len"),
    (["bcd.nope=1"], "bcd.nope"),
    (["nope=1"], "nope"),
    (["bcd=3"], "bcd"),
    (["bcd.blocks=abc"], "bcd.blocks"),
    (["bcd.blocks=2.5"], "bcd.blocks"),
    (["bcd.preinfer=maybe"], "bcd.preinfer"),
    (["bcd.act_dtype=float8"], "bcd.act_dtype"),
    (["optim.name=adam"], "optim.name"),
    (["optim.lr=0"], "optim.lr"),
    (["train.precision=fp8"], "train.precision"),
    (["bcd.split=halves"], "bcd.split"),
    (["data.val_fraction=1"], "data.val_fraction"),
    (["model.n_head=5"], "model.n_head"),  # 128 % 5: the model config's own check, still named
    (["model.name=tiny-llama", "model.n_kv_head=3"], "model.n_kv_head"),
])
def test_bad_value_names_its_key(sets, key):
    with pytest.raises(ConfigError) as e:
        load_config(sets=sets)
    assert str(e.value).startswith(f"{key}:"), str(e.value)
    assert "\n" not in str(e.value)  # one line for the CLI


@pytest.mark.parametrize("sets,allowed", [
    (["model.name=nope"], "tiny-llama"),
    (["bcd.order=zigzag"], "greedy"),
    (["bcd.blocks=7"], "n_layer=6"),
    (["bcd.sample_rate=1.5"], "(0, 1]"),
])
def test_error_says_what_is_allowed(sets, allowed):
    with pytest.raises(ConfigError) as e:
        load_config(sets=sets)
    assert allowed in str(e.value)


def test_parse_config_of_a_nested_dict():
    with pytest.raises(ConfigError, match=r"^bcd\.order:"):
        parse_config({"bcd": {"order": "zigzag"}})
    with pytest.raises(ConfigError, match=r"^model\.name:"):
        parse_config({"model": {"name": "nope"}})
    cfg = load_config(sets=["bcd.blocks=2", "model.name=tiny-llama"])
    assert parse_config(cfg.model_dump()) == cfg  # flows pass configs as plain dicts


@pytest.mark.parametrize("bounds", ["[9]", "[-1]", "[0]", "[6]", "[2, 6]"])
def test_out_of_range_boundaries_are_rejected_at_config_time(bounds):
    # before anything is written to the store (docs/DESIGN.md §8), not later in make_plan
    with pytest.raises(ConfigError, match=r"^bcd\.boundaries:.*n_layer=6"):
        load_config(sets=[f"bcd.boundaries={bounds}"])
    assert load_config(sets=["bcd.boundaries=[2, 4]", "bcd.blocks=6"]).bcd.boundaries == [2, 4]


def test_empty_boundaries_mean_unset():
    cfg = load_config(sets=["bcd.boundaries=[]"])
    assert cfg.bcd.blocks == 3 and not cfg.bcd.boundaries


def test_set_value_parsing():
    cfg = load_config(sets=[
        "bcd.blocks=4",                  # int
        "bcd.sample_rate=0.5",           # float
        "optim.lr=3e-4",                 # YAML reads this as a string; the float field coerces it
        "bcd.min_delta=.01",
        "bcd.boundaries=[2, 4]",         # list of ints
        "data.files=[a.txt, b.txt]",     # list of strings
        "bcd.preinfer=false",            # bools
        "data.max_chars=",               # empty = None
        "model.name=tiny-llama",         # a dash in a string value
        "store=memory://bucket/x",       # '=' and ':' inside the value are kept
        "seed=7",
    ])
    assert cfg.bcd.blocks == 4 and isinstance(cfg.bcd.blocks, int)
    assert cfg.bcd.sample_rate == 0.5 and cfg.optim.lr == pytest.approx(3e-4) and cfg.bcd.min_delta == 0.01
    assert cfg.bcd.boundaries == [2, 4]
    assert cfg.data.files == ["a.txt", "b.txt"]
    assert cfg.bcd.preinfer is False
    assert cfg.data.max_chars is None
    assert cfg.model.name == "tiny-llama" and model_config(cfg).family == "llama"
    assert cfg.store == "memory://bucket/x" and cfg.seed == 7
    for text, value in [("true", True), ("True", True), ("no", False), ("yes", True), ("0", False)]:
        assert load_config(sets=[f"bcd.preinfer={text}"]).bcd.preinfer is value
    assert load_config(sets=["store=a=b"]).store == "a=b"


def test_set_without_equals_is_an_error():
    with pytest.raises(ConfigError, match=r"^--set 'bcd.blocks'"):
        load_config(sets=["bcd.blocks"])


def test_numeric_looking_string_values():
    # --set values are YAML-parsed; a str field still takes a number-looking value as text
    cfg = load_config(sets=["experiment=2024", "data.split=0", "train.device=cpu"])
    assert (cfg.experiment, cfg.data.split) == ("2024", "0")


def test_defaults():
    cfg = load_config()
    assert cfg == RunConfig()
    assert (cfg.model.name, cfg.bcd.order, cfg.bcd.sample_rate, cfg.bcd.preinfer) == ("tiny", "cyclic", 0.9, True)


def test_yaml_file_then_overrides(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "model:\n  name: tiny-llama\n  n_layer: 4\n"
        "bcd:\n  blocks: 2\n  order: reverse\n  boundaries: [1, 3]\n"
        "seed: 5\n"
    )
    cfg = load_config(str(f))
    assert (cfg.model.name, cfg.model.n_layer, cfg.bcd.blocks, cfg.bcd.order, cfg.seed) == \
        ("tiny-llama", 4, 2, "reverse", 5)
    assert cfg.bcd.boundaries == [1, 3]
    # --set wins over the file, and only for the keys it names: the rest of a section survives
    cfg = load_config(str(f), sets=["bcd.blocks=4", "seed=9", "bcd.boundaries="])
    assert (cfg.bcd.blocks, cfg.seed, cfg.bcd.boundaries) == (4, 9, None)
    assert (cfg.model.name, cfg.model.n_layer, cfg.bcd.order) == ("tiny-llama", 4, "reverse")
    # the file wins over a base dict
    cfg = load_config(str(f), base={"seed": 1, "bcd": {"cycles": 3, "blocks": 1}})
    assert (cfg.seed, cfg.bcd.cycles, cfg.bcd.blocks) == (5, 3, 2)
    # the cross-field check sees the merged result: n_layer 4 from the file, blocks 5 from --set
    with pytest.raises(ConfigError, match=r"^bcd\.blocks:"):
        load_config(str(f), sets=["bcd.blocks=5", "bcd.boundaries="])


def test_yaml_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("bcd:\n  blocks: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^config file .*bad\.yaml.*not valid YAML"):
        load_config(str(bad))
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"^config file .*list\.yaml.*mapping"):
        load_config(str(lst))
    with pytest.raises(ConfigError, match=r"^config file .*missing\.yaml.*does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("bcd:\n  nope: 1\n")
    with pytest.raises(ConfigError, match=r"^bcd\.nope:"):
        load_config(str(unknown))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(str(empty)) == RunConfig()


def test_the_config_loads_without_torch():
    """``core/config.py`` and what it imports (the optimizer registry, the model configs and plans, the records it
    builds: models/specs.py) are torch-free, so the commands that only read a store parse a stored config through
    ``RunConfig`` and answer at once. It imported torch through ``models/`` (the trainer's OptimSpec, the base model's
    name prefixes, the package's own imports)."""
    import subprocess
    import sys

    code = ("import sys, bcdflow.core.config as c; cfg = c.load_config(sets=['optim.name=sgd']); "
            "cfg.optim_spec(); cfg.stop_rule(); cfg.step_shape(); print(sorted(m for m in sys.modules if "
            "m.split('.')[0] in ('torch', 'prefect', 'mlflow')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout[:500]


def test_the_step_shape_is_the_runs():
    """``RunConfig.step_shape``: the one place the planner's arguments come from a run config."""
    cfg = load_config(sets=["train.batch_size=4", "data.seq_len=64", "train.precision=bf16", "bcd.recompute=all",
                            "bcd.freeze=[head]", "train.stream_window=3", "train.pcie_gbs=12", "bcd.expand_rank=8"])
    s = cfg.step_shape()
    assert (s.batch, s.seq, s.precision, s.recompute, s.freeze, s.window, s.pcie_gbs, s.expand_rank, s.offload) == (
        4, 64, "bf16", "all", ("head",), 3, 12.0, 8, "auto")
    assert load_config(sets=["bcd.expand=off"]).step_shape().expand_rank == 0
    two = load_config(sets=["train.gpus=2"])  # several processes stream nothing; their no-grad passes may
    assert two.step_shape().offload == "off" and two.step_shape(no_grad=True).offload == "auto"


def test_the_time_models_rates_are_the_training_cards_kind():
    """``spend.train_device`` picks the planner's rates (models/specs.CARD_RATES) through ``RunConfig.step_shape``, so
    recompute=auto, streaming and ``bcd.preinfer=auto`` weigh the card the run is priced as; ``train.tflops`` and
    ``train.pcie_gbs`` each win over the kind's; the default kind plans as the time model always did (an RTX 4090's)."""
    from bcdflow.models.specs import CARD_RATES, PCIE_GBS, TFLOPS

    def shape(*sets):
        return load_config(sets=list(sets)).step_shape()

    d = shape()
    assert (d.tflops, d.pcie_gbs) == (TFLOPS["fp32"], PCIE_GBS) == (40.0, 25.0)
    assert RunConfig().train.pcie_gbs is None and RunConfig().train.tflops is None  # None: by kind
    assert shape("train.precision=bf16").tflops == TFLOPS["bf16"] == 80.0
    a100 = shape("spend.train_device=a100", "train.precision=bf16")
    assert (a100.tflops, a100.pcie_gbs) == (CARD_RATES["a100"].bf16, 25.0) and a100.tflops >= 1.5 * 80
    assert shape("spend.train_device=a100").tflops == CARD_RATES["a100"].fp32 < 40  # fp32 on CUDA cores, no TF32
    h100 = shape("spend.prices=[h100=2.49]", "spend.train_device=h100", "train.precision=bf16")
    assert h100.tflops > 3 * a100.tflops and h100.pcie_gbs == 50.0  # PCIe 5.0
    over = shape("spend.train_device=a100", "train.precision=bf16", "train.tflops=123", "train.pcie_gbs=7")
    assert (over.tflops, over.pcie_gbs) == (123.0, 7.0)
    one = shape("spend.train_device=a100", "train.precision=bf16", "train.pcie_gbs=7")
    assert (one.tflops, one.pcie_gbs) == (CARD_RATES["a100"].bf16, 7.0)


def test_a_card_kind_without_rates_is_one_line_naming_spend_train_device(capsys):
    """A kind priced but unknown to the time model (``spend.prices=[t4=0.35]``) is refused in one line naming
    ``spend.train_device``, the known kinds and what to set (exit 2), unless both rates are given."""
    from bcdflow.flows.cli import main
    from bcdflow.models.specs import CARD_RATES

    priced = ["spend.prices=[t4=0.35]", "spend.train_device=t4"]
    for given in ([], ["train.tflops=30"], ["train.pcie_gbs=12"]):
        with pytest.raises(ConfigError) as e:
            load_config(sets=priced + given)
        msg = str(e.value)
        assert msg.startswith("spend.train_device:") and "\n" not in msg and "'t4'" in msg, msg
        assert all(k in msg for k in CARD_RATES) and "train.tflops" in msg and "train.pcie_gbs" in msg, msg
    s = load_config(sets=priced + ["train.tflops=30", "train.pcie_gbs=12"]).step_shape()
    assert (s.tflops, s.pcie_gbs) == (30.0, 12.0)
    assert main(["plan-memory", *[a for kv in priced for a in ("--set", kv)]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "spend.train_device:" in err[0] and "rtx4090" in err[0], err


def test_a_run_stored_with_a_priced_only_kind_reads_back_with_the_rates_it_planned_with():
    """Before the rates were by kind a run priced as any kind planned with an RTX 4090's; its stored config (rates
    unset) still reads back, with those, and rates it stated stay its own."""
    from bcdflow.core.config import stored_config

    stored = RunConfig().model_dump(exclude={"store"})
    stored["spend"].update(prices=["t4=0.35"], train_device="t4")
    stored["train"].update(tflops=None, pcie_gbs=25.0)  # as such a run stored them
    cfg = stored_config(stored, "config.json")
    assert (cfg.train.tflops, cfg.train.pcie_gbs) == (40.0, 25.0)
    stored["train"].update(tflops=30.0, pcie_gbs=12.0)
    again = stored_config(stored, "config.json").train
    assert (again.tflops, again.pcie_gbs) == (30.0, 12.0)


def test_every_config_field_says_whether_a_resumed_run_must_keep_it():
    """Issue 44: the identity a resume checks was a hand-kept list that could not say whether a key was left out on
    purpose. Each field now carries ``SAME`` or ``FREE`` (a section marked as a whole: ``model``, ``data``); a new
    field without a mark fails here, and ``tasks/run.IDENTITY`` is derived from the marks."""
    from bcdflow.core.config import RunConfig, field_resume, identity_keys
    from bcdflow.tasks.run import IDENTITY

    unmarked = []
    for name, f in RunConfig.model_fields.items():
        sub = getattr(f.annotation, "model_fields", None)
        if field_resume(f) is None:
            assert sub, f"{name}: a plain field with no Resume mark"
            unmarked += [f"{name}.{k}" for k, g in sub.items() if field_resume(g) is None]
        elif sub:  # a section marked as a whole: its fields carry none of their own
            assert all(field_resume(g) is None for g in sub.values()), name
    assert not unmarked, f"config fields that do not say whether a resume must keep them: {unmarked}"
    assert IDENTITY == (*identity_keys(), "mode", "format", "hf.fingerprint", "dataset")
    # what the hand-kept list held is what the marks give (the peers' knobs, the schedule's shape, budget, moments)
    assert {"optim.rank", "optim.lisa_layers", "optim.switch_every", "optim.schedule", "bcd.budget",
            "bcd.moments", "train.batch_size", "seed", "model", "data"} <= set(IDENTITY)
    assert not {"optim.lr", "bcd.cycles", "train.device", "train.nodes", "bcd.act_store", "store"} & set(IDENTITY)
