"""The README's OpenAI-HTTP examples, run as pasted: the launch line of that section (on the tiny
demo model in place of /tmp/demo, and a free port in place of 8000 — the only two substitutions,
made in every block alike), then the openai snippet through python and the curl example through
bash with curl, against that real deployment."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entrypoints.launch_harness import launched
from tests.tools import require_tool

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
READY = re.compile(r"^epdserve ready: grpc://\S+ .* http=(?P<http>http://\S+)")


def section_blocks(title: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README section that starts with `title`."""
    text = README.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```(\w+)\n(.*?)```", text[start:end if end != -1 else None], re.S)


def test_readme_http_examples_run_as_pasted(qwen2_vl_tiny):
    require_tool("curl", why="the README's curl example needs it")
    blocks = section_blocks("First request")
    launch_block = next(code for lang, code in blocks if lang == "bash" and "epdserve launch" in code)
    python_block = next(code for lang, code in blocks if lang == "python" and "from openai import OpenAI" in code)
    curl_block = next(code for lang, code in blocks if lang == "bash" and code.startswith("curl "))
    line = next(x for x in launch_block.splitlines() if x.startswith("epdserve launch "))
    argv = shlex.split(line.split("&")[0], comments=True)[2:]  # after `epdserve launch`, without ` &  # ...`
    assert "--http-port" in argv and "8000" in argv and "/tmp/demo" in argv
    model = str(qwen2_vl_tiny)
    argv = [{"8000": "0", "/tmp/demo": model}.get(a, a) for a in argv] + ["--kv-cache-mb", "16"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPDSERVE_")}
    with launched(argv, env, READY) as (found, _):
        base = found["http"]

        def pasted(code: str) -> str:
            return code.replace("http://127.0.0.1:8000", base).replace("/tmp/demo", model)

        r = subprocess.run([sys.executable, "-c", pasted(python_block)], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "CompletionUsage(completion_tokens=" in r.stdout, r.stdout  # print(..., r.usage)

        r = subprocess.run(["bash", "-c", pasted(curl_block)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        events = [x[len("data: "):] for x in r.stdout.splitlines() if x.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"usage"' in events[-2] and '"completion_tokens"' in events[-2], r.stdout
        assert '"error"' not in r.stdout
