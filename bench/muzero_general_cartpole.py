#!/usr/bin/env python3
"""muzero-general on CartPole-v1, unmodified, with its shipped ``games/cartpole.py`` config:
time to its first test reward >= 475, as the README's MuZero row puts beside mpper.

Each run is one child process (in a network namespace with loopback only, ``unshare
--net``, unless ``--no-netns``) that starts Ray locally (127.0.0.1, no dashboard, usage
statistics off, a private temp dir), builds ``muzero.MuZero("cartpole", config=...)``
overriding only ``seed`` (``--seed-base + 10 * run``, so that one run's self-play seed and
test-worker seed never meet another run's) and ``results_path``, calls its ``train()``,
and polls its ``SharedStorage`` actor about once a second for ``total_reward`` (its
one-episode test worker's latest return), ``training_step``, games and moves played. A run
stops ``--hold`` seconds after the first test reward >= ``--threshold``, at
``--time-limit`` seconds, or when muzero-general's own ``training_steps`` are done; it is
stopped the way muzero-general's logging loop ends by itself (the driver's copy of
``training_steps`` is lowered, so the loop exits and runs its own
``terminate_workers()``), then Ray is shut down and any process of the run that survived
is killed by pid (the parent is a child subreaper).

mpper's rule too (``--weights-every N``): the poller also saves the storage's weights
every N training steps (``run_<N>/weights/step_<S>.pt``), and after the run, with Ray
shut down, the child plays each saved set in training-step order with muzero-general's own
MCTS as mpper's evaluator plays (no root noise, the most visited action), ``--eval-episodes``
episodes from env seeds ``--eval-seed`` on, until one set's mean return is >= the
threshold (``first_mean_solved``). A set stops being played as soon as its mean can no
longer get there. Use a ``--hold`` as long as ``--time-limit`` to let the run go on past
its first one-episode success. With ``--past-solve S`` the pass goes on after that set,
playing every later set's episodes whole, up to the first set at least S training steps past
it, whose weights then play ``--final-episodes`` more from env seeds ``--final-seed`` on
(``bench/holds_peers.py`` judges a run by ``bench/holds.py``'s rule this way);
``--eval-spacing`` passes over sets closer than that many training steps to the last one
played.

Times: ``t_run`` from the start of the run (before ``ray.init``), ``t_proc`` from the
launch of the run's Python process. Writes ``run_<N>/run.json`` per run and
``summary.json`` / ``summary.md`` to ``--out``, and prints the summary table.

Usage (with the Python of a virtualenv holding muzero-general's requirements and Ray)::

    /path/to/mzg-venv/bin/python bench/muzero_general_cartpole.py --mzg-dir /path/to/muzero-general \\
        --runs 0 1 2 --time-limit 300
    # and by mpper's rule (a mean of 10 greedy episodes), weights saved every 100 steps:
    ... --runs 0 1 2 --time-limit 360 --hold 360 --weights-every 100
"""

import argparse
import ctypes
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_KEYS = [
    "total_reward",
    "episode_length",
    "mean_value",
    "training_step",
    "lr",
    "total_loss",
    "value_loss",
    "reward_loss",
    "policy_loss",
    "num_played_games",
    "num_played_steps",
    "num_reanalysed_games",
]


