"""Why a run died, said plainly: RUN_DIR/run.log and the failure's cause chain.

Place in the dataflow: `asyncrl launch` attaches `RunLog` to the root logger before the run starts (every
line the driver logs, at `--log-level`, also goes to RUN_DIR/run.log; the roles' own lines reach it when
they run in process, `--local`). When the run fails, the CLI prints `cause_chain(exc)`: the innermost
exception first — the user's (a reward module that does not import, a data source that raises, an env
constructor's error) — then each exception that wrapped it, one line each, with Ray's wrappers
(`RayTaskError`, which repeats the remote traceback in its text) reduced to the exception they carry. The
full tracebacks go to run.log.
"""

from __future__ import annotations

import logging
from pathlib import Path

RUN_LOG = "run.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RunLog:
    """A file handler on the root logger, writing RUN_DIR/run.log (appended to on resume)."""

    def __init__(self, run_dir: str | Path, level: int = logging.INFO) -> None:
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / RUN_LOG
        self.handler = logging.FileHandler(self.path, encoding="utf-8")
        self.handler.setLevel(level)
        self.handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
        logging.getLogger().addHandler(self.handler)

    def exception(self, exc: BaseException, message: str = "run failed") -> None:
        """`exc` with its whole traceback into run.log only (the console gets `cause_chain`'s lines)."""
        self.handler.handle(logging.LogRecord("asyncrl", logging.ERROR, __file__, 0, message, None,
                                              (type(exc), exc, exc.__traceback__)))

    def close(self) -> None:
        logging.getLogger().removeHandler(self.handler)
        self.handler.close()


def _inner(exc: BaseException) -> BaseException | None:
    """The exception `exc` wraps: Ray's carried `cause` first (a remote task's error), then the chain."""
    carried = getattr(exc, "cause", None)
    if isinstance(carried, BaseException) and carried is not exc:
        return carried
    if exc.__cause__ is not None:
        return exc.__cause__
    if exc.__context__ is not None and not exc.__suppress_context__:
        return exc.__context__
    return None


def _is_ray_wrapper(exc: BaseException) -> bool:
    return any(c.__module__.startswith("ray.") and c.__name__ == "RayTaskError" for c in type(exc).__mro__)


def _line(exc: BaseException) -> str:
    name = type(exc).__name__
    if _is_ray_wrapper(exc) and isinstance(getattr(exc, "cause", None), BaseException):
        name = type(exc.cause).__name__  # type: ignore[attr-defined]  # RayTaskError(ValueError) -> ValueError
        text = str(exc.cause)  # type: ignore[attr-defined]
    else:
        text = str(exc)
    first = next((t.strip() for t in text.strip().splitlines() if t.strip()), "")
    return f"{name}: {first[:300]}" if first else name


def cause_chain(exc: BaseException, limit: int = 6) -> list[str]:
    """One line per exception of `exc`'s chain, the innermost (the root cause) first; Ray's task wrappers
    are folded into the exception they carry, repeated lines are dropped."""
    chain: list[BaseException] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < 32:
        seen.add(id(e))
        chain.append(e)
        e = _inner(e)
    lines: list[str] = []
    for e in reversed(chain):
        if _is_ray_wrapper(e) and _inner(e) is not None and id(_inner(e)) in seen:
            continue  # its carried cause is already in the list
        line = _line(e)
        if line not in lines:
            lines.append(line)
    return lines[:limit] if len(lines) <= limit else [*lines[: limit - 1], lines[-1]]
