"""`python -m autocompress.X POSITIONAL key=value ...`: short keys of one config group, other keys as Hydra overrides."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autocompress.errors import AutoCompressError, ConfigError

_TASK_STARTED = False


def task(interrupted: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Mark a @hydra.main task function (put it under the decorator): once it runs, Hydra has composed the config.
    Bad input and Ctrl-C end it as `guarded` says; `interrupted` is the line for a Ctrl-C that carries no message of its
    own (what was kept, how to go on)."""
    import functools

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            global _TASK_STARTED
            _TASK_STARTED = True
            code = guarded(lambda: fn(*args, **kwargs), interrupted=interrupted)
            if code:
                sys.exit(code)

        return wrapper

    return decorate


def guarded(body: Callable[[], Any], usage: str | None = None, interrupted: str = "nothing was written") -> int:
    """Every command's exit policy: `body()` and 0; bad input as one `error:` line (plus `usage` after a malformed
    command line) and 2; Ctrl-C or SIGTERM as one `interrupted:` line, what was kept and how to go on (the exception's
    message, else `interrupted`), and 130; no traceback for either."""
    try:
        body()
    except UsageError as exc:
        print(f"error: {exc}" + (f"\n\n{usage}" if usage else ""), file=sys.stderr)
        return 2
    except AutoCompressError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        _ignore_further_interrupts()  # more Ctrl-C while Ray and the engines shut down: no traceback after this line
        print(f"interrupted: {str(exc) or interrupted}", file=sys.stderr)
        return 130
    return 0


def _ignore_further_interrupts() -> None:
    """The command has stopped and says so; further Ctrl-C (users press it again and again) must not break the shutdown
    that follows (Ray's atexit handlers) with a KeyboardInterrupt traceback and exit 1."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


class _HeldStderr:
    """stderr that holds what is written until the task starts (Hydra's composing), then writes through."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.held: list[str] = []

    def write(self, text: str) -> int:
        if _TASK_STARTED:
            self.release()
            return int(self.real.write(text))
        self.held.append(text)
        return len(text)

    def release(self) -> None:
        if self.held:
            self.real.write("".join(self.held))
            self.held = []

    def flush(self) -> None:
        if _TASK_STARTED:
            self.release()
        self.real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


CONFIG_DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def help_config(prefix: str = "") -> str:
    """`--help-config [PREFIX]`: every documented setting whose key starts with PREFIX (docs/configuration.md's rows:
    key, default, range or choices, what it does). ConfigError when none does."""
    if not CONFIG_DOC.exists():  # a wheel install carries the code, not the docs
        raise ConfigError("docs/configuration.md is not installed here; read it in the project's repository")
    rows = []
    for line in CONFIG_DOC.read_text().splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) >= 4 and cells[0].startswith(prefix):
            rows.append(f"{cells[0]} = {cells[1]}  ({cells[2]})\n    {' | '.join(cells[3:])}")
    if not rows:
        raise ConfigError(f"no setting starts with {prefix!r}; --help-config alone lists them all (docs/configuration.md)")
    return "\n".join(rows)


def _help_config(argv: list[str]) -> bool:
    """Print the settings for `--help-config [PREFIX]` and return True; False when argv does not ask for them."""
    if "--help-config" not in argv:
        return False
    rest = argv[argv.index("--help-config") + 1 :]
    try:
        print(help_config(rest[0] if rest and not rest[0].startswith("-") else ""))
    except AutoCompressError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    return True


def hydra_entry(main: Callable[[], None]) -> None:
    """Run a @hydra.main entry point so that Hydra's own errors (unknown key, bad group option, malformed
    override: all before the task runs) end as one `error:` line naming the value and the nearest valid choices, exit 2
    like every other bad input; a crash inside the task keeps exit 1 and its traceback. `--help-config [PREFIX]` lists
    the documented settings instead (Hydra's own --help lists the config groups)."""
    if _help_config(sys.argv[1:]):
        return
    real = sys.stderr
    held = _HeldStderr(real)
    sys.stderr = held
    try:
        main()
    except SystemExit as exc:
        if exc.code == 1 and not _TASK_STARTED:
            print(f"error: {hydra_error_line(''.join(held.held))}", file=real)
            held.held = []
            raise SystemExit(2) from None
        raise
    finally:
        sys.stderr = real
        held.release()