# ----------------------------------------------------------------- processes
def proc_start_epoch(pid="self"):
    """Wall-clock (epoch) time at which process `pid` was launched."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 overall
    with open("/proc/stat") as f:
        btime = next(int(l.split()[1]) for l in f if l.startswith("btime"))
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


def _ppid_map():
    m = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    m[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return m


def descendants(root):
    m = _ppid_map()
    out, frontier = [], [root]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in m.items() if pp == p]
        out += kids
        frontier += kids
    return out


def pid_has_tag(pid, tag):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return tag.encode() in f.read()
    except OSError:
        return False


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def kill_pids(pids, grace=5.0):
    """SIGTERM then SIGKILL exactly these pids.  Returns what was found."""
    found = [(p, cmdline(p)) for p in pids if os.path.exists(f"/proc/{p}")]
    for p, _ in found:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    t = time.time()
    while time.time() - t < grace and any(os.path.exists(f"/proc/{p}") for p, _ in found):
        time.sleep(0.2)
    for p, _ in found:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p, _ in found:  # reap if they are our children
        try:
            os.waitpid(p, os.WNOHANG)
        except ChildProcessError:
            pass
    return [{"pid": p, "cmdline": c[:200]} for p, c in found]


def stray(root, tag):
    """Live (non-zombie) descendants of root, plus any process carrying our env tag."""
    pids = set(descendants(root))
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid() and pid_has_tag(int(d), tag):
            pids.add(int(d))
    live = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                live.append(p)
        except OSError:
            pass
    return sorted(live)


def derive(res):
    """Per-run summary fields, computed from the raw ~1/s samples."""
    thr = res.get("threshold", 475.0)
    smp = res.get("samples") or []
    first = next((x for x in smp if x["total_reward"] >= thr), None)
    res["first_solved"] = first
    res["solved"] = first is not None
    res["final"] = smp[-1] if smp else None
    res["max_total_reward"] = max((x["total_reward"] for x in smp), default=None)
    if first:
        hold = [x for x in smp if x["t_run_s"] >= first["t_run_s"]]
        res["hold_min_total_reward"] = min(x["total_reward"] for x in hold)
        res["hold_all_ge_threshold"] = all(x["total_reward"] >= thr for x in hold)
        res["hold_observed_s"] = hold[-1]["t_run_s"] - first["t_run_s"]
    return res


# ----------------------------------------------------------------- mpper's evaluation rule
def greedy_episode(cfg, model, seed):
    """One episode of muzero-general's own play (``SelfPlay.play_game``) with its MCTS, but
    as mpper's evaluator plays: no root noise, the most visited action (muzero-general's
    ``select_action`` at temperature 0). Returns the episode's return."""
    import numpy
    import torch
    from games.cartpole import Game
    from self_play import MCTS, GameHistory

    game = Game(seed)
    history = GameHistory()
    observation = game.reset()
    history.action_history.append(0)
    history.observation_history.append(observation)
    history.reward_history.append(0)
    history.to_play_history.append(game.to_play())
    done, total = False, 0.0
    with torch.no_grad():
        while not done and len(history.action_history) <= cfg.max_moves:
            stacked = history.get_stacked_observations(-1, cfg.stacked_observations, len(cfg.action_space))
            root, _ = MCTS(cfg).run(model, stacked, game.legal_actions(), game.to_play(), False)
            actions = list(root.children.keys())
            visits = numpy.array([child.visit_count for child in root.children.values()], dtype="int32")
            action = actions[int(numpy.argmax(visits))]
            observation, reward, done = game.step(action)
            total += reward
            history.action_history.append(action)
            history.observation_history.append(observation)
            history.reward_history.append(reward)
            history.to_play_history.append(game.to_play())
    return total


def evaluate_snapshots(a, cfg, weights_dir, res):
    """mpper's rule on the run's weight snapshots, in training-step order: the mean return of
    ``--eval-episodes`` greedy episodes >= ``--threshold``. Snapshots closer than
    ``--eval-spacing`` training steps to the last one played are passed over. Before the
    first snapshot that passes (``first_mean_solved``), a snapshot's evaluation stops as
    soon as its mean can no longer reach the threshold. The pass stops at that snapshot, or,
    with ``--past-solve``, goes on playing every snapshot whole until the first one at least
    that many training steps past it, whose weights then play ``--final-episodes`` episodes
    from env seeds ``--final-seed`` on (``final_weights``); or at ``--eval-time-limit``."""
    import torch
    from models import MuZeroNetwork

    torch.set_num_threads(1)
    model = MuZeroNetwork(cfg)
    model.eval()
    t0 = time.time()
    res["evaluations"], res["first_mean_solved"], res["final_weights"] = [], None, None
    n, need = a.eval_episodes, a.threshold * a.eval_episodes
    last_played = None
    for snap in sorted(res.get("snapshots", []), key=lambda x: x["training_step"]):
        if last_played is not None and snap["training_step"] < last_played + a.eval_spacing:
            continue
        if time.time() - t0 > a.eval_time_limit:
            res["evaluation_cut_by_time_limit"] = True
            break
        solve = res["first_mean_solved"]
        path = os.path.join(weights_dir, f"step_{snap['training_step']:06d}.pt")
        model.set_weights(torch.load(path, weights_only=True))
        returns = []
        for k in range(n):
            returns.append(greedy_episode(cfg, model, a.eval_seed + k))
            if solve is None and sum(returns) + cfg.max_moves * (n - len(returns)) < need:
                break  # cannot pass any more
        passed = len(returns) == n and sum(returns) >= need
        last_played = snap["training_step"]
        res["evaluations"].append({**snap, "returns": returns, "passed": passed})
        print(f"[eval] step {snap['training_step']}: {returns} {'PASS' if passed else ''}", flush=True)
        if passed and solve is None:
            res["first_mean_solved"] = solve = {**snap, "mean_return": sum(returns) / n}
            if not a.past_solve:
                break
        if solve is not None and snap["training_step"] >= solve["training_step"] + a.past_solve:
            final = []
            while len(final) < a.final_episodes and time.time() - t0 <= a.eval_time_limit:
                final.append(greedy_episode(cfg, model, a.final_seed + len(final)))
            cut = len(final) < a.final_episodes  # a partial final set is kept apart: it does not judge the run
            res["final_weights_partial" if cut else "final_weights"] = {**snap, "returns": final}
            res["evaluation_cut_by_time_limit"] = cut
            print(f"[eval] final weights, step {snap['training_step']}: {len(final)} episodes, {final}", flush=True)
            break
    res["evaluation_s"] = time.time() - t0


