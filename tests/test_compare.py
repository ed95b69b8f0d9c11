"""``bcdflow compare`` on two tiny runs (a full-parameter baseline and BCD) and on curves written as runs write
them: L* from the baseline's quality, the crossing of each run interpolated within its bracket, the B-F
multiplier (withheld when a bracket is too wide, naming the key to rerun with), "not reached", the gap at equal
steps; what-if costs and the cost-reduction tables; the CLI (--json, errors), the plot and the flow's artifact."""
from __future__ import annotations

import json

import pytest

from bcdflow.storage import runs
from bcdflow.storage.runs import RunState, VisitRecord
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


def interpolated(curve, target):
    """(steps, tokens, GPU-hours, USD) where ``curve`` first reaches ``target``, linear between the two points that
    bracket it (written out independently of flows/compare.py), and the bracket."""
    for (s0, l0, *c0), (s1, l1, *c1) in zip([(0, float("inf"), 0.0, 0.0, 0.0)] + curve, curve):
        if l1 <= target:
            f = 1.0 if l0 == float("inf") else (l0 - target) / (l0 - l1)
            return (s0 + f * (s1 - s0), *(a + f * (b - a) for a, b in zip(c0, c1))), (s0, s1)
    return None


@pytest.mark.slow
def test_compare_multiplier_matches_the_recorded_curves(two_runs):
    from bcdflow.flows.compare import compare

    store = Store(two_runs)
    states = {r: runs.read_state(store, r) for r in ("full", "bcd")}
    curves = {r: own_curve(s) for r, s in states.items()}
    assert len(curves["full"]) == 4 and len(curves["bcd"]) == 4  # val every 3 of 12 steps; 4 visits
    # L* = the baseline's quality (its best + 0.02), not the worst of the runs' bests
    target = min(p[1] for p in curves["full"]) + 0.02
    res = compare(store, ["full", "bcd"], bracket_tol=10.0)  # 3-step brackets of a 12-step run: let it through
    assert res["target_val_loss"] == pytest.approx(target)
    by_id = {r["run_id"]: r for r in res["runs"]}
    hit = {r: interpolated(c, target) for r, c in curves.items()}
    for r in ("full", "bcd"):
        assert by_id[r]["final_val_loss"] == states[r].visits[-1].val_loss
        if hit[r] is None:
            assert by_id[r]["bf_multiplier"] is None and by_id[r]["not_reached"].startswith("not reached: ended at")
            continue
        (steps, tokens, gpu_h, usd), bracket = hit[r]
        assert by_id[r]["steps_to_target"] == pytest.approx(steps) and by_id[r]["bracket"] == list(bracket)
        assert by_id[r]["tokens_to_target"] == pytest.approx(tokens)
        assert by_id[r]["spend_to_target_usd"] == pytest.approx(usd)
        for kind, price in res["catalog"].items():
            assert by_id[r]["what_if_usd"][kind] == pytest.approx(gpu_h * price)
    assert res["baseline"] == "full" and by_id["full"]["bf_multiplier"] == 1.0
    if hit["bcd"] is not None:
        assert by_id["bcd"]["bf_multiplier"] == pytest.approx(hit["bcd"][0][0] / hit["full"][0][0])

    # totals from the records
    for r, st in states.items():
        assert by_id[r]["spend_usd"] == pytest.approx(sum(v.spend_usd for v in st.visits))
        assert by_id[r]["gpu_hours"] == pytest.approx(sum(v.gpu_hours for v in st.visits))
        assert by_id[r]["wall_seconds"] == pytest.approx(sum(v.seconds for v in st.visits))
    assert by_id["full"]["device"] == "1×a100" and by_id["bcd"]["device"] == "1×rtx4090*"  # * the default kind
    assert res["catalog"] == {"rtx4090": 0.29, "a800": 0.69, "a100": 1.20, "x": 0.5}
    for kind, price in res["catalog"].items():  # Tables 5-7: BCD as it ran against the baseline on each kind
        base_row, bcd_row = res["cost_reduction"][kind]
        assert base_row["run_id"] == "full" and base_row["reduction"] == 0
        if hit["bcd"] is not None:
            assert bcd_row["reduction"] == pytest.approx(1 - hit["bcd"][0][3] / (hit["full"][0][2] * price))
    md = res["markdown"]
    assert "B-F ×" in md and "| full |" in md and "Baseline on **a100**" in md and "default price kind" in md


