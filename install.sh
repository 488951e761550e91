#!/usr/bin/env bash
# Installs offloadopt (editable) into the current Python environment, with torch first:
#   - with an NVIDIA GPU (nvidia-smi lists one): torch from the package index, its CUDA build;
#   - without one: torch's CPU build, 2.13.0+cpu (the build CI tests first), from PyTorch's CPU
#     wheel index where it can be reached, else from the indexes and links pip is configured
#     with. PyPI's Linux wheel of torch is the CUDA build (several GB), so a plain
#     `pip install -e .` on a machine without torch would download that.
# A torch already installed in the supported range (2.11 through 2.15) is kept.
# Environment: PYTHON (default python3), TORCH_CPU_INDEX (PyTorch's CPU wheel index).
# Arguments are extras to install too, e.g. `./install.sh test` installs ".[test]".
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
RANGE="torch>=2.11,<2.16"
INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
pip_() { "$PY" -m pip install --disable-pip-version-check "$@"; }

if "$PY" - <<'PYCODE' 2>/dev/null; then
import sys
import torch
major, minor = (int(x) for x in torch.__version__.split(".")[:2])
sys.exit(0 if (2, 11) <= (major, minor) <= (2, 15) else 1)
PYCODE
    echo "install.sh: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "install.sh: a GPU is present: torch's CUDA build from the package index"
    pip_ "$RANGE"
else
    echo "install.sh: no GPU: torch's CPU build"
    index=()
    if "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" "$INDEX" 2>/dev/null; then
        index=(--extra-index-url "$INDEX")
    fi
    pip_ "torch==2.13.0+cpu" "${index[@]}"
fi
extras=""
if [ "$#" -gt 0 ]; then extras="[$(IFS=,; echo "$*")]"; fi
pip_ -e ".$extras"
"$PY" -c "import torch, offloadopt; print(f'install.sh: offloadopt {offloadopt.__version__}, torch {torch.__version__}')"