# ----------------------------------------------------------------- child
def child_main(a):
    t_proc = proc_start_epoch()
    rundir = os.path.abspath(os.path.join(a.out, f"run_{a.run}"))
    os.makedirs(rundir, exist_ok=True)
    seed = a.seed_base + 10 * a.run

    # headless, local-only, workers can import muzero-general's modules
    os.environ["PYTHONPATH"] = a.mzg_dir + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # node ip = 127.0.0.1 (ray otherwise resolves "127.0.0.1" to the primary interface)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # private HOME: ray's token file lands here, and a stub ~/ray_bootstrap_config.yaml
    # stops ray's UsageStatsHead from probing cloud metadata endpoints (169.254.169.254)
    home = os.path.join(rundir, "home")
    os.makedirs(home, exist_ok=True)
    with open(os.path.join(home, "ray_bootstrap_config.yaml"), "w") as f:
        f.write("{}\n")
    os.environ["HOME"] = home
    os.environ["MPLBACKEND"] = "Agg"
    os.chdir(a.mzg_dir)
    sys.path.insert(0, a.mzg_dir)

    import pathlib

    import muzero  # muzero-general, unmodified
    import numpy
    import ray
    import torch

    res = {
        "run": a.run,
        "seed": seed,
        "threshold": a.threshold,
        "time_limit_s": a.time_limit,
        "hold_s": a.hold,
        "pid": os.getpid(),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "ray": ray.__version__,
            "numpy": numpy.__version__,
            "gym": __import__("gym").__version__,
        },
        "mzg_commit": subprocess.run(
            ["git", "-C", a.mzg_dir, "rev-parse", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "import_s": time.time() - t_proc,
        "samples": [],
    }
    out_json = os.path.join(rundir, "run.json")

    t_run = time.time()  # "driver started the run": before ray.init
    res["t_run_start_minus_proc_launch_s"] = t_run - t_proc
    ray_kwargs = dict(
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=a.ray_tmp,
        object_store_memory=a.object_store_mb * 1024 * 1024,
        log_to_driver=True,
    )
    if a.num_cpus is not None:
        ray_kwargs["num_cpus"] = a.num_cpus
    ray.init(**ray_kwargs)
    res["ray_resources"] = ray.cluster_resources()
    res["ray_init_s"] = time.time() - t_run

    mz = muzero.MuZero(
        "cartpole",
        config={"seed": seed, "results_path": pathlib.Path(rundir) / "mzg_results"},
    )
    cfg = mz.config
    res["config"] = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                     for k, v in cfg.__dict__.items()}
    h = hashlib.sha256()
    for k, v in sorted(mz.checkpoint["weights"].items()):
        h.update(k.encode())
        h.update(v.detach().cpu().numpy().tobytes())
    res["initial_weights_sha256"] = h.hexdigest()[:16]

    state = {"stop_reason": None, "t_stop": None}
    solved = {}

    def write_json():
        tmp = out_json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1, default=str)
        os.replace(tmp, out_json)

    snapshots = {"next_step": 0}
    weights_dir = os.path.join(rundir, "weights")

    def save_weights(storage, sample):
        """The storage's weights and their training step, fetched together, to weights/step_N.pt."""
        try:
            got = ray.get(storage.get_info.remote(["weights", "training_step"]), timeout=10)
        except Exception as e:  # noqa
            res.setdefault("poll_errors", []).append(repr(e)[:200])
            return
        os.makedirs(weights_dir, exist_ok=True)
        step = int(got["training_step"])
        torch.save({k: v.cpu() for k, v in got["weights"].items()},
                   os.path.join(weights_dir, f"step_{step:06d}.pt"))
        res.setdefault("snapshots", []).append({"training_step": step, "t_run_s": sample["t_run_s"]})
        snapshots["next_step"] = step + a.weights_every

    def poller():
        while mz.shared_storage_worker is None:
            if time.time() - t_run > a.time_limit:
                break
            time.sleep(0.05)
        storage = mz.shared_storage_worker  # own handle, survives terminate_workers()
        if storage is None:
            state["stop_reason"], state["t_stop"] = "time_limit_before_workers", time.time()
            cfg.training_steps = 0
            return
        res["t_workers_launched_s"] = time.time() - t_run
        next_t = time.time()
        last_write = 0
        while True:
            next_t = max(next_t + a.poll, time.time())  # no burst catch-up after a stall
            try:
                info = ray.get(storage.get_info.remote(POLL_KEYS), timeout=10)
            except Exception as e:  # noqa
                res.setdefault("poll_errors", []).append(repr(e)[:200])
                info = None
            now = time.time()
            if info is not None:
                s = {"t_run_s": round(now - t_run, 3), "t_proc_s": round(now - t_proc, 3)}
                s.update({k: (float(v) if isinstance(v, (float, numpy.floating)) else v)
                          for k, v in info.items()})
                res["samples"].append(s)
                if not solved and s["total_reward"] >= a.threshold:
                    solved.update(s)
                if a.weights_every and s["training_step"] >= snapshots["next_step"]:
                    save_weights(storage, s)
            el = now - t_run
            reason = None
            if solved and now - t_run - solved["t_run_s"] >= a.hold:
                reason = "solved+hold"
            elif el >= a.time_limit:
                reason = "time_limit"
            elif info is not None and info["training_step"] >= cfg.training_steps:
                reason = "training_steps_done"
            if now - last_write > 10:
                write_json()
                last_write = now
            if reason:
                state["stop_reason"] = reason
                state["t_stop"] = now
                break
            time.sleep(max(0.0, next_t - time.time()))
        # Stop muzero-general's blocking logging loop.  Its loop condition reads
        # the DRIVER's config copy each iteration (info["training_step"] <
        # self.config.training_steps); lowering that copy makes the loop exit
        # normally within 0.5 s and run its own terminate_workers() + replay-buffer
        # dump.  Workers hold their own config copies, so training is unaffected.
        # (A Ctrl-C from _thread.interrupt_main() does not reach that loop reliably.)
        if state["stop_reason"] != "training_steps_done":
            res["stop_method"] = "driver_config.training_steps=0"
            cfg.training_steps = 0
        t_s = time.time()
        while not state.get("train_returned") and time.time() - t_s < 60:
            time.sleep(0.2)
        if not state.get("train_returned"):
            res["stop_method"] = "emergency_exit"
            res["final_poll_samples_only"] = True
            write_json()
            print("[poller] train() did not return within 60 s; emergency exit", flush=True)
            os._exit(3)

    th = threading.Thread(target=poller, daemon=True)
    th.start()
    t_train_call = time.time()
    res["t_train_call_s"] = t_train_call - t_run
    try:
        mz.train()  # blocks in logging_loop until interrupted / training_steps reached
    except KeyboardInterrupt:
        res["interrupt_outside_logging_loop"] = True
    state["train_returned"] = True
    res["t_train_returned_s"] = time.time() - t_run
    th.join(timeout=30)

    res["stop_reason"] = state["stop_reason"]
    res["stopped_at_t_run_s"] = (state["t_stop"] - t_run) if state["t_stop"] else None
    derive(res)

    # ----- tear down ray and make sure nothing of ours is left
    t = time.time()
    try:
        ray.shutdown()
    except Exception as e:  # noqa
        res["ray_shutdown_error"] = repr(e)
    time.sleep(1.0)
    left = stray(os.getpid(), a.tag)
    res["stray_after_shutdown"] = kill_pids(left) if left else []
    res["teardown_s"] = time.time() - t
    if a.weights_every and a.eval_episodes:
        write_json()
        evaluate_snapshots(a, cfg, weights_dir, res)
    write_json()
    print(f"[run {a.run}] done: stop={res['stop_reason']} solved={res['solved']} "
          f"first={res.get('first_solved')} final={res.get('final')}", flush=True)
    sys.stdout.flush()
    os._exit(0)


