"""Print the commands of README.md's "## Set up" code block, one per line, comments dropped.

`.ci/run` runs them in a fresh virtual environment, so CI does exactly what the README tells a
newcomer to do; a test (tests/test_packaging.py) checks that the block holds both set-up commands.
"""
import re
import sys
from pathlib import Path


def setup_commands(readme: str) -> list[str]:
    section = readme.split("\n## Set up", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    if block is None:
        raise SystemExit("README.md: no ```bash block under '## Set up'")
    lines = (line.split("#", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line]


if __name__ == "__main__":
    print("\n".join(setup_commands(Path(sys.argv[1]).read_text())))
