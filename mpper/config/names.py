"""Names a key is looked for under that are not its own, for the "did you mean" of an
unknown key: keys that were renamed or moved to an algorithm's section, and the names
other libraries give a setting."""

from __future__ import annotations

__all__ = ["FOREIGN_NAMES", "RENAMED"]

# Keys that had another name or moved to an algorithm's section: an old name is an error
# that names the new one.
RENAMED: dict[str, tuple[str, str]] = {
    "training.checkpoint_interval": ("training.publish_interval", "same meaning"),
    **{f"training.{k}": (f"muzero.{k}", "same meaning") for k in (
        "num_unroll_steps", "td_steps", "stacked_observations", "value_loss_weight", "symmetry_augmentation",
        "priority_update")},
    "runtime.reanalyse": ("reanalyse.enabled", "same meaning"),
    "runtime.reanalyse_batch_episodes": ("reanalyse.batch_episodes", "same meaning"),
    "dqn.initial_priority": ("replay.initial_priority", '"td" is now "actor"'),
}  # fmt: skip


# Names other libraries give a setting (Stable-Baselines3, CleanRL, LightZero, ...), in any
# section or at the top level: the mpper keys that mean it (the first one the config's
# algorithm has is suggested) and what it is in mpper's terms.
_LR = (("training.lr_init",), "the initial learning rate; training.lr_decay_rate decays it")
_BUDGET = (("training.env_steps",), "a budget in env steps; training.training_steps counts learner batches")
_GAMMA = (("dqn.gamma", "mcts.discount"), "the reward discount")
_CAPACITY = (("replay.capacity",), "steps in the replay buffer")
_ENVS = (("runtime.envs_per_worker",), "envs each self-play process steps; runtime.workers is the processes")
_WORKERS = (("runtime.workers",), "self-play processes")
_WARMUP = (("training.min_buffer_steps",), "env steps stored before learning starts")
_RATIO = (("training.samples_per_insert",), "training samples per stored env step")
_TARGET = (("dqn.target_update_interval",), "training steps between target-network updates")
_CLIP = (("training.grad_clip",), "the largest global gradient norm")
_EPS_START = (("dqn.epsilon_start",), "the first exploration epsilon")
_EPS_END = (("dqn.epsilon_end",), "the exploration epsilon it decays to")
_EPS_DECAY = (("dqn.epsilon_decay",), "the epsilon decay, in each worker's env steps")
_NSTEP = (("dqn.n_step", "muzero.td_steps"), "the steps of the bootstrapped return")
_ENV_ID = (("env.id",), "the gymnasium id or module:callable")
FOREIGN_NAMES: dict[str, tuple[tuple[str, ...], str]] = {
    **dict.fromkeys(("learning_rate", "lr", "lr_start", "initial_lr"), _LR),
    **dict.fromkeys(("total_timesteps", "total_steps", "num_timesteps", "max_env_steps", "total_env_steps"), _BUDGET),
    **dict.fromkeys(("gamma", "discount", "discount_factor"), _GAMMA),
    **dict.fromkeys(("buffer_size", "replay_size", "replay_buffer_size", "memory_size", "buffer_capacity"), _CAPACITY),
    **dict.fromkeys(("n_envs", "num_envs", "env_num", "collector_env_num"), _ENVS),
    **dict.fromkeys(("num_workers", "n_workers", "num_actors", "n_actors"), _WORKERS),
    **dict.fromkeys(("learning_starts", "warmup_steps", "replay_start_size", "start_steps"), _WARMUP),
    **dict.fromkeys(("train_freq", "gradient_steps", "replay_ratio", "update_per_collect"), _RATIO),
    **dict.fromkeys(("target_network_frequency", "target_update_freq", "target_update_frequency"), _TARGET),
    **dict.fromkeys(("max_grad_norm", "clip_grad_norm", "grad_norm_clip", "max_norm"), _CLIP),
    **dict.fromkeys(("exploration_initial_eps", "start_e", "eps_start", "epsilon"), _EPS_START),
    **dict.fromkeys(("exploration_final_eps", "end_e", "eps_end", "final_epsilon"), _EPS_END),
    **dict.fromkeys(("exploration_fraction", "eps_decay"), _EPS_DECAY),
    **dict.fromkeys(("n_steps", "multi_step", "n_step", "nstep"), _NSTEP),
    **dict.fromkeys(("env_id", "env_name", "gym_id"), _ENV_ID),
    "seed": (("runtime.seed",), "the random seed"),
    "device": (("runtime.device",), "the learner's device"),
    "eval_freq": (("runtime.evaluation_interval_s",), "seconds between greedy evaluations"),
    "n_eval_episodes": (("runtime.evaluation_episodes",), "greedy episodes per evaluation"),
    "prioritized_replay_alpha": (("replay.alpha",), "the priority exponent"),
    "prioritized_replay_beta0": (("replay.beta",), "the initial importance-sampling exponent"),
    "net_arch": (("network.hidden", "dqn.hidden"), "the hidden layer widths"),
}  # fmt: skip
