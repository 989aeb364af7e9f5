"""Image environments: MinAtar (``MinAtar/...``, the ``minatar`` extra) and Atari through
the Arcade Learning Environment (``ALE/...``, the ``atari`` extra), made from a config as
the workers make them, checked against the same envs made by hand with gymnasium's own
wrappers; observations keep the env's dtype in episodes and in the buffer; a missing
package is one line naming the extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

from mpper.config import ConfigError, EnvConfig
from mpper.envs.spec import env_spec, make_env
from mpper.extras import register_env_family

ROOT = Path(__file__).resolve().parents[2]


def _steps(env, seed: int, actions: list[int]) -> list[np.ndarray]:
    obs, _ = env.reset(seed=seed)
    out = [obs]
    for a in actions:
        obs, _, terminated, truncated, _ = env.step(a)
        out.append(obs)
        if terminated or truncated:
            break
    return out


def test_minatar_planes_come_channels_first_in_their_own_dtype():
    config = EnvConfig(id="MinAtar/Breakout-v1", preprocessing="channels_first")
    spec = env_spec(config)
    assert spec.observation_shape == (4, 10, 10) and spec.observation_dtype == np.bool_ and spec.num_actions == 3
    register_env_family("MinAtar/Breakout-v1")  # done by make_env already: a no-op
    actions = list(np.random.default_rng(0).integers(0, 3, 60))
    ours = _steps(make_env(config), 5, actions)
    plain = _steps(gym.make("MinAtar/Breakout-v1"), 5, actions)
    assert len(ours) == len(plain) > 5
    for a, b in zip(ours, plain):
        assert a.dtype == np.bool_
        np.testing.assert_array_equal(a, np.transpose(b, (2, 0, 1)))


@pytest.mark.parametrize("kwargs", [{}, {"screen_size": 96, "terminal_on_life_loss": True}])
def test_atari_frames_are_gymnasiums_preprocessing_with_a_channel_axis(kwargs):
    config = EnvConfig(id="ALE/Pong-v5", preprocessing="atari", preprocessing_kwargs=kwargs)
    size = kwargs.get("screen_size", 84)
    spec = env_spec(config)
    assert spec.observation_shape == (1, size, size) and spec.observation_dtype == np.uint8 and spec.num_actions == 6
    register_env_family("ALE/Pong-v5")
    plain_env = gym.wrappers.AtariPreprocessing(gym.make("ALE/Pong-v5", frameskip=1), **kwargs)
    actions = list(np.random.default_rng(1).integers(0, 6, 40))
    ours = _steps(make_env(config), 3, actions)
    plain = _steps(plain_env, 3, actions)
    assert len(ours) == len(plain) == 41
    for a, b in zip(ours, plain):
        assert a.shape == (1, size, size) and a.dtype == np.uint8
        np.testing.assert_array_equal(a[0], b)
    assert len({a.tobytes() for a in ours}) > 5  # the frames move


def test_channels_first_needs_images():
    with pytest.raises(ConfigError, match=r'"channels_first" needs \(H, W, C\) Box observations'):
        env_spec(EnvConfig(id="CartPole-v1", preprocessing="channels_first"))


@pytest.mark.slow  # a child process
def test_a_config_names_a_minatar_id_in_a_fresh_process(tmp_path):
    """The config check registers the family itself: nothing imported minatar before."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"algorithm": "dqn", "env": {"id": "MinAtar/Breakout-v1",
                                                            "preprocessing": "channels_first"}}))
    code = f"from mpper.algos.configs import load_config; print(load_config({str(path)!r}).env.id)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "MinAtar/Breakout-v1"


@pytest.mark.slow  # a child process
@pytest.mark.parametrize("module,env_id,extra", [("minatar", "MinAtar/Breakout-v1", "minatar"),
                                                 ("ale_py", "ALE/Pong-v5", "atari")])
def test_a_missing_package_is_one_line_naming_the_extra(tmp_path, module, env_id, extra):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"algorithm": "dqn", "env": {"id": env_id}}))
    code = (f"import sys; sys.modules[{module!r}] = None\n"  # the import of that package now fails
            f"import runpy; sys.argv = ['run.py', '--config', {str(path)!r}, '--workers', '0']\n"
            "runpy.run_path('run.py', run_name='__main__')")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"{path}: env.id" in lines[0] and repr(env_id) in lines[0]
    assert f"pip install -e .[{extra}]" in lines[0]


