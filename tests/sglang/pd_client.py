"""A P/D client run inside a testbed namespace (``ip netns exec NS python pd_client.py ...``),
where the servers' addresses are reachable: test_testbed.py's hands there. Standard library.

    pd_client.py wait URL [URL ...]
    pd_client.py pd PREFILL_URL DECODE_URL BOOTSTRAP_PORT LENGTHS   # one JSON line per prompt
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.sglang import harness


def wait(urls: list[str], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"{url} not ready after {timeout_s:.0f} s")
            time.sleep(0.5)


def main() -> None:
    if sys.argv[1] == "wait":
        wait(sys.argv[2:])
        return
    prefill, decode, bport, lengths = sys.argv[2:6]
    for n in (int(x) for x in lengths.split(",")):
        body = harness.request_body(harness.prompt_of(n, seed=n))
        body.update(bootstrap_host=prefill.split("//")[1].rsplit(":", 1)[0],
                    bootstrap_port=int(bport), bootstrap_room=random.randint(0, 2**62))
        with cf.ThreadPoolExecutor(2) as ex:
            fp = ex.submit(harness.generate, prefill, body, 300)
            fd = ex.submit(harness.generate, decode, body, 300)
            (sp, _jp, _tp), (sd, jd, td) = fp.result(), fd.result()
        print(json.dumps({"length": n, "prefill_status": sp, "decode_status": sd,
                          "ids": harness.output_ids(jd), "decode_s": td,
                          "answer": None if sd == 200 else jd}), flush=True)


if __name__ == "__main__":
    main()
