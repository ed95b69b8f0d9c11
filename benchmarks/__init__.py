"""bcdflow benchmarks: the paper's claims measured side by side on this machine (``python -m benchmarks run``)."""
