#!/usr/bin/env bash
# Validates the deployment files offline: the compose file with docker-compose,
# the load balancer's configuration with nginx -t, the alerting rules with
# promtool (their syntax, and their unit tests). A missing tool is installed
# from Debian's packages when running as root; otherwise that check is skipped,
# saying so.
set -euo pipefail
cd "$(dirname "$0")/.."

have() { command -v "$1" >/dev/null || [ -x "/usr/sbin/$1" ]; }
ensure() {
	have "$1" && return 0
	if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
		apt-get update -qq >/dev/null
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$2" >/dev/null
		return 0
	fi
	echo "skipped: $1 is not installed (and this is not root, so it is not installed here)"
	return 1
}

if ensure docker-compose docker-compose; then
	POSTGRES_PASSWORD=check docker-compose -f docker-compose.yml config -q
	echo "docker-compose.yml: valid"
fi

if ensure nginx nginx; then
	# Docker's resolver answers only inside compose; check the syntax with a
	# resolver and a replica name that resolve here.
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' EXIT
	sed -e 's/resolver 127.0.0.11/resolver 127.0.0.1/' -e 's|http://gateway:8080|http://127.0.0.1:8080|' \
		-e "s|^events {|pid $tmp/nginx.pid;\nerror_log $tmp/error.log;\nevents {|" deploy/nginx.conf > "$tmp/nginx.conf"
	PATH="$PATH:/usr/sbin" nginx -t -q -c "$tmp/nginx.conf" -e "$tmp/error.log"
	echo "deploy/nginx.conf: valid"
fi

if ensure promtool prometheus; then
	promtool check rules deploy/prometheus/alerts.yml
	(cd deploy/prometheus && promtool test rules alerts_test.yml)
fi