@pytest.mark.slow
def test_compare_cli_and_flow_artifact(two_runs, capsys):
    from bcdflow.flows.cli import main
    from bcdflow.flows.compare_flow import compare_runs

    assert main(["compare", "full", "bcd", "--store", two_runs, "--json", "--target", "common",
                 "--bracket-tol", "10"]) == 0
    printed = json.loads(capsys.readouterr().out)
    curves = {r: own_curve(runs.read_state(Store(two_runs), r)) for r in ("full", "bcd")}
    target = max(min(p[1] for p in c) for c in curves.values())  # common: the lowest every run reaches
    steps = {r: interpolated(c, target)[0][0] for r, c in curves.items()}
    assert printed["runs"][1]["bf_multiplier"] == pytest.approx(steps["bcd"] / steps["full"])
    assert main(["compare", "bcd", "full", "--store", two_runs]) == 0  # BCD as the baseline
    assert "against baseline `bcd`" in capsys.readouterr().out

    for args, words in ((["full", "nope"], "'nope' not found"), (["full"], "at least two"),
                        (["full", "bcd", "--target", "lowest"], "--target")):
        assert main(["compare", *args, "--store", two_runs]) == 2
        assert words in capsys.readouterr().err

    state = compare_runs(run_ids=["full", "bcd"], store=two_runs, return_state=True)
    assert state.is_completed()
    from tests.test_tracking import _prefect_artifacts

    (art,) = _prefect_artifacts(str(state.state_details.flow_run_id))["markdown"]
    assert art["key"] == artifact_key("compare", "full-bcd") and "B-F ×" in art["data"]


def _curve_run(store: Store, run_id: str, mode: str, visits: list[tuple[int, float, list[tuple[int, float]]]],
               **cfg) -> None:
    """A run whose visits end at (global step, val loss) with in-visit (step, val loss) points, as a run writes
    them; one second and $0.001 per step."""
    recs, start = [], 0
    for i, (end, val, points) in enumerate(visits):
        n = end - start
        recs.append(VisitRecord(cycle=0, block=i, version=i + 1, steps=n, step_end=end, stopped_by="max_steps",
                                rows=1, tokens=100 * n, first_loss=9.0, train_loss=val, val_loss=val, val_ppl=1.0,
                                val_points=points, tokens_per_s=100.0, seconds=float(n), gpu_hours=n / 3600,
                                spend_usd=0.001 * n, cum_spend_usd=0.001 * end))
        start = end
    runs.write_config(store, run_id, {"mode": mode, "bcd": {"window": cfg.get("window", 20)},
                                      "spend": {"train_device": "a100", "prices": []}})
    runs.write_state(store, RunState(run_id=run_id, version=len(recs), status="done", mode=mode, visits=recs))


def test_a_baseline_validated_once_gives_no_multiplier_and_says_what_to_rerun(tmp_path, capsys):
    """Issue 28: a 45-step baseline validated once (train.eval_every=100) made compare report BCD at 0.67× the
    baseline's steps though the baseline ended lower (7.09 vs 7.36). Against the baseline's own quality the BCD run
    has not arrived (7.36 > 7.09 + 0.02), the gap at equal steps says so; and a baseline whose one point brackets the
    crossing in [0, 45] gives no multiplier, naming the key to rerun it with."""
    from bcdflow.flows.cli import main
    from bcdflow.flows.compare import compare

    store = Store(str(tmp_path / "store"))
    _curve_run(store, "full", "full", [(45, 7.09, [])])
    _curve_run(store, "bcd", "bcd", [(15, 7.9, []), (30, 7.36, [])])
    res = compare(store, ["full", "bcd"])
    full, bcd = res["runs"]
    assert res["target_val_loss"] == pytest.approx(7.11)
    assert bcd["bf_multiplier"] is None and bcd["not_reached"] == "not reached: ended at 7.3600 after 30 steps"
    assert bcd["gap_at_equal_steps"] is None  # the baseline has no point at or before step 30
    # a BCD run that gets there: the baseline's bracket [0, 45] is too wide to place its crossing
    _curve_run(store, "bcd2", "bcd", [(15, 7.9, []), (30, 7.05, [])])
    bcd2 = compare(store, ["full", "bcd2"])["runs"][1]
    assert bcd2["reached"] and bcd2["bf_multiplier"] is None
    assert "full crosses L* between steps 0 and 45" in bcd2["bf_withheld"]
    assert "rerun full with --set train.eval_every=4 --set bcd.window=4" in bcd2["bf_withheld"]
    assert main(["compare", "full", "bcd2", "--store", store.url]) == 0
    out = capsys.readouterr().out
    assert "B-F not given" in out and "train.eval_every=4" in out
    # asked for a wider bracket, it is given with its range
    wide = compare(store, ["full", "bcd2"], bracket_tol=2.0)["runs"][1]
    assert wide["bf_range"][1] == float("inf") and wide["bf_multiplier"] == pytest.approx(bcd2["steps_to_target"] / 45)


