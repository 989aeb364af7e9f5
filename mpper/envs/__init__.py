"""Environments: making them, the facts the buffer and networks need, the two-player
contract, board symmetries, and the TicTacToe env mpper ships (importing this package
registers the gymnasium id ``mpper/TicTacToe-v0``)."""

from .spec import EnvSpec, config_symmetries, env_spec, make_env, make_env_checked
from .tictactoe import TicTacToeEnv

__all__ = ["EnvSpec", "TicTacToeEnv", "config_symmetries", "env_spec", "make_env", "make_env_checked"]
