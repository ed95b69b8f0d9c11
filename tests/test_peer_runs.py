"""The peers of issue 35 through the product (``bcdflow baseline --set optim.name=<peer>``): each trains, is killed -9
right after a mid-run checkpoint (BAdam and LISA in the middle of a switching period), resumes with ``bcdflow
resume`` and ends bitwise where an uninterrupted run ends; ``bcdflow compare`` sets each beside full AdamW with its
method (LoRA marked not full-parameter); a BCD run refuses a peer in one line, exit 2."""
from __future__ import annotations

import json
import signal

import pytest

from bcdflow.flows.cli import main
from bcdflow.flows.compare import compare
from bcdflow.models.optimizers import OPTIMIZERS
from bcdflow.storage import runs
from bcdflow.storage.store import Store
from tests.helpers import assert_same, finished_weights
from tests.test_resume import _cli, _sets

PEERS = sorted(n for n, o in OPTIMIZERS.items() if o.peer)
# killed and resumed through the CLI: one peer of each kind of state (BAdam's block switch, GaLore's projections,
# LISA's sampled layers, LoRA's wrapped model); APOLLO and APOLLO-Mini keep GaLore's kind, and every peer's state
# round trip is tested in process (tests/test_peers.py), 40 s less for the suite
KILLED = ["badam", "galore", "lisa", "lora"]
# 10 steps, a checkpoint every 2, BAdam and LISA switching every 3: the kill after the second checkpoint (step 4)
# falls inside a period, GaLore and APOLLO carry their step-0 projections across it
RUN = ["train.steps=10", "train.eval_every=5", "optim.switch_every=3"]


@pytest.fixture(scope="module")
def references(prefect_server, tmp_path_factory) -> str:
    """Uninterrupted baselines in one store: full AdamW ("full") and every peer (its own name)."""
    root = str(tmp_path_factory.mktemp("peers") / "store")
    assert main(["baseline", *_sets(*RUN), "--store", root, "--run-id", "full"]) == 0
    for name in PEERS:
        assert main(["baseline", *_sets(*RUN, f"optim.name={name}"), "--store", root, "--run-id", name]) == 0
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", KILLED)
def test_a_peer_killed_after_a_checkpoint_resumes_bitwise(prefect_api_url, references, tmp_path, name):
    store = str(tmp_path / "store")
    killed = _cli(prefect_api_url, "baseline", *_sets(*RUN, f"optim.name={name}"), "--store", store, "--run-id", name,
                  env={"BCDFLOW_FAILPOINTS": "train-checkpoint:2"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    pointer = Store(store).read_json(f"runs/{name}/visits/c0-b0/train-ckpt/ckpt.json")
    assert pointer["step"] == 4
    done = _cli(prefect_api_url, "resume", name, "--store", store)
    assert done.returncode == 0, done.stderr[-3000:]
    (visit,) = runs.read_state(Store(store), name).visits
    assert visit.resumed_at == 4 and visit.steps == 10
    ref = finished_weights(Store(references), name)
    assert_same(finished_weights(Store(store), name), ref)
    # and the peer trained differently from full AdamW
    assert any(not ref[k].equal(v) for k, v in finished_weights(Store(references), "full").items())


@pytest.mark.slow
def test_compare_sets_every_peer_beside_full_adamw(references, capsys):
    res = compare(Store(references), ["full", *PEERS], target="final", tol=10.0)
    methods = {r["run_id"]: r["method"] for r in res["runs"]}
    assert methods == {"full": "adamw", **{p: p + (" (not full-parameter)" if p == "lora" else "") for p in PEERS}}
    assert all(r["reached"] for r in res["runs"])  # L* 10 above the baseline's final: every run reaches it
    assert "| galore |" in res["markdown"] and "| lora (not full-parameter) |" in res["markdown"]
    assert main(["compare", "full", "lora", "--store", references, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["method"] for r in out["runs"]] == ["adamw", "lora (not full-parameter)"]


def test_compare_knows_which_optimizers_are_not_full_parameter():
    """flows/compare.py reads the registry's ``full_parameter`` (torch-free data): it spelled the names again."""
    import inspect

    from bcdflow.flows import compare as compare_mod

    assert "lora" not in inspect.getsource(compare_mod) and not OPTIMIZERS["lora"].full_parameter


@pytest.mark.slow
def test_a_bcd_run_refuses_a_peer_in_one_line(prefect_api_url, tmp_path):
    r = _cli(prefect_api_url, "train", *_sets("optim.name=badam"), "--store", str(tmp_path / "s"), "--run-id", "b")
    assert r.returncode == 2, r.stderr[-2000:]
    assert ("optim.name: badam trains the whole model in the baseline's step loop: run it with `bcdflow baseline "
            "--set optim.name=badam`") in r.stderr
    assert not (tmp_path / "s" / "runs").exists()