def test_a_bcd_run_that_stops_short_of_the_baseline_gets_not_reached(tmp_path):
    """Issue 28: L* was the worst of the runs' best losses, so a BCD run that stopped early set the target itself
    (B-F 1.77 for a loss full training passed at ~600 of 1500 steps). L* is the baseline's best + 0.02 now."""
    from bcdflow.flows.compare import compare

    store = Store(str(tmp_path / "store"))
    pts = [(s, 8.0 - 4.4 * s / 1500) for s in range(50, 1500, 50)]  # every 50 steps, down to 3.63
    _curve_run(store, "full", "full", [(1500, 3.63, pts)])
    _curve_run(store, "bcd", "bcd", [(s, 8.0 - 3.6 * s / 1060, []) for s in range(60, 1060, 100)] + [(1060, 4.39, [])])
    res = compare(store, ["full", "bcd"])
    full, bcd = res["runs"]
    assert res["target_val_loss"] == pytest.approx(3.65)
    assert bcd["bf_multiplier"] is None and bcd["not_reached"] == "not reached: ended at 4.3900 after 1060 steps"
    assert bcd["gap_at_equal_steps"] == pytest.approx(4.39 - (8.0 - 4.4 * 1060 / 1500))  # at step 1060
    assert "not reached: ended at 4.3900 after 1060 steps" in res["markdown"]
    # the old rule, asked for by name, still reports the worst of the bests
    common = compare(store, ["full", "bcd"], target="common", bracket_tol=1.0)
    assert common["target_val_loss"] == pytest.approx(4.39) and common["runs"][1]["bf_multiplier"] is not None


def test_a_resolved_crossing_is_interpolated_with_its_bracket_and_gap(tmp_path):
    from bcdflow.flows.compare import compare

    store = Store(str(tmp_path / "store"))
    _curve_run(store, "full", "full", [(200, 3.0, [(s, 5.0 - 0.01 * s) for s in range(10, 200, 10)])])
    _curve_run(store, "bcd", "bcd", [(100, 4.5, []), (120, 4.0, []), (140, 3.5, []), (160, 3.1, []),
                                     (170, 3.0, []), (180, 2.9, [])])
    res = compare(store, ["full", "bcd"], tol=0.05)
    full, bcd = res["runs"]
    assert res["target_val_loss"] == pytest.approx(3.05)
    assert full["steps_to_target"] == pytest.approx(195) and full["bracket"] == [190, 200]
    # BCD: 3.1 at 160, 3.0 at 170 -> 3.05 half way: 165
    assert bcd["steps_to_target"] == pytest.approx(165) and bcd["bracket"] == [160, 170]
    assert bcd["spend_to_target_usd"] == pytest.approx(0.165)
    assert bcd["bf_multiplier"] == pytest.approx(165 / 195)
    assert bcd["bf_range"] == pytest.approx([160 / 200, 170 / 190])
    assert bcd["gap_at_equal_steps"] == pytest.approx(2.9 - 3.2) and bcd["gap_step"] == 180
    assert "0.85 [0.80–0.89]" in res["markdown"] and "-0.3000 at step 180" in res["markdown"]
    # a BCD bracket wider than 10% of its step (20 steps at ~165) withholds the multiplier
    _curve_run(store, "coarse", "bcd", [(100, 4.5, []), (140, 3.5, []), (160, 3.1, []), (180, 2.9, [])])
    coarse = compare(store, ["full", "coarse"], tol=0.05)["runs"][1]
    assert coarse["bf_multiplier"] is None and "rerun coarse with --set bcd.eval_every=16" in coarse["bf_withheld"]
    assert compare(store, ["full", "bcd"], target=3.5)["target_val_loss"] == 3.5


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
    crossed = [f"{r['run_id']} reaches L*" for r in result["runs"] if r["reached"]]
    priced = [f"{r['run_id']} reaches L*" for r in result["runs"] if r["spend_to_target_usd"] is not None]
    # each run's crossing of L* marked; against spend only where its bracket is narrow enough to price it
    assert crossed and labels == [["base", "bcd", star, *crossed], ["base", "bcd", star, *priced]]

    for bad, words in ((str(tmp_path / "no" / "dir" / "x.png"), "does not exist"), (str(tmp_path / "x.txt"), ".png")):
        assert main(["compare", "base", "bcd", "--store", store.url, "--plot", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "--plot" in err[0]