# ----------------------------------------------------------------- parent
def fmt(v, nd=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def parent_main(a):
    # become a child subreaper so orphaned ray daemons get re-parented to us
    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:  # noqa
        pass
    os.makedirs(a.out, exist_ok=True)
    results = []
    for run in a.runs:
        rundir = os.path.join(a.out, f"run_{run}")
        os.makedirs(rundir, exist_ok=True)
        tag = f"mzgharness{os.getpid()}r{run}"
        ray_tmp = f"/tmp/mzg{os.getpid()}r{run}"
        env = dict(os.environ, MZG_HARNESS_TAG=tag)
        cmd = [sys.executable, os.path.abspath(__file__), "--_child", "--run", str(run),
               "--out", os.path.abspath(a.out), "--time-limit", str(a.time_limit),
               "--hold", str(a.hold), "--threshold", str(a.threshold), "--poll", str(a.poll),
               "--seed-base", str(a.seed_base), "--mzg-dir", a.mzg_dir,
               "--object-store-mb", str(a.object_store_mb), "--tag", tag, "--ray-tmp", ray_tmp,
               "--weights-every", str(a.weights_every), "--eval-episodes", str(a.eval_episodes),
               "--eval-seed", str(a.eval_seed), "--eval-time-limit", str(a.eval_time_limit),
               "--eval-spacing", str(a.eval_spacing), "--past-solve", str(a.past_solve),
               "--final-episodes", str(a.final_episodes), "--final-seed", str(a.final_seed)]
        if a.num_cpus is not None:
            cmd += ["--num-cpus", str(a.num_cpus)]
        if not a.no_netns:
            # private network namespace with only loopback: nothing can leave the box
            cmd = ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] + cmd
        print(f"=== run {run}: {' '.join(cmd)}", flush=True)
        t0 = time.time()
        with open(os.path.join(rundir, "driver.log"), "w") as log:
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                evaluating = a.eval_time_limit + 600 if a.weights_every and a.eval_episodes else 0
                rc = p.wait(timeout=a.time_limit + a.hold + 240 + evaluating)
            except subprocess.TimeoutExpired:
                rc = "killed-timeout"
                kill_pids([p.pid])
        time.sleep(1.0)
        left = stray(os.getpid(), tag)
        killed = kill_pids(left) if left else []
        # reap any zombies re-parented to us
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG) == (0, 0):
                    break
            except ChildProcessError:
                break
        subprocess.run(["rm", "-rf", ray_tmp])
        try:
            with open(os.path.join(rundir, "run.json")) as f:
                r = json.load(f)
        except Exception as e:  # noqa
            r = {"run": run, "error": repr(e)}
        if "samples" in r:
            derive(r)
        r["child_rc"] = rc
        r["child_wall_s"] = time.time() - t0
        r["stray_killed_by_parent"] = killed
        with open(os.path.join(rundir, "run.json"), "w") as f:
            json.dump(r, f, indent=1, default=str)
        results.append(r)
        print(f"=== run {run}: rc={rc} wall={r['child_wall_s']:.1f}s stop={r.get('stop_reason')} "
              f"solved={r.get('solved')} strays_killed={len(killed)}", flush=True)

    # summary
    rows = []
    for r in results:
        fs = r.get("first_solved") or {}
        fin = r.get("final") or {}
        rows.append({
            "run": r.get("run"), "seed": r.get("seed"), "solved": r.get("solved"),
            "first_ge_thr_t_run_s": fs.get("t_run_s"), "first_ge_thr_t_proc_s": fs.get("t_proc_s"),
            "first_ge_thr_training_step": fs.get("training_step"),
            "first_ge_thr_games": fs.get("num_played_games"),
            "first_ge_thr_moves": fs.get("num_played_steps"),
            "hold_all_ge_thr": r.get("hold_all_ge_threshold"),
            "hold_min_reward": r.get("hold_min_total_reward"),
            "final_total_reward": fin.get("total_reward"),
            "best_total_reward": r.get("max_total_reward"),
            "final_training_step": fin.get("training_step"),
            "final_games": fin.get("num_played_games"), "final_moves": fin.get("num_played_steps"),
            "stop_reason": r.get("stop_reason"), "stopped_at_t_run_s": r.get("stopped_at_t_run_s"),
            "strays": len(r.get("stray_after_shutdown") or []) + len(r.get("stray_killed_by_parent") or []),
            "mean_solved_training_step": (r.get("first_mean_solved") or {}).get("training_step"),
            "mean_solved_t_run_s": (r.get("first_mean_solved") or {}).get("t_run_s"),
            "snapshots_evaluated": len(r.get("evaluations") or []),
        })
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump({"threshold": a.threshold, "time_limit_s": a.time_limit, "rows": rows}, f, indent=1)
    hdr = ["run", "seed", "solved", "t_run@475", "t_proc@475", "step@475", "games@475",
           "moves@475", "held", "hold_min", "final_R", "best_R", "final_step", "final_games",
           "final_moves", "stop", "stop_t", f"step@mean{a.eval_episodes}", f"t_run@mean{a.eval_episodes}",
           "snapshots_evaluated"]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for w in rows:
        lines.append("| " + " | ".join(fmt(x) for x in [
            w["run"], w["seed"], w["solved"], w["first_ge_thr_t_run_s"], w["first_ge_thr_t_proc_s"],
            w["first_ge_thr_training_step"], w["first_ge_thr_games"], w["first_ge_thr_moves"],
            w["hold_all_ge_thr"], w["hold_min_reward"], w["final_total_reward"], w["best_total_reward"],
            w["final_training_step"], w["final_games"], w["final_moves"], w["stop_reason"],
            w["stopped_at_t_run_s"], w["mean_solved_training_step"], w["mean_solved_t_run_s"],
            w["snapshots_evaluated"]]) + " |")
    table = "\n".join(lines)
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(f"muzero-general CartPole, threshold {a.threshold}, limit {a.time_limit}s "
                f"(t_run = since driver started the run, before ray.init; "
                f"t_proc = since the run's python process launched)\n\n{table}\n")
    print(table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, nargs="+", default=[0])
    ap.add_argument("--time-limit", type=float, default=420.0,
                    help="wall s since the run started (before ray.init)")
    ap.add_argument("--hold", type=float, default=30.0,
                    help="keep running this long after first total_reward >= threshold")
    ap.add_argument("--threshold", type=float, default=475.0)
    ap.add_argument("--poll", type=float, default=1.0)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "muzero-general"))
    ap.add_argument("--seed-base", type=int, default=0, help="seed = seed_base + 10*run")
    ap.add_argument("--num-cpus", type=int, default=None, help="ray num_cpus (default: autodetect)")
    ap.add_argument("--object-store-mb", type=int, default=1024)
    ap.add_argument("--mzg-dir", required=True, help="a checkout of muzero-general")
    ap.add_argument("--no-netns", action="store_true",
                    help="do not wrap each run in `unshare --net` (loopback-only namespace)")
    ap.add_argument("--weights-every", type=int, default=0,
                    help="save the storage's weights every this many training steps (0: never)")
    ap.add_argument("--eval-episodes", type=int, default=10,
                    help="with --weights-every: after the run, evaluate the saved weights by mpper's rule "
                         "(mean of this many greedy episodes >= --threshold); 0: do not")
    ap.add_argument("--eval-seed", type=int, default=50_000_000, help="seed of the first evaluation episode")
    ap.add_argument("--eval-time-limit", type=float, default=1800.0, help="wall s for the evaluations of one run")
    ap.add_argument("--eval-spacing", type=int, default=0, metavar="STEPS",
                    help="evaluate only saved weights at least this many training steps after the last evaluated")
    ap.add_argument("--past-solve", type=int, default=0, metavar="STEPS",
                    help="go on evaluating after the first passing weights up to the first this many steps past them, "
                         "and play those on --final-episodes episodes; 0: stop at the first passing weights")
    ap.add_argument("--final-episodes", type=int, default=100)
    ap.add_argument("--final-seed", type=int, default=60_000_000, help="seed of the final weights' first episode")
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--run", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    ap.add_argument("--ray-tmp", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        child_main(a)
    else:
        parent_main(a)


if __name__ == "__main__":
    main()
