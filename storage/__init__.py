"""Storage layer: fsspec + Zarr + safetensors. Knows nothing of Prefect or MLflow (DESIGN §4)."""
