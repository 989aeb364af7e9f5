"""A run directory a user received is data: its files are read only as regular files of
their own within a size (a FIFO, device, socket or symbolic link is refused unread, in one
line), nothing is written through a link in it, and no network address in its config is
used unless the command line repeats it. ``--ray`` at a port that is not a Ray head says
what answered there, within seconds.

Each refused command runs as ``mpper.cli.main`` (what ``python run.py`` calls) in the test's
process, against a copy of the shared ``trained_run``; the PNG written and the ``--ray``
probe run as ``python run.py``. A command that hangs (a FIFO opened for reading waits for a
writer for ever) fails the test at its timeout instead of stalling the suite."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_train_e2e import ROOT, run_args

from mpper import cli
from mpper.safe_files import ReceivedFileError, open_append, open_received, read_received, refuse_link

HANG_S = 120  # far above any of these refusals; a command still running then is hung


def command(args: list[str], timeout: float = HANG_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"run.py {' '.join(args)} hung (still running after {timeout} s)")


def refusal(args: list[str], capfd) -> str:
    """The one line ``error: ...`` of ``run.py ARGS``, run in this process, that exits 2;
    nothing else on stderr."""
    capfd.readouterr()
    code = cli.main(args)
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, out[-2000:] + err[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-4000:]
    return lines[0]


def child_refusal(args: list[str], timeout: float = HANG_S) -> str:
    """The one line ``error: ...`` of ``python run.py ARGS`` that exits 2, nothing else on stderr."""
    proc = command(args, timeout)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-4000:]
    return lines[0]


@pytest.fixture
def run_dir(trained_run, tmp_path) -> Path:
    """A copy of a finished run that a test may change."""
    copy = tmp_path / "received"
    shutil.copytree(trained_run, copy, symlinks=True)
    return copy


def replace_with(path: Path, kind: str, target: Path | None = None) -> None:
    """Put a FIFO (``kind="fifo"``) or a symbolic link to ``target`` (``"link"``) where
    ``path`` was."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to(target)


COMMANDS = {
    "--resume": lambda run: ["--resume", str(run), "--device", "cpu"],
    "--evaluate": lambda run: ["--evaluate", str(run), "--episodes", "1"],
    "--plot": lambda run: ["--plot", str(run)],
}


# ---- reads: regular files only --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, flag", [
    ("config.json", "fifo", "--resume"),
    ("config.json", "fifo", "--evaluate"),
    ("config.json", "fifo", "--plot"),
    ("config.json", "/dev/zero", "--resume"),
    ("config.json", "/dev/zero", "--evaluate"),
    ("config.json", "/dev/zero", "--plot"),
    (".lock", "fifo", "--resume"),
    ("episodes.jsonl", "fifo", "--resume"),
    ("metrics.jsonl", "fifo", "--resume"),
    ("metrics.jsonl", "fifo", "--plot"),
    ("best.pt", "fifo", "--evaluate"),
    ("best.pt", "/dev/zero", "--evaluate"),
    ("checkpoint.pt", "fifo", "--resume"),
    ("checkpoint.pt", "/dev/zero", "--resume"),
])  # fmt: skip
def test_a_fifo_or_a_link_to_dev_zero_in_a_run_directory_is_refused_unread(run_dir, capfd, name, kind, flag):
    replace_with(run_dir / name, "fifo" if kind == "fifo" else "link", Path(kind))
    line = refusal(COMMANDS[flag](run_dir), capfd)
    what = "is a FIFO, not a regular file" if kind == "fifo" else "is a symbolic link"
    assert str(run_dir / name) in line and what in line, line


def test_received_files_open_only_as_regular_files_within_their_size(tmp_path):
    regular = tmp_path / "config.json"
    regular.write_bytes(b"{}" * 10)
    assert read_received(regular, 20) == b"{}" * 10
    with pytest.raises(ReceivedFileError, match=r"20 bytes, more than the 19 mpper reads"):
        read_received(regular, 19)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(regular)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(tmp_path / "sock"))
    refused = {fifo: "is a FIFO", link: "is a symbolic link", tmp_path / "sock": "is a socket",
               tmp_path: "is a directory", Path("/dev/null"): "is a device"}  # fmt: skip
    try:
        for path, what in refused.items():
            with pytest.raises(ReceivedFileError, match=what):
                open_received(path, 1 << 20, follow_links=path == Path("/dev/null"))
    finally:
        server.close()
    # a link the user named on the command line is followed, to a regular file only
    assert read_received(link, 20, follow_links=True) == b"{}" * 10
    (tmp_path / "zero").symlink_to("/dev/zero")
    with pytest.raises(ReceivedFileError, match="is a device"):
        read_received(tmp_path / "zero", 1 << 20, follow_links=True)
    with pytest.raises(FileNotFoundError):
        open_received(tmp_path / "missing", 1)


# ---- writes: never through a link -----------------------------------------------------------


