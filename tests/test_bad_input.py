"""Every bad input and every damaged store gets one line, the right exit and an unchanged store.

Bad input exits 2 before anything is written; a damaged store exits 1 naming the object; neither prints a
traceback, and neither suggests ``resume`` where resuming cannot help. The CLI runs in-process (``main``),
so stderr here is exactly what bcdflow prints (Prefect's own console log goes to the real stderr).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from bcdflow.flows.cli import main
from bcdflow.storage import checkpoints, runs
from bcdflow.storage.store import Store
from tests.helpers import TINY, fill_disk, temporaries


def _sets(*extra: str) -> list[str]:
    return [a for s in [*TINY, "tracking_uri=none", *extra] for a in ("--set", s)]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _tree(path) -> list[str]:
    """Every file below ``path`` with its size: a store that is 'unchanged' has the same tree."""
    out = []
    for root, _, files in os.walk(path):
        out += [f"{os.path.relpath(os.path.join(root, f), path)}:{os.lstat(os.path.join(root, f)).st_size}"
                for f in files]
    return sorted(out)


# -- bad input: exit 2 before anything is written ------------------------------------------------------------

BAD = [
    (["train", "--set", "bcd.boundaries=[2, 1]"], "bcd.boundaries: cut points must be strictly increasing"),
    (["train", "--set", "bcd.boundaries=[1, 1]"], "bcd.boundaries: cut points must be strictly increasing"),
    (["train", "--set", "bcd.boundaries=[2.5]"], "bcd.boundaries: cut points are layer indices, a block is whole "
                                                 "layers (a cut cannot split a layer), got 2.5"),
    (["train", "--set", "optim.name=adamw8bit-bf16", "--set", "train.precision=fp32"],
     "optim.name: adamw8bit-bf16 keeps bf16 master weights, which need train.precision=bf16"),
    (["train", "--set", "train.device=tpu9"], "train.device: unknown device 'tpu9'"),
    (["train", "--set", "optim.lr=inf"], "optim.lr"),
    (["train", "--store", "foo://x"], "store: 'foo://x' has an unknown protocol 'foo'"),
    (["train", "--run-id", "../../etc"], "--run-id: '../../etc' is not a valid run id"),
    (["train", "--run-id", "a/b"], "--run-id: 'a/b' is not a valid run id"),
    (["train", "--run-id", ".."], "--run-id: '..' is not a valid run id"),
    (["status", "../x"], "--run-id: '../x' is not a valid run id"),
    (["resume", ".."], "--run-id: '..' is not a valid run id"),
    (["export", "a/b", "/tmp/never"], "--run-id: 'a/b' is not a valid run id"),
    (["compare", "ok", "a/b"], "--run-id: 'a/b' is not a valid run id"),
    (["status", "r", "--store", "foo://x"], "store: 'foo://x' has an unknown protocol"),
    (["train", "--set", "seed=-1"], "seed: Input should be greater than or equal to 0"),
    (["train", "--set", "model.n_layer=100000000"], "model.n_layer: 100000000 is beyond any model this trains"),
    (["train", "--set", "model.d_model=4000000"], "model.d_model: 4000000 is beyond any model this trains"),
    (["train", "--set", "model.n_layer=1024", "--set", "model.d_model=65536"],  # each in bounds, together not
     "model: 52,777.5B parameters (n_layer=1024, d_model=65536): one of 3 blocks alone needs"),
    (["train", "--set", "data.vocab_size=2147483647"], "data.vocab_size: 2147483647 is beyond what the tokenizer"),
    (["train", "--set", "fleet.lease_seconds=1e12"], "fleet.lease_seconds: Input should be less than or equal to"),
    (["train", "--set", "data.files=[]"], "data.files: empty (no files given"),
    (["train", "--set", "bcd.lr_scales=[1, 2]"], "bcd.lr_scales: 2 value(s) for 3 blocks (one per block)"),
    (["train", "--set", "bcd.lr_scales=[1, 0, 1]"], "bcd.lr_scales: each must be a positive number"),
    (["train", "--set", "bcd.budget=greedy"], "bcd.budget: unknown budget 'greedy' (choose from fixed, adaptive)"),
    (["train", "--set", "optim.min_lr_ratio=2"], "optim.min_lr_ratio: Input should be less than or equal to 1"),
    (["train", "--set", "checkpoint.every_seconds=1e12"], "checkpoint.every_seconds: Input should be less than or"),
    (["train", "--set", "fleet.poll_seconds=inf"], "fleet.poll_seconds: Input should be"),
    (["train", "--set", "fleet.reschedule_delay_s=1e300"], "fleet.reschedule_delay_s: Input should be less than"),
    (["train", "--set", "optim.lr=1e-310"], "optim.lr: 1e-310 is below 1.175e-38, the smallest normal fp32 number"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, args, message):
    store = tmp_path / "store"
    full = [args[0], *(_sets() if args[0] == "train" else []), *args[1:]]  # the case's --set last: it wins
    if "--store" not in args:
        full += ["--store", str(store)]
    assert main(full) == 2
    line = _one_line(capsys)
    assert line.startswith("bcdflow: error: ") and message in line, line
    assert "resume" not in line
    assert not store.exists()


PEER_PAST_MODEL = {  # a peer's setting past the model: found by LISA's constructor or the allocator, in the run
    "lisa layers past the model's": (["optim.name=lisa", "optim.lisa_layers=99"],
                                     "optim.lisa_layers: 99 sampled layers, but the model has"),
    "a LoRA rank past its matrices": (["optim.name=lora", "optim.rank=1000000"],
                                      "optim.rank: 1000000 is past the matrices lora adapts"),
    "a GaLore rank past its matrices": (["optim.name=galore", "optim.rank=65"],
                                        "optim.rank: 65 is past the matrices galore projects"),
}


@pytest.mark.parametrize("sets,message", PEER_PAST_MODEL.values(), ids=PEER_PAST_MODEL.keys())
def test_a_peer_setting_past_the_model_is_refused_before_the_run_is_made(tmp_path, capsys, sets, message):
    """A baseline peer whose ``optim.lisa_layers`` or ``optim.rank`` the model cannot take: one line naming the key,
    exit 2, nothing written (it was found in the first visit, after the run was created, or as memory on every
    attempt)."""
    assert main(["baseline", *_sets(*sets), "--store", str(tmp_path / "s")]) == 2
    line = _one_line(capsys)
    assert line.startswith("bcdflow: error: ") and message in line, line
    assert not (tmp_path / "s").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_machine_without_it(tmp_path, capsys):
    assert main(["train", *_sets("train.device=cuda"), "--store", str(tmp_path / "s")]) == 2
    assert "train.device: 'cuda' asked for, but this machine has no CUDA device" in _one_line(capsys)
    assert not (tmp_path / "s").exists()


def test_binary_corpus(tmp_path, capsys):
    (tmp_path / "blob.txt").write_bytes(bytes(range(256)) * 64)
    assert main(["train", *_sets(f"data.files={tmp_path / 'blob.txt'}"), "--store", str(tmp_path / "s")]) == 2
    line = _one_line(capsys)
    assert "data.files:" in line and "blob.txt is not UTF-8 text" in line
    assert not (tmp_path / "s").exists()


def _fifo(d):
    os.mkfifo(d / "corpus.txt")
    return ["--set", f"data.files={d}/*.txt"], "corpus.txt is not a regular file"


def _dev_zero(d):
    (d / "a.txt").write_text("some text " * 50)
    os.symlink("/dev/zero", d / "b.txt")
    return ["--set", f"data.files={d}/*.txt"], "b.txt is not a regular file"


def _dangling_data(d):
    (d / "a.txt").write_text("some text " * 50)
    os.symlink(d / "gone.txt", d / "b.txt")
    return ["--set", f"data.files={d}"], "b.txt is a broken or looping symbolic link"


def _yaml(text):
    def setup(d):
        (d / "run.yaml").write_text(text)
        return ["-c", str(d / "run.yaml")], "appears twice in one mapping"
    return setup


def _store_link(target):
    def setup(d):
        os.symlink(d / target, d / "link")
        return ["--store", str(d / "link" / "sub")], f"store: {d}/link/sub leads through {d}/link, a broken or looping"
    return setup


FILES = {
    "fifo in data.files": _fifo,
    "link to /dev/zero in data.files": _dev_zero,
    "dangling link in a data.files directory": _dangling_data,
    "duplicate YAML key": _yaml("bcd:\n  blocks: 2\n  blocks: 3\n"),
    "duplicate YAML section": _yaml("bcd:\n  blocks: 2\nseed: 1\nbcd:\n  cycles: 3\n"),
    "dangling store link": _store_link("nowhere"),
    "looping store link": _store_link("link"),
}


@pytest.mark.parametrize("setup", FILES.values(), ids=FILES.keys())
def test_bad_files_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, setup):
    """Special files, duplicate YAML keys, a store path through a broken link: refused naming the file or key
    (a FIFO or /dev/zero used to hang the run for ever; a duplicate key silently lost the first value)."""
    d = tmp_path / "in"
    d.mkdir()
    args, message = setup(d)
    before = _tree(tmp_path)
    store = [] if "--store" in args else ["--store", str(tmp_path / "store")]
    assert main(["train", *_sets(), *store, *args]) == 2
    line = _one_line(capsys)
    assert line.startswith("bcdflow: error: ") and message in line and "resume" not in line, line
    assert _tree(tmp_path) == before and not (tmp_path / "store").exists()
    if "--store" in args:
        assert main(["status", "r", *args]) == 2 and message in _one_line(capsys)


def test_export_onto_a_file_or_an_uncreatable_path(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["export", "r", str(tmp_path / "afile"), "--store", str(tmp_path / "s")]) == 2
    assert "export:" in _one_line(capsys) and (tmp_path / "afile").read_text() == "x"
    assert main(["export", "r", str(tmp_path / "afile" / "sub" / "out"), "--store", str(tmp_path / "s")]) == 2
    assert "export: cannot create" in _one_line(capsys)


# -- S3: which of credentials, endpoint, bucket; quickly, with no resume hint ----------------------------------

def test_s3_without_credentials(tmp_path, capsys, monkeypatch):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup on a laptop
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert main(["train", *_sets("s3.endpoint_url=http://127.0.0.1:9"), "--store", "s3://bkt/x"]) == 2
    line = _one_line(capsys)
    assert "no AWS credentials" in line and "resume" not in line


def test_s3_unreachable_or_missing_bucket(s3_server, tmp_path, capsys, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    assert main(["train", *_sets(f"s3.endpoint_url=http://127.0.0.1:{dead}"), "--store", "s3://bkt/x"]) == 2
    line = _one_line(capsys)
    assert "cannot reach the S3 endpoint" in line and "resume" not in line
    assert main(["status", "r", "--store", "s3://no-such-bucket/x", "--endpoint-url", s3_server.endpoint]) == 2
    assert "bucket 'no-such-bucket' does not exist" in _one_line(capsys)


# -- a damaged store: exit 1, naming the object --------------------------------------------------------------

@pytest.fixture(scope="module")
def finished(prefect_server, tmp_path_factory):
    """A finished 3-visit run to damage (each test damages a copy)."""
    root = tmp_path_factory.mktemp("finished") / "store"
    assert main(["train", *_sets(), "--store", str(root), "--run-id", "r"]) == 0
    return root


@pytest.fixture
def damaged(finished, tmp_path):
    copy = tmp_path / "store"
    shutil.copytree(finished, copy)
    return copy


def test_truncated_state(damaged, capsys):
    state = damaged / "runs" / "r" / "state.json"
    state.write_bytes(state.read_bytes()[:50])
    before = _tree(damaged)
    for args in (["status", "r"], ["resume", "r"], ["export", "r", str(damaged.parent / "out")]):
        assert main([*args, "--store", str(damaged)]) == 1
        line = _one_line(capsys)
        assert "runs/r/state.json is damaged (not valid JSON" in line and "bcdflow resume" not in line, line
    assert main(["train", *_sets(), "--store", str(damaged), "--run-id", "r"]) == 1
    assert "state.json is damaged" in _one_line(capsys)
    assert _tree(damaged) == before and not (damaged.parent / "out").exists()


def test_missing_config(damaged, capsys):
    (damaged / "runs" / "r" / "config.json").unlink()
    before = _tree(damaged)
    for args in (["status", "r"], ["resume", "r"]):
        assert main([*args, "--store", str(damaged)]) == 1
        assert "runs/r/config.json is missing" in _one_line(capsys)
    assert _tree(damaged) == before


def test_finished_run_whose_last_manifest_is_gone(damaged, capsys):
    """resume must notice, not say "done"; export of that version names the manifest; an earlier one exports."""
    (damaged / "runs" / "r" / "versions" / "3.json").unlink()
    before = _tree(damaged)
    assert main(["resume", "r", "--store", str(damaged)]) == 1
    line = _one_line(capsys)
    assert "runs/r/versions/3.json of version 3 is missing" in line and "bcdflow resume" not in line
    assert main(["export", "r", str(damaged.parent / "out"), "--store", str(damaged)]) == 1
    assert "versions/3.json" in _one_line(capsys) and not (damaged.parent / "out").exists()
    assert _tree(damaged) == before
    assert main(["export", "r", str(damaged.parent / "v2"), "--version", "2", "--store", str(damaged)]) == 0


def test_missing_block_file(damaged, capsys):
    entry = json.loads((damaged / "runs" / "r" / "versions" / "3.json").read_text())["blocks"]["2"]
    (damaged / "runs" / "r" / entry["file"]).unlink()
    assert main(["resume", "r", "--store", str(damaged)]) == 1
    line = _one_line(capsys)
    assert entry["file"] in line and "missing" in line


# -- a full disk: one line naming the file, exit 1, no temporary file left ------------------------------------

def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(damaged, tmp_path, capsys, monkeypatch):
    """Issue 17: a run on a full disk left ``*.tmp-*`` files in the store and its error named no file; ``export``
    onto a full disk printed a traceback. Now: the run's line names the object it could not write (and how to
    continue), export's names the file, each exits 1, and neither leaves a temporary file or directory."""
    from safetensors import SafetensorError

    from bcdflow.core import export
    from bcdflow.storage import store as store_mod

    before = _tree(damaged)
    fill_disk(monkeypatch, store_mod, lambda path: "/states/" in path)  # the continued run's first state (its fence)
    assert main(["train", *_sets("bcd.cycles=2"), "--store", str(damaged), "--run-id", "r"]) == 1
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err and len(lines) == 2, err
    assert lines[0].startswith("bcdflow: error: run r failed: OSError: [Errno 28] No space left on device: "
                               f"'{damaged}/runs/r/states/0000000000"), lines
    assert f"continue with: bcdflow resume r --store {damaged}" in lines[1]
    assert temporaries(damaged) == [] and runs.read_state(Store(str(damaged)), "r").version == 3

    def half(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    real_save = export.save_file
    fill_disk(monkeypatch, export, lambda path: path.endswith("config.json"))  # hf: after the weights
    for fmt, name, save in (("bcdflow", "model.safetensors", half), ("hf", "config.json", real_save)):
        monkeypatch.setattr(export, "save_file", save)
        out = tmp_path / f"out-{fmt}"
        assert main(["export", "r", str(out), "--format", fmt, "--store", str(damaged)]) == 1
        assert _one_line(capsys) == f"bcdflow: error: {out}/{name}: No space left on device"
        assert not out.exists() and temporaries(tmp_path) == []
    assert [f for f in _tree(damaged) if "/lease/" not in f] == [f for f in before if "/lease/" not in f]


# -- training that diverges ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_divergence_stops_the_visit_and_a_lower_lr_continues(prefect_server, tmp_path, capsys):
    store = str(tmp_path / "store")
    assert main(["train", *_sets("optim.lr=1e6"), "--store", store, "--run-id", "d"]) == 2
    line = _one_line(capsys)
    assert "visit c0-b0 of run 'd': training diverged at step" in line and "optim.lr=1e+06" in line
    assert "bcdflow train --run-id d --set optim.lr=" in line
    s = Store(store)
    assert runs.read_state(s, "d").version == 0 and not s.exists("runs/d/versions/1.json")  # nothing committed

    assert main(["train", *_sets("optim.lr=0.003"), "--store", store, "--run-id", "d"]) == 0
    state = runs.read_state(s, "d")
    assert state.status == "done" and state.version == 3
    assert runs.read_config(s, "d")["optim"]["lr"] == 0.003  # resume continues with the new rate
    final = checkpoints.load_blocks(s, "d", 3)
    assert all(torch.isfinite(t).all() for t in final.values())


# -- a read-only store: status and export read, and write nothing ----------------------------------------------

def _stat_tree(path) -> list[tuple]:
    """Every file and directory below ``path`` with its size and modification time: any write changes it."""
    out = []
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            st = os.lstat(os.path.join(root, n))
            out.append((os.path.relpath(os.path.join(root, n), path), st.st_size, st.st_mtime_ns))
    return sorted(out)


@pytest.fixture
def read_only(finished, monkeypatch):
    """``finished`` as a chmod -w store would be for a user who is not root (tests run as root, where chmod stops
    nothing): no write permission reported for it, and any write below it raises."""
    import builtins
    import io

    root = str(finished)

    def below(p) -> bool:
        return isinstance(p, (str, os.PathLike)) and os.path.abspath(os.fspath(p)).startswith(root)

    def refuse(*a, **k):
        raise AssertionError(f"a write to the read-only store: {a[:2]}")

    access, real_open = os.access, builtins.open
    monkeypatch.setattr(os, "access", lambda p, mode, **k: False if mode & os.W_OK and below(p) else access(p, mode, **k))

    def guarded_open(file, mode="r", *a, **k):
        if below(file) and set(mode) & set("wax+"):
            refuse(file, mode)
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(io, "open", guarded_open)
    for name in ("write_bytes", "write_json", "create", "rm"):
        monkeypatch.setattr(Store, name, refuse)
    for name in ("replace", "rename", "link", "makedirs", "mkdir", "remove", "unlink", "rmdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, **k: refuse(*a) if below(a[0]) or
                            (len(a) > 1 and below(a[1])) else _real(*a, **k))
    return finished


def test_status_and_export_on_a_read_only_store(read_only, tmp_path, capsys):
    """Read commands work on a store they may not write (issue 17: they refused it, the probe asked for write
    permission), and make no write at all."""
    before = _stat_tree(read_only)
    assert main(["status", "r", "--json", "--store", str(read_only)]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == 3
    assert main(["compare", "r", "r", "--json", "--store", str(read_only)]) == 0
    for fmt in ("bcdflow", "hf"):
        out = tmp_path / f"out-{fmt}"
        assert main(["export", "r", str(out), "--format", fmt, "--store", str(read_only)]) == 0
        assert (out / "model.safetensors").exists() or list(out.glob("*.safetensors"))
    assert _stat_tree(read_only) == before


def test_resume_after_the_data_changed_is_refused(prefect_server, tmp_path, capsys):
    """The token dataset id (a hash of the files' contents) is part of a run's identity: the same data.files path
    with new contents is refused on resume, naming data.files, before anything is written (issue 17: the run
    continued on the new data, mixing it with the old data's checkpoints and activations)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read())
    store = tmp_path / "store"
    assert main(["train", *_sets(f"data.files={corpus}", "bcd.cycles=1"), "--store", str(store),
                 "--run-id", "d"]) == 0
    capsys.readouterr()
    # as if interrupted between its last visit and its end (a finished run has nothing to resume: it says so)
    from bcdflow.storage import runs
    from bcdflow.storage.store import Store

    state = runs.read_state(Store(str(store)), "d")
    runs.write_state(Store(str(store)), state.model_copy(update={"status": "running", "stop_reason": None}))
    corpus.write_text(corpus.read_text().replace("parser", "PARSER"))
    before = _tree(store)
    for args in (["resume", "d", "--store", str(store)],
                 ["train", *_sets(f"data.files={corpus}", "bcd.cycles=1"), "--store", str(store), "--run-id", "d"]):
        assert main(args) == 2
        line = _one_line(capsys)
        assert "data.files: the data of run 'd' changed since it started" in line and "resume" not in line, line
    assert _tree(store) == before
