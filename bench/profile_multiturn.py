"""Profile: where the time of a multi-turn (calculator, no tool latency) run goes, and how many cores it keeps busy."""
# Issue 31's part 2. The same warm-started calculator policy as bench/trl_vs_molt.py part 2 (without latency) trains
# at max_staleness 0 and 2. Meanwhile a sampling profiler reads every Python thread's stack every few milliseconds
# and files each sample under what that thread was doing:
#   waiting       the innermost frame blocks (a lock, a condition, the event loop's select, a queue)
#   sampler       inside molt_engine/inference/sampler.py (the decode steps: the model's forward, sampling, KV cache)
#   trainer       inside update.py / algo.py (log-probs, loss, backward, optimizer step)
#   env           inside envs.py, molt_envs/builtin.py / chat.py (the env's turns, tool calls, rewards)
#   tokenization  inside tokenizers / transformers' tokenization code
#   collation     inside rollout.py (building the episode records)
#   other         anything else: the loop's own Python (scheduling, metrics, the sink)
# and the kernel's CPU time of every thread (/proc/self/task) gives CPU seconds per wall second: per Python thread,
# for torch's native intra-op threads together, and for the process (the "cores busy" of issue 31).
#
#     python bench/profile_multiturn.py                 # 40 steps at each setting (several minutes on 2 cores)
#     python bench/profile_multiturn.py --steps 5       # smoke test
import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trl_vs_molt import CALCULATOR_WARM_START, PART2_LR, run_ours, warm_started_policy  # noqa: E402

# innermost frames that block; `_worker` is an executor thread waiting for work (its queue.get is C code)
WAITS = {"wait", "select", "poll", "get", "acquire", "_wait_for_tstate_lock", "join", "sleep", "_worker"}
WHERE = [("molt_engine/inference/sampler.py", "sampler"), ("molt_engine/update.py", "trainer"), ("molt_engine/algo.py", "trainer"),
         ("molt_engine/envs.py", "env"), ("molt_envs/builtin.py", "env"), ("molt_engine/chat.py", "env"), ("tokenizers", "tokenization"),
         ("tokenization_utils", "tokenization"), ("molt_engine/rollout.py", "collation")]
ACTIVITIES = ["sampler", "trainer", "env", "tokenization", "collation", "other", "waiting"]
TICKS = os.sysconf("SC_CLK_TCK")


def classify(frame) -> tuple[str, str]:
    """What the thread is doing, and the innermost engine function it is in ("-" outside the engine)."""
    if frame.f_code.co_name in WAITS:
        return "waiting", "-"
    activity, where = "other", "-"
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        if where == "-" and "molt_engine/" in name:
            where = f"{name.rsplit('/', 1)[1]}:{frame.f_code.co_name}"
        if activity == "other":
            activity = next((a for part, a in WHERE if part in name), "other")
        frame = frame.f_back
    return activity, where


def cpu_seconds() -> dict[int, float]:
    """Every live thread's user + system CPU seconds so far, by native thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def process_cpu() -> float:
    """The process's CPU seconds, threads that have exited included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Profiler:
    """Samples every Python thread's stack each `interval` seconds on its own thread (excluded from the counts),
    and every thread's CPU time every 20 samples (the newest reading of a thread that exits is kept)."""

    def __init__(self, interval: float = 0.005):
        self.interval, self.stop = interval, threading.Event()
        self.counts: dict[str, Counter] = defaultdict(Counter)   # thread name -> activity -> samples
        self.functions: Counter = Counter()                      # (activity, engine function) -> busy samples
        self.names: dict[int, str] = {}                          # native id -> thread name
        self.thread = threading.Thread(target=self.sample, name="profiler", daemon=True)

    def __enter__(self):
        self.cpu0, self.process0, self.t0 = cpu_seconds(), process_cpu(), time.perf_counter()
        self.cpu = dict(self.cpu0)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.wall, self.process = time.perf_counter() - self.t0, process_cpu() - self.process0
        self.cpu.update(cpu_seconds())

    def sample(self):
        me, rounds = threading.get_ident(), 0
        while not self.stop.wait(self.interval):
            threads = {t.ident: t for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident != me and ident in threads:
                    name = threads[ident].name
                    # the default executor's threads take turns at sampler and trainer steps: one row for them
                    key = "executor threads" if name.startswith(("asyncio_", "ThreadPoolExecutor")) else name
                    activity, where = classify(frame)
                    self.counts[key][activity] += 1
                    if activity != "waiting":
                        self.functions[activity, where] += 1
                    self.names[threads[ident].native_id] = key
            rounds += 1
            if rounds % 20 == 0:
                self.cpu.update(cpu_seconds())
        self.own = time.thread_time()

    def report(self) -> list[str]:
        used = defaultdict(float)
        for tid, seconds in self.cpu.items():
            if tid != self.thread.native_id:
                used[self.names.get(tid, "native (torch intra-op)")] += seconds - self.cpu0.get(tid, 0.0)
        lines = ["| thread | CPU s / wall s | " + " | ".join(ACTIVITIES) + " |",
                 "|---|---|" + "---|" * len(ACTIVITIES)]
        for name, counts in sorted(self.counts.items()):
            total = sum(counts.values())
            lines.append(f"| {name} | {used.get(name, 0.0) / self.wall:.2f} | "
                         + " | ".join(f"{100 * counts[a] / total:.0f}%" for a in ACTIVITIES) + " |")
        lines.append(f"| native (torch intra-op) | {used.get('native (torch intra-op)', 0.0) / self.wall:.2f} |"
                     + " |" * len(ACTIVITIES))
        busy = (self.process - self.own) / self.wall
        busy_samples = sum(self.functions.values())
        lines += ["", f"cores busy (process CPU s per wall s, the profiler's own {self.own / self.wall:.2f} "
                      f"excluded): **{busy:.2f}** of {os.cpu_count()}; wall {self.wall:.1f} s", "",
                  "Where the busy samples of every thread are (innermost engine function):", "",
                  "| activity | engine function | share of busy samples |", "|---|---|---|"]
        for (activity, where), n in self.functions.most_common(12):
            lines.append(f"| {activity} | {where} | {100 * n / busy_samples:.1f}% |")
        return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, nargs="+", default=[1], help="loop.threads (torch intra-op threads) to try")
    args = p.parse_args(argv)
    print(f"### Multi-turn profile: calculator without tool latency, {args.steps} steps per setting "
          f"(seed {args.seed}; load average at start {os.getloadavg()[0]:.2f})\n", flush=True)
    with tempfile.TemporaryDirectory() as model_dir:
        warm_started_policy("calculator", args.seed, model_dir, CALCULATOR_WARM_START)
        for threads, staleness in ((t, s) for t in args.threads for s in (0, 2)):
            config = {"env": "calculator", "seed": args.seed, "model": {"preset": None, "path": model_dir},
                      "warm_start": {"steps": 0}, "algo": {"lr": PART2_LR},
                      "loop": {"steps": args.steps, "max_staleness": staleness, "eval_every": 0, "threads": threads}}
            with Profiler() as profiler:
                result = run_ours(config, max_seconds=1e9)
            print("\n".join([f"**max_staleness {staleness}, loop.threads {threads}**: {result['samples_per_s']:.0f} "
                             f"samples/s, last-10 train reward {result['last10_reward']:.3f}", ""]
                            + profiler.report() + [""]), flush=True)

if __name__ == "__main__":
    main()
