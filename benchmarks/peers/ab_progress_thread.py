"""A/B of the client's NIXL progress thread across harness hosts (the first fix of issue 14).

    flock /tmp/kvpool-heavy.lock .venv/bin/python benchmarks/peers/ab_progress_thread.py base,noprog 6

A master (host m) and one node (host n) stay up; client processes on host c alternate between
`base` (NIXL's UCX progress thread on, as before the fix) and `noprog` (off, as DataPlane does
now), reversing the order every round. Each reads 48 x 1 MiB and 6 x 16 MiB (every byte
compared) and prints GB/s and its CPU seconds. Variants: base, noprog, lazy (progress thread on,
no spinning and up to 2 ms between polls), fastpoll (no thread, at most 50 us between polls), spin
(no thread, no sleep between polls), nospin (no 200 us busy phase), sleep2 / sleep4 (sleeps grow
to 2 / 4 ms instead of 1 ms). The put figure is the process's first put (NIXL start-up
included), not a bandwidth.
"""
import sys, os, json, subprocess
from kvpool.bench import hosts, procs
CODE = r'''
import numpy as np, time, json, sys
variant = sys.argv[2]
import kvpool.transfer.nixlio as nx
if variant == "lazy":
    nx._SPIN_S = 0.0; nx._MAX_SLEEP_S = 0.002
elif variant == "fastpoll":  # no thread; sleeps between polls capped at 50 us instead of 1 ms
    nx._MAX_SLEEP_S = 0.00005
elif variant == "spin":  # no thread; never sleeps between polls (one core busy while waiting)
    nx._SPIN_S = 1e9
elif variant == "nospin":  # no thread; sleeps from the first poll on (no 200 us busy phase)
    nx._SPIN_S = 0.0
elif variant == "sleep2":  # no thread; sleeps between polls grow to 2 ms instead of 1 ms
    nx._MAX_SLEEP_S = 0.002
elif variant == "sleep4":  # no thread; sleeps between polls grow to 4 ms
    nx._MAX_SLEEP_S = 0.004
from kvpool.client import Client
from kvpool.transfer import DataPlane
plane = DataPlane(nixl_progress_thread=variant in ("base", "lazy"))
c = Client(sys.argv[1], "u", timeout_s=30, plane=plane)
out = {}
for size, n in [(1<<20, 48), (16<<20, 6)]:
    src = np.random.default_rng(0).integers(0,256,size*n,dtype=np.uint8); dst = np.zeros_like(src)
    c.register(src); c.register(dst)
    A = lambda b: [[b.ctypes.data + i*size] for i in range(n)]
    keys = [f"{variant}/{size}/{i}" for i in range(n)]
    t = time.perf_counter(); assert c.put_from(keys, A(src), [[size]]*n, parents=[None]*n) == [0]*n; put = size*n/(time.perf_counter()-t)/1e9
    gs = []
    for r in range(4):
        dst[:] = 0; t = time.perf_counter(); k = c.get_into(keys, A(dst), [[size]]*n); gs.append(size*n/(time.perf_counter()-t)/1e9)
        assert k == n and np.array_equal(src, dst), k
    c.remove(keys)
    cpu = time.process_time()
    out[size] = [round(float(np.median(gs[1:])), 3), round(put, 3)]
out["cpu_s"] = round(time.process_time(), 2)
print(json.dumps(out))
'''
variants = sys.argv[1].split(",")
res = {v: [] for v in variants}
with hosts.HostNetwork(["m", "n", "c"]) as net:
    wd = procs.scratch_dir("poll-")
    m = procs.ManagedProcess("master", net["m"].wrap(procs.kvpool_argv("master", "--insecure", "--host", net["m"].address, "--port", "0", "--lease-ttl-s", "5")), wd).start(30)
    node = procs.ManagedProcess("node", net["n"].wrap(procs.kvpool_argv("node", "--master", m.info["address"], "--memory", "512MiB")), wd).start(60)
    for r in range(int(sys.argv[2])):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            out = subprocess.run(net["c"].wrap([sys.executable, "-c", CODE, m.info["address"], v]), capture_output=True, text=True)
            if out.returncode: print(v, out.stderr[-800:]); continue
            res[v].append(json.loads(out.stdout.splitlines()[-1])); print(r, v, res[v][-1], round(os.getloadavg()[0],1), flush=True)
    node.stop(); m.stop()