# --------------------------------------------------------------------------------------
# DQN's convolutional torsos, against the networks of the papers built by hand
# --------------------------------------------------------------------------------------


def _paper_network(kind: str, shape: tuple[int, ...], num_actions: int):
    import torch
    from torch import nn

    c, h, w = shape
    if kind == "minatar":  # Young and Tian 2019, their DQN's Q-network
        convs = [nn.Conv2d(c, 16, kernel_size=3, stride=1)]
        flat, hidden = 16 * (h - 2) * (w - 2), 128
    else:  # Mnih et al. 2015, Extended Data Table / methods
        convs = [nn.Conv2d(c, 32, 8, stride=4), nn.Conv2d(32, 64, 4, stride=2), nn.Conv2d(64, 64, 3, stride=1)]
        side = ((h - 8) // 4 + 1 - 4) // 2 + 1 - 2
        flat, hidden = 64 * side * side, 512

    class Paper(nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = nn.ModuleList(convs)
            self.fc = nn.Linear(flat, hidden)
            self.out = nn.Linear(hidden, num_actions)

        def forward(self, x):
            x = x.float() / (255.0 if kind == "nature" else 1.0)
            for conv in self.convs:
                x = torch.relu(conv(x))
            return self.out(torch.relu(self.fc(x.reshape(x.shape[0], -1))))

    return Paper(), flat


@pytest.mark.parametrize("kind,shape,dtype", [("minatar", (4, 10, 10), np.bool_), ("nature", (4, 84, 84), np.uint8)])
def test_dqn_conv_torsos_are_the_papers_networks(kind, shape, dtype):
    import torch

    from mpper.algos.dqn.dqn import QNetwork

    torch.manual_seed(0)
    hidden = [128] if kind == "minatar" else [512]
    ours = QNetwork(shape, 6, hidden, torso=kind)
    paper, flat = _paper_network(kind, shape, 6)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in paper.parameters())
    assert ours.body[0].in_features == flat
    # The same weights, layer by layer, in the order both define them.
    with torch.no_grad():
        for mine, theirs in zip([m for m in ours.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))],
                                [m for m in paper.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]):
            theirs.weight.copy_(mine.weight)
            theirs.bias.copy_(mine.bias)
    rng = np.random.default_rng(0)
    frames = rng.random((5, *shape)) < 0.3 if dtype == np.bool_ else rng.integers(0, 256, (5, *shape), dtype=np.uint8)
    x = torch.from_numpy(frames)
    torch.testing.assert_close(ours(x), paper(x), rtol=1e-5, atol=1e-5)


def test_a_conv_torso_needs_images():
    from mpper.algos.dqn.dqn import QNetwork

    with pytest.raises(ValueError, match=r'dqn.torso "minatar" needs \(C, H, W\) image observations'):
        QNetwork((4,), 2, [8], torso="minatar")
    with pytest.raises(ValueError, match="too small"):
        QNetwork((1, 20, 20), 2, [8], torso="nature")


# --------------------------------------------------------------------------------------
# MuZero's downsampling representation, against muzero-general's
# --------------------------------------------------------------------------------------


