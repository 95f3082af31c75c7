"""The README's quick start runs as written and trains."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quick_start() -> str:
    text = README.read_text()
    section = text.split("## Quick start", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "no python block under '## Quick start'"
    return match.group(1)


def test_quick_start_runs_and_learns(capsys):
    code = _quick_start()
    namespace: dict = {}
    exec(compile(code, "README-quick-start", "exec"), namespace)
    state, loss = namespace["state"], namespace["loss"]
    assert int(state.step) == 200
    assert float(loss) < 0.6  # chance level for 4 classes is ln 4 = 1.39
    assert "loss" in capsys.readouterr().out
