"""``python -m benchmarks run [--quick] [--only NAME ...] [--out DIR]`` (see benchmarks/cli.py)."""
import sys

from benchmarks.cli import main, setup_env

setup_env()
sys.exit(main())
