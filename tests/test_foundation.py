"""The foundation itself: the CLI, the import layout, and the process harness."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from infergate.procs import ManagedProcess, ProcessGroup, ProcessStartError, free_port, http_ready

SUBCOMMANDS = ["engine", "epp", "operator", "up", "bench"]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infergate.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_help_lists_every_subcommand() -> None:
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    for name in SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["engine", "--help"],
        ["engine", "serve", "--help"],
        ["engine", "make-tiny-model", "--help"],
        ["epp", "--help"],
        ["operator", "--help"],
        ["up", "--help"],
        ["bench", "serve", "--help"],
    ],
)
def test_every_subcommand_has_help(args: list[str]) -> None:
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    assert "Usage" in result.stdout


def test_component_folders_import_under_infergate_only() -> None:
    import operator

    import infergate.engine
    import infergate.epp

    import infergate.operator.cli

    repo = Path(__file__).resolve().parents[1]
    assert Path(infergate.operator.cli.__file__).resolve().parent == repo / "operator"
    assert Path(infergate.epp.__file__).parent == repo / "epp"
    assert Path(infergate.engine.__file__).parent == repo / "engine"
    assert not Path(operator.__file__).resolve().is_relative_to(repo)


def test_repo_root_never_shadows_stdlib_operator() -> None:
    """`python -m ...` from the repository root puts it first on sys.path."""
    repo = Path(__file__).resolve().parents[1]
    assert not (repo / "operator" / "__init__.py").exists()
    probe = subprocess.run(
        [sys.executable, "-m", "json.tool", "--help"], cwd=repo, capture_output=True, text=True
    )
    assert probe.returncode == 0, probe.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import operator; print(operator.__file__)"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    assert not Path(probe.stdout.strip()).resolve().is_relative_to(repo)


def test_start_failure_reports_the_log(tmp_path: Path) -> None:
    process = ManagedProcess(
        "crasher",
        [sys.executable, "-c", "print('boom: bad flag'); raise SystemExit(3)"],
        log_path=tmp_path / "crasher.log",
    ).start()
    with pytest.raises(ProcessStartError, match="boom: bad flag"):
        process.wait_ready(lambda: False, timeout=10)
    assert process.stop() == 3


def test_readiness_deadline_and_group_stop(tmp_path: Path) -> None:
    # A shell that starts a grandchild: stopping the child must take the grandchild too.
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 300 & echo $! > {pid_file}; wait"
    process = ManagedProcess("sleeper", ["bash", "-c", script]).start()
    with pytest.raises(ProcessStartError, match="not ready after"):
        process.wait_ready(lambda: False, timeout=0.3)
    while not pid_file.exists() or not pid_file.read_text().strip():
        pass
    grandchild = int(pid_file.read_text())
    process.stop(grace=2)
    assert not process.alive()
    assert (
        not Path(f"/proc/{grandchild}").exists()
        or "Z" in Path(f"/proc/{grandchild}/stat").read_text().split()[2]
    )


def test_process_group_waits_for_http(tmp_path: Path) -> None:
    port = free_port()
    with ProcessGroup() as group:
        server = group.start(
            "http",
            [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
            ready=http_ready(f"http://127.0.0.1:{port}/"),
            timeout=20,
            cwd=tmp_path,
        )
        assert server.alive()
    assert not server.alive()


def test_children_die_with_a_killed_parent(tmp_path: Path) -> None:
    """Even if the parent is SIGKILLed, its managed children do not linger."""
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import sys, time
        from infergate.procs import ManagedProcess
        child = ManagedProcess("c", [sys.executable, "-c", "import time; time.sleep(300)"]).start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            subprocess.run(["sleep", "0.05"], check=True)
        child_pid = int(pid_file.read_text())
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not Path(f"/proc/{child_pid}").exists():
            break
        stat = Path(f"/proc/{child_pid}/stat").read_text().split()
        if stat[2] == "Z":
            break
        subprocess.run(["sleep", "0.05"], check=True)
    else:
        pytest.fail(f"child {child_pid} outlived its killed parent")
