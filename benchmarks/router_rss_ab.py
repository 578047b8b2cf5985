"""Router native-memory growth per client cancel, two source trees side by side: a router from an
earlier commit (a git worktree, removed afterwards) and one from this tree, each in front of a
tiny-model worker of its own, both driven with one kind of request (default: streams the client
cancels 0-30 ms in); prints each router's and each worker's anonymous RSS every 30 s
(docs/reliability.md, "Soak").

    .venv/bin/python benchmarks/router_rss_ab.py BASE_REV MINUTES CONCURRENCY [KIND]   # from the repo root
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.router_rss_by_request_kind import measure, start_router  # noqa: E402
from llmserve.modelgen import make_model  # noqa: E402
from tests.integration.test_router import engine_flags, spawn  # noqa: E402


def main() -> None:
    base_rev, minutes, concurrency = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    kind = sys.argv[4] if len(sys.argv) > 4 else "cancel"  # a kind of benchmarks/router_rss_by_request_kind.py
    work = Path(tempfile.mkdtemp())
    base = work / "base"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), base_rev], check=True,
                   stdout=subprocess.DEVNULL)
    model = make_model(work / "m", arch="llama", preset="tiny", seed=0)
    tokenizer = spawn("tokenizer", ["tokenizer", "--model", str(model)], work)
    workers = [spawn(f"worker-{side}", ["worker", "--model", str(model), *engine_flags()], work)
               for side in ("base", "this")]
    procs = [tokenizer, *workers]
    try:
        deadline = time.monotonic() + 120
        for p in procs:
            p.wait_port(deadline)
        routers = [start_router("base", tokenizer, workers[0], work, deadline, source=base),
                   start_router("this", tokenizer, workers[1], work, deadline, source=ROOT)]
        procs += routers
        asyncio.run(measure(routers, [kind, kind], minutes, concurrency, also=workers))
    finally:
        for p in procs:
            p.proc.terminate()
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)


if __name__ == "__main__":
    main()
