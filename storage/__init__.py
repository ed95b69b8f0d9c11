"""Storage layer: fsspec + Zarr + safetensors. Knows nothing of Prefect or MLflow (docs/DESIGN.md §4)."""
