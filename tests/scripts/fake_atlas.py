"""A fake Atlas server for scripts/atlas_node.sh's preflight: an Ascend install root (driver
version.info, a CANN toolkit with its set_env.sh) and an `npu-smi` that prints `info -m` and
`info -t usages` as an A3-style server does (two chips per card; the Mcu row has no logical id).
Its HBM figures come from FAKE_HBM_MB (capacity, default 65536) and FAKE_HBM_RATE (usage %,
default 25) in the script's environment, so a test can play a 32 GB Atlas 800I A2 or a full NPU;
FAKE_NPU_ID=-1 plays a card npu-smi marks unavailable, FAKE_NO_HBM=1 a product without HBM (its
usages print "Memory Capacity(MB)", as Ascend's npu-smi manual shows for the Atlas 200I A2);
FAKE_CHIPS=8 lists logical ids 0-7 (an 800I A2's eight NPUs; default 2: ids 0 and 1)."""

from pathlib import Path

FAKE_NPU_SMI = r"""#!/bin/sh
case "$*" in
  "info") echo "+ npu-smi fake +" ;;
  "info -m")
    echo "        NPU ID    Chip ID    Chip Logic ID    Chip Name"
    i=0
    while [ "$i" -lt "${FAKE_CHIPS:-2}" ]; do
      echo "        ${FAKE_NPU_ID:-$((i / 2))}         $((i % 2))          $i                Ascend 910"
      i=$((i + 1))
    done
    echo "        ${FAKE_NPU_ID:-0}         2          -                Mcu" ;;
  "info -t usages -i "[0-9]*" -c 0"|"info -t usages -i "[0-9]*" -c 1")
    if [ -n "${FAKE_NO_HBM:-}" ]; then
      echo "        Memory Capacity(MB)            : 10810"
      echo "        Memory Usage Rate(%)           : 46"
    else
      echo "        HBM Capacity(MB)               : ${FAKE_HBM_MB:-65536}"
      echo "        HBM Usage Rate(%)              : ${FAKE_HBM_RATE:-25}"
    fi ;;
  *) exit 1 ;;
esac
"""


def bare_env(tmp_path: Path, path: str) -> dict:
    # No PYTHONPATH: the fake set_env.sh reads it, as some CANN versions do.
    return {"PATH": path, "HOME": str(tmp_path), "ASCEND_HOME": str(tmp_path / "Ascend")}


def make_fake_atlas(tmp_path: Path) -> dict:
    """The fake install root and a bin/ with npu-smi under tmp_path; returns the env to run the script in."""
    root = tmp_path / "Ascend"
    toolkit = root / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    (toolkit / "aarch64-linux" / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.2.RC1\n")
    (root / "ascend-toolkit" / "set_env.sh").write_text(
        f"export ASCEND_TOOLKIT_HOME={toolkit}\nexport PYTHONPATH={toolkit}/python:$PYTHONPATH\n"
    )
    (root / "driver").mkdir()
    (root / "driver" / "version.info").write_text("Version=25.0.rc1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "npu-smi").write_text(FAKE_NPU_SMI)
    (bin_dir / "npu-smi").chmod(0o755)
    return bare_env(tmp_path, f"{bin_dir}:/usr/bin:/bin")
