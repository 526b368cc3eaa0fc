# Sourced by the device scripts (cluster_check.sh, gpu_train_check.sh): where `ip`/`tc`
# are missing, the Debian packages carried in .debs/ are unpacked under /tmp/iproute2
# (never into /) and put on PATH.
if ! command -v tc >/dev/null || ! command -v ip >/dev/null; then
    for f in .debs/*.deb; do dpkg -x "$f" /tmp/iproute2; done
    export PATH="/tmp/iproute2/usr/sbin:/tmp/iproute2/usr/bin:/tmp/iproute2/sbin:/tmp/iproute2/bin:$PATH"
    export LD_LIBRARY_PATH="/tmp/iproute2/usr/lib/x86_64-linux-gnu:/tmp/iproute2/lib/x86_64-linux-gnu"
fi
