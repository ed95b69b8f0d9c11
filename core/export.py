"""Export one version of a run as a standalone model directory (``bcdflow export``, and the MLflow
``model/`` artifact at the end of a run):

    out_dir/model.safetensors   every block's tensors, merged (metadata: run_id, version)
    out_dir/config.json         run id, version, resolved model config, block plan, dataset id
    out_dir/tokenizer.json      the run's tokenizer, when the dataset has one
"""
from __future__ import annotations

import json
import os

from safetensors.torch import save_file

from storage import checkpoints, runs
from storage.store import Store


def export_version(store: Store, run_id: str, version: int, out_dir: str) -> int:
    """Write version ``version`` of ``run_id`` to ``out_dir``; returns the number of tensors."""
    tensors = checkpoints.load_blocks(store, run_id, version)
    cfg = runs.read_config(store, run_id)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"),
              metadata={"run_id": run_id, "version": str(version)})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump({"run_id": run_id, "version": version, "model": cfg["model_resolved"],
                   "plan": cfg["plan"], "dataset": cfg["dataset"]}, f, indent=2)
    tok = f"datasets/{cfg['dataset']}/tokenizer.json"
    if store.exists(tok):
        with open(os.path.join(out_dir, "tokenizer.json"), "wb") as f:
            f.write(store.read_bytes(tok))
    return len(tensors)
