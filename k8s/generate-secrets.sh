#!/bin/sh
# Writes the Secret material the kustomize base and the dev-tls component read (kept out of git).
# In k8s/base/secrets/ ($KVRELAY_SECRETS_DIR):
#   redis-password, redis-auth.conf  the Redis password and the redis.conf fragment that requires
#                                    it (`requirepass`, read by redis-server from a mounted file,
#                                    never from its command line). The password is
#                                    $KVRELAY_REDIS_PASSWORD when set (URL-safe characters only:
#                                    the policy service puts it in REDIS_URL), else 32 random bytes
#                                    in hex.
#   api-keys                         the API keys the gateway accepts (`kvrelay token` lines; none
#                                    at first: Generate is open until you add one). Never replaced.
# In k8s/components/dev-tls/secrets/ ($KVRELAY_TLS_DIR): a development CA and one certificate per
# role from `kvrelay certs` ($KVRELAY_CERT_DAYS days, default 90; the `kvrelay` on PATH, or
# $KVRELAY). Its ca.key goes into no Secret. For production, see k8s/README.md (cert-manager).
# Existing files are kept: rerun with --force to replace the password and the certificates.
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
dir="${KVRELAY_SECRETS_DIR:-$here/base/secrets}"
tls="${KVRELAY_TLS_DIR:-$here/components/dev-tls/secrets}"
force=no
[ "${1:-}" = "--force" ] && force=yes
kvrelay="${KVRELAY:-kvrelay}"

# Every check before anything is written: a refusal leaves the directory as it was.
if [ ! -e "$dir/redis-password" ] || [ "$force" = yes ]; then
  password="${KVRELAY_REDIS_PASSWORD:-$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')}"
  case "$password" in
    *[!A-Za-z0-9._~-]*) echo "KVRELAY_REDIS_PASSWORD: use only A-Z a-z 0-9 . _ ~ -" >&2; exit 2 ;;
  esac
  [ "${#password}" -ge 16 ] || { echo "KVRELAY_REDIS_PASSWORD: at least 16 characters" >&2; exit 2; }
fi
if [ ! -e "$tls/ca.pem" ] || [ "$force" = yes ]; then
  command -v "$kvrelay" >/dev/null 2>&1 || {
    echo "KVRELAY: no '$kvrelay' command to make the certificates (install kvrelay, or set KVRELAY to its path)" >&2
    exit 2
  }
fi

umask 077
mkdir -p "$dir"
if [ -n "${password:-}" ]; then
  printf '%s' "$password" > "$dir/redis-password"
  printf 'requirepass %s\n' "$password" > "$dir/redis-auth.conf"
  echo "wrote $dir/redis-password and $dir/redis-auth.conf"
else
  echo "kept $dir/redis-password (rerun with --force to replace it)"
fi
if [ ! -e "$tls/ca.pem" ] || [ "$force" = yes ]; then
  mkdir -p "$tls"
  "$kvrelay" certs --dir "$tls" --days "${KVRELAY_CERT_DAYS:-90}" --force >/dev/null
  echo "wrote $tls (CA and per-role certificates)"
else
  echo "kept $tls (rerun with --force to replace it)"
fi
if [ ! -e "$dir/api-keys" ]; then
  printf '# API keys the gateway accepts: one `kvrelay token --name NAME --role client` line each.\n' \
    > "$dir/api-keys"
  echo "wrote $dir/api-keys (no keys yet: Generate is open)"
fi
