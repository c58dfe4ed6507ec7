"""The README's example runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_the_readme_example_runs():
    text = (Path(__file__).parents[1] / "README.md").read_text()
    example = re.search(r"## Use\n\n```python\n(.*?)```", text, re.S)
    assert example, "README has a ## Use example"
    exec(compile(example.group(1), "README.md", "exec"), {})
