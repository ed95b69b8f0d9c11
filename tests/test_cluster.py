"""Communication in the plan (issue 42): each visit's all-reduce on a cluster of ``train.nodes`` machines of
``train.gpus`` GPUs (core/cluster.py), and full training on the same cluster to the same loss beside the run. The
bytes DDP's hook all-reduces in a real two-process visit are checked against the plan's in
tests/test_distributed.py and tests/test_nodes.py (two machines)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bcdflow.core.cluster import BUCKET_BYTES, Cluster
from bcdflow.flows.cli import main

GB = 1e9
LLAMA = ["model.from_hf=benchmarks/shapes/llama-3-8b", "data.seq_len=1024", "train.precision=bf16",
         "train.batch_size=16", "bcd.blocks=8", "bcd.expand=off", "bcd.max_steps=1000", "optim.name=adamw8bit-bf16",
         "tracking_uri=none"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_ring_sends_twice_the_buffer_less_a_share_over_the_slowest_link():
    one = Cluster(1, 1, 1.25, 10.0)
    assert one.allreduce(10**9, 1.0).wire_bytes == 0 and one.zero3(10**9, 10**9, 10**8, 1, 1).seconds == 0
    box = Cluster(1, 4, 1.25, 10.0)  # within one machine: the GPUs' link
    c = box.allreduce(4 * 10**9, 0.0)
    assert c.bytes == 4 * 10**9 and c.wire_bytes == pytest.approx(2 * 3 / 4 * 4e9)
    assert c.seconds == pytest.approx(6e9 / 10e9) and c.exposed_s == c.seconds
    four = Cluster(4, 4, 1.25, 10.0)  # across machines: their link, 16 processes
    c = four.allreduce(4 * 10**9, 0.0)
    assert four.world == 16 and c.seconds == pytest.approx(2 * 15 / 16 * 4e9 / 1.25e9)
    # overlap: hidden behind the backward that makes the gradients, never below the last bucket's reduction
    hidden = four.allreduce(4 * 10**9, 1e6)
    assert hidden.exposed_s == pytest.approx(2 * 15 / 16 * BUCKET_BYTES / 1.25e9)
    assert four.allreduce(4 * 10**9, 2.0).exposed_s == pytest.approx(c.seconds - 2.0)
    # ZeRO-3: the weights gathered twice, the gradients reduce-scattered once, (n-1)/n each
    z = four.zero3(2 * 10**9, 4 * 10**9, 10**8, 0.0, 0.0)
    assert z.wire_bytes == pytest.approx(15 / 16 * (2 * 2e9 + 4e9)) and z.seconds == pytest.approx(z.wire_bytes
                                                                                                    / 1.25e9)


def _plan(capsys, *args) -> dict:
    sets = [x for s in LLAMA for x in ("--set", s)]
    with pytest.MonkeyPatch.context() as m:
        m.chdir(ROOT)
        assert main(["plan", *sets, "--tokens", "100e6", "--gpu-gb", "24", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_on_sixteen_4090s_in_four_boxes_the_plan_prices_each_visits_all_reduce_and_full_training(capsys, tmp_path):
    """The guide's fourth scale: a visit all-reduces its block's gradients (bf16 under adamw8bit-bf16: 2 bytes a
    matrix element) over 10 Gbit/s; full training all-reduces (DDP) or gathers and reduces (ZeRO-3) all of them."""
    p = _plan(capsys, "--nodes", "4", "--gpus", "4", "--link-gbs", "1.25", "--set", f"store={tmp_path}/s")
    assert p["config"]["train_gpus"] == 16
    for v in p["visits"]:
        c = v["comm"]
        assert 1e9 < c["bytes"] < 3e9  # a block of ~1B parameters at 2 bytes (its vectors at 4)
        assert c["wire_bytes"] == pytest.approx(2 * 15 / 16 * c["bytes"])
        assert c["seconds"] == pytest.approx(c["wire_bytes"] / 1.25e9)
        assert v["train_compute_s"] == pytest.approx(v["steps"] * (v["step_s"] + c["exposed_s"]))
    full = p["full"]
    assert [w["way"] for w in full["ways"]] == ["data parallel (DDP)", "ZeRO-3"]
    ddp, zero3 = full["ways"]
    assert 15e9 < ddp["comm"]["bytes"] < 17e9  # every gradient: 8B parameters at 2 bytes
    assert zero3["comm"]["wire_bytes"] > ddp["comm"]["wire_bytes"]  # ZeRO-3 moves 1.5x DDP's bytes
    assert not ddp["fits"] and zero3["fits"]  # a replica of 8B does not fit a 4090; sharded over 16 it does
    assert full["steps"] == pytest.approx(full["bcd_steps"] / full["bf"])
    assert full["best"]["way"] == "ZeRO-3" and full["best"]["time_x"] < 1  # where BCD should win, it does
    # one machine of the same 16 GPUs' worth: the link inside it, no comparison to machines
    box = _plan(capsys, "--gpus", "4", "--set", f"store={tmp_path}/s")
    assert box["visits"][1]["comm"]["seconds"] == pytest.approx(2 * 3 / 4 * box["visits"][1]["comm"]["bytes"] / 10e9)
    # the text says which wins and by how much
    sets = [x for s in LLAMA for x in ("--set", s)]
    with pytest.MonkeyPatch.context() as m:
        m.chdir(ROOT)
        assert main(["plan", *sets, "--tokens", "100e6", "--nodes", "4", "--gpus", "4", "--set",
                     f"store={tmp_path}/s"]) == 0
    out = capsys.readouterr().out
    assert "All-reduce a step on 4 machines x 4 GPUs (16 GPUs), 1.25 GB/s between machines" in out
    assert "bcdflow takes 0." in out and "x the time of ZeRO-3" in out


@pytest.mark.parametrize("args, line", [
    (["--nodes", "2.5"], "--nodes: must be a whole number of machines, got 2.5"),
    (["--nodes", "0"], "--nodes: must be a positive number, got 0"),
    (["--link-gbs", "-1"], "--link-gbs: must be a positive number, got -1"),
    (["--gpu-link-gbs", "nan"], "--gpu-link-gbs: must be a positive number, got nan"),
    (["--bf", "0"], "--bf: must be a positive number, got 0"),
    (["--set", "train.link_gbs=x"], "train.link_gbs:"),
    (["--set", "train.nodes=0"], "train.nodes:"),
    (["--nodes", "64"], "train.nodes: 64 processes need at least one row each of a batch"),
])
def test_bad_cluster_input_is_one_line_exit_2(args, line, tmp_path):
    cmd = [os.path.join(os.path.dirname(sys.executable), "bcdflow"), "plan", "--tokens", "1e6", *args,
           "--set", f"store={tmp_path}/s"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DO_NOT_TRACK": "1"})
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and line in err[0], r.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("args, line", [
    (["join", "r", "--node-rank", "0"], "--node-rank: must be 1 or more (node 0 is the machine whose task trains"),
    (["train", "--set", "train.nodes=2", "--set", "train.rdzv_endpoint=host-without-port"],
     "train.rdzv_endpoint: must be HOST:PORT"),
    (["train", "--set", "train.nodes=2", "--set", "train.rdzv_endpoint=h:99999"], "train.rdzv_endpoint: must be"),
])
def test_bad_join_and_endpoint_input_is_one_line_exit_2(args, line, tmp_path, capsys):
    from tests.helpers import TINY

    sets = [x for s in [*TINY, "tracking_uri=none"] for x in ("--set", s)] if args[0] == "train" else []
    assert main([*args, *sets, "--store", str(tmp_path / "store")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and line in err[0], err
    assert not (tmp_path / "store").exists()


def test_on_one_4090_the_plan_sets_the_exact_single_card_recipes_beside_the_run(capsys, tmp_path):
    """Issue 41, item 4: beside a one-card plan, full training's recipes that fit a card too small for the model:
    ZeRO-3 with parameters and optimizer on the host (host memory 18 bytes a parameter, the host's AdamW in each
    step) and torchtune's bf16 weights with 8-bit AdamW paged (what the card cannot keep moves over PCIe each step),
    each at the run's steps / B-F; plain full training does not fit."""
    p = _plan(capsys, "--set", f"store={tmp_path}/s", "--set", "train.batch_size=8", "--bf", "2")
    f = p["full"]
    ways = {w["way"]: w for w in f["ways"]}
    assert list(ways) == ["one card", "ZeRO-3 + CPU offload", "bf16 + 8-bit paged (torchtune)"]
    assert not ways["one card"]["fits"] and ways["ZeRO-3 + CPU offload"]["fits"]
    off, paged = ways["ZeRO-3 + CPU offload"], ways["bf16 + 8-bit paged (torchtune)"]
    from bcdflow.core.figures import CPU_ADAM_PARAMS_S

    assert off["host_bytes"] == pytest.approx(18 * 8.03e9, rel=0.01)
    assert off["step_s"] > 8.03e9 / CPU_ADAM_PARAMS_S  # the host's AdamW is in every step
    assert paged["fits"] and paged["host_bytes"] > 0 and paged["step_s"] > ways["one card"]["step_s"]
    assert f["bf"] == 2 and all(w["steps"] == pytest.approx(f["bcd_steps"] / 2) for w in f["ways"])
    assert f["best"]["way"] == "bf16 + 8-bit paged (torchtune)"  # the fastest that fits
