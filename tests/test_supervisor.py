"""The supervisor's restart policy on an injected clock (no processes), its status
endpoint, and the removal of /dev/shm segments of dead owners."""

import json
import os
import subprocess
import sys
import urllib.request

from splitserve.deploy.supervisor import BACKOFF_MAX_S, HEALTHY_AFTER_S, Supervisor
from splitserve.node.shm_segments import list_segments, owner_pid, remove_dead_segments, segment_name


class Fake:
    """Members whose exit codes the test sets; respawn records and revives."""

    def __init__(self):
        self.now = 0.0
        self.codes = {"prefill-0": None, "router": None}
        self.respawned, self.forgotten = [], []

    def respawn(self, name):
        self.respawned.append((name, self.now))
        self.codes[name] = None

    def supervisor(self):
        return Supervisor(lambda: list(self.codes), self.codes.get, self.respawn, self.forgotten.append,
                          clock=lambda: self.now)


def test_dead_member_restarts_with_exponential_backoff_and_others_untouched():
    f = Fake()
    sup = f.supervisor()
    sup.poll()
    delays = []
    for _ in range(8):  # crash-loops right after every start
        f.codes["prefill-0"] = -9
        sup.poll()
        died, n = f.now, len(f.respawned)
        while len(f.respawned) == n:
            f.now += 0.25
            sup.poll()
        delays.append(f.respawned[-1][1] - died)
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == BACKOFF_MAX_S
    assert f.forgotten == ["prefill-0"] * 8 and all(n == "prefill-0" for n, _ in f.respawned)
    st = {m["name"]: m for m in sup.status()["members"]}
    assert st["prefill-0"]["restarts"] == 8 and st["prefill-0"]["last_exit"] == -9
    assert st["router"]["restarts"] == 0 and st["router"]["alive"]

    f.now += HEALTHY_AFTER_S  # ran long enough: the next death restarts quickly again
    f.codes["prefill-0"] = 1
    sup.poll()
    f.now += 0.5
    sup.poll()
    assert f.respawned[-1] == ("prefill-0", f.now)


def test_status_endpoint_serves_counters():
    f = Fake()
    sup = f.supervisor()
    sup.poll()
    f.codes["router"] = -9
    sup.poll()
    port = sup.serve_status()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            st = json.loads(r.read())
        assert {m["name"]: m["alive"] for m in st["members"]} == {"prefill-0": True, "router": False}
        f.now += 1
        sup.poll()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            assert 'splitserve_launcher_restarts_total{member="router"} 1' in r.read().decode()
    finally:
        sup.close()


def test_segments_of_dead_owners_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    mine, gone = segment_name(os.getpid()), segment_name(dead.pid)
    for name in (mine, gone, "splitserve-kv-notapid", "other-file"):
        (tmp_path / name).write_bytes(b"x")
    assert owner_pid(gone) == dead.pid and owner_pid("other-file") is None
    assert list_segments(str(tmp_path)) == sorted([mine, gone])
    assert remove_dead_segments(str(tmp_path)) == [gone]
    assert sorted(os.listdir(tmp_path)) == sorted([mine, "splitserve-kv-notapid", "other-file"])
