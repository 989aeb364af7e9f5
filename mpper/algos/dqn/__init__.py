"""DQN with prioritized replay, done Ape-X style.

``dqn`` reads top to bottom (network, exploration, TD errors, player, trainer);
``targets`` holds the stored row layout and the n-step transitions built at sample time;
``snapshot_eval`` judges a network on stored data.
"""
