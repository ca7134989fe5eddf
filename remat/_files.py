"""Reading the JSON files remat writes (plans, pipeline plans), with remat's errors for a missing
or damaged file, and for a path that is not one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from remat._errors import RematTypeError, RematValueError, message


def path_of(path: object, api: str) -> Path:
    """``path`` (a string or an ``os.PathLike``) as a Path; a RematTypeError naming ``api`` for
    anything else (a number, None, a model passed in its place)."""
    if not isinstance(path, (str, os.PathLike)):
        raise RematTypeError(
            message(
                api, "a path is a string or a pathlib.Path", f"got {type(path).__name__}", "pass a file path"
            )
        )
    return Path(path)


def read_json(path: str | os.PathLike[str], api: str, writer: str) -> Any:
    """The JSON body of ``path``; a RematValueError naming ``api`` where the file is missing or is
    not JSON (``writer``: what writes such files, for the hint)."""
    try:
        return json.loads(path_of(path, api).read_text())
    except FileNotFoundError:
        raise RematValueError(
            message(api, "no such file", str(path), f"pass the path {writer} wrote")
        ) from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as err:
        raise RematValueError(
            message(api, "cannot read this file", f"{path}: {err}", f"pass the path {writer} wrote")
        ) from None
    except (json.JSONDecodeError, RecursionError) as err:  # nested past Python's stack: not a plan
        said = err if isinstance(err, json.JSONDecodeError) else "nested too deep"
        raise RematValueError(
            message(api, "the plan file is not JSON", f"{path}: {said}", f"load a file {writer} wrote")
        ) from None


def write_text(path: str | os.PathLike[str], text: str, api: str) -> None:
    """Write ``text`` to ``path``; a RematValueError naming ``api`` where it cannot be written (a
    missing folder, a folder in its place, no permission)."""
    target = path_of(path, api)
    try:
        target.write_text(text)
    except OSError as err:
        raise RematValueError(
            message(
                api,
                "the file could not be written",
                f"{path}: {err.strerror or err}",
                "pass a file path in a folder that exists and can be written",
            )
        ) from None


def writable(file: object, api: str) -> None:
    """Refuse a ``file=`` that is neither None (standard output) nor has a ``write`` method."""
    if file is not None and not callable(getattr(file, "write", None)):
        rule = "file is where the table goes: a text stream such as sys.stderr, or None for stdout"
        raise RematTypeError(
            message(api, rule, f"got {type(file).__name__}", "pass an open file, or leave it out")
        )
    if file is not None and getattr(file, "closed", False) is True:
        raise RematValueError(
            message(
                api,
                "file is a stream open for writing",
                f"got a closed {type(file).__name__}",
                "pass an open file",
            )
        )
