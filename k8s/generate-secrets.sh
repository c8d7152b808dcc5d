#!/bin/sh
# Writes the Secret material the kustomize base reads (k8s/base/secrets/, kept out of git): the
# Redis password and the redis.conf fragment that requires it (`requirepass`, read by
# redis-server from a mounted file, never from its command line). The password is
# $KVRELAY_REDIS_PASSWORD when set (URL-safe characters only: the policy service puts it in
# REDIS_URL), else 32 random bytes in hex. Existing files are kept: rerun with --force to replace.
set -eu
dir="${KVRELAY_SECRETS_DIR:-$(cd "$(dirname "$0")" && pwd)/base/secrets}"
if [ -e "$dir/redis-password" ] && [ "${1:-}" != "--force" ]; then
  echo "kept $dir (rerun with --force to replace it)"
  exit 0
fi
password="${KVRELAY_REDIS_PASSWORD:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
case "$password" in
  *[!A-Za-z0-9._~-]*) echo "KVRELAY_REDIS_PASSWORD: use only A-Z a-z 0-9 . _ ~ -" >&2; exit 2 ;;
esac
[ "${#password}" -ge 16 ] || { echo "KVRELAY_REDIS_PASSWORD: at least 16 characters" >&2; exit 2; }
umask 077
mkdir -p "$dir"
printf '%s' "$password" > "$dir/redis-password"
printf 'requirepass %s\n' "$password" > "$dir/redis-auth.conf"
echo "wrote $dir/redis-password and $dir/redis-auth.conf"
