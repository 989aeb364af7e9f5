"""Self-play on Ray against local worker processes, on a 2-node Ray cluster on this machine.

The cluster: a head node (the learner's: the supervisor, the buffer, the ingest actor)
and one worker node with a custom resource "remote" on which the self-play actors are
placed, every node bound to 127.0.0.1; Ray's workers run at nice 0 as mpper's local
processes do (``RAY_worker_niceness=0``; Ray's default is 15). Two parts:

- ``ingest``: the path of an episode. Real CartPole episodes (stored rows of mpper's
  MuZero player with a random network, collected once; with ``--rows N``, their rows
  repeated to N, the size of a long episode) are written as fast as possible
  for ``--seconds``: by P local processes calling ``add_episode`` on the shared buffer,
  and by P Ray actors on the worker node sending them through the ingest actor (one
  episode in flight per actor, as self-play does). Reported: episodes/s, bytes per
  episode through Ray, the latency from an episode's end to its being sampleable
  (local: ``add_episode``'s time; Ray: from the actor's send to the ingest's return of
  ``add_episode``) and the ingest actor's CPU seconds per episode, which says how many
  episodes per second one learner node can take in per core it gives the ingest.
- ``solve``: CartPole time to solve with ``--workers`` local processes and with as many
  Ray actors on the worker node (``bench/solve_cartpole.py``'s runs, seeds interleaved).

Usage::

    python bench/ray_scaleout.py --part ingest --seconds 20 --writers 2 --rows 0 501
    python bench/ray_scaleout.py --part solve --seeds 0 1 2 3 4 --workers 4 --time-limit 300
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # keep the driver on 127.0.0.1 (before ray is imported)
# Ray starts its worker processes at nice 15; local workers run at 0. Both paths at the same
# priority, so that the comparison is of the paths (the raylets read this when they start).
os.environ["RAY_worker_niceness"] = "0"

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LOOPBACK = "127.0.0.1"


def start_cluster(remote_cpus: int):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": LOOPBACK,
                                                            "include_dashboard": False})  # fmt: skip
    cluster.add_node(num_cpus=remote_cpus, resources={"remote": 64}, node_ip_address=LOOPBACK)
    cluster.wait_for_nodes()
    return cluster


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- ingest ---------------------------------------------------------------------------------


def cartpole_episodes(count: int, seed: int = 0) -> list[tuple[dict, np.ndarray | None]]:
    """``count`` real stored episodes of mpper's MuZero player on CartPole-v1 (random
    network, the shipped config's search): what a self-play worker sends."""
    import torch

    from mpper.algos.configs import load_config
    from mpper.algos.registry import algorithm_of
    from mpper.runtime.roles import labelled_envs

    cfg = load_config(ROOT / "configs" / "cartpole.json")
    torch.manual_seed(seed)
    envs = labelled_envs(cfg, "bench", 8)
    algorithm = algorithm_of(cfg)
    network = algorithm.make_network(cfg, (4,), 2).eval()
    player = algorithm.make_player(cfg, envs, network, explore=True, seed=seed, worker_id=0)
    out = []
    while len(out) < count:
        for ep in player.step(0.0):
            out.append(player.stored(ep))
    return out[:count]


def _local_writer(handle, episodes, seconds, start_at, results) -> None:
    from mpper import ReplayBuffer

    buf = ReplayBuffer.attach(handle)
    while time.time() < start_at:
        time.sleep(0.001)
    latencies, n, deadline = [], 0, start_at + seconds
    while time.time() < deadline:
        arrays, priorities = episodes[n % len(episodes)]
        t0 = time.perf_counter()
        buf.add_episode(arrays, priorities=priorities, terminated=True)
        latencies.append(time.perf_counter() - t0)
        n += 1
    buf.close()
    results.put((n, latencies))


def make_buffer(capacity: int):
    from mpper.algos.configs import load_config
    from mpper.algos.registry import algorithm_of
    from mpper.replay.buffer import ReplayBuffer

    cfg = load_config(ROOT / "configs" / "cartpole.json")
    schema = algorithm_of(cfg).schema((4,), 2, np.float32)
    return ReplayBuffer.create(schema, capacity, alpha=0.5, mp_context=mp.get_context("forkserver"))


