#!/usr/bin/env bash
# Validates the deployment files offline: the compose file with docker-compose,
# the load balancer's configuration with nginx -t. Installs both from Debian's
# packages when they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
if [ ${#missing[@]} -gt 0 ]; then
	apt-get update -qq >/dev/null
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

docker-compose -f docker-compose.yml config -q
echo "docker-compose.yml: valid"

# The replicas' names resolve only inside compose; check the syntax against loopback.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
sed -e 's/gateway[123]:8080/127.0.0.1:8080/' -e "s|^events {|pid $tmp/nginx.pid;\nerror_log $tmp/error.log;\nevents {|" deploy/nginx.conf > "$tmp/nginx.conf"
PATH="$PATH:/usr/sbin" nginx -t -q -c "$tmp/nginx.conf" -e "$tmp/error.log"
echo "deploy/nginx.conf: valid"
