"""Peak memory of ``python -m jaxamp.review`` against the size of ``metrics.jsonl``.

Writes run folders of the same 1000 steps (logged again and again, as a run resumed over the
same steps would) at several file sizes, reviews each in a fresh interpreter and reports the
peak RSS (``ru_maxrss``), with the ratio to the smallest file's and to the file size::

    python bench/review_memory.py            # 2 MB, 20 MB and 200 MB files
    python bench/review_memory.py --mb 2 20  # other sizes
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS = 1000
_PROBE = ("import resource, sys\n"
          "from jaxamp.review import main\n"
          "code = main([sys.argv[1], '--json'])\n"
          "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, code, file=sys.stderr)\n")


def write_metrics(run: Path, megabytes: float, steps: int = STEPS) -> int:
    """``run/metrics.jsonl`` of about ``megabytes`` MB: ``steps`` healthy steps repeated; its
    size in bytes."""
    run.mkdir(parents=True, exist_ok=True)
    block = "".join(json.dumps({
        "step": s, "loss": 2.0 + 3.0 * math.exp(-s / 300) + 0.01 * math.sin(s),
        "loss_scale": 65536.0, "grad_norm": 0.5 + 0.1 * math.cos(s), "grads_finite": True,
        "skipped": False, "skipped_steps": 0, "loss_scale_at_min": False,
        "tokens_per_s": 10000.0 + s}) + "\n" for s in range(1, steps + 1)).encode()
    repeats = max(1, round(megabytes * 1e6 / len(block)))
    with open(run / "metrics.jsonl", "wb") as f:
        for _ in range(repeats):
            f.write(block)
    return repeats * len(block)


def peak_rss_of_review(run: Path) -> tuple[int, int]:
    """(peak RSS in bytes, exit status) of ``python -m jaxamp.review run`` in a fresh
    interpreter."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(run)], capture_output=True,
                          text=True, timeout=600)
    kib, code = proc.stderr.strip().splitlines()[-1].split()
    return int(kib) * 1024, int(code)  # ru_maxrss is in KiB on Linux


def measure(sizes_mb: list[float]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in sizes_mb:
            run = Path(tmp) / f"run-{mb:g}"
            size = write_metrics(run, mb)
            peak, code = peak_rss_of_review(run)
            rows.append({"file_bytes": size, "peak_rss_bytes": peak, "exit_status": code})
            (run / "metrics.jsonl").unlink()
    base = rows[0]["peak_rss_bytes"]
    for r in rows:
        r["peak_vs_smallest"] = r["peak_rss_bytes"] / base
        r["peak_vs_file_size"] = r["peak_rss_bytes"] / r["file_bytes"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, nargs="+", default=[2, 20, 200])
    rows = measure(p.parse_args(argv).mb)
    print(f"{'file':>10} {'peak RSS':>10} {'vs smallest':>12} {'vs file':>8} status")
    for r in rows:
        print(f"{r['file_bytes'] / 1e6:8.1f}MB {r['peak_rss_bytes'] / 1e6:8.1f}MB "
              f"{r['peak_vs_smallest']:11.2f}x {r['peak_vs_file_size']:7.3f}x "
              f"{r['exit_status']:>6}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