def hydra_error_line(text: str) -> str:
    """Hydra's multi-line message -> one line: what is wrong and the nearest valid choices."""
    import difflib
    import re

    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("Set the environment variable HYDRA")]
    missing = re.search(r"Could not find '([\w./-]+)/([^']+)'", text)
    if missing:
        group, name = missing.groups()
        listed = text.split("Available options in", 1)[-1].split("Config search path:", 1)[0]  # not the search path's lines
        options = [line.strip() for line in listed.splitlines()[1:] if line.startswith("\t")]
        near = sorted(options, key=lambda o: -difflib.SequenceMatcher(None, name, o).ratio())  # nearest first
        return (
            f"{group}={name} is not a shipped {group} nor one of --config-dir's; choose one of {', '.join(near)} "
            f"(or write conf/{group}/{name}.yaml, or {group}/{name}.yaml in your own folder given with --config-dir: docs/scenarios.md)"
        )
    unknown = re.search(r"full_key: ([\w.]+)", text)
    if unknown and "not in struct" in text:
        key = unknown.group(1)
        parent, _, leaf = key.rpartition(".")
        near = difflib.get_close_matches(leaf, _config_keys(parent), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(f'{parent}.{n}' if parent else n for n in near)}?" if near else ""
        return f"unknown key {key}{hint} (add a new key with +{key}=VALUE)"
    return "; ".join(lines[:2]) if lines else "the command line could not be composed (Hydra)"


def _config_keys(path: str) -> list[str]:
    """The keys under `path` of the shipped default config (empty where it cannot be composed)."""
    try:
        from autocompress.config.compose import compose_dict

        node: Any = compose_dict()
        for part in filter(None, path.split(".")):
            node = node[part]
        return list(node) if isinstance(node, dict) else []
    except Exception:
        return []


class UsageError(ConfigError):
    """The command line is malformed (entry points print their usage after the message)."""


def run_command(argv: list[str] | None, usage: str, body: Callable[[list[str]], None]) -> int:
    """An entry point's shell: the usage for -h/--help (exit 0) or no arguments (exit 2); `body(args)`;
    bad input as one `error:` line (plus the usage for a malformed command line) and exit 2."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    return guarded(lambda: body(args), usage)


@dataclass(frozen=True)
class Command:
    """A parsed command line: positional arguments, the command's own options, and the composed config."""

    positional: list[str]
    options: dict[str, str]  # keys the command handles itself (out=, overwrite=, ...)
    config: dict[str, Any]  # the project's composed config (conf/config.yaml + overrides), plain data


def parse(argv: list[str], group: str, spec: type, options: tuple[str, ...] = ()) -> Command:
    """Split `argv`: `key=value` for a field of `spec` becomes `group.key=value`, `options` stay with the command,
    anything else (`model=tiny_llama`, `data.seq_len=64`, `model.path=DIR`) is a Hydra override of conf/config.yaml."""
    from autocompress.config.compose import compose_dict

    fields = {f.name for f in dataclasses.fields(spec)}
    positional, own, overrides = [], {}, []
    for arg in argv:
        if "=" not in arg:
            positional.append(arg)
            continue
        key, value = arg.split("=", 1)
        if key in options:
            own[key] = value
        elif key.split(".")[0] in fields:
            if "," in value and not value.startswith("["):
                value = f"[{value}]"  # tasks=a,b means the list, not a Hydra multirun
            overrides.append(f"{group}.{key}={value}")
        else:
            overrides.append(arg)
    try:
        config = compose_dict(*overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra's own errors: unknown key, bad group option
        raise UsageError(f"{' '.join(overrides)}: {exc}") from exc
    return Command(positional, own, config)


def flag(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
        raise UsageError(f"{key}={value}: expected true or false")
    return value.lower() in ("true", "1", "yes")
