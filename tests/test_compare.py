"""``bcdflow compare`` on two tiny runs (a full-parameter baseline and BCD): the best common validation
loss, steps/tokens to reach it and the B-F multiplier, checked against the runs' own recorded curves in
state.json; what-if costs and the cost-reduction tables; the CLI (--json, errors) and the flow's
markdown artifact."""
from __future__ import annotations

import json

import pytest

from bcdflow.storage import runs
from bcdflow.storage.store import Store
from bcdflow.flows.artifacts import artifact_key


def own_curve(state) -> list[tuple[int, float, float, float, float]]:
    """(step, val loss, tokens, GPU-hours, USD so far) straight from the visit records, written out independently:
    a visit's intermediate validation points are costed pro rata by step."""
    out, before = [], [0.0, 0.0, 0.0]
    for v in state.visits:
        start = v.step_end - v.steps
        pts = {s: val for s, val in v.val_points}
        pts[v.step_end] = v.val_loss
        for s in sorted(pts):
            f = (s - start) / v.steps
            out.append((s, pts[s], before[0] + v.tokens * f, before[1] + v.gpu_hours * f, before[2] + v.spend_usd * f))
        before = [before[0] + v.tokens, before[1] + v.gpu_hours, before[2] + v.spend_usd]
    return out


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, prefect_server):
    from bcdflow.flows.bcd import bcd_train, full_train
    from bcdflow.core.config import load_config
    from tests.helpers import TINY

    root = tmp_path_factory.mktemp("cmp")
    sets = TINY + [f"store={root / 'store'}", "tracking_uri=none", "stop.patience_cycles=0"]
    full = load_config(sets=sets + ["train.steps=12", "train.eval_every=3", "spend.train_device=a100"])
    bcd = load_config(sets=sets + ["bcd.blocks=2", "bcd.cycles=2", "spend.prices=[x=0.5]",
                                   "spend.preinfer_device=x"])
    full_train(config=full, run_id="full")
    bcd_train(config=bcd, run_id="bcd")
    return str(root / "store")


@pytest.mark.slow
def test_compare_multiplier_matches_the_recorded_curves(two_runs):
    from bcdflow.flows.compare import compare

    store = Store(two_runs)
    res = compare(store, ["full", "bcd"])
    states = {r: runs.read_state(store, r) for r in ("full", "bcd")}
    curves = {r: own_curve(s) for r, s in states.items()}
    assert len(curves["full"]) == 4 and len(curves["bcd"]) == 4  # val every 3 of 12 steps; 4 visits

    target = max(min(p[1] for p in c) for c in curves.values())
    assert res["target_val_loss"] == pytest.approx(target)
    first = {r: next((p[0], p[2], p[3], p[4]) for p in c if p[1] <= target) for r, c in curves.items()}
    by_id = {r["run_id"]: r for r in res["runs"]}
    for r in ("full", "bcd"):
        assert by_id[r]["steps_to_target"] == first[r][0]
        assert by_id[r]["tokens_to_target"] == pytest.approx(first[r][1])
        assert by_id[r]["final_val_loss"] == states[r].visits[-1].val_loss
    assert res["baseline"] == "full" and by_id["full"]["bf_multiplier"] == 1.0
    assert by_id["bcd"]["bf_multiplier"] == pytest.approx(first["bcd"][0] / first["full"][0])
    assert by_id["bcd"]["tokens_multiplier"] == pytest.approx(first["bcd"][1] / first["full"][1])

    # totals from the records
    for r, st in states.items():
        assert by_id[r]["spend_usd"] == pytest.approx(sum(v.spend_usd for v in st.visits))
        assert by_id[r]["gpu_hours"] == pytest.approx(sum(v.gpu_hours for v in st.visits))
        assert by_id[r]["wall_seconds"] == pytest.approx(sum(v.seconds for v in st.visits))
    assert by_id["full"]["device"] == "1×a100" and by_id["bcd"]["device"] == "1×rtx4090"

    # what-if: GPU-hours to L* priced on every kind of the merged catalog
    assert res["catalog"] == {"rtx4090": 0.29, "a800": 0.69, "a100": 1.20, "x": 0.5}
    for r in ("full", "bcd"):
        assert by_id[r]["spend_to_target_usd"] == pytest.approx(first[r][3])
        for kind, price in res["catalog"].items():
            assert by_id[r]["what_if_usd"][kind] == pytest.approx(first[r][2] * price)
    # Tables 5-7: BCD as it ran against the baseline priced on each kind
    for kind, price in res["catalog"].items():
        base_row, bcd_row = res["cost_reduction"][kind]
        assert base_row["run_id"] == "full" and base_row["reduction"] == 0
        assert bcd_row["reduction"] == pytest.approx(1 - first["bcd"][3] / (first["full"][2] * price))
    md = res["markdown"]
    assert "B-F ×" in md and "| full |" in md and "Baseline on **a100**" in md


@pytest.mark.slow
def test_compare_cli_and_flow_artifact(two_runs, capsys):
    from bcdflow.flows.cli import main
    from bcdflow.flows.compare import compare_runs

    assert main(["compare", "full", "bcd", "--store", two_runs, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    curves = {r: own_curve(runs.read_state(Store(two_runs), r)) for r in ("full", "bcd")}
    target = max(min(p[1] for p in c) for c in curves.values())
    steps = {r: next(p[0] for p in c if p[1] <= target) for r, c in curves.items()}
    assert printed["runs"][1]["bf_multiplier"] == pytest.approx(steps["bcd"] / steps["full"])
    assert main(["compare", "bcd", "full", "--store", two_runs]) == 0  # BCD as the baseline
    assert "against baseline `bcd`" in capsys.readouterr().out

    for args, words in ((["full", "nope"], "'nope' not found"), (["full"], "at least two")):
        assert main(["compare", *args, "--store", two_runs]) == 2
        assert words in capsys.readouterr().err

    state = compare_runs(run_ids=["full", "bcd"], store=two_runs, return_state=True)
    assert state.is_completed()
    from tests.test_tracking import _prefect_artifacts

    (art,) = _prefect_artifacts(str(state.state_details.flow_run_id))["markdown"]
    assert art["key"] == artifact_key("compare", "full-bcd") and "B-F ×" in art["data"]


def test_compare_plot_draws_one_line_per_run_with_l_star(tmp_path, capsys):
    """``--plot``: validation loss against steps and against spend, one line per run and L* in each panel; a plot
    path in a missing directory is one line and exit 2, before anything is read."""
    from bcdflow.flows.cli import main
    from bcdflow.flows.compare import compare, plot
    from tests.test_runs import _run

    store = Store(str(tmp_path / "store"))
    _run(store, "base", 6, status="done", mode="full")
    _run(store, "bcd", 4, status="done")
    out = tmp_path / "cmp.png"
    assert main(["compare", "base", "bcd", "--store", store.url, "--plot", str(out)]) == 0
    assert f"plot: {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = compare(store, ["base", "bcd"])
    labels = plot(store, result, str(tmp_path / "again.png"))
    star = f"L* = {result['target_val_loss']:.4f}"
    assert labels == [["base", "bcd", star], ["base", "bcd", star]]

    for bad, words in ((str(tmp_path / "no" / "dir" / "x.png"), "does not exist"), (str(tmp_path / "x.txt"), ".png")):
        assert main(["compare", "base", "bcd", "--store", store.url, "--plot", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "--plot" in err[0]
