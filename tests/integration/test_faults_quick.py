"""The fault campaign's quick version: a few trials of each kind, all against the real CLI.

The full campaign (50+ kill and 50+ corruption trials) is `python tools/faults.py`; its summary
is in the README's reliability section.
"""

import subprocess
import sys

from verlj_testing import REPO, env


def test_quick_fault_campaign():
    # every kind but kill, node-loss, async, two-writers and bitflip, which tests/integration/test_recovery.py
    # (random kills), test_shipping.py (a node lost at a random moment), test_node_loss.py (at each crash
    # point; a second trainer on a live shipped run, from this node and another), test_async.py and
    # test_rerun.py (a gradient and a parameter bit flipped, found by verlj rerun) cover with the same scenarios
    kinds = "corruption,disk-full,concurrency,bad-input"
    out = subprocess.run([sys.executable, "tools/faults.py", "--quick", "--seed", "5", "--kinds", kinds], capture_output=True, text=True,
                         cwd=REPO, env=env(), timeout=1200)
    print(out.stdout[-6000:])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " 0 failed, 0 silent" in summary
    for kind in kinds.split(","):
        assert any(line.startswith(kind) for line in out.stdout.splitlines()), kind
