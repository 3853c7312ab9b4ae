"""Every command ends the same way: bad input one `error:` line and exit 2, Ctrl-C one `interrupted:` line and 130."""

from __future__ import annotations

import pytest

from autocompress.config import cliargs
from autocompress.config.cliargs import UsageError, guarded, run_command, task
from autocompress.errors import ConfigError
from autocompress.search.tune import Interrupted


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize(
    "exc,code,line",
    [
        (None, 0, None),
        (ConfigError("bad key x: use y"), 2, "error: bad key x: use y"),
        (UsageError("give a FOLDER"), 2, "error: give a FOLDER\n\nusage: cmd FOLDER"),
        (KeyboardInterrupt(), 130, "interrupted: nothing was written"),
        (Interrupted("3 of 8 trials recorded; finish the run with resume=R"), 130, "interrupted: 3 of 8 trials recorded"),
    ],
)
def test_guarded_maps_each_ending(
    exc: BaseException | None, code: int, line: str | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal

    handlers: list[object] = []
    monkeypatch.setattr(signal, "signal", lambda sig, handler: handlers.append((sig, handler)))
    assert guarded(lambda: None if exc is None else _raise(exc), usage="usage: cmd FOLDER") == code
    err = capsys.readouterr().err
    assert (err == "") if line is None else err.startswith(line)
    assert "Traceback" not in err
    # after an interruption, more Ctrl-C during the shutdown is ignored (no KeyboardInterrupt traceback from Ray's atexit)
    assert handlers == ([(signal.SIGINT, signal.SIG_IGN)] if code == 130 else [])


def test_a_hydra_task_and_an_argv_command_exit_alike(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    monkeypatch.setattr(cliargs, "_TASK_STARTED", False)  # the tasks below set it; later tests see it as it was
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)  # the test process keeps its own Ctrl-C
    with pytest.raises(SystemExit) as stop:
        task("kept: x")(lambda: _raise(ConfigError("scenario missing: add +scenario=NAME")))()
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: scenario missing: add +scenario=NAME\n"
    with pytest.raises(SystemExit) as stop:
        task("kept: x")(lambda: _raise(KeyboardInterrupt()))()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "interrupted: kept: x\n"
    task("kept: x")(lambda: None)()  # no exit when the task ends normally
    assert run_command(["x"], "usage: cmd X", lambda args: _raise(ConfigError(f"no {args[0]}"))) == 2
    assert capsys.readouterr().err == "error: no x\n"
    assert run_command([], "usage: cmd X", lambda args: None) == 2  # no arguments: the usage
    assert run_command(["-h"], "usage: cmd X", lambda args: None) == 0
