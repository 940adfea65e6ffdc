"""engine_overhead under GIL contention, for trees whose engine_overhead has no --gil-threads: two Python threads
hold the GIL 50 us of every 200 (as `engine_overhead --gil-threads 2` does) at a 100 us switch interval, then
`python -m triton_mtp.bench.engine_overhead` runs with the remaining arguments, from whichever tree
PYTHONPATH puts first.

    python ab.py <engine_overhead arguments>
"""
import sys
import threading
import time

from triton_mtp.bench import engine_overhead

sys.setswitchinterval(100e-6)


def spin() -> None:
    while True:
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass
        time.sleep(150e-6)


for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
engine_overhead.main(sys.argv[1:])
