"""Reading the JSON files remat writes (plans, pipeline plans), with remat's errors for a missing
or damaged file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from remat._errors import RematValueError, message


def read_json(path: str | os.PathLike[str], api: str, writer: str) -> Any:
    """The JSON body of ``path``; a RematValueError naming ``api`` where the file is missing or is
    not JSON (``writer``: what writes such files, for the hint)."""
    try:
        return json.loads(Path(path).read_text())
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
    try:
        Path(path).write_text(text)
    except OSError as err:
        raise RematValueError(
            message(
                api,
                "the file could not be written",
                f"{path}: {err.strerror or err}",
                "pass a file path in a folder that exists and can be written",
            )
        ) from None
