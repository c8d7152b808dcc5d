"""Where registered manifests survive a loss of Redis: the policy service's own record of them.

The policy service owns the manifests, so it keeps every one it has seen stored — those it
validated and registered, and those other replicas registered (found in Redis) — in memory
and, when a journal path is given, in an append-only file: one canonical manifest JSON per
line, fsynced before the registration is answered. A restarted service reads the journal
back (each line is validated again and must be canonical; a torn last line after a crash is
skipped), so a Redis that lost its data, or an embedded one that died with its service, gets
every manifest back (`PolicyStore.republish`). Manifests are immutable and few, so the
record only grows, up to `max_manifests`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from services.kvpolicy.errors import KVPolicyError
from services.kvpolicy.manifest import KVVisibilityPolicyManifest
from services.policy.types import ManifestRef, StoredManifest

log = logging.getLogger(__name__)
DEFAULT_MAX_MANIFESTS = 4096


class ManifestArchive:
    """Every manifest this service has seen stored, by sha; journaled to `journal` if given."""

    def __init__(self, journal: Path | None = None, *, max_manifests: int = DEFAULT_MAX_MANIFESTS) -> None:
        if max_manifests < 1:
            raise ValueError(f"max_manifests: {max_manifests} must be >= 1")
        self.journal = journal
        self._max = max_manifests
        self._by_sha: dict[str, StoredManifest] = {}

    def __len__(self) -> int:
        return len(self._by_sha)

    @property
    def full(self) -> bool:
        return len(self._by_sha) >= self._max

    def load(self) -> int:
        """Read the journal (if any) into memory; returns how many manifests it held."""
        if self.journal is None or not self.journal.exists():
            return 0
        skipped = 0
        with open(self.journal, "rb") as lines:
            for number, line in enumerate(lines, 1):
                stored = parse_canonical(line.rstrip(b"\n"))
                if stored is None:
                    skipped += 1
                    log.warning("manifest journal %s line %d is not a canonical manifest; skipped", self.journal, number)
                elif len(self._by_sha) < self._max:
                    self._by_sha.setdefault(stored.ref.sha256, stored)
        log.info("manifest journal %s: %d manifests (%d lines skipped)", self.journal, len(self), skipped)
        return len(self)

    def remember(self, stored: StoredManifest) -> bool:
        """Keep `stored` (and journal it); False if it was known already or the record is full."""
        if stored.ref.sha256 in self._by_sha:
            return False
        if self.full:
            log.warning("manifest archive full (%d); %s is not kept", self._max, stored.ref.sha256)
            return False
        if self.journal is not None:
            _append(self.journal, stored.canonical_json)
        self._by_sha[stored.ref.sha256] = stored
        return True

    def get(self, sha256: str) -> StoredManifest | None:
        return self._by_sha.get(sha256)

    def manifests(self) -> list[StoredManifest]:
        return list(self._by_sha.values())

    def count(self, name: str = "") -> int:
        """How many manifests are kept (of policy `name`, if given)."""
        if not name:
            return len(self._by_sha)
        return sum(1 for stored in self._by_sha.values() if stored.ref.name == name)


def parse_canonical(line: bytes) -> StoredManifest | None:
    """The manifest whose canonical JSON is `line`, validated like a registration; None if
    `line` is not one."""
    try:
        manifest = KVVisibilityPolicyManifest.from_json(line)
    except (KVPolicyError, UnicodeDecodeError, RecursionError):
        return None
    if manifest.canonical_json() != line:
        return None
    return StoredManifest(ManifestRef(manifest.sha256, manifest.name, manifest.policy_generation), line)


def _append(path: Path, canonical_json: bytes) -> None:
    # Canonical JSON is one line (json.dumps escapes newlines inside strings).
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as journal:
        journal.write(canonical_json + b"\n")
        journal.flush()
        os.fsync(journal.fileno())
