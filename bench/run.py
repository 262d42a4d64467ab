#!/usr/bin/env python
"""The GPU run's entry point (``bench/gpu.sh``, stage ``bench``; the code is ``_gpu.py``)::

    python bench/run.py --gpu --json OUT/results-gpu.json             # on a GPU
    python bench/run.py --gpu --cpu-dry-run --json /tmp/gpu-dry.json  # toy size, CPU

The CPU ``--quick`` mode is in git: ``git show a1e47fe:bench/run.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gpu import cli  # noqa: E402

if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
