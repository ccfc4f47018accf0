"""Ctrl-C to train.py early, many at once under load, with diagnostics for any that hang.
python3 .gpu_int.py OUT_JSON COPIES ROUNDS"""
import json, os, signal, subprocess, sys, tempfile, threading, time
import conftest  # the test session's environment
import jax
print(jax.devices(), os.environ.get("XLA_FLAGS"), flush=True)
from test_train import FAST, HERE
from test_interrupts import wait_until_jax_loads
out_json, copies, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tmp = tempfile.mkdtemp()
results, lock = [], threading.Lock()

def proc_info(pid):
    info = {}
    for f in ("status",):
        try:
            info["state"] = [l for l in open(f"/proc/{pid}/status") if l.startswith(("State", "Threads"))]
        except OSError as e:
            info["state"] = repr(e)
    tasks = []
    try:
        for t in sorted(os.listdir(f"/proc/{pid}/task")):
            d = f"/proc/{pid}/task/{t}"
            try:
                stat = open(d + "/stat").read().split(") ")[1].split()[0]
                tasks.append([t, open(d + "/comm").read().strip(), stat, open(d + "/wchan").read().strip(),
                              open(d + "/syscall").read().strip()[:60] if os.access(d + "/syscall", os.R_OK) else ""])
            except OSError as e:
                tasks.append([t, repr(e)])
    except OSError as e:
        tasks = repr(e)
    info["tasks"] = tasks
    return info

def trial(i, delay):
    env = conftest.job_env(PYTHONFAULTHANDLER="1")
    d = f"{tmp}/r{i}"
    p = subprocess.Popen([sys.executable, "train.py"] + FAST + ["--out", d, "--cache-dir", f"{tmp}/c{i // 2}"], cwd=HERE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    t0 = time.time()
    wait_until_jax_loads(p)
    t1 = time.time()
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    r = {"i": i, "delay": delay, "to_jax_s": t1 - t0}
    try:
        o, e = p.communicate(timeout=60)
        r.update(code=p.returncode, end_s=time.time() - t1 - delay, out_len=len(o), err=e[-2000:], err_len=len(e))
    except subprocess.TimeoutExpired:
        r["hung"] = proc_info(p.pid)
        p.send_signal(signal.SIGABRT)  # faulthandler: every thread's Python traceback on stderr
        try:
            o, e = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill(); o, e = p.communicate()
        r.update(code=p.returncode, out_len=len(o), err=e[-6000:], err_len=len(e))
    with lock:
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k not in ("err", "hung")}), "HUNG" if "hung" in r else "",
              flush=True)

delays = [0.2, 2.0]
n = 0
for _ in range(rounds):
    ths = []
    for c in range(copies):
        def pair(n=n):
            trial(n, 0.2); trial(n + 1, 2.0)
        th = threading.Thread(target=pair); th.start(); ths.append(th); n += 2
    for th in ths:
        th.join()
json.dump(results, open(out_json, "w"), indent=1)
codes = {}
for r in results:
    codes[(r["delay"], r.get("code"), "hung" in r)] = codes.get((r["delay"], r.get("code"), "hung" in r), 0) + 1
print(sorted(codes.items()))