def _muzero_general_representation(in_channels: int, channels: int, blocks: int):
    """muzero-general's ``RepresentationNetwork`` with ``downsample="resnet"`` (models.py
    at commit 0825bd5: ``DownSample``, then ``num_blocks`` ``ResidualBlock``s), written
    out here as it is there."""
    import torch
    from torch import nn

    def conv3x3(i, o, stride=1):
        return nn.Conv2d(i, o, kernel_size=3, stride=stride, padding=1, bias=False)

    class ResidualBlock(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = conv3x3(c, c), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = conv3x3(c, c), nn.BatchNorm2d(c)

        def forward(self, x):
            out = torch.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            return torch.relu(out + x)

    class DownSample(nn.Module):
        def __init__(self, i, o):
            super().__init__()
            self.conv1 = nn.Conv2d(i, o // 2, kernel_size=3, stride=2, padding=1, bias=False)
            self.resblocks1 = nn.ModuleList([ResidualBlock(o // 2) for _ in range(2)])
            self.conv2 = nn.Conv2d(o // 2, o, kernel_size=3, stride=2, padding=1, bias=False)
            self.resblocks2 = nn.ModuleList([ResidualBlock(o) for _ in range(3)])
            self.pooling1 = nn.AvgPool2d(kernel_size=3, stride=2, padding=1)
            self.resblocks3 = nn.ModuleList([ResidualBlock(o) for _ in range(3)])
            self.pooling2 = nn.AvgPool2d(kernel_size=3, stride=2, padding=1)

        def forward(self, x):
            x = self.conv1(x)
            for block in self.resblocks1:
                x = block(x)
            x = self.conv2(x)
            for block in self.resblocks2:
                x = block(x)
            x = self.pooling1(x)
            for block in self.resblocks3:
                x = block(x)
            return self.pooling2(x)

    class Representation(nn.Module):
        def __init__(self):
            super().__init__()
            self.downsample_net = DownSample(in_channels, channels)
            self.resblocks = nn.ModuleList([ResidualBlock(channels) for _ in range(blocks)])

        def forward(self, x):
            x = self.downsample_net(x)
            for block in self.resblocks:
                x = block(x)
            return x

    return Representation()


@pytest.mark.parametrize("shape", [(3, 96, 96), (1, 84, 84)])
def test_muzero_downsampling_is_muzero_generals(shape):
    import torch

    from mpper.algos.muzero.config import NetworkConfig
    from mpper.algos.muzero.networks import make_network, min_max_scale

    torch.manual_seed(0)
    config = NetworkConfig(kind="residual", encoding_size=16, hidden=[16], blocks=2, support_size=5,
                           reduced_channels=2, downsample=True)  # fmt: skip
    ours = make_network(config, shape, 6)
    assert ours.hidden_shape == (16, 6, 6)
    reference = _muzero_general_representation(shape[0], 16, 2)
    mine = ours.representation_network.state_dict()
    theirs = reference.state_dict()
    assert [tuple(t.shape) for t in mine.values()] == [tuple(t.shape) for t in theirs.values()]
    reference.load_state_dict(dict(zip(theirs.keys(), mine.values())))
    ours.eval()
    reference.eval()
    x = torch.rand(3, *shape)
    with torch.no_grad():
        torch.testing.assert_close(ours.representation(x), min_max_scale(reference(x), 2), rtol=1e-5, atol=1e-5)
        out = ours.recurrent_inference(ours.representation(x), torch.tensor([0, 3, 5]))
    assert out.hidden_state.shape == (3, 16, 6, 6) and out.policy_logits.shape == (3, 6)


def test_the_dqn_player_acts_on_the_stacks_the_learner_builds():
    """``dqn.frame_stack`` 3 on MinAtar: the stack a worker feeds its network at each move
    is the stack ``NStepTargets`` builds for that position from the stored episode."""
    import dataclasses

    import torch

    from mpper.algos.configs import default_config
    from mpper.algos.dqn.dqn import make_q_network
    from mpper.algos.dqn.targets import stack_frames
    from mpper.algos.registry import algorithm_of

    base = default_config("dqn")
    config = dataclasses.replace(
        base, env=EnvConfig(id="MinAtar/Breakout-v1", preprocessing="channels_first"),
        dqn=dataclasses.replace(base.dqn, frame_stack=3, torso="minatar", hidden=[16]),
    )  # fmt: skip
    seen = []

    class Recording(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append(x.numpy().copy())
            return self.inner(x)

    torch.manual_seed(0)
    network = Recording(make_q_network(config, (4, 10, 10), 3).eval())
    player = algorithm_of(config).make_player(config, [make_env(config.env)], network, explore=True, seed=2)
    finished = []
    while not finished:
        finished = player.step()
    arrays, _ = player.stored(finished[0])
    T = finished[0].moves
    assert T >= 3
    rows = np.arange(T)
    learner_view = stack_frames(arrays["observation"], rows, rows, 3)
    acted_on = np.concatenate(seen[:T])  # the first T forward passes: one per move (batch of one env)
    assert acted_on.shape == (T, 12, 10, 10)
    np.testing.assert_array_equal(acted_on, learner_view)
    assert not learner_view[0, :8].any() and learner_view[2].any()
