"""Run one rank's program and record its peak RSS when it ends.

    torchrun ... bench/_rank_rss.py -m trainer_pkg.launch --config job.json
    torchrun ... bench/_rank_rss.py bench/handwritten_ddp.py --data d.npz ...

The program runs in this process (``runpy``, as ``python -m``/``python script.py`` would run it), so
its footprint is this process's. At exit the peak resident set size (``VmHWM`` in
``/proc/self/status``) is written to ``$BENCH_RSS_DIR/rank<RANK>.json``, with the resident anonymous
and file-backed memory at that moment (``RssAnon``, ``RssFile``: a memory-mapped file's pages the
rank touched count in the latter), and the CPU seconds the process used, every thread's, user and
system (``cpu_s``, ``os.times``), of which its hardware sampler took ``sampling_cpu_s``
(``trainer_pkg.hardware.sampling_cpu_s``; 0 when the rank did not sample itself). With ``$BENCH_PROFILE_DIR`` set, the whole program also runs under
``cProfile`` and each rank's statistics go to ``$BENCH_PROFILE_DIR/rank<RANK>.prof`` (a diagnostic:
profiling slows Python-heavy code, so never time a profiled run). The trainer and the
hand-written loop are measured by this same wrapper, so whatever the wrapper itself costs (nothing
measurable: runpy is what ``-m`` uses anyway) cancels in the difference.
"""

import cProfile
import json
import os
import runpy
import sys


def status_kb(*fields: str) -> dict[str, int]:
    """The given fields of ``/proc/self/status`` in kB (0 when absent)."""
    out = dict.fromkeys(fields, 0)
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in out:
                out[name] = int(line.split()[1])
    return out


def vmhwm_kb() -> int:
    return status_kb("VmHWM")["VmHWM"]


_PROFILE: cProfile.Profile | None = None


def record() -> None:
    global _PROFILE
    if _PROFILE is not None:
        _PROFILE.disable()
        _PROFILE.dump_stats(os.path.join(os.environ["BENCH_PROFILE_DIR"], f"rank{os.environ.get('RANK', '0')}.prof"))
        _PROFILE = None
    out = os.environ.get("BENCH_RSS_DIR")
    if out:
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
            kb = status_kb("VmHWM", "RssAnon", "RssFile")
            times = os.times()
            hardware = sys.modules.get("trainer_pkg.hardware")  # loaded where the rank samples itself
            json.dump({"rank": int(rank), "vmhwm_kb": kb["VmHWM"], "rss_anon_kb": kb["RssAnon"],
                       "rss_file_kb": kb["RssFile"], "pid": os.getpid(),
                       "cpu_s": times.user + times.system,
                       "sampling_cpu_s": getattr(hardware, "sampling_cpu_s", 0.0)}, f)


def main() -> None:
    args = sys.argv[1:]
    if not args:
        sys.exit("usage: _rank_rss.py (-m MODULE | SCRIPT) [ARGS...]")
    # The trainer ends its ranks with os._exit (trainer_pkg.metrics.exit_process), which skips the
    # finally below: record the peak there too.
    real_exit = os._exit

    def exit_after_record(code: int) -> None:
        record()
        real_exit(code)

    os._exit = exit_after_record
    if os.environ.get("BENCH_PROFILE_DIR"):
        global _PROFILE
        _PROFILE = cProfile.Profile()
        _PROFILE.enable()
    code: object = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    finally:
        record()
    sys.exit(code)


if __name__ == "__main__":
    main()
