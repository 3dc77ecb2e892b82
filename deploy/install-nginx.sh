#!/bin/sh
# nginx for the service's front (service/front/), from the distribution's packages: Debian/Ubuntu
# apt-get, as root or through sudo without a password. Exits non-zero when it cannot.
set -e
command -v apt-get >/dev/null || { echo "install-nginx: no apt-get here; install nginx by hand" >&2; exit 1; }
if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "install-nginx: not root and no password-less sudo; install nginx by hand" >&2; exit 1
fi
$SUDO apt-get update -qq
# The package's own nginx service must not start (on port 80): only our front runs nginx. A
# policy-rc.d that refuses every start, for the install only, unless the machine has one.
POLICY=/usr/sbin/policy-rc.d
OURS=""
if [ ! -e "$POLICY" ]; then
    printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$POLICY" >/dev/null && $SUDO chmod 755 "$POLICY" && OURS=1
fi
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends nginx || status=$?
[ -n "$OURS" ] && $SUDO rm -f "$POLICY"
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    $SUDO systemctl disable --now nginx || true
fi
exit ${status:-0}
