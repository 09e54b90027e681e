"""The main job on embedded defaults: sim peers through `replay-proxy record`.

Two sim engines and a sim frontend with two API servers talk through the
recording proxy, each in its own process; the recording lands in
demo/demo.db of the folder it runs in (the project's, from demo.sh; ignored
by git: the committed recordings/demo.db is the tests' fixture, which the demo
leaves alone), and a few example queries show what it holds.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from replay_proxy.processes import Child, free_port

DB = Path("demo") / "demo.db"
CLI = [sys.executable, "-m", "replay_proxy"]
QUERIES = [
    ["--preset", "frames-by-kind"],
    ["--preset", "engines"],
    ["SELECT request_id, engine_index, client_index, tokens, finish_reason, "
     "round(ttft_ms, 2) AS ttft_ms FROM request_timeline ORDER BY added_ns LIMIT 8"],
    ["SELECT method, engine_index, client_index, result FROM utility_calls LIMIT 4"],
]


def main() -> None:
    DB.parent.mkdir(exist_ok=True)
    DB.unlink(missing_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="replay-proxy-demo-"))
    frontend_port, listen_port = free_port(), free_port()
    upstream, listen = f"tcp://127.0.0.1:{frontend_port}", f"tcp://127.0.0.1:{listen_port}"
    children = []
    try:
        proxy = Child([*CLI, "record", "--listen", listen, "--upstream", upstream, "--db", str(DB),
                       "--session", "demo"], logs / "proxy.log", name="replay-proxy record")
        children.append(proxy)
        proxy.wait_for_log("listening on", timeout=30)
        frontend = Child([*CLI, "sim", "frontend", "--handshake", upstream, "--engines", "2",
                          "--api-servers", "2", "--requests", "20"], logs / "frontend.log", name="sim frontend")
        children.append(frontend)
        for index in range(2):
            children.append(Child([*CLI, "sim", "engine", "--handshake", listen, "--index", str(index)],
                                  logs / f"engine-{index}.log", name=f"sim engine {index}"))
        if frontend.wait(timeout=60) != 0:
            sys.exit(f"sim frontend failed:\n{frontend.log_tail()}")
        print(frontend.log_tail(1))
        if proxy.stop(timeout=30) != 0:
            sys.exit(f"replay-proxy record failed:\n{proxy.log_tail()}")
        print(proxy.log_tail(1))
    finally:
        for child in children:
            child.stop()
    shutil.rmtree(logs)  # (a failure above exits with the log's tail, and keeps the folder)
    for query in QUERIES:
        print(f"\n$ replay-proxy query --db demo/demo.db {' '.join(repr(q) if ' ' in q else q for q in query)}")
        subprocess.run([*CLI, "query", "--db", str(DB), *query], check=True, timeout=60)


if __name__ == "__main__":
    main()
