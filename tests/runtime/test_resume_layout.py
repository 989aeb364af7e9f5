"""``--resume`` checks the snapshot's fields against the run's config before anything
starts, as ``--evaluate --on-snapshot`` does: a field stored with another dtype or shape
(checksums and manifest rewritten to match, so that only the layout is wrong) is
refused in one line with exit code 2, instead of being converted into the new buffer
and trained on."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from mpper import cli

pytestmark = pytest.mark.slow


def rewrite_field(snapshot: Path, name: str, array: np.ndarray) -> None:
    """Store ``array`` as the snapshot's field ``name``, its manifest entry (shape, dtype,
    sha256) and schema entry rewritten to match: a snapshot consistent in itself."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    file = f"field.{name}.npy"
    np.save(snapshot / file, array, allow_pickle=False)
    digest = hashlib.sha256((snapshot / file).read_bytes()).hexdigest()
    manifest["files"][file] = {"sha256": digest, "shape": list(array.shape), "dtype": array.dtype.str}
    (entry,) = [e for e in manifest["schema"] if e["name"] == name]
    entry.update(shape=list(array.shape[1:]), dtype=array.dtype.str)
    (snapshot / "manifest.json").write_text(json.dumps(manifest))


def refusal_lines(run_dir: Path, capsys) -> list[str]:
    """The stderr lines of ``run.py --resume run_dir`` (``mpper.cli.main`` in this process:
    the refusal comes before anything starts), which must exit 2 with one line."""
    capsys.readouterr()
    code = cli.main(["--resume", str(run_dir), "--device", "cpu"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err[-4000:]
    return lines


VARIANTS = {
    "float64": ("observation", lambda a: a.astype(np.float64), "(4,) float64 there, the run stores (4,) float32"),
    "int8": ("action", lambda a: a.astype(np.int8), "() int8 there, the run stores () int64"),
    "reshaped": ("observation", lambda a: a.reshape(len(a), 2, 2), "(2, 2) float32 there, the run stores (4,) float32"),
    "uint8 0/255": ("legal_actions", lambda a: a.astype(np.uint8) * 255, "(2,) uint8 there, the run stores (2,) bool"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_resume_refuses_a_snapshot_whose_fields_do_not_match_the_config(trained_run, tmp_path, capsys, variant):
    name, convert, expected = VARIANTS[variant]
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    rewrite_field(run_dir / "buffer", name, convert(np.load(run_dir / "buffer" / f"field.{name}.npy")))
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    lines = refusal_lines(run_dir, capsys)
    assert lines[0].startswith(f"error: --resume {run_dir}: snapshot {run_dir / 'buffer'} does not match run"), lines
    assert f"{name} is {expected}" in lines[0], lines[0]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before  # nothing started, nothing written


def test_resume_refuses_bool_bytes_other_than_0_and_1(trained_run, tmp_path, capsys):
    """A bool field's bytes are 0 or 1; numpy reads any other as true, but sums and
    compiled kernels read the byte. ``legal_actions`` stored as bool with bytes 255: the
    dtype and shape match, the values do not."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained_run, run_dir)
    legal = np.load(run_dir / "buffer" / "field.legal_actions.npy")
    rewrite_field(run_dir / "buffer", "legal_actions", (legal.view(np.uint8) * 255).view(np.bool_))
    lines = refusal_lines(run_dir, capsys)
    assert f"{run_dir / 'buffer' / 'field.legal_actions.npy'}: slot " in lines[0], lines[0]
    assert "holds a bool byte other than 0 or 1" in lines[0], lines[0]
