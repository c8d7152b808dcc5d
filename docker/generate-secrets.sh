#!/bin/sh
# Writes the local stack's secrets into docker/secrets/ (git-ignored by its own .gitignore, outside
# the image build context), all read from files, none on a command line:
#   redis-auth.conf, redis-cli.env, policy.env  the Redis password as the redis.conf fragment
#       redis-server includes (a Compose secret), REDISCLI_AUTH for its health check and the policy
#       service's REDIS_URL. The password is $KVRELAY_REDIS_PASSWORD when set (URL-safe characters
#       only: it goes into REDIS_URL), else 32 random bytes in hex.
#   tls/  a development CA and one certificate per role from `kvrelay certs` ($KVRELAY_CERT_DAYS
#       days, default 30; the `kvrelay` on PATH, or $KVRELAY), mounted into each service as Compose
#       secrets. tls/ca.key is mounted nowhere; client.pem/.key and operator.pem/.key are for you.
#   api-keys  the API keys the gateway accepts (`kvrelay token` lines; none at first: Generate is
#       open until you add one). Never replaced.
# Existing files are kept: rerun with --force to replace the password and the certificates.
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/secrets"
force=no
[ "${1:-}" = "--force" ] && force=yes
kvrelay="${KVRELAY:-kvrelay}"

# Every check before anything is written: a refusal leaves the directory as it was.
if [ ! -e "$dir/redis-auth.conf" ] || [ "$force" = yes ]; then
  password="${KVRELAY_REDIS_PASSWORD:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
  case "$password" in
    *[!A-Za-z0-9._~-]*) echo "KVRELAY_REDIS_PASSWORD: use only A-Z a-z 0-9 . _ ~ -" >&2; exit 2 ;;
  esac
  [ "${#password}" -ge 16 ] || { echo "KVRELAY_REDIS_PASSWORD: at least 16 characters" >&2; exit 2; }
fi
if [ ! -e "$dir/tls/ca.pem" ] || [ "$force" = yes ]; then
  command -v "$kvrelay" >/dev/null 2>&1 || {
    echo "KVRELAY: no '$kvrelay' command to make the certificates (install kvrelay, or set KVRELAY to its path)" >&2
    exit 2
  }
fi

umask 077
mkdir -p "$dir"
printf '*\n' > "$dir/.gitignore"
if [ -n "${password:-}" ]; then
  printf 'requirepass %s\n' "$password" > "$dir/redis-auth.conf"
  # Compose bind-mounts the secret file as it is: redis (uid 999 in the container) must read it;
  # the 0700 directory keeps other host users out.
  chmod 644 "$dir/redis-auth.conf"
  printf 'REDISCLI_AUTH=%s\n' "$password" > "$dir/redis-cli.env"
  printf 'REDIS_URL=redis://:%s@redis:6379/0\n' "$password" > "$dir/policy.env"
  echo "wrote $dir/redis-auth.conf, redis-cli.env and policy.env"
else
  echo "kept $dir/redis-auth.conf (rerun with --force to replace it)"
fi
if [ ! -e "$dir/tls/ca.pem" ] || [ "$force" = yes ]; then
  "$kvrelay" certs --dir "$dir/tls" --days "${KVRELAY_CERT_DAYS:-30}" --force >/dev/null
  # The services' keys are bind-mounted as they are, for uid 10001 in the containers: readable,
  # behind the 0700 directories. The CA key and your client keys stay 0600.
  for role in policy gateway prefill decode; do
    chmod 644 "$dir/tls/$role.key"
  done
  echo "wrote $dir/tls (CA and per-role certificates)"
else
  echo "kept $dir/tls (rerun with --force to replace it)"
fi
if [ ! -e "$dir/api-keys" ]; then
  printf '# API keys the gateway accepts: one `kvrelay token --name NAME --role client` line each.\n' \
    > "$dir/api-keys"
  chmod 644 "$dir/api-keys"
  echo "wrote $dir/api-keys (no keys yet: Generate is open)"
fi
