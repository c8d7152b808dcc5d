#!/bin/sh
# Writes the local stack's secrets into docker/secrets/ (git-ignored by its own .gitignore, outside
# the image build context): the Redis password as the redis.conf fragment redis-server includes
# (`redis-auth.conf`, a Compose secret), REDISCLI_AUTH for the health check (`redis-cli.env`) and
# the policy service's REDIS_URL (`policy.env`), all read from files, none on a command line. The
# password is $KVRELAY_REDIS_PASSWORD when set (URL-safe characters only: it goes into REDIS_URL),
# else 32 random bytes in hex. Existing files are kept: rerun with --force to replace them.
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
if [ -e "$dir/redis-auth.conf" ] && [ "${1:-}" != "--force" ]; then
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
printf '*\n' > "$dir/.gitignore"
printf 'requirepass %s\n' "$password" > "$dir/redis-auth.conf"
# Compose bind-mounts the secret file as it is: redis (uid 999 in the container) must read it;
# the 0700 directory keeps other host users out.
chmod 644 "$dir/redis-auth.conf"
printf 'REDISCLI_AUTH=%s\n' "$password" > "$dir/redis-cli.env"
printf 'REDIS_URL=redis://:%s@redis:6379/0\n' "$password" > "$dir/policy.env"
echo "wrote $dir/redis-auth.conf, redis-cli.env and policy.env"
