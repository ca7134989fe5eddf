"""``import remat`` gives every namespace the README uses and loads no heavy library it does not
need yet (scipy loads with the first MILP, transformers with the first Hugging Face model)."""

from __future__ import annotations

import subprocess
import sys


def test_import_remat_is_light_and_complete() -> None:
    code = (
        "import sys, remat\n"
        "assert callable(remat.integrations.huggingface.enable)\n"
        "assert callable(remat.memory.track) and callable(remat.zoo.build)\n"
        "print(sorted(m for m in ('scipy', 'transformers', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
