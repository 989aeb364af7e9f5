"""A received checkpoint cannot make mpper allocate more than the file holds, nor more than
a checkpoint of the config's network can: compressed zip entries (a small file that
expands to gigabytes) and oversized or sparse files are refused before ``torch.load``
reads them, while every real trainer's checkpoint (network, optimizer moments, target or
online network) fits the budget of its network."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch

from mpper.algos.configs import load_config
from mpper.algos.registry import algorithm_of, run_env_spec
from mpper.checkpoint import CheckpointError, checkpoint_budget, load_checkpoint, save_checkpoint

CONFIGS = Path(__file__).resolve().parents[1] / "mpper" / "configs"


def recompressed(path: Path, out: Path) -> None:
    """``path``'s zip archive rewritten with every entry deflated, as a crafted file would be."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry.filename))


def test_a_checkpoint_with_compressed_entries_is_refused_before_it_expands(tmp_path):
    plain = tmp_path / "plain.pt"
    torch.save({"network": {"w": torch.zeros(16 * 2**20 // 4)}, "training_step": 1}, plain)  # 16 MiB of zeros
    bomb = tmp_path / "checkpoint.pt"
    recompressed(plain, bomb)
    assert bomb.stat().st_size < plain.stat().st_size // 100  # small on disk
    assert torch.load(bomb, weights_only=True)["network"]["w"].numel() == 4 * 2**20  # torch.load would expand it
    with pytest.raises(CheckpointError, match=r"entry '.*' is compressed .* not written by mpper") as info:
        load_checkpoint(bomb)
    assert str(bomb) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["cartpole", "cartpole_dqn", "tictactoe", "minatar_breakout_dqn"])
def test_every_trainer_checkpoint_fits_the_budget_of_its_network_and_a_larger_one_does_not(name, tmp_path):
    config = load_config(CONFIGS / f"{name}.json", ["training.ema_decay=0.99"] if name == "tictactoe" else [])
    algorithm, spec = algorithm_of(config), run_env_spec(config)
    network = algorithm.make_network(config, spec.observation_shape, spec.num_actions)
    trainer = algorithm.make_trainer(config, network, torch.device("cpu"))
    # one optimizer step, so that the optimizer holds its moments (Adam: two per weight)
    loss = sum((p.float() ** 2).sum() for p in trainer.network.parameters())
    loss.backward()
    trainer.optimizer.step()
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, trainer, {"note": "x" * 1000})
    budget = checkpoint_budget(network)
    assert path.stat().st_size <= budget
    assert set(load_checkpoint(path, max_bytes=budget)["network"]) == set(network.state_dict())
    # the same file against the budget of a network with a quarter of the weights is refused
    with pytest.raises(CheckpointError, match=r"more than the .* a checkpoint of this config's network can hold"):
        load_checkpoint(path, max_bytes=path.stat().st_size - 1)


def test_a_sparse_terabyte_file_is_refused_from_its_size(tmp_path):
    path = tmp_path / "checkpoint.pt"
    buffer = io.BytesIO()
    torch.save({"network": {}, "training_step": 0}, buffer)
    with open(path, "wb") as f:
        f.write(buffer.getvalue())
        f.truncate(1 << 40)  # sparse: nothing is written past the real archive
    with pytest.raises(CheckpointError, match=r"1,099,511,627,776 bytes, more than the 1,048,576"):
        load_checkpoint(path, max_bytes=1 << 20)


def test_a_zip_directory_that_claims_more_than_the_file_is_refused(tmp_path):
    path = tmp_path / "checkpoint.pt"
    torch.save({"network": {"w": torch.ones(1000)}, "training_step": 0}, path)
    data = bytearray(path.read_bytes())
    # the central directory's uncompressed size of the data entry (4,000 bytes) raised to 4 GB - 1
    with zipfile.ZipFile(path) as archive:
        entry = next(e for e in archive.infolist() if e.file_size == 4000)
    name = entry.filename.encode()
    at = next(i - 46 for i in range(len(data)) if data.startswith(name, i) and data[i - 46:i - 42] == b"PK\x01\x02")
    data[at + 24:at + 28] = (2**32 - 2).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"claims .* bytes of entries in a file of .*: corrupt"):
        load_checkpoint(path)
