# Sourced by the device scripts (gpu_check.sh, gpu_train_check.sh, cluster_check.sh),
# whose first argument is the output folder: makes it ($out), moves to the
# repository's root, imports sparcml from src/ with the machine's python3 ($py;
# nothing installed; "${sp[@]}" is the CLI) and, where `ip`/`tc` are missing, unpacks
# the Debian packages carried in .debs/ under /tmp/iproute2 (never into /).
set -uo pipefail
out=${1:?usage: $0 OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # (absolute: the scripts move to the root)
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
sp=("$py" -m sparcml.tools.cli)
if { ! command -v tc || ! command -v ip; } >/dev/null && compgen -G ".debs/*.deb" >/dev/null; then
    for f in .debs/*.deb; do dpkg -x "$f" /tmp/iproute2; done
    export PATH="/tmp/iproute2/usr/sbin:/tmp/iproute2/usr/bin:/tmp/iproute2/sbin:/tmp/iproute2/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/iproute2/usr/lib/x86_64-linux-gnu:/tmp/iproute2/lib/x86_64-linux-gnu"
fi