def ingest_local(episodes, writers: int, seconds: float) -> dict:
    ctx = mp.get_context("forkserver")
    buf = make_buffer(100_000)
    try:
        results = ctx.Queue()
        start_at = time.time() + 3.0
        procs = [ctx.Process(target=_local_writer, args=(buf.handle, episodes, seconds, start_at, results))
                 for _ in range(writers)]  # fmt: skip
        for p in procs:
            p.start()
        got = [results.get(timeout=seconds + 120) for _ in procs]
        for p in procs:
            p.join()
        n = sum(g[0] for g in got)
        lat = sorted(x for g in got for x in g[1])
        return {"episodes_per_s": n / seconds, "episodes": n, "latency_ms_median": 1e3 * statistics.median(lat),
                "latency_ms_p95": 1e3 * lat[int(0.95 * (len(lat) - 1))]}  # fmt: skip
    finally:
        buf.close()


def ingest_ray(episodes, writers: int, seconds: float, address: str) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from mpper.algos.configs import load_config
    from mpper.runtime.remote import EpisodeIngest
    from mpper.runtime.roles import StoredEpisode

    ray.init(address=address, log_to_driver=False, logging_level="warning")
    training = load_config(ROOT / "configs" / "cartpole.json", ["training.samples_per_insert=null"]).training

    @ray.remote(resources={"remote": 1}, num_cpus=1)
    class Sender:
        """Sends the same real episodes, one in flight, as SelfPlayActor does."""

        def __init__(self, episodes, ingest):
            self.episodes, self.ingest = episodes, ingest

        def run(self, seconds: float, start_at: float) -> int:
            while time.time() < start_at:
                time.sleep(0.001)
            n, in_flight, deadline = 0, None, start_at + seconds
            while time.time() < deadline:
                arrays, priorities = self.episodes[n % len(self.episodes)]
                report = {"return": 0.0, "length": 0, "weights_version": 0}
                if in_flight is not None:
                    ray.get(in_flight)
                in_flight = self.ingest.add.remote(StoredEpisode("bench", arrays, priorities, True, report, time.time()))
                n += 1
            ray.get(in_flight)
            return n

    buf = make_buffer(100_000)
    try:
        here = ray.get_runtime_context().get_node_id()
        ingest = ray.remote(EpisodeIngest).options(
            num_cpus=0, max_concurrency=writers + 4,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(buf.handle.portable(), training)  # fmt: skip
        ingest_pid = ray.get(ingest.__ray_call__.remote(lambda self: os.getpid()))
        episodes_ref = ray.put(episodes)
        senders = [Sender.remote(episodes_ref, ingest) for _ in range(writers)]
        ray.get([s.__ray_ready__.remote() for s in senders])
        cpu0, start_at = cpu_seconds(ingest_pid), time.time() + 3.0
        counts = ray.get([s.run.remote(seconds, start_at) for s in senders])
        cpu1 = cpu_seconds(ingest_pid)
        reports, stats = ray.get(ingest.drain.remote())
        lat = sorted(r[2]["store_latency_s"] for r in reports)
        n = sum(counts)
        assert stats["episodes"] == n == buf.counters["games"], (stats, n, buf.counters["games"])
        ray.get(ingest.close.remote())
        ray.kill(ingest)
        return {"episodes_per_s": n / seconds, "episodes": n, "bytes_per_episode": stats["bytes"] / n,
                "rows_per_episode": stats["rows"] / n, "latency_ms_median": 1e3 * statistics.median(lat),
                "latency_ms_p95": 1e3 * lat[int(0.95 * (len(lat) - 1))],
                "ingest_cpu_ms_per_episode": 1e3 * (cpu1 - cpu0) / n, "ingest_write_ms_per_episode":
                1e3 * stats["write_s"] / n}  # fmt: skip
    finally:
        buf.close()
        ray.shutdown()


def stretched(episodes, rows: int):
    """The episodes with their rows repeated to ``rows`` each: the size of a long episode
    (a solved CartPole's 500 moves), the content of a short one."""
    return [({k: np.resize(a, (rows, *a.shape[1:])) for k, a in arrays.items()},
             None if p is None else np.resize(p, rows - 1)) for arrays, p in episodes]  # fmt: skip


def part_ingest(args) -> list[dict]:
    real = cartpole_episodes(32)
    out = []
    for rows in args.rows:
        episodes = real if rows == 0 else stretched(real, rows)
        mean_len = float(np.mean([len(a["action"]) for a, _ in episodes]))
        print(f"{len(episodes)} CartPole episodes, mean {mean_len:.1f} rows", file=sys.stderr)
        local = ingest_local(episodes, args.writers, args.seconds)
        print(f"local: {local}", file=sys.stderr)
        cluster = start_cluster(remote_cpus=args.writers)
        try:
            remote = ingest_ray(episodes, args.writers, args.seconds, cluster.address)
        finally:
            cluster.shutdown()
        print(f"ray:   {remote}", file=sys.stderr)
        out.append({"rows_per_episode": mean_len, "stretched": rows != 0, "local": local, "ray": remote})
    return out


# ---- solve ----------------------------------------------------------------------------------


def part_solve(args) -> dict:
    import solve_cartpole

    cluster = start_cluster(remote_cpus=args.workers)
    results = {"local": [], "ray": []}
    try:
        for seed in args.seeds:
            for kind in ("local", "ray"):
                extra = [] if kind == "local" else [f"runtime.ray_address={cluster.address}",
                                                    'runtime.ray_actor_resources={"remote": 1}']  # fmt: skip
                run_args = argparse.Namespace(config="configs/cartpole.json", workers=args.workers,
                                              time_limit=args.time_limit, set=extra, tag=f"ray-{kind}")  # fmt: skip
                print(f"seed {seed} {kind} ...", file=sys.stderr, flush=True)
                r = solve_cartpole.run_seed(seed, run_args)
                r.pop("curve", None)
                print(f"  {r}", file=sys.stderr, flush=True)
                results[kind].append(r)
    finally:
        cluster.shutdown()
    return results


def report(args, out: dict) -> str:
    command = "python bench/ray_scaleout.py " + " ".join(sys.argv[1:])
    lines = [f"# Ray self-play vs local workers: `{command}` ({time.strftime('%Y-%m-%d')})", ""]
    if "ingest" in out:
        lines += [f"{args.writers} writers for {args.seconds:g} s per path; CartPole MuZero episodes of mpper's "
                  "player (random network), as stored, or their rows repeated to a solved episode's length.", "",
                  "| rows per episode | path | episodes/s | bytes per episode | end -> sampleable, median ms | "
                  "p95 ms | ingest CPU ms per episode (in add_episode) | episodes/s per ingest core |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for case in out["ingest"]:
            loc, ray_ = case["local"], case["ray"]
            rows = f"{case['rows_per_episode']:.0f}" + (" (repeated)" if case["stretched"] else " (as played)")
            lines += [f"| {rows} | local processes: add_episode | {loc['episodes_per_s']:,.0f} | - | "
                      f"{loc['latency_ms_median']:.2f} | {loc['latency_ms_p95']:.2f} | - | - |",
                      f"| {rows} | Ray actors -> ingest actor | {ray_['episodes_per_s']:,.0f} | "
                      f"{ray_['bytes_per_episode']:,.0f} | {ray_['latency_ms_median']:.2f} | "
                      f"{ray_['latency_ms_p95']:.2f} | {ray_['ingest_cpu_ms_per_episode']:.2f} "
                      f"({ray_['ingest_write_ms_per_episode']:.2f}) | "
                      f"{1e3 / ray_['ingest_cpu_ms_per_episode']:,.0f} |"]  # fmt: skip
    if "solve" in out:
        lines += ["", "| seed | local: solved, wall s, training step | Ray: solved, wall s, training step |",
                  "|---|---|---|"]  # fmt: skip
        for loc, ray_ in zip(out["solve"]["local"], out["solve"]["ray"]):
            cell = lambda r: f"yes, {r['wall_s']:.1f}, {r['training_step']:,}" if r["solved"] else "no"
            lines.append(f"| {loc['seed']} | {cell(loc)} | {cell(ray_)} |")
        for kind in ("local", "ray"):
            rs = out["solve"][kind]
            walls = sorted(r["wall_s"] if r["solved"] else float("inf") for r in rs)
            lines.append(f"\n{kind}: solved {sum(r['solved'] for r in rs)}/{len(rs)}, median wall "
                         f"{statistics.median(walls):.1f} s")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("ingest", "solve", "both"), default="both")
    ap.add_argument("--seconds", type=float, default=20.0, help="ingest: seconds of writing per path")
    ap.add_argument("--writers", type=int, default=2, help="ingest: local writer processes / Ray actors")
    ap.add_argument("--rows", type=int, nargs="+", default=[0, 501],
                    help="ingest: rows per episode, 0: the episodes as played; N: their rows repeated to N")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--workers", type=int, default=4, help="solve: local workers / Ray actors")
    ap.add_argument("--time-limit", type=float, default=300.0)
    args = ap.parse_args()
    out = {}
    if args.part in ("ingest", "both"):
        out["ingest"] = part_ingest(args)
    if args.part in ("solve", "both"):
        out["solve"] = part_solve(args)
    text = report(args, out)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"ray_scaleout_{args.part}.json").write_text(json.dumps(out, indent=1))
    (RESULTS / f"ray_scaleout_{args.part}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
