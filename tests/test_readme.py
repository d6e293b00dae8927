"""The README's example runs as pasted, and its test command is the one CI runs."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_first_example_runs_as_pasted(capsys):
    text = (REPO / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "(29, 512)"


def test_ci_runs_the_readme_test_command():
    text = (REPO / "README.md").read_text()
    command = re.search(r"```bash\n(pip install -e \"\.\[test\]\" && python -m pytest -q)\n```", text).group(1)
    assert command in (REPO / ".ci" / "run").read_text()
