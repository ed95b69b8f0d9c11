"""Deployments from prefect.yaml, end to end on the session's test server: create the work pool, `prefect
deploy --all`, create a flow run through the API with the flat form's parameters (as the UI does), run it
on a worker started here (`prefect worker start --run-once`), and find the trained run in the store,
bitwise equal to the same config trained through the CLI."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
import yaml

from bcdflow.flows.params import KEYS, RunParams
from bcdflow.storage import runs
from bcdflow.storage.checkpoints import load_blocks
from bcdflow.storage.store import Store
from tests.helpers import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFECT = os.path.join(os.path.dirname(sys.executable), "prefect")
BCDFLOW = os.path.join(os.path.dirname(sys.executable), "bcdflow")
POOL = "bcdflow"


def test_prefect_yaml_declares_the_deployments():
    with open(os.path.join(REPO, "prefect.yaml")) as f:
        spec = yaml.safe_load(f)
    deps = {d["name"]: d for d in spec["deployments"]}
    assert deps["bcd"]["entrypoint"] == "flows/bcd.py:bcd_train"
    assert deps["baseline"]["entrypoint"] == "flows/bcd.py:full_train"
    pool = spec["definitions"]["work_pools"]["process"]
    for name in ("bcd", "baseline", "compare"):  # one shared pool definition (a YAML anchor)
        assert deps[name]["work_pool"] == pool
    # the GPU pool's visit deployment is named after its pool (flows/fleet.py looks it up as bcd-visit/<pool>)
    gpu = spec["definitions"]["work_pools"]["gpu"]
    assert deps[gpu["name"]]["entrypoint"] == "flows/visit.py:visit" and deps[gpu["name"]]["work_pool"] == gpu
    # workers load the flows from their own copy of the code (bcdflow worker / the image set BCDFLOW_HOME)
    assert spec["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "{{ $BCDFLOW_HOME }}"}}]
    assert deps["bcd"]["schedules"][0] == spec["definitions"]["schedules"]["nightly"]


def test_flat_params_round_trip_and_form_schema():
    from prefect.utilities.callables import parameter_schema

    from bcdflow.flows.bcd import bcd_train
    from bcdflow.core.config import load_config

    cfg = load_config(sets=TINY + ["data.files=/x/*.txt", "bcd.boundaries=[2, 4]", "spend.prices=[h100=2]",
                                   "spend.train_device=h100", "stop.target_val_loss=3.5"])
    flat = RunParams.from_config(cfg)
    assert flat.bcd_boundaries == [2, 4] and flat.spend_train_device == "h100"
    assert flat.to_config() == cfg
    assert RunParams.model_validate(flat.model_dump()).to_config() == cfg  # through JSON, as the API stores it
    assert set(KEYS.values()) >= {"model.name", "bcd.blocks", "spend.budget_usd", "stop.target_val_loss", "seed"}

    schema = parameter_schema(bcd_train).model_dump()
    form = schema["definitions"]["RunParams"]["properties"]
    # flat and primitive: no nested objects, dropdowns for closed sets, docs from the config's docstrings
    assert all("$ref" not in p and p.get("type") != "object" for p in form.values())
    assert form["bcd_order"]["enum"] == ["cyclic", "reverse", "random", "greedy"]
    assert "paper §3.2.3" in form["bcd_sample_rate"]["description"]
    assert form["bcd_blocks"]["default"] == 3 and form["bcd_blocks"]["minimum"] == 1
    assert schema["properties"]["run_id"]["default"] is None


def _env(tmp_path, api_url: str) -> dict:
    return {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_CLI_PROMPT": "false",
            "PREFECT_LOGGING_LEVEL": "INFO"}


def _prefect(env, *args, timeout=180, cwd=REPO) -> subprocess.CompletedProcess:
    proc = subprocess.run([PREFECT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"prefect {' '.join(args)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
def test_deployment_run_on_a_worker_trains_like_the_cli(prefect_api_url, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from bcdflow.flows.cli import main
    from bcdflow.core.config import load_config

    env = _env(tmp_path, prefect_api_url)
    with get_client(sync_client=True) as client:  # = prefect work-pool create bcdflow --type process
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        client.create_work_pool(WorkPoolCreate(name="bcdflow-gpu", type="process"))
    _prefect(env, "--no-prompt", "deploy", "--all")

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("bcd_train/bcd")
        assert dep.work_pool_name == POOL
        assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory":
                                   {"directory": "{{ $BCDFLOW_HOME }}"}}]  # read on each worker, not baked in
        assert client.read_deployment_by_name("bcd-visit/bcdflow-gpu").work_pool_name == "bcdflow-gpu"
        assert [s.active for s in dep.schedules] == [False]
        assert "bcd_blocks" in dep.parameter_openapi_schema["definitions"]["RunParams"]["properties"]
        assert client.read_deployment_by_name("full_train/baseline").entrypoint == "flows/bcd.py:full_train"

    # a run as docs/guide/deployments.md starts it from the command line: `config` as one JSON object of flat keys; a flat key
    # given as its own --param is refused (the deployment has two parameters, run_id and config)
    sets = TINY + ["bcd.blocks=2", "tracking_uri=none"]
    cfg = load_config(sets=sets + [f"store={tmp_path / 'store'}"])
    config = {k: v for k, v in RunParams.from_config(cfg).model_dump(mode="json").items()
              if v != RunParams().model_dump(mode="json")[k]}  # only what differs from the form's defaults
    refused = subprocess.run([PREFECT, "deployment", "run", "bcd_train/bcd", "--param", "bcd_max_steps=3"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0
    started = _prefect(env, "deployment", "run", "bcd_train/bcd", "--param", "run_id=dep",
                       "--param", f"config={json.dumps(config)}")
    fr_id = re.search(r"UUID: ([0-9a-f-]{36})", started.stdout).group(1)
    worker = subprocess.run([BCDFLOW, "worker", "--pool", POOL, "--", "--run-once", "--limit", "1"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=300)  # from anywhere: its own code

    with get_client(sync_client=True) as client:
        fr = client.read_flow_run(fr_id)
        state = fr.state
        assert fr.name == "dep" and list(dep.parameter_openapi_schema["properties"])[0] == "run_id", \
            f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
    assert state.is_completed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
    store = Store(cfg.store)
    st = runs.read_state(store, "dep")
    assert st.status == "done" and st.version == 2 and st.stop_reason == "cycles"

    # the same config through the CLI, in-process: bitwise the same weights
    args = [a for s in sets for a in ("--set", s)]
    assert main(["train", *args, "--store", str(tmp_path / "store"), "--run-id", "cli"]) == 0
    a, b = load_blocks(store, "dep", 2), load_blocks(store, "cli", 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dockerfile_copies_every_package_and_installs_the_fleet_extras():
    """The worker image builds from the repository (CI has no Docker engine to build it): every package the
    project installs is copied into it, every file it copies exists, and it runs the SIGTERM-safe worker."""
    import tomllib

    text = open(os.path.join(REPO, "Dockerfile")).read()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setup = tomllib.load(f)["tool"]["setuptools"]
    folders = {setup.get("package-dir", {}).get(p, p) for p in setup["packages"]}  # bcdflow.core lives in core/
    copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    sources = {src for srcs in copied for src in srcs}
    assert folders <= sources, folders - sources
    assert all(os.path.exists(os.path.join(REPO, s)) for s in sources), sources
    assert "torch==2.13.0" in text and '".[fleet,gpu]"' in text and "-c constraints.txt" in text
    assert 'ENTRYPOINT ["bcdflow", "worker"]' in text and "BCDFLOW_HOME=/opt/bcdflow" in text
