"""Issue 41's rate sweep on the held-out seed 3: each rate's baseline, and each BCD setting's steps to the tuned
baseline's L* (the best rate's 600-step validation loss + 0.02) where its curve reaches it. From the repository root:

    .venv/bin/python docs/results/rates-2026-11-28/analyze.py
"""
import glob, json, sys

def first(curve, target):
    for p in curve:
        if p["val_loss"] <= target:
            return p["step"]
    return None

runs = {}
for f in sorted(glob.glob("docs/results/rates-2026-11-28/sweep-seed3/lr-*/suite.json")):
    lr = f.split("lr-")[1].split("/")[0]
    runs[float(lr)] = json.load(open(f))["groups"][0]["seeds"]["3"]
full = {lr: r["full"] for lr, r in runs.items()}
best_lr = min(full, key=lambda k: full[k]["final_val"])
target = full[best_lr]["final_val"] + 0.02
full_steps = first(full[best_lr]["curve"], target)
print(f"baseline (full AdamW, 600 steps) final val by rate: " + ", ".join(f"{k:g}: {v['final_val']:.3f}" for k, v in sorted(full.items())))
print(f"tuned baseline: lr {best_lr:g}, L* = {target:.3f}, reached at step {full_steps}")
print("| setting | " + " | ".join(f"lr {k:g}" for k in sorted(runs)) + " |")
for s in ["keep-adaptive", "lora-r16", "sign-lr-quarter"]:
    cells = []
    for lr in sorted(runs):
        r = runs[lr]["settings"].get(s)
        if not r:
            cells.append("–"); continue
        st = first(r["run"]["curve"], target)
        own = r["steps"]["value"] if isinstance(r["steps"], dict) else r["steps"]
        cells.append(f"{st / full_steps:.2f}x ({st})" if st else f"not reached (min {r['run']['best_val']:.3f}; B-F at own rate {own:.2f})")
    print(f"| {s} | " + " | ".join(cells) + " |")
