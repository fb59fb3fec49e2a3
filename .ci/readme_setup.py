"""The commands of README.md's "## Set up" code block, one per line, comments dropped.

`readme_setup.py README.md` prints them; `readme_setup.py --check README.md CMD...` exits 1 unless
they are exactly CMD... (`.ci/run` runs its own copy of them, so CI does what the README tells a
newcomer to do and stops when the two drift apart; tests/test_packaging.py checks the same).
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
    check = sys.argv[1] == "--check"
    args = sys.argv[2:] if check else sys.argv[1:]
    commands = setup_commands(Path(args[0]).read_text())
    if not check:
        print("\n".join(commands))
    elif commands != args[1:]:
        sys.exit(f"README.md's set-up commands {commands} are not the ones .ci/run runs {args[1:]}: make them agree")
