"""The fault campaign's quick version: a few trials of each kind, all against the real CLI.

The full campaign (50+ kill and 50+ corruption trials) is `python tools/faults.py`; its summary
is in the README's reliability section.
"""

import subprocess
import sys

from harness.processes import fork_server
from verlj_testing import REPO, env


def test_quick_fault_campaign():
    # the kinds no dedicated test holds. The others have theirs: kill in test_recovery.py (random kills),
    # corruption in test_verify_inspect.py and test_recovery.py (damaged snapshots fall back) and
    # test_hardening.py (a damaged journal), node-loss in test_shipping.py (a node lost at a random moment)
    # and test_node_loss.py (at each crash point; two-writers: a second trainer on a live shipped run),
    # async in test_async.py, bitflip in test_rerun.py (a gradient and a parameter bit flipped), fleet in test_fleet.py (an actor
    # killed; --quick leaves fleet out: each of its trials starts a trainer and two Ray actors)
    kinds = "disk-full,concurrency,bad-input"
    cmd = [sys.executable, "tools/faults.py", "--quick", "--seed", "5", "--kinds", kinds]
    e = env()
    server = fork_server(e)
    if server is not None and server.serves(e):  # each trial's `python -m verlj.cli ...` forked by the suite's fork server
        cmd += ["--python", server.rank_python]
        e["VERLJ_FORKSERVER_SOCKET"] = server.socket
    before = len(server.said()) if "--python" in cmd else 0
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=e, timeout=1200)
    if "--python" in cmd:
        assert sum(line.startswith("forked verlj.cli") for line in server.said()[before:]) >= 10  # the trials' runs: forked
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " 0 failed, 0 silent" in summary
    for kind in kinds.split(","):
        assert any(line.startswith(kind) for line in out.stdout.splitlines()), kind