def test_appends_and_directories_written_into_never_follow_a_link(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("theirs\n")
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(outside)
    with pytest.raises(ReceivedFileError, match="is a symbolic link"):
        open_append(link)
    fifo = tmp_path / "episodes.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ReceivedFileError, match="is a FIFO"):
        open_append(fifo)  # opening a FIFO to write would wait for a reader
    assert outside.read_text() == "theirs\n"
    with open_append(tmp_path / "new.jsonl", line_buffered=True) as f:
        f.write("one\n")
    with open_append(tmp_path / "new.jsonl") as f:
        f.write("two\n")
    assert (tmp_path / "new.jsonl").read_text() == "one\ntwo\n"
    (tmp_path / "tensorboard").symlink_to(tmp_path)
    with pytest.raises(ReceivedFileError, match="is a symbolic link"):
        refuse_link(tmp_path / "tensorboard")
    with pytest.raises(ReceivedFileError, match="is a regular file, not a directory"):
        refuse_link(outside)
    refuse_link(tmp_path / "absent")  # nothing there: mpper creates it


def test_a_run_never_appends_to_a_linked_file_in_its_directory(tmp_path):
    """A new run into a directory that holds only a planted link (no run yet, so nothing
    asks for --resume): ``Run.start`` refuses it and the file it points to is unchanged."""
    from mpper.algos.configs import load_config
    from mpper.runtime.run import Run

    outside = tmp_path / "theirs.txt"
    outside.write_text("theirs\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "episodes.jsonl").symlink_to(outside)
    run = Run(load_config(ROOT / "configs" / "cartpole.json"), run_dir)
    try:
        with pytest.raises(ReceivedFileError, match="episodes.jsonl: is a symbolic link"):
            run.start()
    finally:
        run.finish()
    assert outside.read_text() == "theirs\n"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["metrics.jsonl", "tensorboard", "episodes.jsonl", "best.pt"])
def test_resume_refuses_a_run_directory_whose_written_entries_are_links(run_dir, tmp_path, capfd, name):
    outside = tmp_path / "outside"
    if name == "tensorboard":
        outside.mkdir()
    else:
        shutil.copyfile(run_dir / name, outside)
    before = sorted(p.name for p in outside.iterdir()) if outside.is_dir() else outside.read_bytes()
    replace_with(run_dir / name, "link", outside)
    line = refusal(COMMANDS["--resume"](run_dir), capfd)
    assert f"{run_dir / name}: is a symbolic link" in line, line
    after = sorted(p.name for p in outside.iterdir()) if outside.is_dir() else outside.read_bytes()
    assert after == before


@pytest.mark.slow
def test_plot_writes_nothing_through_a_link(run_dir, tmp_path, capfd):
    """A linked ``plots/`` directory is refused; a linked ``plots/return.png`` is replaced
    by the new PNG (renamed into place), the file it pointed to left as it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    replace_with(run_dir / "plots", "link", outside)
    line = refusal(COMMANDS["--plot"](run_dir), capfd)
    assert f"{run_dir / 'plots'}: is a symbolic link" in line, line
    assert list(outside.iterdir()) == []

    (run_dir / "plots").unlink()
    (run_dir / "plots").mkdir()
    theirs = outside / "theirs.png"
    theirs.write_bytes(b"not mpper's")
    (run_dir / "plots" / "return.png").symlink_to(theirs)
    proc = command(COMMANDS["--plot"](run_dir))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert theirs.read_bytes() == b"not mpper's"
    png = run_dir / "plots" / "return.png"
    assert not png.is_symlink() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the network: no received address, and a timeout that says what answered ----------------


@pytest.fixture
def silent_listener():
    """A TCP port on 127.0.0.1 that accepts connections (the kernel's backlog) and never
    says anything."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    try:
        yield server
    finally:
        server.close()


def connections_made(server: socket.socket) -> int:
    server.setblocking(False)
    made = 0
    while True:
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            return made
        conn.close()
        made += 1


@pytest.mark.slow
def test_resume_connects_to_no_address_its_config_names(run_dir, silent_listener, capfd):
    address = "127.0.0.1:%d" % silent_listener.getsockname()[1]
    config = json.loads((run_dir / "config.json").read_text())
    config["runtime"].update(ray_address=address, workers=1)
    (run_dir / "config.json").write_text(json.dumps(config))
    line = refusal(COMMANDS["--resume"](run_dir), capfd)
    assert f'sets runtime.ray_address "{address}"' in line and f"repeat it with --ray {address}" in line, line
    assert connections_made(silent_listener) == 0


@pytest.mark.slow
def test_ray_at_a_port_that_is_not_a_ray_head_is_one_line(tmp_path, silent_listener):
    address = "127.0.0.1:%d" % silent_listener.getsockname()[1]
    t0 = time.monotonic()
    # a child: the probe is Ray's client, kept out of the test's process ([2:]: run_args without python run.py)
    line = child_refusal(run_args(tmp_path / "run", "--workers", "1", "--ray", address)[2:])
    assert line.startswith(f"error: {address} accepted a TCP connection but answered nothing within 5 s: "
                           "not a Ray head"), line  # fmt: skip
    assert time.monotonic() - t0 < HANG_S


def test_the_probe_says_what_answered_and_lets_a_grpc_server_through():
    from concurrent import futures

    import grpc

    from mpper.runtime.remote import ClusterError, _probe_head

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def greet() -> None:
        conn, _ = server.accept()
        with conn:
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            conn.recv(1024)

    greeter = threading.Thread(target=greet, daemon=True)
    greeter.start()
    try:
        with pytest.raises(ClusterError, match=r"answered b'SSH-2\.0-OpenSSH_9\.6.*not as a gRPC server"):
            _probe_head("127.0.0.1:%d" % server.getsockname()[1])
    finally:
        greeter.join(10)
        server.close()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # what a Ray head's GCS is
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        _probe_head(f"127.0.0.1:{port}")
    finally:
        grpc_server.stop(None)
