"""What a run reports: the one seam to MLflow (``tracker``) and the figures and tables it logs
(``report``). No Prefect here; the Prefect artifacts live in ``flows/artifacts.py``."""
