"""One `nki-autotune run`-like tuner process for the multi-worker tests: the real storage and claiming, a fake
compiler and clock (nothing is compiled), and the machine lock, whose holding times it logs.

    python fake_worker.py STORAGE PROFILE OUT --step 0.02 --lease 600 --heartbeat 1 --lock-log LOG --lock PATH \
        [--trials N]
"""

import argparse
import contextlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for fakes

from fakes import EagerCpu, FakeClock, QuietMeter  # noqa: E402

import nki_autotune.kernels  # noqa: E402, F401
from nki_autotune.autotune.calibration import Calibration  # noqa: E402
from nki_autotune.autotune.measure import LocalBench, machine_lock  # noqa: E402
from nki_autotune.autotune.search import Search, open_storage  # noqa: E402
from nki_autotune.autotune.tuner import Options, Tuner  # noqa: E402
from nki_autotune.registry import load_profile, ops  # noqa: E402


class Slow(FakeClock):
    """Each timed step takes real time, so two workers overlap."""

    def __init__(self, step_s):
        super().__init__(lambda cfg: 40.0 if cfg["threads"] == 2 else 90.0)
        self.step_s = step_s

    def time(self, runner, i):
        time.sleep(self.step_s)
        return super().time(runner, i)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("storage")
    p.add_argument("profile")
    p.add_argument("out")
    p.add_argument("--step", type=float, default=0.02)
    p.add_argument("--lease", type=float, default=600.0)
    p.add_argument("--heartbeat", type=int, default=1)
    p.add_argument("--lock", required=True)
    p.add_argument("--lock-log", required=True)
    p.add_argument("--trials", type=int, default=20)
    a = p.parse_args()

    @contextlib.contextmanager
    def logged_lock():
        with machine_lock(a.lock):
            t0 = time.time()
            yield
            with open(a.lock_log, "a") as f:
                f.write(f"{t0} {time.time()}\n")

    be, clock = EagerCpu(), Slow(a.step)
    options = Options(trials=a.trials, search_rounds=3, final_rounds=4, sets=1, pause_s=0, poll_s=0.2)
    bench = LocalBench(be, options.measure(), clock=clock, calibration=Calibration(be, clock, QuietMeter()),
                       lock=logged_lock)
    search = Search(open_storage(a.storage, heartbeat_s=a.heartbeat), be.fingerprint(), trials=a.trials,
                    lease_s=a.lease)
    Tuner(be, search, bench, options).tune(load_profile(a.profile, ops())).save(a.out)


if __name__ == "__main__":
    main()
